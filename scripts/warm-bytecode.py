"""Write once the bytecode every process of `make test` would otherwise make again for itself.

Where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it), no process writes a .pyc, so
each compiles what it imports from source: each of a pass's pytest workers rewrote the asserts of every
test file it collected (some 13 s of CPU, of a worker's 35 s collection), and each of the hundreds of
Python processes the tests start (daemons, Celery workers, channel workers, `manage.py` commands)
compiled the project's modules it imports. A process reads a .pyc that is there whatever that setting
says, so this script, run once before the passes (`make test`'s var/bytecode.stamp), writes them:

  * the project's own modules and tests/ with compileall, as `import` would have written them;
  * each test module and conftest.py as pytest rewrites it, where pytest's import hook looks for it
    (its own cache file, `<name>.<tag>-pytest-<version>.pyc`, checked against the source's hash, so a
    file edited since is rewritten at import as before).

Nothing else changes: the same code runs, only compiled once. Any failure here leaves pytest to do the
work itself, as before (the script says so and exits 0).
"""
from __future__ import annotations

import compileall
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("channels_app", "cron_app", "plugins_app", "rules_app", "ugent_common", "ugent_site", "tests")


def _rewritten(fn: str) -> int:
    """`fn`'s assert-rewritten code, cached where pytest's import hook reads it; 1 when written."""
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, get_cache_dir

    class _State:  # what _write_pyc asks of pytest's AssertionState: a trace to call
        @staticmethod
        def trace(*args):
            pass

    path = Path(fn)
    cache_dir = get_cache_dir(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    pyc = cache_dir / (path.name[:-3] + PYC_TAIL)
    if _read_pyc(path, pyc) is not None:
        return 0  # already there and matching the source
    source_hash, co = _rewrite_test(path, None)  # (no config: pytest.ini sets no rewrite option)
    return int(bool(_write_pyc(_State, co, source_hash, pyc)))


def _rewrite_targets() -> list[str]:
    """What pytest rewrites on import here: test_*.py (pytest.ini's python_files), every conftest.py and the
    plugin pytest.ini loads with -p."""
    tests = ROOT / "tests"
    found = {*tests.rglob("test_*.py"), *tests.rglob("conftest.py"), tests / "support" / "workers.py"}
    return sorted(str(p) for p in found if "__pycache__" not in p.parts)


def main() -> int:
    os.chdir(ROOT)
    workers = min(2, os.cpu_count() or 1)
    try:
        ok = all(compileall.compile_dir(str(ROOT / p), quiet=1, workers=workers) for p in PACKAGES)
        ok = compileall.compile_file(str(ROOT / "manage.py"), quiet=1) and ok
        with ProcessPoolExecutor(workers) as pool:
            written = sum(pool.map(_rewritten, _rewrite_targets(), chunksize=8))
    except Exception as exc:  # an optimisation only: pytest and import compile for themselves
        print(f"warm-bytecode: skipped ({type(exc).__name__}: {exc}); each process compiles for itself",
              file=sys.stderr)
        return 0
    if not ok:
        print("warm-bytecode: some modules did not compile (their import will say why)", file=sys.stderr)
    print(f"warm-bytecode: {written} test modules rewritten for pytest; the project's modules compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
