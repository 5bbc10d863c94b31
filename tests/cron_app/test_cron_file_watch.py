"""UGENT_CRON_FILE is imported when it changes (cron_app/filewatch.py, services.cron_file_sync): "an edit to
cron.toml counts without a restart", while a restart with the same file leaves the admin's edits alone and
a refused file changes nothing."""
from __future__ import annotations

import logging
import os
import time

import pytest
from django.core.management import call_command

from cron_app.filewatch import LOG_IMPORTED, LOG_REFUSED, CronFileWatcher
from cron_app.models import CronJob, CronSettings
from cron_app.services import cron_file_sync
from tests.support.layout import wait_until

DIGEST = """
[[jobs]]
id = "digest"
rule_trigger = true

[[jobs.tasks]]
id = "summarise"
prompt = "Summarise what the sender asked for, in one line."
"""

NIGHTLY = """
[[jobs]]
id = "nightly"
schedule = "30 2 * * 1-5"

[[jobs.tasks]]
id = "collect"
prompt = "Collect yesterday's tickets."
"""


def jobs() -> dict[str, bool]:
    return dict(CronJob.objects.values_list("name", "enabled"))


def write(path, text: str, stamp: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(stamp * 10**9, stamp * 10**9))  # a new signature even within the clock's tick


@pytest.mark.django_db
def test_a_file_is_imported_once_and_again_only_when_its_text_changes(tmp_path):
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    assert cron_file_sync(path=str(path)) == {"state": "imported", "jobs": 1, "removed": 0}
    assert jobs() == {"digest": True}
    assert cron_file_sync(path=str(path)) == {"state": "unchanged"}
    # the admin turns the job off: a restart with the same file leaves that alone
    CronJob.objects.filter(name="digest").update(enabled=False)
    assert cron_file_sync(path=str(path)) == {"state": "unchanged"}
    assert jobs() == {"digest": False}
    # the file changes: the file's jobs, as it says them
    write(path, DIGEST + NIGHTLY, 2)
    assert cron_file_sync(path=str(path)) == {"state": "imported", "jobs": 2, "removed": 0}
    assert jobs() == {"digest": True, "nightly": True}
    write(path, NIGHTLY, 3)
    assert cron_file_sync(path=str(path)) == {"state": "imported", "jobs": 1, "removed": 1}
    assert jobs() == {"nightly": True}


@pytest.mark.django_db
def test_a_refused_or_missing_file_changes_nothing(tmp_path):
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    cron_file_sync(path=str(path))
    digest = CronSettings.current().file_sha256
    write(path, DIGEST + '\n[[jobs]]\nid = "bad"\nschedule = "61 * * * *"\n[[jobs.tasks]]\nid = "t"\nprompt = "p"\n', 2)
    out = cron_file_sync(path=str(path))
    assert out["state"] == "refused" and "bad" in out["reason"], out
    assert jobs() == {"digest": True} and CronSettings.current().file_sha256 == digest
    path.unlink()
    assert cron_file_sync(path=str(path)) == {"state": "missing", "reason": "no such file"}
    assert jobs() == {"digest": True}


@pytest.mark.django_db
def test_cron_import_records_the_text_it_imported(tmp_path):
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    call_command("cron", "import", str(path), stdout=open(os.devnull, "w"))
    assert cron_file_sync(path=str(path)) == {"state": "unchanged"}


@pytest.mark.django_db(transaction=True)
def test_the_watcher_imports_an_edit_without_a_restart_and_logs_a_refused_one_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ugent.cron")
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    watcher = CronFileWatcher(str(path), poll=0.2).start()
    try:
        assert jobs() == {"digest": True}  # imported before start() returned
        write(path, DIGEST + NIGHTLY, 2)
        wait_until(lambda: jobs() == {"digest": True, "nightly": True}, 10, interval=0.05, what="the watcher")
        write(path, "[[jobs]]\nid = \"x\"\nbogus = 1\n", 3)
        refused = LOG_REFUSED.split(" (")[0]
        wait_until(lambda: any(r.getMessage().startswith(refused) for r in caplog.records), 10, interval=0.05,
                   what="the refusal's line")
        time.sleep(1.0)  # several polls of the same broken file
        assert sum(r.getMessage().startswith(refused) for r in caplog.records) == 1
        assert jobs() == {"digest": True, "nightly": True}
        # replaced by rename, as editors save
        new = tmp_path / "cron.toml.new"
        write(new, NIGHTLY, 4)
        os.replace(new, path)
        wait_until(lambda: jobs() == {"nightly": True}, 10, interval=0.05, what="the watcher")
        assert sum(r.getMessage().startswith(LOG_IMPORTED.split(" (")[0]) for r in caplog.records) == 3
    finally:
        watcher.stop()


