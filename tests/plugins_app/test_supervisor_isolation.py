"""One misbehaving worker cannot freeze supervision or harm its neighbours: a worker SIGKILL does not end
at once (as one in uninterruptible sleep) holds up neither the loop nor the shutdown and is never started
twice; a worker past its memory cap fails and is restarted like any crash; and the bridge token is in no
worker's environment, where any process of the same user could read it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from plugins_app.channel.supervisor import BACKOFF, STOPPING, DesiredWorker, Supervisor, WorkerHandle, WorkerSpec
from plugins_app.channel.supervisor.process import pid_alive, pid_file_path, proc_start_time

from .test_supervisor import (QUICK, SLEEPER, dead_pid, harness, sleeper_spec,  # noqa: F401 (a fixture)
                              wait_until, write_pid_file)

pytestmark = [pytest.mark.mode_free,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc, prctl and ptrace")]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture(autouse=True)
def _eager_celery():
    # Overrides the shared conftest's fixture, which needs pytest-django (as test_supervisor.py does).
    yield



# --- a worker SIGKILL does not end at once -----------------------------------------------

# Real D state (a process stuck in the kernel, where SIGKILL waits until the call returns) cannot be made on
# demand without root. What this worker does is real, and has the same effect on its parent: its tracer, a
# child that has left the worker's session and so its process group (the group's SIGKILL misses it), asks for
# PTRACE_O_TRACEEXIT, and the kernel then holds the SIGKILLed worker at its exit, alive and unreaped, for as
# long as the tracer lives. The test ends the hold by killing the tracer.
HELD_AT_EXIT = textwrap.dedent("""
    import ctypes, os, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    ready = {ready!r}
    worker = os.getpid()
    go_r, go_w = os.pipe()
    tracer = os.fork()
    if tracer == 0:
        os.setsid()
        os.read(go_r, 1)
        if libc.ptrace(0x4206, worker, None, ctypes.c_void_p(0x40)) != 0:  # PTRACE_SEIZE, PTRACE_O_TRACEEXIT
            open(ready + ".tmp", "w").write("refused: " + os.strerror(ctypes.get_errno()))
        else:
            open(ready + ".tmp", "w").write(str(os.getpid()))
        os.rename(ready + ".tmp", ready)
        time.sleep(120)  # a safety net only: the test kills the tracer long before
        os._exit(0)
    libc.prctl(0x59616D61, tracer, 0, 0, 0)  # PR_SET_PTRACER: under Yama's ptrace_scope 1 a child may not trace
    os.write(go_w, b"g")
    time.sleep(120)
""")


class Held:
    """The worker above: its code, its tracer's pid, and the release (the tracer killed)."""

    def __init__(self, tmp_path: Path):
        self.ready = tmp_path / "tracer.ready"
        self.code = HELD_AT_EXIT.format(ready=str(self.ready))
        self.tracers: list[int] = []

    def tracer(self) -> int:
        assert wait_until(self.ready.exists, 10), "the worker's tracer never started"
        text = self.ready.read_text()
        if text.startswith("refused"):
            pytest.skip(f"ptrace is not permitted here ({text})")
        self.tracers.append(int(text))
        return self.tracers[-1]

    def release(self) -> None:
        for pid in self.tracers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def held(tmp_path):
    h = Held(tmp_path)
    yield h
    h.release()


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_kill_gives_up_on_a_worker_sigkill_does_not_end_and_poll_reaps_it_once_it_exits(tmp_path, held):
    dirs = {"log_dir": tmp_path / "logs", "pid_dir": tmp_path / "pids"}
    handle = WorkerHandle.spawn(WorkerSpec("held", PY, ["-c", held.code]), **dirs)
    held.tracer()
    pid_file = pid_file_path(dirs["pid_dir"], "held")

    got = []
    killing = threading.Thread(target=lambda: got.append(handle.kill(wait=0.2)))
    killing.start()
    killing.join(30)
    try:
        assert not killing.is_alive(), "kill() waited for the held worker"
    finally:
        if killing.is_alive():
            held.release()
    assert got == [None]
    assert proc_state(handle.pid) == "t"  # SIGKILLed, held at its exit: alive and not reaped
    assert handle.poll() is None and pid_file.exists()

    held.release()
    assert wait_until(lambda: handle.poll() is not None, 10)
    assert handle.returncode == -signal.SIGKILL
    assert not pid_file.exists()


