"""Rule engine core: parsing, refusals, drops, evaluation and the spec's examples."""

import dataclasses
import logging
import string
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from rules_app import engine
from rules_app.engine import (
    AllOf,
    AnyOf,
    IGNORED_ANSWER,
    Ignore,
    MessageFacts,
    Not,
    PassToDefaultAgent,
    CompiledRuleSet,
    RuleSetError,
    RunNativeAction,
    StartWorkflow,
    compile_condition,
    load_rules_file,
    parse_rules,
    workflow_check_from,
)

pytestmark = pytest.mark.mode_free  # rules and messages in memory: nothing a run mode changes


def load(text, **kw):
    return parse_rules(textwrap.dedent(text), source="rules.toml", **kw)


def decider(ruleset, **fields):
    m = ruleset.evaluate(MessageFacts(**fields))
    return m.rule.name if m.rule else None


def dropped_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("rule dropped")]


# ---------------------------------------------------------------------------
# Contract strings
# ---------------------------------------------------------------------------


def test_contract_strings_are_letter_for_letter():
    assert engine.IGNORED_ANSWER == "rule engine: message ignored"
    assert engine.LOG_FAILED_LOAD == "failed to load rule set — starting with empty rules (fail-open)"
    assert engine.LOG_AUTO_RELOAD_FAILED == "rule set auto-reload failed — retaining previous rule set"
    assert engine.LOG_WATCH_DISABLED == "rule engine watch disabled"
    assert engine.LOG_RULE_SET_LOADED % 3 == "rule set loaded (rules=3)"
    assert engine.LOG_RULE_SET_AUTO_RELOADED % 2 == "rule set auto-reloaded (rules=2)"
    assert engine.DRY_RUN_MATCHED.format(name="x") == '[dry-run] matched rule "x"'
    assert engine.DRY_RUN_NO_MATCH.format(text="hi") == '[dry-run] no rule matched for: "hi"'
    assert engine.RULES_RELOADED_ANSWER == "Rule set reloaded."
    assert engine.memory_saved_answer(3) == "Saved 3 facts to memory."
    assert engine.memory_saved_answer(1) == "Saved 1 fact to memory."
    assert engine.memory_saved_answer(0) == "Found nothing new to save to memory."
    from cron_app.messages import WORKFLOW_STARTED_FOLLOWS
    assert WORKFLOW_STARTED_FOLLOWS.format(workflow="digest") == (
        "Started workflow 'digest'. Its result will follow here."
    )


# ---------------------------------------------------------------------------
# Spec examples
# ---------------------------------------------------------------------------

QUICK_START = """
# Drop obvious spam before it reaches the agent.
[[rules]]
name = "ignore-spam"
priority = 100
decision = "Ignore"
match = { field = "text", contains_any = ["unsubscribe", "you won the lottery"] }

# Everything else goes to the agent. A message no rule matches does anyway;
# this rule only says so.
[[rules]]
name = "default"
priority = 0
decision = "PassToDefaultAgent"
match = { always = true }
"""


def test_quick_start_ignore_spam_and_default():
    rs = load(QUICK_START).ruleset
    assert len(rs) == 2
    m = rs.evaluate(MessageFacts(text="Please UNSUBSCRIBE me", channel="web"))
    assert m.rule.name == "ignore-spam"
    assert isinstance(m.decision, Ignore)
    assert m.stops and m.answer == IGNORED_ANSWER
    m = rs.evaluate(MessageFacts(text="hey, You Won The Lottery!"))
    assert m.rule.name == "ignore-spam"
    m = rs.evaluate(MessageFacts(text="what's the weather?", channel="web"))
    assert m.rule.name == "default"
    assert isinstance(m.decision, PassToDefaultAgent)
    assert not m.stops and m.answer is None
    # A message with no text at all still reaches the always rule.
    assert decider(rs) == "default"


