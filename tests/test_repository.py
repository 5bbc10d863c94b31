"""The repository stands on its own, and its tests measure behaviour, not the clock.

These read the tracked files, so a test or doc that points outside the clone, a test that asserts
a duration, or a test module that skips itself when another app's interface moves fails here.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if p != THIS and (ROOT / p).is_file()]


def test_nothing_points_outside_the_clone():
    outside = re.compile(r"\.\./shared|/work/shared|shared/specs|shared/seeds|shared/DESIGN")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in tracked("*.py", "*.md", "*.toml", "*.ini", "*.sh",
                                                               "Makefile", ".ci/*")
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert offenders == []


def test_every_file_a_test_reads_from_data_is_in_the_repository():
    data = ROOT / "tests" / "data"
    readme = (data / "README.md").read_text()
    files = sorted(p.name for p in data.iterdir() if p.name not in ("README.md", "__pycache__"))  # (bytecode of
    # its two scripts, written by make test's warm-bytecode or any run without PYTHONDONTWRITEBYTECODE)
    assert files, "tests/data is empty"
    for name in files:
        assert f"`{name}`" in readme, f"tests/data/README.md does not say where {name} came from"


def test_no_test_asserts_a_duration():
    clock = re.compile(r"^\s*assert\b.*\b(time\.(monotonic|time|perf_counter)\(\)|elapsed|took)\b.*[<>]")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in tracked("tests/*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if clock.search(line)]
    assert offenders == []


def test_no_test_module_skips_itself():
    """A moved interface must fail loudly, not turn a module of tests into skips."""
    skip = re.compile(r"allow_module_level\s*=\s*True|^\s*pytest\.importorskip\(\s*[\"'](channels_app|rules_app|"
                      r"cron_app|plugins_app|ugent_site|ugent_common)")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in tracked("tests/*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if skip.search(line)]
    assert offenders == []


def test_each_of_the_once_doubled_class_names_has_one_meaning():
    """InboundMessage (the SDK's wire message) vs the hub's Submission, OutboundDelivery (the row) vs
    the SDK's Delivery, the rule engine's MessageFacts/CompiledRule/CompiledRuleSet vs the models."""
    names = {"InboundMessage", "OutboundDelivery", "Message", "Rule", "RuleSet", "SubmitResult"}
    defined: dict[str, list[str]] = {}
    for p in tracked("channels_app/*.py", "rules_app/*.py", "cron_app/*.py", "plugins_app/*.py", "ugent_common/*.py",
                     "ugent_site/*.py"):
        for m in re.finditer(r"^class (\w+)\b", p.read_text(), flags=re.M):
            if m.group(1) in names:
                defined.setdefault(m.group(1), []).append(str(p.relative_to(ROOT)))
    assert {n: w for n, w in defined.items() if len(w) > 1} == {}


def test_redis_replies_are_parsed_by_hiredis():
    """redis-py takes hiredis's C parser when it can import it (requirements.txt pins it): servers mode's
    web and worker processes spent 0.9x the CPU per turn with it than with redis-py's own parser
    (docs/performance.md). A missing or too old hiredis falls back silently; this says so."""
    from redis.utils import HIREDIS_AVAILABLE
    assert HIREDIS_AVAILABLE


def test_no_bench_script_stands_in_for_a_package():
    """`python bench/X.py` puts bench/ first on sys.path: a bench named like a package the project imports
    (bench/channels.py once did, for Django Channels) breaks every in-process bench that loads the URLconf."""
    import importlib.util
    bench = ROOT / "bench"
    clashes = [p.name for p in sorted(bench.glob("*.py"))
               if p.stem != "__init__" and importlib.util.find_spec(p.stem) is not None]
    assert clashes == []


def test_every_python_file_compiles_without_a_warning():
    """An invalid escape sequence (a SyntaxWarning now, an error in a later Python) is caught here."""
    import warnings
    offenders = []
    for p in tracked("*.py"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(p.read_text(), str(p.relative_to(ROOT)), "exec")
            except (SyntaxError, Warning) as exc:
                offenders.append(f"{p.relative_to(ROOT)}: {exc}")
    assert offenders == []
