"""kill -9 in the middle of cron.toml's import, in the run mode the environment names.

The import is one transaction that writes the jobs, their tasks, destinations and beat schedules, deletes
the jobs the file no longer names, and records the text's SHA-256 (`services.cron_file_sync`,
`cron_config_import`). A process killed inside it must leave the jobs exactly as they were, with the old
text's digest, so that the next start imports the file again, once, and the start after that imports
nothing. Both the daemon's own import at its start (embedded: the daemon; servers: beat) and the operator's
`manage.py cron import` are killed here. The kill lands after some task rows were written and before the
dropped job was deleted (tests/support/pause_site/sitecustomize.py holds the process there)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.support.daemon import PY, ROOT, Daemon

OLD = """
enabled = true

[[jobs]]
id = "alpha"
schedule = "0 6 * * *"

[[jobs.tasks]]
id = "a1"
prompt = "Old alpha."

[[jobs]]
id = "beta"
schedule = "0 7 * * *"

[[jobs.tasks]]
id = "b1"
prompt = "Beta."
"""

NEW = """
enabled = true

[[jobs]]
id = "alpha"
schedule = "15 6 * * *"

[[jobs.tasks]]
id = "a1"
prompt = "New alpha."

[[jobs.tasks]]
id = "a2"
prompt = "Alpha's second task."

[[jobs]]
id = "gamma"
schedule = "0 8 * * 1-5"

[[jobs.tasks]]
id = "g1"
prompt = "Gamma."

[[jobs.destinations]]
channel = "slack"
conversation = "C123"

[[jobs]]
id = "delta"
rule_trigger = true

[[jobs.tasks]]
id = "d1"
prompt = "Delta."
"""

#: The import stops after its third task row (alpha's two and gamma's first): alpha is new, gamma half made,
#: delta missing and beta not yet deleted.
PAUSE_AFTER_TASKS = "3"

#: What the rows say once NEW is imported: jobs (name, enabled, rule_trigger, schedule, position), tasks
#: (job, task, prompt, position), destinations, and the beat schedules (name, enabled, minute, hour, day of week).
NEW_STATE = {
    "jobs": [("alpha", True, False, "15 6 * * *", 0), ("delta", True, True, "", 2),
             ("gamma", True, False, "0 8 * * 1-5", 1)],
    "tasks": [("alpha", "a1", "New alpha.", 0), ("alpha", "a2", "Alpha's second task.", 1),
              ("delta", "d1", "Delta.", 0), ("gamma", "g1", "Gamma.", 0)],
    "destinations": [("gamma", "slack", "C123")],
    "schedules": [("cron job alpha", True, "15", "6", "*"), ("cron job gamma", True, "0", "8", "1-5")],
}


def state(d: Daemon) -> dict:
    """Every row the import writes, as an operator would read them from the database."""
    return {
        "jobs": [(n, bool(e), bool(r), s, p) for n, e, r, s, p in d.sql(
            "SELECT name, enabled, rule_trigger, schedule, position FROM cron_app_cronjob ORDER BY name")],
        "tasks": d.sql("SELECT j.name, t.task_id, t.prompt, t.position FROM cron_app_crontask t "
                       "JOIN cron_app_cronjob j ON j.id = t.job_id ORDER BY j.name, t.position, t.task_id"),
        "destinations": d.sql("SELECT j.name, x.channel, x.conversation FROM cron_app_crondestination x "
                              "JOIN cron_app_cronjob j ON j.id = x.job_id ORDER BY j.name, x.position"),
        "schedules": [(n, bool(e), mi, h, dw) for n, e, mi, h, dw in d.sql(
            "SELECT p.name, p.enabled, c.minute, c.hour, c.day_of_week FROM django_celery_beat_periodictask p "
            "JOIN django_celery_beat_crontabschedule c ON c.id = p.crontab_id "
            "WHERE p.name LIKE ? ORDER BY p.name", ("cron job %",))],
    }


def digest(d: Daemon) -> str:
    (row,) = d.sql("SELECT file_sha256 FROM cron_app_cronsettings WHERE id = 1")
    return row[0]


def sha256(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()


def wait_for_mark(mark: Path, procs, timeout: float = 90) -> int:
    """The pid of the process now paused inside the import."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mark.exists():
            pid, *saved = mark.read_text().split()
            assert saved == ["a1", "a2", "g1"], saved  # the kill lands where the module says
            return int(pid)
        for p in procs:
            assert p.poll() is None, f"a process exited before the import paused (rc={p.returncode})"
        time.sleep(0.05)
    raise AssertionError("the import never reached its third task")