DECISIONS = """
[[rules]]
name = "digest"
priority = 50
match = { field = "text", starts_with = "digest" }

[rules.decision.StartWorkflow]
workflow = "digest"         # a cron job with rule_trigger = true
inject_context = true       # optional, default false

[[rules]]
name = "remember"
priority = 40
match = { field = "text", starts_with = "remember this" }

[rules.decision.RunNativeAction]
action = "extract_memory"   # or compact_conversation; neither takes params
"""


def test_digest_and_remember_decisions():
    rs = load(DECISIONS).ruleset
    m = rs.evaluate(MessageFacts(text="Digest my week"))
    assert m.rule.name == "digest"
    assert m.decision == StartWorkflow("digest", True)
    assert m.stops and m.answer is None
    m = rs.evaluate(MessageFacts(text="REMEMBER THIS: my cat is Tom"))
    assert m.rule.name == "remember"
    assert m.decision == RunNativeAction("extract_memory")
    assert rs.evaluate(MessageFacts(text="please digest")).rule is None
    assert rs.evaluate(MessageFacts(text="remember that")).rule is None
    assert isinstance(rs.evaluate(MessageFacts(text="remember that")).decision, PassToDefaultAgent)


def test_start_workflow_inject_context_defaults_false():
    rs = load(
        """
        [[rules]]
        name = "w"
        match = { always = true }
        [rules.decision.StartWorkflow]
        workflow = "nightly"
        """
    ).ruleset
    assert rs.rules[0].decision == StartWorkflow("nightly", False)


CHANNEL_ALLOWLIST = """
[[rules]]
name = "channel-allowlist"
priority = 200
decision = "Ignore"

[rules.match]
not = { any_of = [
  { field = "channel", equals = "slack" },
  { field = "channel", equals = "discord" },
] }
"""


@pytest.mark.parametrize(
    "channel,ignored",
    [("slack", False), ("Slack", False), ("discord", False), ("web", True), ("line", True), (None, True)],
)
def test_channel_allowlist(channel, ignored):
    rs = load(CHANNEL_ALLOWLIST).ruleset
    assert (decider(rs, text="hi", channel=channel) == "channel-allowlist") is ignored


VIP = """
[[rules]]
name = "vip-through"
priority = 300
decision = "PassToDefaultAgent"

[rules.match]
all_of = [
  { field = "channel", equals = "slack" },
  { field = "user_id", equals = "U12345678" },
]

[[rules]]
name = "slack-closed"
priority = 200
decision = "Ignore"
match = { field = "channel", equals = "slack" }
"""


def test_vip_routing():
    rs = load(VIP).ruleset
    m = rs.evaluate(MessageFacts(text="hi", channel="slack", user_id="U12345678"))
    assert m.rule.name == "vip-through" and not m.stops
    assert decider(rs, text="hi", channel="slack", user_id="u12345678") == "vip-through"
    m = rs.evaluate(MessageFacts(text="hi", channel="slack", user_id="U99999999"))
    assert m.rule.name == "slack-closed" and m.answer == IGNORED_ANSWER
    assert decider(rs, text="hi", channel="slack") == "slack-closed"
    assert decider(rs, text="hi", channel="discord", user_id="U12345678") is None


def test_vip_priority_wins_regardless_of_file_order():
    reordered = VIP.split("[[rules]]")
    text = "[[rules]]" + reordered[2] + "[[rules]]" + reordered[1]
    rs = load(text).ruleset
    assert [r.name for r in rs.rules] == ["vip-through", "slack-closed"]
    assert decider(rs, channel="slack", user_id="U12345678") == "vip-through"


GROUPS = """
# In group chats, answer only messages that ask for the agent.
[[rules]]
name = "groups-need-a-trigger"
priority = 150
decision = "Ignore"

[rules.match]
all_of = [
  { field = "source_type", equals = "group" },
  { not = { any_of = [
    { field = "text", starts_with = "/ask" },
    { field = "text", contains_any = ["#agent"] },
  ] } },
]
"""


