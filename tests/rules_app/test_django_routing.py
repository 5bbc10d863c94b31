"""Routing (priority 50) before the rule engine (priority 100), through the chat API."""
from __future__ import annotations

import pytest

from channels_app import hooks
from channels_app.models import Receipt, Turn
from rules_app.runtime import runtime
from tests.rules_app.conftest import answer, submit
from tests.support.http import chat
from tests.support.scripted import CALLS

ROUTES = r"""
[[routes]]
name = "expand"
priority = 10
match = { always = true }
rewrite = { pattern = '\bpls\b', replace = "please" }

[[routes]]
name = "billing"
match = { field = "text", contains_any = ["invoice"] }
tags = ["billing", "money"]
allowed_tools = ["search_docs", "calculator"]
inject_context = "Billing questions: answer from the billing policy."

[[routes]]
name = "no-secrets"
priority = 100
match = { field = "text", contains_any = ["password"] }
reject = "Please do not send passwords here."
"""

RULES = """
[[rules]]
name = "polite-only"
priority = 10
decision = "Ignore"
match = { field = "text", starts_with = "please" }
"""


def test_both_hooks_are_registered_in_order():
    assert [n for _p, n in hooks.registered() if n in ("routing", "rules")] == ["routing", "rules"]
    assert dict((n, p) for p, n in hooks.registered())["routing"] == 50
    assert dict((n, p) for p, n in hooks.registered())["rules"] == 100


def test_the_rule_engine_sees_the_rewritten_text(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.rules(RULES)
    assert answer(chat(tcast.alice, "pls help")) == "rule engine: message ignored"
    assert answer(chat(tcast.bob, "plsx help")) == "echo: plsx help (history=0)"


def test_rewritten_text_is_what_the_agent_reads_while_history_keeps_the_original(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.reset()
    # history: the injected context and the routing tags, as system messages before the user's
    assert answer(chat(tcast.alice, "send the invoice pls")) == "echo: send the invoice please (history=2)"
    turn = Turn.objects.get()
    assert turn.context["text"] == "send the invoice please"
    assert turn.context["tags"] == ["billing", "money"]
    assert turn.context["injected_context"] == ["Billing questions: answer from the billing policy."]
    assert ("system", "Billing questions: answer from the billing policy.") in CALLS[-1]["messages"]
    assert ("system", "Routing tags: billing, money") in CALLS[-1]["messages"]
    assert turn.messages.get(role="user").content == "send the invoice pls"


def test_tool_narrowing_never_widens(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.reset()
    chat(tcast.alice, "invoice", conversation_id="a", ugent_allowed_tools=["calculator", "shell"])
    chat(tcast.alice, "invoice", conversation_id="b")
    chat(tcast.alice, "invoice", conversation_id="c", ugent_allowed_tools=["shell"])
    chat(tcast.alice, "no route here", conversation_id="d", ugent_allowed_tools=["shell"])
    tools = {t.conversation.external_id: t.allowed_tools for t in Turn.objects.select_related("conversation")}
    assert tools == {"a": ["calculator"], "b": ["calculator", "search_docs"], "c": [], "d": ["shell"]}


def test_a_route_rejects_with_its_message_before_the_rule_engine(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.rules('[[rules]]\nname = "all"\ndecision = "PassToDefaultAgent"\nmatch = { always = true }\n')
    resp = chat(tcast.alice, "my PASSWORD is hunter2")
    assert answer(resp) == "Please do not send passwords here."
    r = Receipt.objects.get()
    assert r.state == "refused" and r.reason == "rejected by route 'no-secrets'"


def test_routing_applies_to_plugin_channels_too(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.reset()
    assert submit("password?", channel="discord").stopped.answer == "Please do not send passwords here."


def test_inline_routing_in_ugent_toml_is_ignored_with_a_warning(site, tcast, rules_log):
    site.config('[routing]\nroutes = []\n')
    site.reset()
    assert answer(chat(tcast.alice, "pls")) == "echo: pls (history=0)"
    assert any("inline [routing] table in ugent.toml is ignored" in m for m in rules_log.messages)


def test_a_broken_routing_file_fails_open(site, tcast, rules_log):
    site.approve()
    site.write('[[routes]]\nname = "x"\nmatch = { field = "input_mode", equals = "voice" }\n', "routing.toml")
    site.reset()
    assert answer(chat(tcast.alice, "pls")) == "echo: pls (history=0)"
    assert any(m.startswith("failed to load routing — starting with no routes (fail-open)")
               for m in rules_log.messages)


def test_an_untrusted_routing_file_is_skipped(site, tcast, rules_log):
    site.write(ROUTES, "routing.toml")
    site.reset()
    assert answer(chat(tcast.alice, "password")) == "echo: password (history=0)"
    assert any("routing file" in m and "not trusted yet" in m for m in rules_log.messages)


def test_an_edited_routing_file_is_reread(site, tcast):
    site.approve()
    site.write(ROUTES, "routing.toml")
    site.reset()
    assert answer(chat(tcast.alice, "password")) == "Please do not send passwords here."
    site.write(ROUTES.replace("do not send passwords", "never send passwords"), "routing.toml")
    assert answer(chat(tcast.bob, "password")) == "Please never send passwords here."


HALF_WRITTEN = ROUTES[:ROUTES.index('reject = "')] + 'reject = "Please do not'
EMPTY_WHY = "is empty (blank or comments alone; `routes = []` alone says no routes)"


@pytest.mark.parametrize("broken, why", [
    ("", EMPTY_WHY), ("\n# being rewritten\n", EMPTY_WHY), (HALF_WRITTEN, ": invalid TOML: "),
    (ROUTES + '\n[[routes]]\nname = "x"\nmatch = { field = "input_mode", equals = "voice" }\n', ": routes[3] (x)"),
], ids=["blank", "comments", "half-written", "invalid"])
def test_a_routing_file_an_edit_leaves_empty_or_broken_keeps_the_routes_in_force(site, tcast, rules_log, broken, why):
    """An editor that truncates routing.toml before writing it again, caught in between (empty, or half-written so
    it does not parse), or an edit that is refused: an empty one parsed as no routes, a broken one was a first
    load's failure (no routes, fail-open), so a `reject` route lapsed until the next write. The routes in force
    stay, as a watched rules file's rules do; `routes = []` still empties the table, and at start a file found
    empty is no routes, one found broken fails open."""
    site.approve()
    path = site.write(ROUTES, "routing.toml")
    site.reset()
    assert answer(chat(tcast.alice, "password", conversation_id="a")) == "Please do not send passwords here."
    site.write(broken, "routing.toml")
    assert answer(chat(tcast.alice, "password", conversation_id="b")) == "Please do not send passwords here."
    error = runtime.routing.last_error
    assert error.startswith(f"{path} {why}" if why == EMPTY_WHY else f"{path}{why}")
    assert f"routing auto-reload failed — retaining previous routes (error={error})" in rules_log.messages
    assert not any(m.startswith("failed to load routing") for m in rules_log.messages)
    site.write("routes = []\n", "routing.toml")
    assert answer(chat(tcast.alice, "password", conversation_id="c")) == "echo: password (history=0)"
    assert runtime.routing.last_error is None
    site.write(ROUTES, "routing.toml")
    site.write(broken, "routing.toml")
    site.reset()  # a start
    assert answer(chat(tcast.alice, "password", conversation_id="d")) == "echo: password (history=0)"
    if why == EMPTY_WHY:
        assert runtime.routing.last_error is None
    else:
        assert runtime.routing.last_error == error
        assert f"failed to load routing — starting with no routes (fail-open) (error={error})" in rules_log.messages
