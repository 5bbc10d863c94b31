"""Hot reload in a running process: real files, the real watcher thread, the chat API, the load record."""
from __future__ import annotations

import pytest

from rules_app.models import RuleSet, WorkspaceTrust
from rules_app.runtime import runtime
from tests.rules_app.conftest import answer, wait_for
from tests.support.http import chat
from ugent_common.config import config_held, load_config

IGNORE_A = '[[rules]]\nname = "ignore-a"\ndecision = "Ignore"\nmatch = { field = "text", equals = "a" }\n'
IGNORE_B = '[[rules]]\nname = "ignore-b"\ndecision = "Ignore"\nmatch = { field = "text", equals = "b" }\n'
TWO = IGNORE_A + IGNORE_B


def file_row():
    return RuleSet.objects.filter(source="file").first()


def test_an_edit_that_parses_replaces_the_rules_and_is_recorded(site, tcast, rules_log):
    site.rules(IGNORE_A)
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"
    assert runtime.holder.watching and runtime.holder._thread.is_alive()
    assert file_row().status == "loaded" and file_row().rule_count == 1
    site.write(TWO)
    assert wait_for(lambda: "rule set auto-reloaded (rules=2)" in rules_log.messages)
    assert answer(chat(tcast.bob, "b")) == "rule engine: message ignored"
    assert wait_for(lambda: file_row().rule_count == 2)
    assert list(file_row().rules.values_list("name", flat=True)) == ["ignore-a", "ignore-b"]


def test_an_edit_that_does_not_parse_keeps_the_previous_rules(site, tcast, rules_log):
    site.rules(TWO)
    assert answer(chat(tcast.alice, "b")) == "rule engine: message ignored"
    site.write(TWO + "\n[[rules]\nbroken")
    assert wait_for(lambda: any(m.startswith("rule set auto-reload failed — retaining previous rule set")
                                for m in rules_log.messages))
    assert answer(chat(tcast.bob, "b")) == "rule engine: message ignored"
    assert wait_for(lambda: file_row().status == "retained")
    row = file_row()
    assert row.rule_count == 2 and "invalid TOML" in row.last_error
    assert row.rules.count() == 2  # the mirror keeps the rules still in force
    site.write(IGNORE_A)
    assert wait_for(lambda: file_row().status == "loaded" and file_row().last_error == "")
    assert answer(chat(tcast.carol, "b")) == "echo: b (history=0)"


def test_an_edit_that_leaves_the_file_empty_keeps_the_previous_rules(site, tcast, rules_log):
    """The running daemon's holder: a rules file caught empty (an editor's truncate before its write) keeps the rules
    in force and the record says retained, as for a broken edit; `rules = []` then empties the set."""
    site.rules(TWO)
    assert answer(chat(tcast.alice, "b")) == "rule engine: message ignored"
    site.write("# being rewritten\n")
    assert wait_for(lambda: file_row().status == "retained")
    assert "is empty (blank or comments alone" in file_row().last_error and file_row().rule_count == 2
    assert answer(chat(tcast.bob, "b")) == "rule engine: message ignored"
    site.write("rules = []\n")
    assert wait_for(lambda: file_row().status == "loaded" and file_row().rule_count == 0)
    assert answer(chat(tcast.carol, "b")) == "echo: b (history=0)"


def test_a_rules_file_created_later_is_picked_up_within_five_seconds(site, tcast, rules_log, settings):
    settings.UGENT_RULES_POLL_INTERVAL = 2.0  # the default: the spec's five seconds must hold with it
    site.approve()
    assert answer(chat(tcast.alice, "a")) == "echo: a (history=0)"
    assert "rule engine watch disabled" in rules_log.messages
    assert file_row().status == "missing"
    site.write(IGNORE_A)
    assert wait_for(lambda: "rule set loaded (rules=1)" in rules_log.messages, timeout=5.0)
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"
    assert wait_for(lambda: file_row().status == "loaded")


def test_approving_the_workspace_loads_its_file_without_a_restart(site, tcast, rules_log):
    site.rules(IGNORE_A, trusted=False)
    assert answer(chat(tcast.alice, "a")) == "echo: a (history=0)"
    assert file_row().status == "skipped"
    site.approve()
    assert wait_for(lambda: "rule set loaded (rules=1)" in rules_log.messages)
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"


def test_a_configuration_reload_rebuilds_the_rules_so_a_broken_file_fails_open_as_at_start(site, tcast, rules_log):
    """Seed 002: "When UGENT starts, or rebuilds its runtime after a configuration reload, a rules file it cannot
    read or parse is logged as failed to load rule set — starting with empty rules (fail-open)"."""
    site.config('[tools]\nenabled = ["workspace"]\n')
    site.rules(IGNORE_A)
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"
    site.write(IGNORE_A + "\n[[rules]\nbroken")  # a broken edit: the rules in force are kept
    assert wait_for(lambda: any(m.startswith("rule set auto-reload failed") for m in rules_log.messages))
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"
    site.config('[tools]\nenabled = ["workspace", "delegation"]\n')  # an edit elsewhere in ugent.toml
    assert wait_for(lambda: any(m.startswith("failed to load rule set — starting with empty rules (fail-open)")
                                for m in rules_log.messages))
    assert answer(chat(tcast.carol, "a")) == "echo: a (history=0)"
    site.write(IGNORE_A)  # and the file is still watched: fixed, it is in force again
    assert wait_for(lambda: file_row().status == "loaded")
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"


