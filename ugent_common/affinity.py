"""Keeping the embedded daemon's threads on one CPU (UGENT_CPU_AFFINITY).

The embedded daemon is one process: its web loop, request threads and turn
threads take turns holding one GIL. When those threads sit on different cores,
every hand-over of the GIL wakes a thread on the other core and moves the
interpreter's working set across caches. On the chat bench (2 cores,
bench/chat_latency.py) that cost a quarter of a turn's CPU at sixteen clients:
6.5 ms a turn spread over both cores, 5.2 ms on one, and 138 against 182
turns/s. So `rundaemon` keeps its threads on one CPU of those it may use,
unless told otherwise:

    UGENT_CPU_AFFINITY=auto   one CPU: the one the daemon was started on, the default
    UGENT_CPU_AFFINITY=off    wherever the kernel puts them
    UGENT_CPU_AFFINITY=2,3    these CPUs

Processes the daemon starts (channel workers) get back the CPUs the daemon had
before it pinned itself: they have GILs of their own. `auto` takes the CPU the
scheduler had put the daemon on, so several daemons on one host (or tests
running beside each other) do not all pile onto one fixed CPU; an operator who
runs several should list a CPU for each, or say `off`. Linux only (elsewhere
this does nothing). No Django imports: the plugin supervisor uses it too.
"""
from __future__ import annotations

import os

#: The CPUs this process could use before `pin` narrowed them; None while unpinned.
original: frozenset[int] | None = None


def choose(setting: str, allowed: set[int], current: int | None = None) -> set[int] | None:
    """The CPUs `setting` asks for among `allowed` (`current`: the CPU running us now); None to leave
    the process as it is."""
    setting = (setting or "auto").strip().lower()
    if setting in ("off", "none", "no", "false"):
        return None
    if setting == "auto":
        if len(allowed) < 2:
            return None
        return {current} if current in allowed else {max(allowed)}
    wanted = set()
    for part in setting.split(","):
        part = part.strip()
        if "-" in part:
            low, high = part.split("-", 1)
            wanted.update(range(int(low), int(high) + 1))
        elif part:
            wanted.add(int(part))
    chosen = wanted & allowed
    if not chosen:
        raise ValueError(f"UGENT_CPU_AFFINITY={setting!r} names no CPU this process may use "
                         f"(it may use {sorted(allowed)})")
    return chosen


def pin(setting: str) -> set[int] | None:
    """Apply `setting` to every thread of this process; the CPUs now used, or None if unchanged."""
    global original
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    cpus = choose(setting, allowed, _current_cpu())
    if cpus is None or cpus == allowed:
        return None
    if original is None:
        original = frozenset(allowed)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile
    return cpus


def restore_in_child() -> None:
    """In a child between fork and exec: the CPUs the daemon had before it pinned itself."""
    if original is not None:
        os.sched_setaffinity(0, original)


def _current_cpu() -> int | None:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat)."""
    try:
        with open("/proc/thread-self/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
