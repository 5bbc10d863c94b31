"""Freed C memory handed back to the system now and then (UGENT_MALLOC_TRIM_SECS).

glibc's malloc keeps what a process frees for its next allocations. It gives memory back on its own
only from the top of a heap; free pages in the middle of a heap, or of one of the arenas each thread
gets, stay in the process's RSS until `malloc_trim(0)` returns them (madvise). In the daemon those
pages come and go with the turns, and RSS creeps up with them: from the 5,000th to the 10,000th turn
of bench/memory_rss.py, malloc's own free memory grew 0.3-0.8 MB while what it had in use did not,
and a trim after the last turn gave back 1.8-3.1 MB. A thread trims every `every_secs` seconds, so
RSS holds at most what was freed since the last trim beyond what is in use (1.2-1.5 MB at 10 s in
that bench). Each trim takes a fraction of a millisecond to a few, holding malloc's arena locks
(bench/memory_rss.py prints them).

Not glibc (musl, macOS): nothing to do. No Django imports: the setting is read by the callers.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time

_thread: threading.Thread | None = None
_lock = threading.Lock()
#: the trims so far and their time (seconds), for the memory report
trims = {"count": 0, "secs": 0.0, "last_secs": 0.0}


@functools.cache
def libc():
    """The C library this process runs on, loaded once (None where it cannot be): the trim here and the
    memory report's malloc figures (ugent_site.memstats) use the one handle."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _libc_trim():
    try:
        trim = libc().malloc_trim
    except AttributeError:  # no C library, or not glibc's
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


#: mallopt's parameter for the most arenas malloc keeps (glibc's malloc.h)
M_ARENA_MAX = -8


def limit_arenas(most: int) -> bool:
    """At most `most` malloc arenas in this process from now on (UGENT_MALLOC_ARENA_MAX; 0 or less: glibc's
    own limit, eight a core). glibc gives each new thread an arena of its own while there are fewer than
    that; the daemon's threads take turns on the GIL, so arenas save them little waiting, and each fragments
    on its own: bench/memory_rss.py --settle found the RSS that grows from turn to turn, with Python's
    objects and malloc's memory in use flat, in those arenas. MALLOC_ARENA_MAX in the environment is the
    operator's own choice, read by glibc at start: it wins, and this does nothing. True when the limit
    was set."""
    import os
    if most <= 0 or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = libc().mallopt
    except AttributeError:  # no C library, or not glibc's
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_ARENA_MAX, most) == 1


def trim_once(trim=None) -> bool:
    """One malloc_trim(0); False where there is none."""
    trim = trim or _libc_trim()
    if trim is None:
        return False
    t0 = time.perf_counter()
    trim(0)
    took = time.perf_counter() - t0
    trims["count"] += 1
    trims["secs"] += took
    trims["last_secs"] = took
    return True


def start(every_secs: float) -> bool:
    """Trim every `every_secs` seconds in a daemon thread (once per process; 0 or less: never). True when
    the thread runs."""
    global _thread
    if every_secs <= 0:
        return False
    trim = _libc_trim()
    if trim is None:
        return False
    with _lock:
        if _thread is not None:
            return True

        def run():
            while True:
                time.sleep(every_secs)
                trim_once(trim)
        _thread = threading.Thread(target=run, name="ugent-malloc-trim", daemon=True)
        _thread.start()
    return True