@pytest.mark.parametrize(
    "source_type,text,ignored",
    [
        ("group", "hello everyone", True),
        ("group", "/ask what time is it", False),
        ("group", "/ASK upper", False),
        ("group", "hey #Agent, help", False),
        ("group", "ask without slash", True),
        ("user", "hello", False),
        ("room", "hello", False),
        (None, "hello", False),
        ("group", None, True),
    ],
)
def test_groups_need_a_trigger(source_type, text, ignored):
    rs = load(GROUPS).ruleset
    assert (decider(rs, text=text, source_type=source_type) == "groups-need-a-trigger") is ignored


VOICE = """
# Do not take payment instructions by voice.
[[rules]]
name = "no-spoken-payments"
priority = 150
decision = "Ignore"

[rules.match]
all_of = [
  { field = "input_mode", equals = "voice" },
  { field = "text", contains_any = ["transfer", "payment"] },
]
"""


@pytest.mark.parametrize(
    "input_mode,text,ignored",
    [
        ("voice", "please TRANSFER 100 euros", True),
        ("voice", "make a payment", True),
        ("Voice", "payment", True),
        ("voice", "what's up", False),
        ("live", "transfer money", False),
        (None, "transfer money", False),  # typed: input_mode absent never matches
    ],
)
def test_no_spoken_payments(input_mode, text, ignored):
    rs = load(VOICE).ruleset
    assert (decider(rs, text=text, input_mode=input_mode, channel="web") == "no-spoken-payments") is ignored


# ---------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------


def test_ties_keep_file_order_and_first_match_decides():
    rs = load(
        """
        [[rules]]
        name = "low"
        priority = -5
        decision = "Ignore"
        match = { always = true }
        [[rules]]
        name = "a"
        priority = 10
        decision = "PassToDefaultAgent"
        match = { field = "text", contains_any = ["x"] }
        [[rules]]
        name = "b"
        priority = 10
        decision = "Ignore"
        match = { field = "text", contains_any = ["x"] }
        [[rules]]
        name = "c"
        decision = "Ignore"
        match = { field = "text", equals = "y" }
        """
    ).ruleset
    assert [r.name for r in rs.rules] == ["a", "b", "c", "low"]
    assert decider(rs, text="x") == "a"
    assert decider(rs, text="y") == "c"
    assert decider(rs, text="z") == "low"


def test_empty_file_loads_zero_rules():
    assert load("").count == 0
    assert load("# only a comment\nother = 1\n").count == 0
    assert CompiledRuleSet.empty().evaluate(MessageFacts(text="x")).rule is None


# ---------------------------------------------------------------------------
# Unknown keys
# ---------------------------------------------------------------------------


def test_unknown_keys_are_ignored_enabled_false_leaves_rule_live():
    result = load(
        """
        top_level_thing = "ignored"
        [[rules]]
        name = "off?"
        enabled = false
        description = "still live"
        decision = "Ignore"
        match = { field = "text", contains_any = ["spam"], comment = "ignored too" }
        """
    )
    assert result.count == 1
    assert decider(result.ruleset, text="spam") == "off?"


def test_unknown_keys_in_decision_tables_are_ignored():
    rs = load(
        """
        [[rules]]
        name = "d"
        match = { always = true }
        [rules.decision.StartWorkflow]
        workflow = "digest"
        colour = "blue"
        """
    ).ruleset
    assert rs.rules[0].decision == StartWorkflow("digest", False)


# ---------------------------------------------------------------------------
# Whole-file refusals
# ---------------------------------------------------------------------------


def refusal(text):
    with pytest.raises(RuleSetError) as exc:
        load(text)
    return str(exc.value)


