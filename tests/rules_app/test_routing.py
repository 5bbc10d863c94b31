"""Routing: parsing routing.toml and applying routes."""

import logging
import textwrap

import pytest
from hypothesis import given, strategies as st

from rules_app.engine import MessageFacts, RuleSetError
from rules_app.routing import (
    LOG_ROUTING_FAILED,
    RoutingError,
    RoutingTable,
    load_routing_or_empty,
    parse_routing,
)

pytestmark = pytest.mark.mode_free  # no database, Redis or run mode




def table(text):
    return parse_routing(textwrap.dedent(text), source="routing.toml")


EXAMPLE = """
[[routes]]
name = "billing"
priority = 10
match = { field = "text", contains_any = ["invoice", "refund"] }
tags = ["billing"]
allowed_tools = ["search_docs", "lookup_invoice"]
inject_context = "Billing questions: answer from the billing policy."

[[routes]]
name = "expand-abbrev"
match = { always = true }
rewrite = { pattern = '\\bpls\\b', replace = "please" }

[[routes]]
name = "slack-tag"
match = { field = "channel", equals = "slack" }
tags = ["slack", "billing"]
allowed_tools = ["search_docs", "web_fetch"]
inject_context = "You are answering in Slack."

[[routes]]
name = "no-secrets"
priority = 100
match = { field = "text", contains_any = ["password"] }
reject = "Please do not send passwords here."
"""


def test_matching_routes_accumulate_in_priority_order():
    t = table(EXAMPLE)
    assert [r.name for r in t.routes] == ["no-secrets", "billing", "expand-abbrev", "slack-tag"]
    out = t.route(MessageFacts(text="pls check my INVOICE", channel="slack"))
    assert out.matched == ("billing", "expand-abbrev", "slack-tag")
    assert out.text == "please check my INVOICE"
    assert out.tags == ("billing", "slack")
    assert out.allowed_tools == frozenset({"search_docs"})
    assert out.injected_context == "Billing questions: answer from the billing policy.\n\nYou are answering in Slack."
    assert not out.rejected
    assert out.apply(MessageFacts(text="pls check my INVOICE", channel="slack", input_mode="voice")) == MessageFacts(
        text="please check my INVOICE", channel="slack", input_mode="voice"
    )


def test_no_route_leaves_everything_untouched():
    t = table(EXAMPLE)
    out = t.route(MessageFacts(text="hello", channel="web"))
    assert out.matched == ("expand-abbrev",)
    assert out.text == "hello" and out.tags == () and out.allowed_tools is None
    assert out.injected_context is None and out.rejection is None
    assert out.narrow_tools(["a", "b"]) == ["a", "b"]
    assert RoutingTable().route(MessageFacts(text="x")).text == "x"


def test_reject_stops_routing():
    out = table(EXAMPLE).route(MessageFacts(text="my password is pls", channel="slack"))
    assert out.rejected and out.rejection == "Please do not send passwords here."
    assert out.matched == ("no-secrets",)
    assert out.tags == () and out.text == "my password is pls"


def test_allowed_tools_only_narrow():
    out = table(EXAMPLE).route(MessageFacts(text="refund", channel="web"))
    assert out.allowed_tools == frozenset({"search_docs", "lookup_invoice"})
    # A tool the turn did not have is never added; order of the turn's tools is kept.
    assert out.narrow_tools(["shell", "lookup_invoice", "search_docs"]) == ["lookup_invoice", "search_docs"]
    assert out.narrow_tools(["shell"]) == []


@given(
    st.lists(st.sampled_from("abcdef"), unique=True),
    st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=5), max_size=4),
)
def test_narrowing_is_a_subset_property(turn_tools, route_tool_lists):
    body = "".join(
        f'[[routes]]\nname = "r{i}"\nmatch = {{ always = true }}\nallowed_tools = {tools!r}\n'.replace("'", '"')
        for i, tools in enumerate(route_tool_lists)
    )
    out = parse_routing(body).route(MessageFacts(text="x"))
    narrowed = out.narrow_tools(turn_tools)
    assert set(narrowed) <= set(turn_tools)
    for tools in route_tool_lists:
        assert set(narrowed) <= set(tools)