@pytest.mark.parametrize("broken", ["", "# being rewritten\n", '[rules]\nfile = "my-rules.toml"\non_error = "clo'],
                         ids=["blank", "comments", "half-written"])
def test_an_ugent_toml_caught_empty_or_half_written_keeps_its_rules_table_in_force(site, tcast, settings, broken):
    """A configuration reload that found ugent.toml blank or half-written (an editor's truncate before its write,
    caught in between) took it as no file: [rules] was gone, so a fail-closed rules file became none (on_error =
    open) until the next write. The whole last good file stays in force, and the rules it gave; a good edit is a
    configuration reload still."""
    settings.UGENT_RULES_WATCH = False  # the test looks in the watcher's stead, when it chooses
    site.approve()
    site.config('[rules]\nfile = "my-rules.toml"\non_error = "closed"\n')
    rules = site.write(IGNORE_A, "my-rules.toml")
    runtime.reset()
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"
    holder = runtime.holder
    site.config(broken)
    assert holder.check_config_once() is False
    assert (holder.path, holder.on_error, holder.status) == (rules, "closed", "loaded")
    assert load_config()["rules"] == {"file": "my-rules.toml", "on_error": "closed"}
    assert config_held().startswith(str(site.ws / "ugent.toml"))
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"
    site.config('[tools]\nenabled = ["workspace"]\n')  # whole again, with no [rules]: the rules follow it
    assert holder.check_config_once() is True
    assert (holder.path, holder.on_error, config_held()) == (None, "open", "")
    assert answer(chat(tcast.carol, "a")) == "echo: a (history=0)"


def test_approving_the_workspace_loads_a_configured_file_inside_it_without_a_restart(site, tcast, rules_log):
    """`[rules] file` naming a file inside the workspace: skipped until approval, then loaded, as a found one is."""
    site.config('[rules]\nfile = "my-rules.toml"\n')
    site.write(IGNORE_A, "my-rules.toml")
    runtime.reset()
    assert answer(chat(tcast.alice, "a")) == "echo: a (history=0)"
    assert file_row().status == "skipped"
    site.approve()
    assert wait_for(lambda: "rule set loaded (rules=1)" in rules_log.messages)
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"
    assert wait_for(lambda: file_row().status == "loaded")


def test_revoking_trust_drops_the_workspace_rules_without_a_restart(site, tcast):
    site.rules(IGNORE_A)
    assert answer(chat(tcast.alice, "a")) == "rule engine: message ignored"
    WorkspaceTrust.objects.update(revoked_at="2024-01-01T00:00:00Z")
    assert wait_for(lambda: not runtime.holder.watching)
    assert answer(chat(tcast.bob, "a")) == "echo: a (history=0)"
    assert wait_for(lambda: file_row().status == "skipped")


def test_a_failed_first_load_is_shown_in_the_record(site, tcast, rules_log):
    site.rules("[[rules]]\nname = 1\n")
    assert answer(chat(tcast.alice, "a")) == "echo: a (history=0)"
    row = file_row()
    assert row.status == "failed" and row.rule_count == 0 and "name: expected a string" in row.last_error
    site.write(IGNORE_A)
    assert wait_for(lambda: "rule set auto-reloaded (rules=1)" in rules_log.messages)
    assert answer(chat(tcast.bob, "a")) == "rule engine: message ignored"


def test_every_process_sees_an_edit_and_the_record_is_written_once(site, rules_log):
    from rules_app.engine import MessageFacts
    from rules_app.runtime import Runtime
    site.rules(IGNORE_A)
    first, second = Runtime(), Runtime()  # two processes' engines: each loads and watches on its own
    try:
        assert first.ruleset().evaluate(MessageFacts(text="a")).rule.name == "ignore-a"
        assert second.ruleset().evaluate(MessageFacts(text="a")).rule.name == "ignore-a"
        loaded_at = file_row().loaded_at
        second.holder.record()  # the same load again: nothing to write
        assert file_row().loaded_at == loaded_at
        site.write(IGNORE_B)
        assert wait_for(lambda: rules_log.messages.count("rule set auto-reloaded (rules=1)") >= 2)
        for rt in (first, second):
            assert rt.ruleset().evaluate(MessageFacts(text="b")).rule.name == "ignore-b"
            assert rt.ruleset().evaluate(MessageFacts(text="a")).rule is None
        assert wait_for(lambda: list(file_row().rules.values_list("name", flat=True)) == ["ignore-b"])
    finally:
        first.reset()
        second.reset()
