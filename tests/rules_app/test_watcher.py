"""Discovery, the rule engine holder's steps, and hot reload with a running watcher thread."""

import logging
import os
import time
from pathlib import Path

import pytest

from rules_app import discovery
from rules_app.discovery import (
    Discovery,
    discover_routing_file,
    discover_rules_file,
    rules_on_error,
)
from rules_app.engine import CLOSED_ANSWER, MessageFacts, workflow_check_from
from rules_app.watcher import RuleEngineHolder

pytestmark = pytest.mark.mode_free  # no database, Redis or run mode




FAILED_LOAD = "failed to load rule set — starting with empty rules (fail-open)"
RELOAD_FAILED = "rule set auto-reload failed — retaining previous rule set"

ONE_RULE = """
[[rules]]
name = "ignore-spam"
priority = 100
decision = "Ignore"
match = { field = "text", contains_any = ["unsubscribe"] }
"""

TWO_RULES = ONE_RULE + """
[[rules]]
name = "default"
decision = "PassToDefaultAgent"
match = { always = true }
"""

THREE_RULES = TWO_RULES + """
[[rules]]
name = "digest"
priority = 50
match = { field = "text", starts_with = "digest" }
[rules.decision.StartWorkflow]
workflow = "digest"
"""

BROKEN = ONE_RULE + """
[[rules]]
name = "ignore-spam"
decision = "Ignore"
match = { always = true }
"""


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    return d


@pytest.fixture
def home(tmp_path):
    d = tmp_path / "home"
    d.mkdir()
    return d


def trusted(_ws):
    return True


def untrusted(_ws):
    return False


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "ugent.rules"]


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------


def test_discovery_order(ws, home):
    assert discover_rules_file(ws, {}, home=home, is_trusted=trusted).path is None
    h = write(home / ".ugent" / "rules.toml", ONE_RULE)
    assert discover_rules_file(ws, {}, home=home, is_trusted=trusted).path == h
    d = write(ws / ".ugent" / "rules.toml", ONE_RULE)
    assert discover_rules_file(ws, {}, home=home, is_trusted=trusted).path == d
    w = write(ws / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, None, home=home, is_trusted=trusted)
    assert found.path == w and not found.configured and found.pollable
    assert found.candidates == (ws / "rules.toml", ws / ".ugent" / "rules.toml", home / ".ugent" / "rules.toml")


def test_configured_file_relative_to_workspace_and_tilde_not_expanded(ws, home, tmp_path):
    elsewhere = write(tmp_path / "srv" / "rules.toml", ONE_RULE)
    write(ws / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, {"rules": {"file": str(elsewhere)}}, home=home, is_trusted=untrusted)
    assert found.path == elsewhere and found.configured and not found.pollable

    rel = write(ws / "conf" / "my-rules.toml", ONE_RULE)
    assert discover_rules_file(ws, {"rules": {"file": "conf/my-rules.toml"}}, home=home, is_trusted=trusted).path == rel

    write(home / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, {"rules": {"file": "~/rules.toml"}}, home=home, is_trusted=trusted)
    assert found.path is None
    assert found.configured_path == ws / "~" / "rules.toml"
    assert found.warnings == (f"rules file {ws / '~' / 'rules.toml'} (from [rules] file in ugent.toml) does not exist",)


def test_configured_missing_does_not_fall_back(ws, home):
    write(ws / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, {"rules": {"file": "/nonexistent/rules.toml"}}, home=home, is_trusted=trusted)
    assert found.path is None and found.configured


def test_untrusted_workspace_file_skipped_with_warning(ws, home):
    w = write(ws / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, {}, home=home, is_trusted=untrusted)
    assert found.path is None
    assert found.skipped_untrusted == (w,)
    assert found.warnings == (
        f"rules file {w} is inside the workspace, which is not trusted yet; skipped until the "
        "workspace is approved with `python manage.py firewall workspace approve`",
    )
    h = write(home / ".ugent" / "rules.toml", ONE_RULE)
    found = discover_rules_file(ws, {}, home=home, is_trusted=untrusted)
    assert found.path == h and len(found.warnings) == 1
    assert discover_rules_file(ws, {}, home=home, is_trusted=trusted).path == w


