"""Status is the daemon's own: only the process that enforces the rules writes their record, with its pid
and a heartbeat; a command that reads the file for itself says so and never overwrites that record; an
edit to ugent.toml's [rules] file takes effect without a restart."""
from __future__ import annotations

import os
from datetime import timedelta
from io import StringIO

from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from rules_app import runtime as runtime_module
from rules_app.engine import MessageFacts
from rules_app.models import RuleSet
from rules_app.runtime import Runtime, runtime
from tests.rules_app.conftest import answer, wait_for
from tests.support.http import chat

IGNORE_A = '[[rules]]\nname = "ignore-a"\ndecision = "Ignore"\nmatch = { field = "text", equals = "a" }\n'
IGNORE_B = '[[rules]]\nname = "ignore-b"\ndecision = "Ignore"\nmatch = { field = "text", equals = "b" }\n'


def file_row():
    return RuleSet.objects.filter(source="file").first()


def run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def snapshot(row):
    return (row.status, row.path, row.rule_count, row.digest, row.pid, row.last_error,
            list(row.rules.values_list("name", flat=True)))


def stale_heartbeat():
    RuleSet.objects.filter(source="file").update(heartbeat_at=timezone.now() - timedelta(hours=1))


def test_the_daemon_records_its_pid_and_heartbeat_and_status_shows_them(site, tcast):
    path = site.rules(IGNORE_A)
    rules = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["source"] == "daemon" and rules["pid"] == os.getpid()
    assert rules["file"]["path"] == str(path) and rules["file"]["pid"] == os.getpid()
    assert rules["file"]["daemon_alive"] is True and rules["file"]["heartbeat_at"] is not None
    assert rules["file"]["heartbeat_age"] < 60


def test_a_process_that_does_not_enforce_the_rules_records_nothing(site, monkeypatch):
    site.rules(IGNORE_A)
    monkeypatch.setattr(runtime_module, "_enforcing", False)
    reader = Runtime()
    try:
        assert reader.ruleset().evaluate(MessageFacts(text="a")).rule.name == "ignore-a"
        assert file_row() is None
    finally:
        reader.reset()


def test_rules_status_reports_the_running_daemons_record_and_leaves_it_alone(site, tmp_path, settings):
    path = site.rules(IGNORE_A)
    runtime.ruleset()
    before = snapshot(file_row())
    settings.UGENT_WORKSPACE = str(tmp_path / "elsewhere")  # the command's own discovery finds nothing
    (tmp_path / "elsewhere").mkdir()
    out, _ = run("rules", "status")
    assert out.splitlines()[0].startswith(f"reporting the running daemon's rules (pid {os.getpid()}")
    assert f"rules file: {path} (loaded, 1 rules, on_error = open)" in out and "rules in force: 1" in out
    assert snapshot(file_row()) == before


def test_rules_status_without_a_running_daemon_says_it_read_the_file_itself(site, tmp_path, settings):
    site.rules(IGNORE_A)
    runtime.ruleset()
    stale_heartbeat()
    before = snapshot(file_row())
    settings.UGENT_WORKSPACE = str(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    out, _ = run("rules", "status")
    first = out.splitlines()[0]
    assert first.startswith("reporting a fresh read of no rules file by this command")
    assert "no daemon is running (last heartbeat 36" in first and "not rules anything enforces now" in first
    assert "rules file: - (missing, 0 rules" in out and "rules in force: 0" in out
    assert snapshot(file_row()) == before  # the old code recorded "missing" over the daemon's load


def test_rules_test_says_whether_it_tests_the_daemons_rules_or_a_fresh_read(site):
    site.rules(IGNORE_A)
    runtime.ruleset()
    runtime.holder.stop()  # the daemon does not see the next edit: its rules and the file now differ
    site.write(IGNORE_B)
    out, err = run("rules", "test", "a")
    assert out.strip() == '[dry-run] matched rule "ignore-a"'
    assert err.startswith(f"testing the running daemon's rules (pid {os.getpid()}")
    stale_heartbeat()
    out, err = run("rules", "test", "a")
    assert out.strip() == '[dry-run] no rule matched for: "a"'
    assert run("rules", "test", "b")[0].strip() == '[dry-run] matched rule "ignore-b"'
    assert err.startswith(f"testing a fresh read of {site.ws / 'rules.toml'} by this command")
    assert file_row().rules.get().name == "ignore-a"


def test_the_watcher_keeps_the_heartbeat_fresh(site, settings):
    settings.UGENT_RULES_HEARTBEAT_SECONDS = 0.2
    site.rules(IGNORE_A)
    runtime.ruleset()
    stale_heartbeat()
    assert wait_for(lambda: file_row().heartbeat_at > timezone.now() - timedelta(seconds=30))


def test_changing_rules_file_in_ugent_toml_takes_effect_without_a_restart(site, tcast, tmp_path):
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text(IGNORE_A)
    second.write_text(IGNORE_B)
    site.config(f'[rules]\nfile = "{first}"\n')
    runtime.reset()
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"
    site.config(f'[rules]\nfile = "{second}"\n')
    assert wait_for(lambda: file_row().path == str(second))
    assert answer(chat(tcast.alice, "b")) == "rule engine: message ignored"
    assert answer(chat(tcast.alice, "a")) != "rule engine: message ignored"
    second.write_text(IGNORE_A)  # and the new file is the one watched now
    assert wait_for(lambda: list(file_row().rules.values_list("name", flat=True)) == ["ignore-a"])
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"


def test_a_rules_file_named_in_ugent_toml_later_is_loaded_without_a_restart(site, tcast, tmp_path):
    missing = tmp_path / "not-yet.toml"
    site.config(f'[rules]\nfile = "{missing}"\n')
    runtime.reset()
    assert answer(chat(tcast.alice, "a")) != "rule engine: message ignored"
    assert file_row().status == "missing"
    present = tmp_path / "present.toml"
    present.write_text(IGNORE_A)
    site.config(f'[rules]\nfile = "{present}"\n')
    assert wait_for(lambda: file_row().status == "loaded" and file_row().path == str(present))
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"