def test_duplicate_names_refuse_the_file():
    msg = refusal(
        """
        [[rules]]
        name = "same"
        decision = "Ignore"
        match = { always = true }
        [[rules]]
        name = "same"
        decision = "PassToDefaultAgent"
        match = { always = true }
        """
    )
    assert "duplicate rule name `same`" in msg
    assert msg.startswith("rules.toml: ")


def test_decision_after_match_header_is_in_the_wrong_table():
    msg = refusal(
        """
        [[rules]]
        name = "late-decision"
        [rules.match]
        field = "text"
        equals = "x"
        decision = "Ignore"
        """
    )
    assert "missing field `decision`" in msg
    assert "late-decision" in msg


def test_match_after_decision_header_is_in_the_wrong_table():
    msg = refusal(
        """
        [[rules]]
        name = "late-match"
        [rules.decision.RunNativeAction]
        action = "extract_memory"
        match = { always = true }
        """
    )
    assert "missing field `match`" in msg


@pytest.mark.parametrize(
    "match,fragment",
    [
        ('{ colour = "red" }', "no known shape"),
        ("{ }", "no known shape"),
        ('{ field = "text" }', "no known shape"),
        ('{ field = "text", contains = ["x"] }', "no known shape"),
        ('{ field = "text", equals = "a", starts_with = "b" }', "no known shape"),
        ('{ field = "text", equals = "a", always = true }', "no known shape"),
        ('{ contains_any = ["x"] }', "missing field `field`"),
        ('{ field = "sender", equals = "x" }', "unknown field `sender`"),
        ('{ field = "text", contains_any = "x" }', "array of strings"),
        ('{ field = "text", equals = 3 }', "expected a string"),
        ('{ always = "yes" }', "expected a boolean"),
        ('{ all_of = { always = true } }', "expected an array"),
        ('{ any_of = [ { nope = 1 } ] }', "match.any_of[0]: condition of no known shape"),
        ('{ not = [ { always = true } ] }', "must be a table"),
        ('"always"', "must be a table"),
    ],
)
def test_conditions_of_no_known_shape_refuse_the_file(match, fragment):
    msg = refusal(
        f"""
        [[rules]]
        name = "ok"
        decision = "Ignore"
        match = {{ always = true }}
        [[rules]]
        name = "bad"
        decision = "Ignore"
        match = {match}
        """
    )
    assert fragment in msg


@pytest.mark.parametrize(
    "body,fragment",
    [
        ('name = "x"\nmatch = { always = true }', "missing field `decision`"),
        ('name = "x"\ndecision = "Ignore"', "missing field `match`"),
        ('decision = "Ignore"\nmatch = { always = true }', "missing field `name`"),
        ('name = "x"\ndecision = "Drop"\nmatch = { always = true }', "unknown decision `Drop`"),
        ('name = "x"\ndecision = "StartWorkflow"\nmatch = { always = true }', "needs a [rules.decision.StartWorkflow] table"),
        ('name = "x"\npriority = "high"\ndecision = "Ignore"\nmatch = { always = true }', "expected an integer"),
        ('name = "x"\npriority = true\ndecision = "Ignore"\nmatch = { always = true }', "expected an integer"),
        ('name = "x"\nmatch = { always = true }\n[rules.decision.StartWorkflow]\ninject_context = true', "missing field `workflow`"),
        ('name = "x"\nmatch = { always = true }\n[rules.decision.RunNativeAction]\nparams = {}', "missing field `action`"),
        ('name = "x"\nmatch = { always = true }\n[rules.decision.StartWorkflow]\nworkflow = "a"\ninject_context = "yes"', "expected a boolean"),
    ],
)
def test_other_refusals(body, fragment):
    assert fragment in refusal("[[rules]]\n" + body + "\n")


def test_invalid_toml_and_rules_not_an_array_refuse():
    assert "invalid TOML" in refusal('[[rules]]\nname = "x\n')
    assert "[[rules]]" in refusal('[rules]\nname = "x"\n')


