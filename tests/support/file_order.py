"""The suite's files, longest first, so no long file starts last (README, Tests).

pytest-xdist's ``--dist loadfile`` hands each worker a whole file at a time, in the order it is given;
by default it orders them by their number of tests, so a file of a few slow tests (a daemon killed and
restarted, a property test of 1,500 examples) could start when the others were nearly done, and the
pass waited minutes for it alone. ``make test`` passes ``--no-loadscope-reorder`` and this orders the
files by what they took last time (``tests/durations.txt``, one line a file: seconds in the embedded
pass, seconds in the servers pass, path), longest first; files not listed keep their place after them.
Tests within a file keep their order.

Each run writes what its files took to ``var/test-logs/durations-<pass>.json``; ``python
scripts/test-durations.py`` folds both passes' figures into ``tests/durations.txt``.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests" / "durations.txt"


def read_durations(path: Path = DURATIONS) -> dict[str, tuple[float, float]]:
    """Path -> (embedded seconds, servers seconds), from ``tests/durations.txt``."""
    out: dict[str, tuple[float, float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        embedded, servers, name = line.split(maxsplit=2)
        out[name] = (float(embedded), float(servers))
    return out


def longest_first(items: list, pass_name: str, durations: dict[str, tuple[float, float]] | None = None) -> list:
    """``items`` with whole files moved so the longest (in this pass) come first; a stable sort."""
    durations = read_durations() if durations is None else durations
    column = 1 if pass_name == "servers" else 0

    def took(item) -> float:
        return durations.get(item.nodeid.split("::", 1)[0], (0.0, 0.0))[column]

    # (a stable sort: equal keys, the unlisted files among them, keep the order they were collected in)
    return sorted(items, key=lambda item: -took(item))


class Recorder:
    """Sums each file's test durations (setup, call and teardown) over a run and writes them on exit."""

    def __init__(self, pass_name: str):
        self.pass_name = pass_name
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += getattr(report, "duration", 0.0) or 0.0

    def write(self, directory: Path = ROOT / "var" / "test-logs") -> Path | None:
        if not self.seconds:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"durations-{self.pass_name}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(sorted(self.seconds.items())), indent=0))
        tmp.replace(path)
        return path
