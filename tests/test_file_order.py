"""make test hands out the longest files first (tests/support/file_order.py)."""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import file_order

pytestmark = pytest.mark.mode_free  # the suite's own plumbing: nothing a run mode changes

ROOT = Path(__file__).resolve().parents[1]


def items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_the_longest_files_of_the_pass_come_first_and_a_files_tests_keep_their_order():
    durations = {"tests/a.py": (1.0, 50.0), "tests/b.py": (30.0, 2.0), "tests/c.py": (5.0, 5.0)}
    collected = items("tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1",
                      "tests/d.py::t1", "tests/b.py::t2", "tests/e.py::t1")
    embedded = [i.nodeid for i in file_order.longest_first(collected, "embedded", durations)]
    servers = [i.nodeid for i in file_order.longest_first(collected, "servers", durations)]
    assert embedded == ["tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/a.py::t1",
                        "tests/a.py::t2", "tests/d.py::t1", "tests/e.py::t1"]
    assert servers == ["tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1", "tests/b.py::t1",
                       "tests/b.py::t2", "tests/d.py::t1", "tests/e.py::t1"]


def test_the_committed_table_names_files_that_exist_and_reads_back():
    table = file_order.read_durations()
    assert len(table) > 50
    assert all((ROOT / name).is_file() for name in table)


def test_make_test_keeps_the_order_given():
    # without it pytest-xdist orders the files by their number of tests and this order is lost
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PYTEST_ARGS := .*--dist loadfile --no-loadscope-reorder", makefile, re.M)


def test_a_runs_figures_fold_into_the_table(tmp_path, monkeypatch):
    logs = tmp_path / "var" / "test-logs"
    recorder = file_order.Recorder("servers")
    for nodeid, seconds in [("tests/test_file_order.py::x", 2.0), ("tests/test_file_order.py::y", 1.5),
                            ("tests/conftest.py::z", 4.0)]:
        recorder.add(SimpleNamespace(nodeid=nodeid, duration=seconds))
    written = recorder.write(logs)
    assert json.loads(written.read_text()) == {"tests/conftest.py": 4.0, "tests/test_file_order.py": 3.5}

    # the script run on a copy of the tree's layout: its table is rewritten there, not the repository's
    root = tmp_path
    (root / "tests" / "support").mkdir(parents=True)
    for name in ("tests/support/file_order.py", "tests/test_file_order.py", "tests/conftest.py"):
        (root / name).write_text((ROOT / name).read_text())
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "support" / "__init__.py").write_text("")
    (root / "scripts").mkdir()
    (root / "scripts" / "test-durations.py").write_text((ROOT / "scripts" / "test-durations.py").read_text())
    (root / "tests" / "durations.txt").write_text("# old\n 9.0 9.0 tests/conftest.py\n 7.0 0.0 tests/gone.py\n")
    out = subprocess.run([sys.executable, "scripts/test-durations.py"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    table = file_order.read_durations(root / "tests" / "durations.txt")
    assert table == {"tests/conftest.py": (9.0, 4.0), "tests/test_file_order.py": (0.0, 3.5)}
