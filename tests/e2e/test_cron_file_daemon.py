"""The daemon imports UGENT_CRON_FILE at start and whenever it changes (embedded: rundaemon; servers: beat),
and a restart with the same file leaves the admin's edits alone (docs/cron.md, "The file and the admin")."""
from __future__ import annotations

import os

import httpx

from tests.cron_app.test_cron_file_watch import DIGEST, NIGHTLY
from tests.support.daemon import Daemon
from tests.support.layout import wait_until

RULES = """
[[rules]]
name = "digest"
priority = 50
match = { field = "text", starts_with = "digest" }

[rules.decision.StartWorkflow]
workflow = "digest"
"""


def test_an_edit_to_cron_toml_counts_without_a_restart_and_a_restart_keeps_the_admins_edits(tmp_path):
    path = tmp_path / "cron.toml"
    path.write_text(DIGEST)
    # a rules.toml whose StartWorkflow names the job cron.toml brings: checked as the rules load at start
    (tmp_path / "rules.toml").write_text(RULES)
    (tmp_path / "d" / "workspace").mkdir(parents=True)
    (tmp_path / "d" / "workspace" / "ugent.toml").write_text(f'[rules]\nfile = "{tmp_path / "rules.toml"}"\n')
    d = Daemon(tmp_path / "d", beat=True, extra_env={"UGENT_CRON_FILE": str(path),
                                                     "UGENT_CRON_WATCH_POLL_SECS": "0.2"}).start()
    log_path = tmp_path / "d" / "daemon.log"
    watched = f"cron file watched (path={path}, state="
    try:
        def jobs():
            return {name: bool(on) for name, on in d.sql("SELECT name, enabled FROM cron_app_cronjob")}
        wait_until(lambda: jobs() == {"digest": True}, 30, what="the file's job at start")
        # (servers mode: beat imports the file, and a web process loads the rules at its first message)
        wait_until(lambda: watched in log_path.read_text(), 30, what="the first look at the file")
        r = httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key}, timeout=30,
                       json={"messages": [{"role": "user", "content": "digest please"}], "user": "alice"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == (
            "Started workflow 'digest'. Its result goes to the workflow's destinations.")
        assert "rule dropped" not in log_path.read_text()
        path.write_text(DIGEST + NIGHTLY)
        os.utime(path, ns=(2 * 10**9, 2 * 10**9))
        wait_until(lambda: jobs() == {"digest": True, "nightly": True}, 30, what="the edit's job")
        # scheduled by beat's schedule, as an imported job is
        assert [bool(on) for on, in d.sql(
            "SELECT enabled FROM django_celery_beat_periodictask WHERE name = 'cron job nightly'")] == [True]
        # the import's line follows its commit: the rows can be seen a moment before it is written
        imported = f"cron file imported (path={path}, jobs=2, removed=0)"
        wait_until(lambda: imported in log_path.read_text(), 30, what="the edit's import logged")
        # the admin turns a job off; a restart with the same file keeps that
        d.sql("UPDATE cron_app_cronjob SET enabled = false WHERE name = 'digest'")
        d.stop()
        d.spawn()
        wait_until(lambda: log_path.read_text().count(watched) == 2, 30,
                   what="the restarted process's first look at the file")
        assert f"{watched}unchanged)" in log_path.read_text()
        assert jobs() == {"digest": False, "nightly": True}
    finally:
        d.close()
