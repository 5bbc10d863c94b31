#!/usr/bin/env python3
"""Fold the last run's per-file test durations into tests/durations.txt (tests/support/file_order.py).

Run after a whole ``make test``: it reads var/test-logs/durations-embedded.json and durations-servers.json
(written by that run: only a run of the whole suite writes them) and rewrites tests/durations.txt, longest
first; a file the run did not time keeps its figures, and a file no longer there is dropped.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.file_order import DURATIONS, read_durations  # noqa: E402


def main() -> int:
    table = {name: list(pair) for name, pair in read_durations().items()}
    read = []
    for column, pass_name in enumerate(("embedded", "servers")):
        path = ROOT / "var" / "test-logs" / f"durations-{pass_name}.json"
        if not path.exists():
            continue
        read.append(pass_name)
        for name, seconds in json.loads(path.read_text()).items():
            table.setdefault(name, [0.0, 0.0])[column] = seconds
    if not read:
        print("no var/test-logs/durations-*.json: run `make test` first", file=sys.stderr)
        return 1
    table = {name: pair for name, pair in table.items() if (ROOT / name).exists() and any(pair)}
    lines = ["# seconds in the embedded pass, in the servers pass, file: what `make test` orders its files by",
             "# (tests/support/file_order.py). Made by scripts/test-durations.py from a whole run; do not edit."]
    for name, (embedded, servers) in sorted(table.items(), key=lambda kv: (-max(kv[1]), kv[0])):
        lines.append(f"{embedded:8.1f} {servers:8.1f} {name}")
    DURATIONS.write_text("\n".join(lines) + "\n")
    print(f"{DURATIONS.relative_to(ROOT)}: {len(table)} files, from the {' and '.join(read)} pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