def test_trust_asked_only_for_files_inside_the_workspace(ws, home, tmp_path):
    asked = []
    write(home / ".ugent" / "rules.toml", ONE_RULE)
    discover_rules_file(ws, {}, home=home, is_trusted=lambda p: asked.append(p) or False)
    assert asked == []
    inside = write(ws / "sub" / "r.toml", ONE_RULE)
    found = discover_rules_file(ws, {"rules": {"file": "sub/r.toml"}}, home=home, is_trusted=lambda p: asked.append(p) or False)
    assert asked == [ws] and found.path is None and found.skipped_untrusted == (inside,)


def test_routing_discovery_and_inline_routing_warning(ws, home):
    found = discover_routing_file(ws, {"routing": {"routes": []}}, home=home, is_trusted=trusted)
    assert found.path is None
    assert len(found.warnings) == 1 and "inline [routing] table in ugent.toml is ignored" in found.warnings[0]
    h = write(home / ".ugent" / "routing.toml", "")
    assert discover_routing_file(ws, {}, home=home, is_trusted=trusted).path == h
    w = write(ws / ".ugent" / "routing.toml", "")
    assert discover_routing_file(ws, {}, home=home, is_trusted=trusted).path == w
    found = discover_routing_file(ws, {}, home=home, is_trusted=untrusted)
    assert found.path == h and "routing file" in found.warnings[0]


def test_on_error_setting():
    assert rules_on_error({}) == ("open", None)
    assert rules_on_error({"rules": {"on_error": "closed"}}) == ("closed", None)
    mode, warning = rules_on_error({"rules": {"on_error": "shut"}})
    assert mode == "open" and "on_error" in warning


# ---------------------------------------------------------------------------
# Holder steps, without the thread
# ---------------------------------------------------------------------------


def holder_for(ws, home, config=None, trust=trusted, **kw):
    return RuleEngineHolder.for_workspace(ws, config or {}, home=home, is_trusted=trust, **kw)