@pytest.mark.django_db
@pytest.mark.parametrize("empty", ["  \n", "# the cron jobs\n"], ids=["blank", "comments-alone"])
def test_an_empty_file_is_refused_not_taken_for_no_jobs(tmp_path, empty):
    """A file caught between an editor's truncate and its write reads empty: importing it would delete
    every job (and their schedules) until the next look. Comments alone are empty too."""
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    cron_file_sync(path=str(path))
    write(path, empty, 2)
    assert cron_file_sync(path=str(path)) == {"state": "refused", "reason": "the file is empty"}
    assert jobs() == {"digest": True}


@pytest.mark.django_db(transaction=True)
def test_the_watcher_follows_a_symlink_swapped_as_kubernetes_swaps_a_configmap(tmp_path):
    """cron.toml -> ..data/cron.toml, ..data -> a versioned folder that a new version replaces by renaming a
    new link over it: the watcher must follow the link as it is now, not the file it named at start."""
    cfg = tmp_path / "cfg"
    for version, text in (("v1", DIGEST), ("v2", NIGHTLY)):
        (cfg / version).mkdir(parents=True)
        write(cfg / version / "cron.toml", text, 1)
    os.symlink("v1", cfg / "..data")
    os.symlink("..data/cron.toml", cfg / "cron.toml")
    watcher = CronFileWatcher(str(cfg / "cron.toml"), poll=0.2).start()
    try:
        assert jobs() == {"digest": True}
        os.symlink("v2", cfg / "..data_tmp")
        os.replace(cfg / "..data_tmp", cfg / "..data")
        wait_until(lambda: jobs() == {"nightly": True}, 10, interval=0.05, what="the watcher")
    finally:
        watcher.stop()


@pytest.mark.django_db(transaction=True)  # (a watcher's look closes its thread's connection)
def test_a_file_written_a_moment_ago_is_read_once_it_settles_and_one_dated_ahead_at_once(tmp_path):
    from cron_app import filewatch
    path = tmp_path / "cron.toml"
    path.write_text(DIGEST)  # mtime: now
    watcher = CronFileWatcher(str(path))
    assert watcher.sync_once() is None and jobs() == {}  # maybe still being written
    time.sleep(filewatch.SETTLE_SECS + 0.05)
    assert watcher.sync_once()["state"] == "imported" and jobs() == {"digest": True}
    ahead = time.time() + 3600  # a clock skewed or set back: no write under way, read it
    path.write_text(NIGHTLY)
    os.utime(path, (ahead, ahead))
    assert watcher.sync_once()["state"] == "imported" and jobs() == {"nightly": True}


@pytest.mark.django_db(transaction=True)  # (a watcher's look closes its thread's connection)
def test_a_failing_import_is_tried_at_every_look_and_its_traceback_logged_once(tmp_path, caplog, monkeypatch):
    from cron_app import services
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    real, calls = services.cron_file_sync, []

    def down(**kw):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("the database is away")
        return real(**kw)
    monkeypatch.setattr(services, "cron_file_sync", down)
    caplog.set_level(logging.INFO, logger="ugent.cron")
    watcher = CronFileWatcher(str(path))
    assert watcher.sync_once()["state"] == "failed"
    assert watcher.sync_once()["state"] == "failed"
    assert watcher.sync_once()["state"] == "imported" and jobs() == {"digest": True}
    assert sum("cron file import failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.django_db(transaction=True)
def test_writes_to_another_file_in_the_folder_make_no_looks(tmp_path):
    """A log file kept beside cron.toml: its writes are no reason to look (each look's own log line would
    be written there, and the watch would feed itself)."""
    path = tmp_path / "cron.toml"
    write(path, DIGEST, 1)
    (tmp_path / "daemon.log").touch()  # there before (a new name beside it is a look: a rename-save's)
    watcher = CronFileWatcher(str(path), poll=5.0).start()
    looks = []
    real = watcher.sync_once
    watcher.sync_once = lambda: looks.append(1) or real()
    try:
        with open(tmp_path / "daemon.log", "a") as log_file:
            for i in range(20):
                log_file.write(f"line {i}\n")
                log_file.flush()
                time.sleep(0.05)
        time.sleep(0.5)
        assert looks == []
        write(path, NIGHTLY, 2)  # while the file itself is still seen
        wait_until(lambda: jobs() == {"nightly": True}, 10, interval=0.05, what="the watcher")
    finally:
        watcher.stop()