def test_a_worker_sigkill_does_not_end_holds_up_neither_the_loop_nor_its_neighbour_and_runs_once(
        tmp_path, held, caplog):
    desired = [DesiredWorker(WorkerSpec("stuck", PY, ["-c", held.code]), QUICK),
               DesiredWorker(sleeper_spec("neighbour"), QUICK)]
    sup = Supervisor(lambda: list(desired), pid_dir=tmp_path / "pids", log_dir=tmp_path / "logs",
                     interval=0.02, kill_wait=0.2)
    stop = threading.Event()
    loop = threading.Thread(target=sup.run, args=(stop,), name="supervisor-loop", daemon=True)

    def status(plugin_id):
        try:
            return sup.status().get(plugin_id)
        except RuntimeError:  # the loop thread changed the slots as they were read
            return None

    def pid(plugin_id):
        st = status(plugin_id)
        return st.pid if st else None

    loop.start()
    try:
        assert wait_until(lambda: pid("stuck") and pid("neighbour"), 10)
        stuck = pid("stuck")
        held.tracer()
        # an edit restarts it: SIGTERM, the grace, SIGKILL, which does not end it
        desired[0] = DesiredWorker(sleeper_spec("stuck"), QUICK)
        assert wait_until(lambda: "did not die after SIGKILL" in getattr(status("stuck"), "reason", ""), 10), \
            status("stuck")
        # the loop goes on: the neighbour, killed with SIGKILL, is started again
        neighbour = pid("neighbour")
        os.kill(neighbour, signal.SIGKILL)
        assert wait_until(lambda: pid("neighbour") not in (None, neighbour), 10)
        # the held worker is still the plugin's, alive, not started again, and its pid file names it
        st = status("stuck")
        assert (st.state, st.pid, st.starts) == (STOPPING, stuck, 1)
        assert st.reason == f"pid {stuck} did not die after SIGKILL; waiting for it to exit"
        assert pid_alive(stuck)
        assert json.loads(pid_file_path(tmp_path / "pids", "stuck").read_text())["pid"] == stuck
        assert any(r.levelname == "ERROR" and "plugin stuck" in r.getMessage() and f"pid {stuck}" in r.getMessage()
                   for r in caplog.records)

        held.release()
        assert wait_until(lambda: pid("stuck") not in (None, stuck), 10)
        assert not pid_alive(stuck)
        assert status("stuck").starts == 2
        assert json.loads(pid_file_path(tmp_path / "pids", "stuck").read_text())["pid"] == pid("stuck")
    finally:
        held.release()
        stop.set()
        loop.join(30)
    assert not loop.is_alive()


def test_shutdown_does_not_wait_for_ever_for_a_worker_sigkill_does_not_end(tmp_path, harness, held, caplog):
    h = harness([DesiredWorker(WorkerSpec("stuck", PY, ["-c", held.code]), QUICK),
                 DesiredWorker(sleeper_spec("p2"), QUICK)], kill_wait=0.2)
    assert h.run_until(lambda: h.pid("stuck") and h.pid("p2"))
    stuck, p2 = h.pid("stuck"), h.pid("p2")
    held.tracer()
    done = threading.Thread(target=h.sup.shutdown, kwargs={"grace": 0.2})
    done.start()
    try:
        done.join(30)
        assert not done.is_alive(), "shutdown waited for the held worker"
        assert not pid_alive(p2)
        assert pid_alive(stuck)
        # its pid file stays for the next supervisor's reaping; the other's is gone
        assert [p.name for p in (tmp_path / "pids").glob("*.json")] == ["stuck.json"]
        assert any(r.levelname == "ERROR" and f"plugin stuck worker pid {stuck} did not die" in r.getMessage()
                   for r in caplog.records)
    finally:
        held.release()
        done.join(30)
    assert wait_until(lambda: not pid_alive(stuck), 10)


def test_a_stale_worker_sigkill_does_not_end_keeps_its_pid_file_and_its_plugin_waits_for_it(tmp_path, harness,
                                                                                            held):
    orphan = subprocess.Popen([PY, "-c", held.code], start_new_session=True)
    try:
        held.tracer()
        pid_file = write_pid_file(tmp_path / "pids", "p1", orphan.pid, start_time=proc_start_time(orphan.pid),
                                  supervisor_pid=dead_pid(), supervisor_start_time=1)
        h = harness([DesiredWorker(sleeper_spec("p1"), QUICK)], reap_grace=0.2, kill_wait=0.2)
        h.sup.start()
        assert [(r.plugin_id, [s.pid for s in r.survivors]) for r in h.sup.reaped] == [("p1", [orphan.pid])]
        h.run_until(lambda: False, timeout=0.5)
        st = h.status()
        assert (st.state, st.pid, st.starts) == (STOPPING, None, 0)
        assert st.reason == (f"pid {orphan.pid} of the previous supervisor's worker did not die after SIGKILL; "
                             "waiting for it to exit")
        assert json.loads(pid_file.read_text())["pid"] == orphan.pid

        held.release()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert h.run_until(lambda: h.pid() is not None)
        assert json.loads(pid_file.read_text())["pid"] == h.pid()
    finally:
        held.release()
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait(10)