def kill9(pid: int) -> None:
    os.killpg(os.getpgid(pid), signal.SIGKILL)  # each process the helpers start leads its own group


def imported_lines(d: Daemon, path: Path) -> list[str]:
    return [line for line in (d.tmp / "daemon.log").read_text().splitlines()
            if f"cron file imported (path={path}" in line]


def new_daemon(tmp: Path) -> tuple[Daemon, Path, Path]:
    cron = tmp / "cron.toml"
    mark = tmp / "paused"
    d = Daemon(tmp / "d", beat=True, extra_env={"UGENT_CRON_FILE": str(cron), "UGENT_CRON_WATCH_POLL_SECS": "0.2"})
    d.prepare()
    # after prepare(): the database is a copy of the template other daemons share, made with the suite's path
    d.env["PYTHONPATH"] = f"{ROOT / 'tests' / 'support' / 'pause_site'}:{d.env['PYTHONPATH']}"
    cron.write_text(OLD)
    d.manage("cron", "import", str(cron))
    return d, cron, mark


def test_a_daemon_killed_mid_import_of_cron_toml_imports_it_once_at_its_next_start(tmp_path):
    d, cron, mark = new_daemon(tmp_path)
    try:
        before = state(d)
        assert [j[0] for j in before["jobs"]] == ["alpha", "beta"]
        assert digest(d) == sha256(OLD)
        cron.write_text(NEW)
        old = time.time() - 5  # settled: the start's look reads it at once
        os.utime(cron, (old, old))

        d.env.update({"UGENT_TEST_PAUSE_CRON_IMPORT": str(mark), "UGENT_TEST_PAUSE_AFTER_TASKS": PAUSE_AFTER_TASKS})
        d.spawn(wait=False)  # embedded: the daemon imports before it serves; servers: beat imports at its start
        pid = wait_for_mark(mark, d.procs)
        kill9(pid)
        d.stop()  # the rest of the layout (servers mode's web process and worker), gracefully

        # the killed transaction left nothing: every row as before, the old text's digest
        assert state(d) == before
        assert digest(d) == sha256(OLD)
        assert imported_lines(d, cron) == []

        del d.env["UGENT_TEST_PAUSE_CRON_IMPORT"]
        d.spawn()  # the next start imports the file: its text is not the one last imported
        deadline = time.monotonic() + 30
        while not imported_lines(d, cron) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(imported_lines(d, cron)) == 1, (d.tmp / "daemon.log").read_text()[-3000:]
        assert "jobs=3, removed=1" in imported_lines(d, cron)[0]
        assert state(d) == NEW_STATE
        assert digest(d) == sha256(NEW)
        d.stop()

        d.spawn()  # and the start after that imports nothing: the same text, the rows untouched
        time.sleep(1.0)  # (the start's import runs before the web process answers in embedded mode, at
        # beat's start in servers mode, and a look every 0.2 s after: a second import would be logged by now)
        assert len(imported_lines(d, cron)) == 1
        assert state(d) == NEW_STATE
    finally:
        d.close()


def test_a_cron_import_command_killed_mid_way_changes_nothing_and_runs_again_whole(tmp_path):
    d, cron, mark = new_daemon(tmp_path)
    try:
        before = state(d)
        new = tmp_path / "new.toml"
        new.write_text(NEW)
        env = {**d.env, "UGENT_TEST_PAUSE_CRON_IMPORT": str(mark), "UGENT_TEST_PAUSE_AFTER_TASKS": PAUSE_AFTER_TASKS}
        proc = subprocess.Popen([PY, "manage.py", "cron", "import", str(new)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert wait_for_mark(mark, [proc]) == proc.pid
            kill9(proc.pid)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL

        assert state(d) == before
        assert digest(d) == sha256(OLD)

        out = d.manage("cron", "import", str(new))
        assert out.stdout.strip() == f"Imported 3 cron job(s) from {new}; removed 1."
        assert state(d) == NEW_STATE
        assert digest(d) == sha256(NEW)
    finally:
        d.close()
