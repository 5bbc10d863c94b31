"""The plugin supervisor with real processes: groups, two-phase stop, kill on drop,
parent death, stale reaping, the restart policy, the breaker and the watchdog."""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plugins_app.channel.supervisor import (
    BACKOFF, COOLDOWN, DISABLED, STOPPED, STOPPING, DesiredWorker, RestartPolicy,
    SupervisionLimits, Supervisor, SupervisorAlreadyRunning, WorkerHandle, WorkerSpec,
    heartbeat_overdue, reap_stale,
)
from plugins_app.channel.supervisor.core import REMOVED, SPEC_CHANGED
from plugins_app.channel.supervisor.policy import HEARTBEAT_OVERDUE
from plugins_app.channel.supervisor.process import pid_alive, pid_file_path, proc_start_time

pytestmark = [pytest.mark.mode_free,  # no database, Redis, Django or run mode: the channel worker SDK and workers
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SLEEPER = ("-c", "import time; time.sleep(60)")


@pytest.fixture(autouse=True)
def _eager_celery():
    # Overrides the shared conftest's fixture, which needs pytest-django: no Celery here,
    # and the file runs with -p no:django.
    yield


def wait_until(predicate, timeout=5.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def read_pid(path: Path, timeout=5.0) -> int:
    assert wait_until(lambda: path.exists() and path.read_text().strip(), timeout), f"{path} never written"
    return int(path.read_text().split()[0])


def sleeper_spec(plugin_id="p1", **kw):
    return WorkerSpec(plugin_id, PY, SLEEPER, **kw)


@pytest.fixture
def dirs(tmp_path):
    return {"log_dir": tmp_path / "logs", "pid_dir": tmp_path / "pids"}


@pytest.fixture
def handles():
    made = []
    yield made
    for handle in made:
        handle.kill()


# --- WorkerHandle ----------------------------------------------------------

def test_the_worker_gets_only_its_env_and_a_minimal_path_lang_home(dirs, monkeypatch):
    monkeypatch.setenv("PARENT_SECRET", "must-not-leak")
    spec = WorkerSpec("env-check", PY, ["-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                      env={"TELEGRAM_BOT_TOKEN": "t0k"})
    handle = WorkerHandle.spawn(spec, **dirs)
    assert wait_until(lambda: handle.poll() is not None)
    assert handle.returncode == 0
    seen = json.loads(handle.log_path.read_text().splitlines()[-1])
    assert set(seen) == {"TELEGRAM_BOT_TOKEN", "PATH", "LANG", "HOME"}
    assert seen["TELEGRAM_BOT_TOKEN"] == "t0k"


def test_the_worker_leads_its_own_session_and_process_group(dirs, handles):
    handle = WorkerHandle.spawn(sleeper_spec(), **dirs)
    handles.append(handle)
    assert os.getpgid(handle.pid) == handle.pid == handle.pgid
    assert os.getsid(handle.pid) == handle.pid
    assert os.getpgid(handle.pid) != os.getpgid(0)


def test_terminate_stops_the_worker_and_everything_in_its_group(dirs, tmp_path):
    child_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(child_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    handle = WorkerHandle.spawn(WorkerSpec("grp", PY, ["-c", code]), **dirs)
    child = read_pid(child_file)
    assert pid_alive(child)
    assert handle.terminate(grace=3) == -signal.SIGTERM
    assert wait_until(lambda: not pid_alive(child), 3)


def test_terminate_sigkills_a_worker_that_ignores_sigterm_after_the_grace(dirs, tmp_path):
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    handle = WorkerHandle.spawn(WorkerSpec("stubborn", PY, ["-c", code]), **dirs)
    read_pid(ready)
    assert handle.terminate(grace=0.3) == -signal.SIGKILL


def test_a_dropped_handle_kills_its_worker(dirs):
    handle = WorkerHandle.spawn(sleeper_spec(), **dirs)
    pid = handle.pid
    assert pid_alive(pid)
    del handle
    gc.collect()
    assert wait_until(lambda: not pid_alive(pid), 3)


def test_the_pid_file_names_the_worker_and_goes_when_it_exits(dirs, tmp_path):
    go = tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nraise SystemExit(3)"
    handle = WorkerHandle.spawn(WorkerSpec("pf", PY, ["-c", code]), **dirs)
    pid_file = pid_file_path(dirs["pid_dir"], "pf")
    data = json.loads(pid_file.read_text())
    assert data["pid"] == data["pgid"] == handle.pid
    assert data["start_time"] == proc_start_time(handle.pid)
    assert data["supervisor_pid"] == os.getpid()
    assert data["supervisor_start_time"] == proc_start_time(os.getpid())
    go.write_text("")
    assert wait_until(lambda: handle.poll() is not None)
    assert handle.returncode == 3
    assert not pid_file.exists()


def test_a_worker_that_exits_takes_what_it_left_in_its_group_with_it(dirs, tmp_path):
    child_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(child_file)!r}, "w").write(str(child.pid))
    """)
    handle = WorkerHandle.spawn(WorkerSpec("leaver", PY, ["-c", code]), **dirs)
    child = read_pid(child_file)
    assert wait_until(lambda: handle.poll() is not None)
    assert wait_until(lambda: not pid_alive(child), 3)


# --- stale workers ---------------------------------------------------------

def dead_pid() -> int:
    gone = subprocess.Popen([PY, "-c", "pass"])
    gone.wait()
    return gone.pid


def write_pid_file(pid_dir: Path, plugin_id, pid, *, start_time, supervisor_pid, supervisor_start_time):
    pid_dir.mkdir(parents=True, exist_ok=True)
    path = pid_file_path(pid_dir, plugin_id)
    path.write_text(json.dumps({
        "plugin_id": plugin_id, "pid": pid, "pgid": pid, "start_time": start_time,
        "supervisor_pid": supervisor_pid, "supervisor_start_time": supervisor_start_time,
        "command": ["worker"],
    }))
    return path


def test_reap_stale_kills_a_worker_whose_supervisor_is_gone_sigterm_then_sigkill(tmp_path):
    ready = tmp_path / "ready"
    code = f"import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
           f"open({str(ready)!r}, 'w').write('1')\ntime.sleep(60)"
    orphan = subprocess.Popen([PY, "-c", code], start_new_session=True)
    read_pid(ready)
    pid_file = write_pid_file(tmp_path / "pids", "old", orphan.pid,
                              start_time=proc_start_time(orphan.pid),
                              supervisor_pid=dead_pid(), supervisor_start_time=1)

    reaped = reap_stale(tmp_path / "pids", grace=0.3)

    assert [r.plugin_id for r in reaped] == ["old"]
    assert orphan.wait(timeout=3) == -signal.SIGKILL
    assert not pid_file.exists()


def test_reap_stale_leaves_a_reused_pid_alone_and_removes_the_file(tmp_path):
    stranger = subprocess.Popen([PY, *SLEEPER], start_new_session=True)
    try:
        pid_file = write_pid_file(tmp_path / "pids", "old", stranger.pid,
                                  start_time=proc_start_time(stranger.pid) - 1,
                                  supervisor_pid=dead_pid(), supervisor_start_time=1)
        assert reap_stale(tmp_path / "pids", grace=0.3) == []
        assert not pid_file.exists()
        time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_reap_stale_keeps_the_workers_of_a_live_supervisor(tmp_path):
    worker = subprocess.Popen([PY, *SLEEPER], start_new_session=True)
    try:
        pid_file = write_pid_file(tmp_path / "pids", "mine", worker.pid,
                                  start_time=proc_start_time(worker.pid),
                                  supervisor_pid=os.getpid(),
                                  supervisor_start_time=proc_start_time(os.getpid()))
        assert reap_stale(tmp_path / "pids", grace=0.3) == []
        assert pid_file.exists()
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


SUPERVISOR_SCRIPT = """
import sys, threading
sys.path.insert(0, {repo!r})
from plugins_app.channel.supervisor import DesiredWorker, SupervisionLimits, Supervisor, WorkerSpec
pid_dir, log_dir, code = sys.argv[1:4]
spec = WorkerSpec("p1", sys.executable, ["-c", code])
want = [DesiredWorker(spec, SupervisionLimits(heartbeat_secs=0))]
Supervisor(lambda: want, pid_dir=pid_dir, log_dir=log_dir, interval=0.05).run(threading.Event())
"""


# Stands in for an init that reaps orphans (PID 1 here may not): a child subreaper
# that runs the supervisor and reaps whatever is reparented to it.
REAPER_SCRIPT = """
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
sup = subprocess.Popen(sys.argv[2:])
open(sys.argv[1], "w").write(str(sup.pid))
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.02)
"""


@pytest.fixture
def supervisor_process(tmp_path):
    started = []

    def start(worker_code):
        script = tmp_path / "supervisor.py"
        script.write_text(SUPERVISOR_SCRIPT.format(repo=str(REPO)))
        reaper_script = tmp_path / "reaper.py"
        reaper_script.write_text(REAPER_SCRIPT)
        sup_file = tmp_path / "supervisor.pid"
        reaper = subprocess.Popen([PY, str(reaper_script), str(sup_file), PY, str(script),
                                   str(tmp_path / "pids"), str(tmp_path / "logs"), worker_code],
                                  start_new_session=True)
        started.append(reaper)
        sup = read_pid(sup_file)
        pid_file = pid_file_path(tmp_path / "pids", "p1")
        assert wait_until(pid_file.exists, 10), "the supervisor never started its worker"
        return sup, json.loads(pid_file.read_text())["pid"]

    yield start
    for reaper in started:
        os.killpg(reaper.pid, signal.SIGKILL)
        reaper.wait()


def test_kill_9_on_the_supervisor_kills_its_workers(supervisor_process):
    sup, worker = supervisor_process("import time; time.sleep(60)")
    assert pid_alive(worker)
    os.kill(sup, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(worker), 3)


# A worker that turns its parent-death signal off outlives its supervisor.
CLEARS_PDEATHSIG = "import ctypes; ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"
SPAWNS_GRANDCHILD = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({path!r}, "w").write(str(child.pid))
    time.sleep(60)
""")


@pytest.mark.parametrize("leftover", ["the worker itself", "only its child"])
def test_a_new_supervisor_reaps_workers_left_by_a_killed_one(tmp_path, supervisor_process, leftover):
    grandchild_file = tmp_path / "grandchild.pid"
    code = SPAWNS_GRANDCHILD.format(path=str(grandchild_file))
    if leftover == "the worker itself":
        code = CLEARS_PDEATHSIG + code
    sup, worker = supervisor_process(code)
    grandchild = read_pid(grandchild_file)
    os.kill(sup, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(sup), 3)
    if leftover == "only its child":
        assert wait_until(lambda: not os.path.exists(f"/proc/{worker}"), 3)
    else:
        time.sleep(0.3)
        assert pid_alive(worker)
    assert pid_alive(grandchild)

    new = Supervisor(lambda: [], pid_dir=tmp_path / "pids", log_dir=tmp_path / "logs", reap_grace=1)
    try:
        new.start()
        assert [r.plugin_id for r in new.reaped] == ["p1"]
        assert wait_until(lambda: not pid_alive(grandchild) and not pid_alive(worker), 3)
        assert not pid_file_path(tmp_path / "pids", "p1").exists()
    finally:
        new.shutdown()


def test_a_second_supervisor_on_the_same_pid_dir_is_refused(dirs):
    first = Supervisor(lambda: [], **dirs)
    first.start()
    try:
        with pytest.raises(SupervisorAlreadyRunning):
            Supervisor(lambda: [], **dirs).start()
    finally:
        first.shutdown()


# --- the policy, with a fake clock -----------------------------------------

FAST = SupervisionLimits(backoff_initial_secs=1, backoff_factor=2, backoff_max_secs=30,
                         restarts_per_round=3, cooldown_secs=60, breaker_rounds=3, stable_secs=120)


def crash_once(policy, now, code=1):
    policy.on_start(now)
    return policy.on_exit(code, now + 0.5)


def test_restarts_back_off_exponentially_then_cool_down():
    policy = RestartPolicy(FAST)
    actions = [crash_once(policy, t) for t in (0, 10, 20, 30)]
    assert [a.state for a in actions] == [BACKOFF, BACKOFF, BACKOFF, COOLDOWN]
    assert [a.restart_at for a in actions] == [1.5, 12.5, 24.5, 90.5]


def test_three_consecutive_cooldown_rounds_disable_the_plugin_and_it_stays_down():
    policy = RestartPolicy(FAST)
    states = [crash_once(policy, t * 10).state for t in range(12)]
    assert states.count(COOLDOWN) == 2
    assert states[-1] == DISABLED
    assert policy.disabled
    assert policy.disabled_reason == "circuit breaker: 3 consecutive cooldown rounds (last exit code 1)"


def test_a_stable_run_resets_the_breaker():
    policy = RestartPolicy(FAST)
    for t in range(8):  # two cooldown rounds
        crash_once(policy, t * 10)
    assert policy.cooldown_rounds == 2
    policy.on_start(100)
    action = policy.on_exit(-signal.SIGSEGV, 100 + FAST.stable_secs)
    assert action.state == BACKOFF and action.reason.startswith("signal SIGSEGV")
    states = [crash_once(policy, 1000 + t * 10).state for t in range(8)]
    assert DISABLED not in states


def test_a_worker_that_never_heartbeats_cannot_pass_for_stable():
    policy = RestartPolicy(FAST)
    states = []
    for t in range(12):  # every run outlives stable_secs but never beats once
        policy.on_start(t * 1000)
        states.append(policy.on_exit(-signal.SIGTERM, t * 1000 + 500, cause=HEARTBEAT_OVERDUE,
                                     healthy_secs=0).state)
    assert states[-1] == DISABLED and states.count(COOLDOWN) == 2


def test_the_breaker_names_a_missed_heartbeat_as_the_last_exit():
    policy = RestartPolicy(SupervisionLimits(restarts_per_round=0, breaker_rounds=1))
    policy.on_start(0)
    assert policy.on_exit(-signal.SIGTERM, 1, cause=HEARTBEAT_OVERDUE).reason == \
        "circuit breaker: 1 consecutive cooldown rounds (last heartbeat overdue)"


def test_heartbeat_watchdog_allows_a_start_up_grace_then_three_missed_beats():
    limits = SupervisionLimits(heartbeat_secs=10, heartbeat_misses=3, startup_grace_secs=5)
    started = 1000.0
    assert not heartbeat_overdue(limits, started + 34, started, None)
    assert heartbeat_overdue(limits, started + 35, started, None)
    # A beat from before this start belongs to an earlier run.
    assert heartbeat_overdue(limits, started + 35, started, started - 1)
    assert not heartbeat_overdue(limits, started + 59, started, started + 30)
    assert heartbeat_overdue(limits, started + 60, started, started + 30)
    assert not heartbeat_overdue(SupervisionLimits(heartbeat_secs=0), started + 1e6, started, None)


# --- the supervisor loop, with real workers --------------------------------

class Harness:
    def __init__(self, tmp_path, desired, **kw):
        self.desired = list(desired)
        self.states = []
        self.sup = Supervisor(lambda: self.desired, pid_dir=tmp_path / "pids", log_dir=tmp_path / "logs",
                              on_state=lambda *s: self.states.append(s), **kw)

    def run_until(self, predicate, timeout=8.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sup.step()
            if predicate():
                return True
            time.sleep(0.01)
        return False

    def status(self, plugin_id="p1"):
        return self.sup.status().get(plugin_id)

    def pid(self, plugin_id="p1"):
        st = self.status(plugin_id)
        return st.pid if st else None


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(desired, **kw):
        h = Harness(tmp_path, desired, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.sup.shutdown(grace=0.5)


QUICK = SupervisionLimits(heartbeat_secs=0, backoff_initial_secs=0.01, backoff_factor=2,
                          backoff_max_secs=0.05, restarts_per_round=1, cooldown_secs=0.05,
                          breaker_rounds=3, stable_secs=30, stop_grace_secs=0.5)


def test_a_worker_that_exits_at_once_trips_the_breaker_after_three_cooldown_rounds_and_stays_down(harness):
    h = harness([DesiredWorker(WorkerSpec("p1", "/bin/sh", ["-c", "exit 1"]), QUICK)])
    assert h.run_until(lambda: h.status().state == DISABLED)
    reason = "circuit breaker: 3 consecutive cooldown rounds (last exit code 1)"
    assert h.states[-1] == ("p1", DISABLED, reason)
    assert [s for _, s, _ in h.states].count(COOLDOWN) == 2
    assert h.status().starts == 6  # three rounds of a start and one restart
    h.run_until(lambda: False, timeout=0.3)
    assert h.status().starts == 6 and h.pid() is None
    assert h.states[-1] == ("p1", DISABLED, reason)


def test_a_breaker_disabled_plugin_runs_again_once_enabled(harness):
    desired = DesiredWorker(WorkerSpec("p1", "/bin/sh", ["-c", "exit 1"]), QUICK)
    h = harness([desired])
    assert h.run_until(lambda: h.status().state == DISABLED)
    h.desired = []  # the caller records "disabled": the plugin leaves the set
    h.sup.step()
    assert h.status() is None
    assert h.states[-1][1] == DISABLED
    h.desired = [desired]  # the admin's enable action
    assert h.run_until(lambda: h.status() is not None and h.status().starts == 1)


def test_a_worker_that_stops_heartbeating_is_restarted(harness):
    limits = SupervisionLimits(heartbeat_secs=0.05, heartbeat_misses=3, startup_grace_secs=0.1,
                               backoff_initial_secs=0.01, stop_grace_secs=0.5)
    h = harness([DesiredWorker(sleeper_spec(), limits)], heartbeat=lambda _id: None)
    assert h.run_until(lambda: h.pid() is not None)
    first = h.pid()
    assert h.run_until(lambda: h.pid() not in (None, first))
    assert ("p1", STOPPING, HEARTBEAT_OVERDUE) in h.states
    assert not pid_alive(first)


def test_a_worker_that_never_heartbeats_trips_the_breaker_however_long_it_ran(harness):
    limits = SupervisionLimits(heartbeat_secs=0.05, heartbeat_misses=3, startup_grace_secs=0.1,
                               restarts_per_round=0, breaker_rounds=1, stable_secs=0.01,
                               stop_grace_secs=0.5)
    h = harness([DesiredWorker(sleeper_spec(), limits)], heartbeat=lambda _id: None)
    assert h.run_until(lambda: h.status().state == DISABLED)
    assert h.status().reason == "circuit breaker: 1 consecutive cooldown rounds (last heartbeat overdue)"


def test_a_worker_that_heartbeats_is_left_running(harness):
    limits = SupervisionLimits(heartbeat_secs=0.05, heartbeat_misses=3, startup_grace_secs=0.1)
    h = harness([DesiredWorker(sleeper_spec(), limits)], heartbeat=lambda _id: time.time())
    assert h.run_until(lambda: h.pid() is not None)
    first = h.pid()
    h.run_until(lambda: False, timeout=0.8)
    assert h.pid() == first and h.status().starts == 1


def test_editing_a_spec_restarts_its_worker(harness):
    h = harness([DesiredWorker(sleeper_spec(), QUICK)])
    assert h.run_until(lambda: h.pid() is not None)
    first = h.pid()
    edited = WorkerSpec("p1", PY, ["-c", "import time; time.sleep(61)"])
    h.desired = [DesiredWorker(edited, QUICK)]
    assert h.run_until(lambda: h.pid() not in (None, first))
    assert not pid_alive(first)
    assert ("p1", STOPPING, SPEC_CHANGED) in h.states
    assert h.sup._slots["p1"].handle.spec.args == edited.args


def test_disabling_a_plugin_stops_its_worker_and_adding_one_starts_it(harness):
    h = harness([DesiredWorker(sleeper_spec("p1"), QUICK)])
    assert h.run_until(lambda: h.pid("p1") is not None)
    first = h.pid("p1")
    h.desired = [DesiredWorker(sleeper_spec("p2"), QUICK)]
    assert h.run_until(lambda: h.status("p1") is None and h.pid("p2") is not None)
    assert not pid_alive(first)
    assert ("p1", STOPPED, REMOVED) in h.states
    assert pid_alive(h.pid("p2"))


def test_a_command_that_cannot_start_counts_as_a_failure(harness):
    h = harness([DesiredWorker(WorkerSpec("p1", "/nonexistent/worker"), QUICK)])
    assert h.run_until(lambda: h.status().state == DISABLED)
    assert "start failed" in h.status().reason


def test_shutdown_stops_every_worker_in_two_phases(harness, tmp_path):
    ready = tmp_path / "ready"
    stubborn = WorkerSpec("p2", PY, ["-c", f"import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                           f"open({str(ready)!r}, 'w').write('1')\ntime.sleep(60)"])
    h = harness([DesiredWorker(sleeper_spec("p1"), QUICK), DesiredWorker(stubborn, QUICK)])
    assert h.run_until(lambda: h.pid("p1") and h.pid("p2") and ready.exists())
    pids = [h.pid("p1"), h.pid("p2")]
    h.sup.shutdown(grace=0.3)
    assert not any(pid_alive(p) for p in pids)
    assert {(p, s) for p, s, _ in h.states[-2:]} == {("p1", STOPPED), ("p2", STOPPED)}
    assert list((tmp_path / "pids").glob("*.json")) == []


def test_status_may_be_read_from_another_thread_while_a_step_changes_the_slots(dirs):
    """status() from another thread (the runtime, a test) while the supervisor's own thread adds and removes slots:
    reading the dict itself raised "dictionary changed size during iteration" (CI saw it once)."""
    import threading
    from types import SimpleNamespace
    sup = Supervisor(lambda: [], **dirs)

    class SlowSlot(SimpleNamespace):
        @property
        def state(self):
            time.sleep(0.001)  # lets the other thread run between two slots, as a busy machine does
            return "running"
    for i in range(20):
        sup._slots[f"p{i}"] = SlowSlot(reason="", handle=None, starts=1, restart_at=None)
    stop = threading.Event()

    def churn():
        n = 0
        while not stop.is_set():
            sup._slots[f"q{n}"] = SlowSlot(reason="", handle=None, starts=1, restart_at=None)
            sup._slots.pop(f"q{n - 1}", None)
            n += 1
            time.sleep(0.0005)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(20):
            status = sup.status()
            assert {f"p{i}" for i in range(20)} <= set(status)
    finally:
        stop.set()
        t.join(5)