def test_later_conditions_see_rewritten_text():
    t = table(
        """
        [[routes]]
        name = "normalise"
        priority = 2
        match = { always = true }
        rewrite = [ { pattern = "(?i)^hey agent,?\\\\s*", replace = "/ask " }, { pattern = "\\\\s+$", replace = "" } ]
        [[routes]]
        name = "ask"
        priority = 1
        match = { field = "text", starts_with = "/ask" }
        tags = ["asked"]
        """
    )
    out = t.route(MessageFacts(text="Hey agent, what time is it?   "))
    assert out.text == "/ask what time is it?"
    assert out.tags == ("asked",)


def test_rewrite_group_references():
    t = table(
        """
        [[routes]]
        name = "ticket"
        match = { field = "text", contains_any = ["#"] }
        rewrite = { pattern = '#(\\d+)', replace = 'ticket \\1' }
        """
    )
    assert t.route(MessageFacts(text="see #42 and #7")).text == "see ticket 42 and ticket 7"


def test_routing_ignores_input_mode_and_refuses_conditions_on_it():
    with pytest.raises(RoutingError, match="input_mode"):
        table(
            """
            [[routes]]
            name = "voice"
            match = { field = "input_mode", equals = "voice" }
            tags = ["voice"]
            """
        )


def test_unknown_keys_ignored():
    t = table(
        """
        other = 1
        [[routes]]
        name = "r"
        enabled = false
        match = { field = "source_type", equals = "GROUP", note = "x" }
        tags = ["group"]
        """
    )
    assert t.route(MessageFacts(text="hi", source_type="group")).tags == ("group",)


@pytest.mark.parametrize(
    "body,fragment",
    [
        ('name = "r"\ntags = ["x"]', "missing field `match`"),
        ('match = { always = true }', "missing field `name`"),
        ('name = "r"\nmatch = { colour = "red" }', "no known shape"),
        ('name = "r"\nmatch = { always = true }\nrewrite = { pattern = "(" , replace = "" }', "invalid regex"),
        ('name = "r"\nmatch = { always = true }\nrewrite = { pattern = "a", replace = "\\\\9" }', "invalid replacement"),
        ('name = "r"\nmatch = { always = true }\nrewrite = { pattern = "a" }', "missing field `replace`"),
        ('name = "r"\nmatch = { always = true }\ntags = "x"', "array of strings"),
        ('name = "r"\nmatch = { always = true }\nallowed_tools = [1]', "array of strings"),
        ('name = "r"\nmatch = { always = true }\ninject_context = 3', "expected a string"),
        ('name = "r"\nmatch = { always = true }\nreject = ""', "non-empty"),
    ],
)
def test_refusals(body, fragment):
    with pytest.raises(RoutingError) as exc:
        parse_routing("[[routes]]\n" + body + "\n", source="routing.toml")
    assert fragment in str(exc.value)
    assert str(exc.value).startswith("routing.toml: ")
    assert isinstance(exc.value, RuleSetError)


def test_duplicate_route_names_refuse():
    with pytest.raises(RoutingError, match="duplicate route name `a`"):
        table(
            """
            [[routes]]
            name = "a"
            match = { always = true }
            [[routes]]
            name = "a"
            match = { always = false }
            """
        )


def test_load_routing_or_empty_fails_open(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ugent.routing")
    p = tmp_path / "routing.toml"
    p.write_text("[[routes]]\nname = 1\n", encoding="utf-8")
    t = load_routing_or_empty(p)
    assert len(t) == 0
    assert any(r.getMessage().startswith(LOG_ROUTING_FAILED) for r in caplog.records)
    p.write_text(textwrap.dedent(EXAMPLE), encoding="utf-8")
    caplog.clear()
    assert len(load_routing_or_empty(p)) == 4
    assert [r.getMessage() for r in caplog.records] == ["routing loaded (routes=4)"]
    assert len(load_routing_or_empty(None)) == 0