# --- the memory cap ------------------------------------------------------------------------

HOG = ("-c", "import time\nx = bytearray(256 * 1024 * 1024)\nprint('allocated', flush=True)\ntime.sleep(60)")


def test_a_worker_runs_under_its_memory_cap_soft_and_hard(tmp_path):
    code = "print([l for l in open('/proc/self/limits') if l.startswith('Max data size')][0].strip())"
    handle = WorkerHandle.spawn(WorkerSpec("capped", PY, ["-c", code], memory_max_mb=64), log_dir=tmp_path)
    assert wait_until(lambda: handle.poll() is not None)
    assert handle.returncode == 0
    log = handle.log_path.read_text()
    assert "(memory cap 64 MiB)" in log.splitlines()[0]
    assert log.splitlines()[-1].split()[3:5] == [str(64 * 1024 * 1024)] * 2


def test_a_worker_past_its_memory_cap_fails_and_is_restarted_like_any_crash(tmp_path, harness):
    h = harness([DesiredWorker(WorkerSpec("p1", PY, HOG, memory_max_mb=64), QUICK)])
    assert h.run_until(lambda: h.status().starts >= 2)
    assert ("p1", BACKOFF, "exit code 1; restart 1/1 in 0.01 s") in h.states
    said = [line for line in (tmp_path / "logs" / "p1.log").read_text().splitlines() if not line.startswith("---")]
    assert "MemoryError" in said and "allocated" not in said


def test_a_worker_without_a_cap_allocates_as_it_likes(tmp_path, harness):
    """The same worker, capped at 0 (no cap): it allocates and stays up (what the test above would see
    if the cap were not applied)."""
    h = harness([DesiredWorker(WorkerSpec("p1", PY, HOG, memory_max_mb=0), QUICK)])
    assert h.run_until(lambda: "\nallocated\n" in (tmp_path / "logs" / "p1.log").read_text())
    h.run_until(lambda: False, timeout=0.3)
    assert h.status().starts == 1 and pid_alive(h.pid())


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_memory_cap_that_is_not_a_whole_number_of_mib_is_refused(bad):
    with pytest.raises(ValueError, match="memory_max_mb must be a whole number of MiB"):
        WorkerSpec("p1", PY, SLEEPER, memory_max_mb=bad)


# --- the token -------------------------------------------------------------------------------

# Reads the token as an SDK worker does, then says what it found, and waits to be looked at.
READS_TOKEN = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    fd = int(os.environ["UGENT_PLUGIN_TOKEN_FD"])
    from plugins_app.channel.sdk.worker import plugin_token
    first, again = plugin_token(), plugin_token()
    try:
        os.fstat(fd)
        closed = False
    except OSError:
        closed = True
    print(os.environ["UGENT_PLUGIN_ID"], first, os.environ.get("UGENT_BRIDGE_SOCKET"), again == first,
          closed, "UGENT_PLUGIN_TOKEN_FD" in os.environ, "UGENT_PLUGIN_TOKEN" in os.environ, flush=True)
    time.sleep(60)
