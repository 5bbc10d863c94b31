"""`manage.py cron run` shows progress, and killed mid-way (kill -9) leaves no ghost run blocking its job."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime, timezone

from tests.support.daemon import PY, ROOT, Daemon

CRON_TOML = '''
enabled = true

[[jobs]]
id = "slow"
enabled = true
overlap = "skip"

[[jobs.tasks]]
id = "wait"
prompt = "script:sleep=60|answer=done"
'''


def wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_cron_run_frees_its_job_and_the_run_says_why(tmp_path):
    d = Daemon(tmp_path, servers=False, extra_env={"UGENT_CRON_RUNNER_LEASE_SECONDS": "1.5"})
    d.prepare()  # the scripted profile is the default
    (tmp_path / "cron.toml").write_text(CRON_TOML)
    d.manage("cron", "import", str(tmp_path / "cron.toml"))

    out_path = tmp_path / "cron-run.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([PY, "manage.py", "cron", "run", "slow"], cwd=ROOT, env=d.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # progress, as it happens: the run starts, then its task's turn runs
        wait_for(lambda: "task 'wait': running (turn " in out_path.read_text(), "the task's progress line")
        progress = [line for line in out_path.read_text().splitlines() if line.startswith(("Run #", "  task"))]
        assert progress[0] in ("Run #1 of 'slow': queued", "Run #1 of 'slow': running")
        assert progress.index("Run #1 of 'slow': running") < len(progress) - 1
        assert progress[-1].startswith("  task 'wait': running (turn turn-")
        (pid_text,) = d.sql("SELECT runner FROM cron_app_cronrun WHERE id = 1")[0]
        assert pid_text == f"cron run pid {proc.pid} on {os.uname().nodename}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert d.sql("SELECT state FROM cron_app_cronrun WHERE id = 1") == [("running",)]

    # once the dead process's lease has lapsed, the job is free: a new run is claimed, not "already running"
    def lapsed():
        (expires,) = d.sql("SELECT runner_lease_expires_at FROM cron_app_cronrun WHERE id = 1")[0]
        return datetime.fromisoformat(expires).replace(tzinfo=timezone.utc) < datetime.now(timezone.utc)
    wait_for(lapsed, "the lease to lapse")
    again = d.manage("cron", "run", "slow", "--no-wait", check=False)
    assert again.returncode == 0, again.stderr
    assert "Run #2 of 'slow' is queued." in again.stdout
    state, error = d.sql("SELECT state, error FROM cron_app_cronrun WHERE id = 1")[0]
    assert state == "interrupted"
    assert error == f"the process running it stopped (cron run pid {proc.pid} on {os.uname().nodename})"
    # and its turn, left running by the dead process, was asked to stop on the run's behalf
    assert d.sql("SELECT cancel_requested, stop_requested_by FROM channels_app_turn") == [(1, "cron run 1")]


def test_a_live_cron_run_keeps_its_job_busy(tmp_path):
    d = Daemon(tmp_path, servers=False, extra_env={"UGENT_CRON_RUNNER_LEASE_SECONDS": "1.5"})
    d.prepare()  # the scripted profile is the default
    (tmp_path / "cron.toml").write_text(CRON_TOML)
    d.manage("cron", "import", str(tmp_path / "cron.toml"))
    out_path = tmp_path / "cron-run.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([PY, "manage.py", "cron", "run", "slow"], cwd=ROOT, env=d.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "task 'wait': running" in out_path.read_text(), "the task's progress line")
        time.sleep(3)  # two lease lengths: a living process renews its lease, so its run is not swept
        busy = d.manage("cron", "run", "slow", "--no-wait", check=False)
        assert busy.returncode != 0 and "cron job 'slow' is already running (overlap = skip)" in busy.stderr
        assert d.sql("SELECT id, state FROM cron_app_cronrun") == [(1, "running")]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
