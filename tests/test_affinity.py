"""UGENT_CPU_AFFINITY: rundaemon keeps its threads on one CPU; the workers it starts get every CPU back."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ugent_common import affinity

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")


def test_auto_takes_the_cpu_it_runs_on_and_leaves_a_single_cpu_alone():
    assert affinity.choose("auto", {0, 1, 2, 3}, current=2) == {2}
    assert affinity.choose("", {0, 1}, current=0) == {0}
    assert affinity.choose("auto", {0, 1, 2, 3}, current=None) == {3}  # not known: the last one
    assert affinity.choose("auto", {5}, current=5) is None
    assert affinity.choose("off", {0, 1}, current=0) is None


@linux_only
def test_the_current_cpu_is_one_this_process_may_use():
    assert affinity._current_cpu() in os.sched_getaffinity(0)


def test_a_list_or_range_is_kept_to_the_cpus_allowed_and_nothing_allowed_is_an_error():
    assert affinity.choose("0,2", {0, 1, 2, 3}) == {0, 2}
    assert affinity.choose("1-3", {0, 1, 2}) == {1, 2}
    with pytest.raises(ValueError, match="names no CPU"):
        affinity.choose("7", {0, 1})


PROBE = r"""
import os, subprocess, sys, threading
sys.path.insert(0, {root!r})
from ugent_common import affinity
before = threading.Thread(target=lambda: done.wait())
done = threading.Event()
before.start()
cpus = affinity.pin({setting!r})
after = {{}}
t = threading.Thread(target=lambda: after.update(cpus=os.sched_getaffinity(0)))
t.start(); t.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       preexec_fn=affinity.restore_in_child, capture_output=True, text=True).stdout.strip()
print(sorted(cpus) if cpus else None, sorted(os.sched_getaffinity(before.native_id)), sorted(after["cpus"]), child)
done.set()
"""


@linux_only
def test_pin_moves_every_thread_new_and_old_and_a_child_gets_the_original_cpus_back():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=root, setting="auto")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pinned, before, after, child = out.stdout.strip().split("] ")
    # pinned to one CPU; the thread started before and the one started after are on it; the child is not
    assert pinned == before == after and len(pinned.strip("[").split(",")) == 1
    assert child == str(allowed)


@linux_only
def test_off_changes_nothing():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=root, setting="off")], capture_output=True,
                         text=True, timeout=60)
    allowed = sorted(os.sched_getaffinity(0))
    assert out.stdout.strip() == f"None {allowed} {allowed} {allowed}"


@linux_only
@pytest.mark.parametrize("pdeathsig", [None, "default"])
def test_a_channel_worker_started_by_the_pinned_daemon_gets_every_cpu_back(tmp_path, pdeathsig):
    """The supervisor's workers are processes with GILs of their own: they must not share the daemon's core."""
    import signal
    from plugins_app.channel.supervisor.process import WorkerHandle, WorkerSpec
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin")
    out = tmp_path / "cpus.txt"
    spec = WorkerSpec(plugin_id="affinity-probe", command=sys.executable,
                      args=["-c", f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"])
    kwargs = {"pdeathsig": None} if pdeathsig is None else {"pdeathsig": signal.SIGKILL}
    pinned = {max(allowed)}
    result = {}

    def spawn_from_a_pinned_thread():  # the daemon pins its threads; the supervisor spawns from one of them
        saved = affinity.original
        try:
            affinity.original = frozenset(allowed)
            os.sched_setaffinity(0, pinned)
            handle = WorkerHandle.spawn(spec, **kwargs)
            handle._proc.popen.wait(30)
            result["handle"] = handle
        finally:
            affinity.original = saved

    t = threading.Thread(target=spawn_from_a_pinned_thread)
    t.start()
    t.join(30)
    assert "handle" in result
    assert out.read_text() == repr(sorted(allowed))
    assert os.sched_getaffinity(0) == allowed  # the test's own thread was never pinned