""")


def test_the_token_reaches_the_worker_on_a_pipe_and_no_other_process_can_read_it_from_its_environment(
        tmp_path, harness):
    issued = []

    def issue(plugin_id):
        issued.append(f"tok-{plugin_id}-{len(issued)}-secret")
        return issued[-1]

    spec = WorkerSpec("p1", PY, ["-c", READS_TOKEN.format(repo=str(REPO))])
    h = harness([DesiredWorker(spec, QUICK)], bridge_socket=tmp_path / "bridge.sock", token_issuer=issue)
    log = tmp_path / "logs" / "p1.log"
    assert h.run_until(lambda: log.exists() and "tok-" in log.read_text())
    worker = h.pid()
    said = [line for line in log.read_text().splitlines() if line.startswith("p1 ")]
    # the SDK read it once, closed the pipe, and dropped the variable naming it
    assert said == [f"p1 {issued[0]} {tmp_path / 'bridge.sock'} True True False False"]
    # a neighbour of the same user reads the worker's environment: no token in it
    environ = Path(f"/proc/{worker}/environ").read_bytes()
    assert issued[0].encode() not in environ
    assert b"UGENT_PLUGIN_TOKEN=" not in environ
    assert b"UGENT_PLUGIN_TOKEN_FD=" in environ
    # nor any pipe of the worker left holding it
    assert not any(os.readlink(f"/proc/{worker}/fd/{fd}").startswith("pipe:") and fd not in ("1", "2")
                   for fd in os.listdir(f"/proc/{worker}/fd"))


def test_each_start_gets_a_fresh_token(tmp_path, harness):
    issued = []

    def issue(plugin_id):
        issued.append(f"tok-{plugin_id}-{len(issued)}")
        return issued[-1]

    code = READS_TOKEN.format(repo=str(REPO)).replace("time.sleep(60)", "")
    h = harness([DesiredWorker(WorkerSpec("p1", PY, ["-c", code]), QUICK)], token_issuer=issue)
    assert h.run_until(lambda: h.status().starts >= 2 and h.pid() is None)
    said = [line.split()[1] for line in (tmp_path / "logs" / "p1.log").read_text().splitlines()
            if line.startswith("p1 ")]
    assert said[:2] == issued[:2] and issued[0] != issued[1]


@pytest.mark.parametrize("value, message", [
    ("x", "UGENT_PLUGIN_TOKEN_FD='x' is not a file descriptor number"),
    ("0", "UGENT_PLUGIN_TOKEN_FD=0: fd 0 is not a pipe"),
    ("97", "UGENT_PLUGIN_TOKEN_FD=97: fd 97 cannot be read: Bad file descriptor"),
])
def test_a_token_fd_that_names_no_pipe_is_a_clear_error(value, message):
    code = "from plugins_app.channel.sdk.worker import plugin_token\nplugin_token()"
    env = {"PATH": os.environ.get("PATH", ""), "UGENT_PLUGIN_TOKEN_FD": value, "UGENT_PLUGIN_TOKEN": "from-env"}
    out = subprocess.run([PY, "-c", code], cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == f"ValueError: {message}"


def test_a_token_pipe_whose_writer_is_kept_open_gives_what_it_holds_without_waiting():
    """A worker started by hand with a pipe its starter keeps open read it to an end that never came."""
    read, write = os.pipe()
    try:
        os.write(write, b"tok-123")
        code = "from plugins_app.channel.sdk.worker import plugin_token\nprint(plugin_token())"
        env = {"PATH": os.environ.get("PATH", ""), "UGENT_PLUGIN_TOKEN_FD": str(read)}
        out = subprocess.run([PY, "-c", code], cwd=REPO, env=env, pass_fds=(read,), capture_output=True,
                             text=True, timeout=60)
        assert (out.returncode, out.stdout) == (0, "tok-123\n"), out.stderr
    finally:
        os.close(read)
        os.close(write)


def test_without_a_token_fd_the_sdk_reads_the_token_from_its_environment():
    """MockBridge, and a worker started by hand, set UGENT_PLUGIN_TOKEN itself."""
    code = "from plugins_app.channel.sdk.worker import plugin_token\nprint(plugin_token())"
    env = {"PATH": os.environ.get("PATH", ""), "UGENT_PLUGIN_TOKEN": "from-env"}
    out = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "from-env\n"), out.stderr


def test_a_negative_default_memory_cap_stops_the_start_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_PLUGIN_MEMORY_MAX_MB="-1", UGENT_VAR_DIR=str(tmp_path))
    out = subprocess.run([PY, "manage.py", "check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "ugent.E003" in out.stderr and "UGENT_PLUGIN_MEMORY_MAX_MB is -1" in out.stderr, out.stderr


def test_a_worker_started_through_a_shell_wrapper_reads_the_token_the_wrapper_passes_on(tmp_path, harness):
    code = READS_TOKEN.format(repo=str(REPO)).replace("time.sleep(60)", "")
    script = tmp_path / "reads_token.py"
    script.write_text(code)
    wrapper = WorkerSpec("p1", "/bin/sh", ["-c", f"{PY} {script} ; true"])
    h = harness([DesiredWorker(wrapper, QUICK)], token_issuer=lambda _id: "wrapped-token")
    log = tmp_path / "logs" / "p1.log"
    assert h.run_until(lambda: log.exists() and "wrapped-token" in log.read_text())
    assert [line.split()[1] for line in log.read_text().splitlines() if line.startswith("p1 ")][0] == "wrapped-token"