# ---------------------------------------------------------------------------
# Dropped rules
# ---------------------------------------------------------------------------

DROPS = """
[[rules]]
name = "start-nightly"
match = { always = true }
[rules.decision.StartWorkflow]
workflow = "nightly"

[[rules]]
name = "bad-action"
match = { always = true }
[rules.decision.RunNativeAction]
action = "memory_compaction"

[[rules]]
name = "with-params"
match = { always = true }
[rules.decision.RunNativeAction]
action = "compact_conversation"
params = { keep = 3 }

[[rules]]
name = "good-digest"
match = { field = "text", starts_with = "digest" }
[rules.decision.StartWorkflow]
workflow = "digest"

[[rules]]
name = "fine"
decision = "Ignore"
match = { field = "text", equals = "spam" }
"""


def test_dropped_rules_are_logged_exactly_and_the_rest_loads(caplog):
    caplog.set_level(logging.ERROR, logger="ugent.rules")
    check = workflow_check_from(lambda name: name == "digest")
    result = load(DROPS, workflow_check=check)
    assert [r.name for r in result.rules] == ["good-digest", "fine"]
    assert [(d.name, d.reason) for d in result.dropped] == [
        ("start-nightly", "workflow 'nightly' is not a cron job with rule_trigger = true"),
        ("bad-action", "unknown native action 'memory_compaction'; the actions are compact_conversation and extract_memory"),
        ("with-params", "native action 'compact_conversation' takes no params"),
    ]
    assert dropped_lines(caplog) == [
        "rule dropped (rule=start-nightly, reason=workflow 'nightly' is not a cron job with rule_trigger = true)",
        "rule dropped (rule=bad-action, reason=unknown native action 'memory_compaction'; the actions are compact_conversation and extract_memory)",
        "rule dropped (rule=with-params, reason=native action 'compact_conversation' takes no params)",
    ]
    assert all(r.levelno == logging.ERROR and r.name == "ugent.rules" for r in caplog.records)


def test_without_workflow_check_workflows_are_not_dropped(caplog):
    result = load(DROPS)
    assert [d.name for d in result.dropped] == ["bad-action", "with-params"]
    assert "start-nightly" in [r.name for r in result.rules]


def test_check_false_keeps_every_rule_like_tui_rules_test(caplog):
    caplog.set_level(logging.ERROR, logger="ugent.rules")
    result = load(DROPS, workflow_check=lambda w: "nope", check=False)
    assert result.count == 5 and not result.dropped
    assert dropped_lines(caplog) == []


def test_dropped_rule_name_still_counts_for_duplicates():
    with pytest.raises(RuleSetError, match="duplicate rule name `x`"):
        load(
            """
            [[rules]]
            name = "x"
            match = { always = true }
            [rules.decision.RunNativeAction]
            action = "nope"
            [[rules]]
            name = "x"
            decision = "Ignore"
            match = { always = true }
            """
        )


def test_empty_params_table_still_counts_as_params():
    result = load(
        """
        [[rules]]
        name = "p"
        match = { always = true }
        [rules.decision.RunNativeAction]
        action = "extract_memory"
        params = {}
        """
    )
    assert result.dropped[0].reason == "native action 'extract_memory' takes no params"


def test_load_rules_file_reads_and_reports_missing(tmp_path):
    p = tmp_path / "rules.toml"
    p.write_text(QUICK_START, encoding="utf-8")
    assert load_rules_file(p).count == 2
    with pytest.raises(RuleSetError, match="cannot read rules file"):
        load_rules_file(tmp_path / "absent.toml")


# ---------------------------------------------------------------------------
# Dry run and explain
# ---------------------------------------------------------------------------


