"""UGENT_GC_FREEZE: a started process's objects leave the cyclic collector's walks (ugent_common/gcfreeze.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Its processes start in embedded mode whichever pass runs it (REDIS_URL and DATABASE_URL removed).
pytestmark = pytest.mark.mode_free

ROOT = Path(__file__).resolve().parents[1]

# a web process's start: Django set up, then the ASGI module, as uvicorn (and rundaemon, last) imports it
WEB_START = """
import gc, django
django.setup()
import ugent_site.asgi
print(gc.get_freeze_count())
"""
# a worker's start: warming (no engine warmed here: none is configured), then the freeze after it
WORKER_START = """
import gc, django
django.setup()
from plugins_app.agent import warm
warm.engines_warm = lambda: None
t = warm.warm_start()
t.join(60)
print(gc.get_freeze_count())
"""


def _start(code: str, tmp_path: Path, freeze: str) -> int:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "ugent_site.settings", "UGENT_VAR_DIR": str(tmp_path),
           "UGENT_CONFIG": str(tmp_path / "ugent.toml"), "UGENT_GC_FREEZE": freeze, "UGENT_WARM_AT_START": "true"}
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [WEB_START, WORKER_START], ids=["web", "worker"])
def test_a_started_process_freezes_what_it_holds_unless_told_not_to(tmp_path, code):
    frozen = _start(code, tmp_path, "true")
    assert frozen > 50_000  # Django, the apps, the models: tens of thousands of objects at least
    assert _start(code, tmp_path, "false") == 0


# in a process of its own: freezing the test process would hide its objects from the memory tests, and its
# other threads (a daemon's, a server's) allocate and collect beside the checks
LIVING_ONLY = """
import gc
from ugent_common import gcfreeze
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle, garbage once the names go
del a, b
kept = Node()
total = gcfreeze.freeze()
assert total == gc.get_freeze_count() > 0
assert not [o for o in gc.get_objects() if type(o) is Node]  # frozen objects are not in get_objects()
assert gcfreeze.freeze(False) == 0 and gc.get_freeze_count() == total
gc.unfreeze()  # back in the collector's generations: the one kept, and not the cycle, which was collected
assert [o for o in gc.get_objects() if type(o) is Node] == [kept]
print("ok")
"""


def test_freeze_collects_the_garbage_first_and_freezes_only_the_living():
    out = subprocess.run([sys.executable, "-c", LIVING_ONLY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
