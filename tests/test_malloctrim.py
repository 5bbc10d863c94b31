"""The periodic malloc_trim(0): started once per process, off at 0, and it hands freed C memory back."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ugent_common import malloctrim

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import ctypes, sys, time
sys.path.insert(0, {root!r})
from ugent_common import malloctrim

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(4096) for _ in range(40000)]   # 160 MB in small blocks below the mmap threshold
for b in blocks:
    ctypes.memset(b, 1, 4096)
keep = blocks[-1]                                     # one block at the top keeps the heap from shrinking
for b in blocks[:-1]:
    libc.free(b)
before = rss_kb()
assert malloctrim.start({every}) is True and malloctrim.start({every}) is True   # once per process
deadline = time.monotonic() + 20   # (a trim of 160 MB can take most of a period on a loaded machine)
while malloctrim.trims["count"] < 2 and time.monotonic() < deadline:
    time.sleep(0.02)
print(before, rss_kb(), malloctrim.trims["count"])
"""


@pytest.mark.skipif(malloctrim._libc_trim() is None, reason="not glibc")
def test_the_thread_trims_what_was_freed_but_kept():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
    env["MALLOC_ARENA_MAX"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), every=0.2)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after, count = (int(x) for x in out.stdout.split())
    assert count >= 2  # every 0.2 s, one thread however often start() is called
    assert after < before - 100_000, (before, after)  # well over 100 MB handed back


def test_off_at_zero():
    assert malloctrim.start(0) is False and malloctrim._thread is None


ARENAS = r"""
import ctypes, os, sys, threading
sys.path.insert(0, {root!r})
from ugent_common import malloctrim
print(malloctrim.limit_arenas({most}), flush=True)
go = threading.Barrier(6)

def work():
    go.wait()  # all at once: each new thread's first malloc takes an arena of its own while there are fewer than the limit
    keep = [bytearray(100_000) for _ in range(20)]
    go.wait()

threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena n:" block an arena, on stderr
"""


def _arenas(most: int, **env_extra) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST", "MALLOC_"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", ARENAS.format(root=str(ROOT), most=most)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr.count("Arena ")


@pytest.mark.skipif(malloctrim._libc_trim() is None, reason="not glibc")
def test_limit_arenas_keeps_new_threads_on_the_arenas_there_are():
    said, unlimited = _arenas(0)  # 0: glibc's own limit (eight a core)
    assert said == "False" and unlimited >= 4, unlimited  # six threads at once: arenas of their own
    said, limited = _arenas(1)
    assert said == "True" and limited == 1
    said, two = _arenas(2)
    assert said == "True" and two == 2


@pytest.mark.skipif(malloctrim._libc_trim() is None, reason="not glibc")
def test_the_operators_malloc_arena_max_wins():
    said, arenas = _arenas(1, MALLOC_ARENA_MAX="3")
    assert said == "False" and arenas == 3


def test_django_sets_the_limit_as_it_starts():
    code = ("import os, sys, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'ugent_site.settings';"
            "from ugent_common import malloctrim;"
            "calls = [];"
            "orig = malloctrim.limit_arenas;"
            "malloctrim.limit_arenas = lambda most: calls.append(most) or orig(most);"
            "django.setup(); print(calls)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "MALLOC_"))}
    env["UGENT_MALLOC_ARENA_MAX"] = "2"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[2]"