def test_dry_run_lines():
    rs = load(QUICK_START + GROUPS + VIP).ruleset
    assert rs.dry_run("unsubscribe now") == '[dry-run] matched rule "ignore-spam"'
    rs2 = load(GROUPS + VIP).ruleset
    assert rs2.dry_run("hello") == '[dry-run] no rule matched for: "hello"'
    assert CompiledRuleSet.empty().dry_run("x y") == '[dry-run] no rule matched for: "x y"'


def test_dry_run_tests_as_channel_cli_source_type_user():
    rs = load(
        """
        [[rules]]
        name = "cli-user"
        decision = "Ignore"
        match = { all_of = [ { field = "channel", equals = "cli" }, { field = "source_type", equals = "user" }, { not = { field = "input_mode", equals = "voice" } } ] }
        """
    ).ruleset
    assert rs.dry_run("anything") == '[dry-run] matched rule "cli-user"'


def test_explain_names_the_decider_and_condition_results():
    rs = load(VIP + GROUPS).ruleset
    ex = rs.explain(MessageFacts(text="hi", channel="slack", user_id="U1", source_type="group"))
    assert ex.decided_by.name == "slack-closed"
    by_name = {t.rule.name: t for t in ex.rules}
    vip = by_name["vip-through"]
    assert vip.reached and not vip.matched
    assert [c.held for c in vip.condition.children] == [True, False]
    assert by_name["slack-closed"].matched and by_name["slack-closed"].reached
    groups = by_name["groups-need-a-trigger"]
    assert groups.matched and not groups.reached  # priority 150 < 200: never tried
    text = "\n".join(ex.lines())
    assert 'rule "slack-closed" decides: Ignore' in text
    assert '[x] channel equals "slack"' in text
    assert '[ ] user_id equals "U12345678"' in text


def test_explain_notes_absent_fields():
    rs = load(VOICE).ruleset
    ex = rs.explain(MessageFacts(text="transfer"))
    assert ex.decided_by is None
    leaf = ex.rules[0].condition.children[0]
    assert not leaf.held and leaf.note == "message has no input_mode"
    assert "no rule matched" in ex.lines()[0]


def test_closed_ruleset_refuses_everything():
    rs = CompiledRuleSet.closed("boom")
    m = rs.evaluate(MessageFacts(text="hi"))
    assert m.refused and m.stops and m.rule is None
    assert m.answer == engine.CLOSED_ANSWER
    assert "boom" in rs.explain(MessageFacts()).lines()[0]


def test_compiled_once_per_load():
    result = load(GROUPS)
    cond = result.rules[0].condition
    assert isinstance(cond, AllOf)
    assert isinstance(cond.items[1], Not) and isinstance(cond.items[1].inner, AnyOf)
    # Evaluating does not rebuild anything: the same objects are used each time.
    result.ruleset.evaluate(MessageFacts(text="x", source_type="group"))
    assert result.rules[0].condition is cond


# ---------------------------------------------------------------------------
# Property tests of the condition algebra
# ---------------------------------------------------------------------------

VALUES = ["slack", "Slack", "web", "group", "voice", "hello world", "/ask x", "#agent", ""]
NEEDLES = ["slack", "SLACK", "web", "group", "voice", "hello", "/ask", "#AGENT", "", "zzz"]

messages = st.builds(
    MessageFacts,
    **{f: st.none() | st.sampled_from(VALUES) | st.text(max_size=6) for f in engine.FIELDS},
)

leaf_raw = st.one_of(
    st.builds(lambda f, n: {"field": f, "contains_any": n}, st.sampled_from(engine.FIELDS), st.lists(st.sampled_from(NEEDLES), max_size=3)),
    st.builds(lambda f, n: {"field": f, "starts_with": n}, st.sampled_from(engine.FIELDS), st.sampled_from(NEEDLES)),
    st.builds(lambda f, n: {"field": f, "equals": n}, st.sampled_from(engine.FIELDS), st.sampled_from(VALUES)),
    st.builds(lambda b: {"always": b}, st.booleans()),
)