def test_start_loads_and_logs_count(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    write(ws / "rules.toml", TWO_RULES)
    h = holder_for(ws, home)
    rs = h.start()
    assert len(rs) == 2 and h.watching
    assert messages(caplog) == ["rule set loaded (rules=2)"]
    assert h.evaluate(MessageFacts(text="unsubscribe")).rule.name == "ignore-spam"
    assert h.dry_run("hello") == '[dry-run] matched rule "default"'


def test_start_with_broken_file_fails_open(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    write(ws / "rules.toml", BROKEN)
    h = holder_for(ws, home)
    assert len(h.start()) == 0
    (line,) = messages(caplog)
    assert line.startswith(FAILED_LOAD + " (error=")
    assert "duplicate rule name `ignore-spam`" in line
    assert caplog.records[-1].levelno == logging.ERROR
    assert h.watching  # still watched, so a fix is picked up
    m = h.evaluate(MessageFacts(text="unsubscribe"))
    assert m.rule is None and not m.stops
    assert h.dry_run("unsubscribe") == '[dry-run] no rule matched for: "unsubscribe"'


def test_start_with_broken_file_on_error_closed(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    write(ws / "rules.toml", "[[rules]\n")
    h = holder_for(ws, home, {"rules": {"on_error": "closed"}})
    h.start()
    assert h.on_error == "closed"
    m = h.evaluate(MessageFacts(text="hello"))
    assert m.refused and m.stops and m.answer == CLOSED_ANSWER
    assert messages(caplog)[0].startswith("failed to load rule set — refusing all messages (fail-closed)")
    write(ws / "rules.toml", ONE_RULE)
    assert h.reload_once()
    assert not h.evaluate(MessageFacts(text="hello")).stops


def test_reload_once_replaces_or_retains(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    f = write(ws / "rules.toml", TWO_RULES)
    h = holder_for(ws, home)
    h.start()
    write(f, THREE_RULES)
    assert h.reload_once() is True
    assert messages(caplog)[-1] == "rule set auto-reloaded (rules=3)"
    before = h.ruleset
    write(f, BROKEN)
    assert h.reload_once() is False
    assert messages(caplog)[-1].startswith(RELOAD_FAILED + " (error=")
    assert h.ruleset is before and len(h.ruleset) == 3
    f.unlink()
    assert h.reload_once() is False
    assert "cannot read rules file" in messages(caplog)[-1]
    assert h.ruleset is before


@pytest.mark.parametrize("text", ["", "\n# being rewritten\n"], ids=["blank", "comments"])
def test_an_edit_that_leaves_the_file_empty_keeps_the_rules_in_force(ws, home, caplog, text):
    """An editor that truncates the file before it writes it again: caught in between, the file is empty, which
    parses as no rules at all; the rules in force stay (a block rule does not lapse), and `rules = []` still empties
    the set. At start, an empty file is no rules, as before."""
    caplog.set_level(logging.INFO, logger="ugent.rules")
    f = write(ws / "rules.toml", TWO_RULES)
    h = holder_for(ws, home)
    h.start()
    before = h.ruleset
    write(f, text)
    assert h.reload_once() is False
    assert messages(caplog)[-1] == (f"{RELOAD_FAILED} (error={f} is empty (blank or comments alone; `rules = []` "
                                    "alone says no rules))")
    assert h.ruleset is before and len(h.ruleset) == 2
    write(f, "rules = []\n")
    assert h.reload_once() is True and len(h.ruleset) == 0
    fresh = holder_for(ws, home)
    write(f, text)
    fresh.start()
    assert len(fresh.ruleset) == 0 and fresh.last_error is None


def test_reload_applies_workflow_check_each_time(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    opted_in = set()
    f = write(ws / "rules.toml", THREE_RULES)
    h = holder_for(ws, home, workflow_check=workflow_check_from(lambda w: w in opted_in))
    h.start()
    assert messages(caplog) == [
        "rule dropped (rule=digest, reason=workflow 'digest' is not a cron job with rule_trigger = true)",
        "rule set loaded (rules=2)",
    ]
    opted_in.add("digest")
    assert len(h.ruleset) == 2  # stays dropped until the rules file is saved again
    write(f, THREE_RULES)
    h.reload_once()
    assert messages(caplog)[-1] == "rule set auto-reloaded (rules=3)"


def test_missing_at_start_then_created_is_picked_up(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    h = holder_for(ws, home)
    h.start()
    assert messages(caplog) == ["rule engine watch disabled"]
    assert not h.watching and h.reload_once() is False
    assert h.check_discovery_once() is False
    write(ws / ".ugent" / "rules.toml", TWO_RULES)
    assert h.check_discovery_once() is True
    assert h.watching and h.path == ws / ".ugent" / "rules.toml"
    assert messages(caplog)[-1] == "rule set loaded (rules=2)"
    # Once a file is watched, discovery is no longer consulted.
    write(ws / "rules.toml", ONE_RULE)
    assert h.check_discovery_once() is False


def test_untrusted_file_picked_up_once_trusted_warning_said_once(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    trust = {"ok": False}
    write(ws / "rules.toml", ONE_RULE)
    h = holder_for(ws, home, trust=lambda _ws: trust["ok"])
    h.start()
    assert not h.watching
    for _ in range(3):
        assert h.check_discovery_once() is False
    warnings = [m for m in messages(caplog) if "not trusted yet" in m]
    assert len(warnings) == 1
    assert "rule engine watch disabled" in messages(caplog)
    trust["ok"] = True
    assert h.check_discovery_once() is True
    assert messages(caplog)[-1] == "rule set loaded (rules=1)"


def test_configured_missing_file_is_not_polled(ws, home, caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    h = holder_for(ws, home, {"rules": {"file": "custom.toml"}})
    h.start()
    assert "rule engine watch disabled" in messages(caplog)
    write(ws / "custom.toml", ONE_RULE)
    write(ws / "rules.toml", ONE_RULE)
    assert h.check_discovery_once() is False and not h.watching


def test_manual_reload(ws, home):
    h = holder_for(ws, home)
    h.start()
    write(home / ".ugent" / "rules.toml", ONE_RULE)
    assert h.reload() is True
    write(home / ".ugent" / "rules.toml", TWO_RULES)
    assert h.reload() is True and len(h.ruleset) == 2


def test_explain_through_holder(ws, home):
    write(ws / "rules.toml", TWO_RULES)
    h = holder_for(ws, home)
    h.start()
    assert h.explain(MessageFacts(text="unsubscribe")).decided_by.name == "ignore-spam"


def test_custom_discover_callable():
    h = RuleEngineHolder(lambda: Discovery(None))
    h.start()
    assert not h.watching and len(h.ruleset) == 0
    with pytest.raises(ValueError):
        RuleEngineHolder(lambda: Discovery(None), on_error="maybe")


# ---------------------------------------------------------------------------
# Hot reload with a running watcher thread
# ---------------------------------------------------------------------------


@pytest.fixture
def running():
    holders = []

    def start(h):
        h.start()
        h.start_watching()
        holders.append(h)
        time.sleep(0.5)  # let the notify watcher settle before the test edits the file
        return h

    yield start
    for h in holders:
        h.stop()
        assert h._thread is None


def test_watcher_thread_reloads_edits_and_retains_on_broken_edit(ws, home, caplog, running):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    f = write(ws / "rules.toml", TWO_RULES)
    h = running(holder_for(ws, home, poll_interval=1.0))
    assert len(h.ruleset) == 2

    write(f, THREE_RULES)
    assert wait_for(lambda: "rule set auto-reloaded (rules=3)" in messages(caplog), 10)
    assert h.evaluate(MessageFacts(text="digest now")).rule.name == "digest"

    write(f, BROKEN)
    assert wait_for(lambda: any(m.startswith(RELOAD_FAILED) for m in messages(caplog)), 10)
    assert len(h.ruleset) == 3

    # An editor's atomic save (write elsewhere, rename over) is seen too.
    tmp = ws / ".rules.toml.swp-tmp"
    write(tmp, ONE_RULE)
    os.replace(tmp, f)
    assert wait_for(lambda: "rule set auto-reloaded (rules=1)" in messages(caplog), 10)
    assert len(h.ruleset) == 1


def test_watcher_ignores_other_files_in_the_directory(ws, home, caplog, running):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    write(ws / "rules.toml", TWO_RULES)
    running(holder_for(ws, home, poll_interval=1.0))
    write(ws / "notes.txt", "hello")
    write(ws / "routing.toml", "")
    time.sleep(1.5)
    assert not any("auto-reload" in m for m in messages(caplog))


def test_missing_at_start_then_created_is_picked_up_within_five_seconds(ws, home, caplog, running):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    h = running(holder_for(ws, home))  # default poll interval
    assert messages(caplog) == ["rule engine watch disabled"]
    # Within five seconds: a missing file is looked for once a poll, and the default poll is shorter.
    assert h.poll_interval <= 5
    write(home / ".ugent" / "rules.toml", TWO_RULES)
    assert wait_for(lambda: "rule set loaded (rules=2)" in messages(caplog), 30)
    assert h.evaluate(MessageFacts(text="unsubscribe")).rule.name == "ignore-spam"
    # And from then on the new file is watched for edits.
    time.sleep(0.5)
    write(home / ".ugent" / "rules.toml", THREE_RULES)
    assert wait_for(lambda: "rule set auto-reloaded (rules=3)" in messages(caplog), 10)


def test_a_discovery_that_fails_while_no_file_is_watched_leaves_the_watcher_running(tmp_path, caplog):
    # discovery asks the database whether a workspace is trusted: a database that is down must not end
    # the watcher thread, which would never pick up a rules file again
    caplog.set_level(logging.INFO, logger="ugent.rules")
    f = tmp_path / "rules.toml"
    calls = []

    def discover():
        calls.append(1)
        if len(calls) in (2, 3):  # the first look (start) is fine; the watcher's next two fail
            raise RuntimeError("database is down")
        return Discovery(f if f.exists() else None)

    h = RuleEngineHolder(discover, poll_interval=0.1)
    h.start()
    t = h.start_watching()
    try:
        assert wait_for(lambda: len(calls) >= 4, 10)
        assert t.is_alive()
        assert sum("rule engine watch error" in m for m in messages(caplog)) == 2
        write(f, TWO_RULES)
        assert wait_for(lambda: "rule set loaded (rules=2)" in messages(caplog), 10)
        assert len(h.ruleset) == 2
    finally:
        h.stop()


def test_stop_is_prompt(ws, home):
    write(ws / "rules.toml", ONE_RULE)
    # A poll an hour long: a stop that waited for the next poll would hang the test (its timeout).
    h = holder_for(ws, home, poll_interval=3600.0)
    h.start()
    t = h.start_watching()
    assert h.start_watching() is t
    time.sleep(0.3)
    h.stop()
    assert not t.is_alive()


def test_discovery_module_constants_mention_approval_command():
    assert discovery.APPROVE_COMMAND == "python manage.py firewall workspace approve"
