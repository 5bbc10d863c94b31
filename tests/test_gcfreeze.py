"""UGENT_GC_FREEZE: a started process's objects leave the cyclic collector's walks (ugent_common/gcfreeze.py)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ugent_common import gcfreeze

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


def test_freeze_collects_the_garbage_first_and_freezes_only_the_living():
    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle, garbage once the names go
    del a, b
    kept = Node()
    before = gc.get_freeze_count()
    try:
        total = gcfreeze.freeze()
        assert total == gc.get_freeze_count() > before
        assert not [o for o in gc.get_objects() if type(o) is Node]  # frozen objects are not in get_objects()
        assert gcfreeze.freeze(False) == 0
    finally:
        gc.unfreeze()  # the test process's own objects back in the collector's generations
    assert any(o is kept for o in gc.get_objects())
    assert sum(type(o) is Node for o in gc.get_objects()) == 1  # the cycle was collected, not frozen