conditions_raw = st.recursive(
    leaf_raw,
    lambda inner: st.one_of(
        st.builds(lambda xs: {"all_of": xs}, st.lists(inner, max_size=3)),
        st.builds(lambda xs: {"any_of": xs}, st.lists(inner, max_size=3)),
        st.builds(lambda x: {"not": x}, inner),
    ),
    max_leaves=8,
)


def reference(raw, msg):
    """An independent interpreter of the spec's condition table."""
    if "always" in raw:
        return raw["always"]
    if "all_of" in raw:
        return all(reference(c, msg) for c in raw["all_of"])
    if "any_of" in raw:
        return any(reference(c, msg) for c in raw["any_of"])
    if "not" in raw:
        return not reference(raw["not"], msg)
    value = getattr(msg, raw["field"])
    if value is None:
        return False
    v = value.casefold()
    if "contains_any" in raw:
        return any(n.casefold() in v for n in raw["contains_any"])
    if "starts_with" in raw:
        return v.startswith(raw["starts_with"].casefold())
    return v == raw["equals"].casefold()


@settings(max_examples=300, deadline=None)
@given(conditions_raw, messages)
def test_compiled_conditions_agree_with_reference(raw, msg):
    cond = compile_condition(raw)
    assert cond.matches(msg) == reference(raw, msg)
    assert cond.trace(msg).held == cond.matches(msg)


@settings(max_examples=200, deadline=None)
@given(conditions_raw, conditions_raw, messages)
def test_condition_algebra(a, b, msg):
    ca, cb = compile_condition(a), compile_condition(b)
    assert compile_condition({"not": a}).matches(msg) == (not ca.matches(msg))
    assert compile_condition({"not": {"not": a}}).matches(msg) == ca.matches(msg)
    assert compile_condition({"all_of": [a, b]}).matches(msg) == (ca.matches(msg) and cb.matches(msg))
    assert compile_condition({"any_of": [a, b]}).matches(msg) == (ca.matches(msg) or cb.matches(msg))
    # De Morgan
    assert compile_condition({"not": {"any_of": [a, b]}}).matches(msg) == compile_condition(
        {"all_of": [{"not": a}, {"not": b}]}
    ).matches(msg)
    assert compile_condition({"all_of": [a]}).matches(msg) == ca.matches(msg)
    assert compile_condition({"any_of": [a]}).matches(msg) == ca.matches(msg)


@given(messages)
def test_identities_and_empty_lists(msg):
    assert compile_condition({"always": True}).matches(msg)
    assert not compile_condition({"always": False}).matches(msg)
    assert compile_condition({"all_of": []}).matches(msg)  # empty conjunction: true
    assert not compile_condition({"any_of": []}).matches(msg)  # empty disjunction: false
    assert not compile_condition({"field": "text", "contains_any": []}).matches(msg)


@given(messages, st.sampled_from(engine.FIELDS), st.sampled_from(["contains_any", "starts_with", "equals"]), st.sampled_from(NEEDLES))
def test_missing_field_never_matches_and_not_of_it_always_does(msg, field, op, needle):
    absent = dataclasses.replace(msg, **{field: None})
    raw = {"field": field, op: [needle] if op == "contains_any" else needle}
    assert not compile_condition(raw).matches(absent)
    assert compile_condition({"not": raw}).matches(absent)


ASCII = string.ascii_letters + " /#"


@given(
    st.text(alphabet=ASCII, max_size=10),
    st.text(alphabet=ASCII, max_size=4),
    st.sampled_from(["contains_any", "starts_with", "equals"]),
)
def test_case_is_ignored(text, needle, op):
    results = set()
    for t in (text, text.upper(), text.lower(), text.swapcase()):
        for n in (needle, needle.upper(), needle.lower()):
            arg = [n] if op == "contains_any" else n
            results.add(compile_condition({"field": "text", op: arg}).matches(MessageFacts(text=t)))
    assert len(results) == 1
