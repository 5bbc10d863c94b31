"""The rule index gives exactly the linear engine's answer: same rule, same order, same ties."""
import pytest
from hypothesis import given, settings, strategies as st

from rules_app.engine import (
    FIELDS,
    AllOf,
    Always,
    AnyOf,
    CompiledRule,
    CompiledRuleSet,
    ContainsAny,
    Equals,
    Ignore,
    MessageFacts,
    Not,
    StartsWith,
    parse_rules,
)

pytestmark = pytest.mark.mode_free  # rules and messages in memory: nothing a run mode changes

# Small alphabets, mixed case and a non-ASCII fold (ß -> ss), so conditions hold often and fold matters.
word = st.text(alphabet="abAB ßs", max_size=4)
field = st.sampled_from(FIELDS)

leaf = st.one_of(
    st.builds(Equals, field, word),
    st.builds(StartsWith, field, word),
    st.builds(ContainsAny, field, st.lists(word, max_size=3)),
    st.builds(Always, st.booleans()),
)
condition = st.recursive(leaf, lambda kids: st.one_of(
    st.builds(AllOf, st.lists(kids, max_size=3)),
    st.builds(AnyOf, st.lists(kids, max_size=3)),
    st.builds(Not, kids),
), max_leaves=8)


@st.composite
def rulesets(draw):
    conds = draw(st.lists(condition, min_size=1, max_size=25))
    rules = [CompiledRule(f"r{i}", draw(st.integers(0, 3)), c, Ignore(), i) for i, c in enumerate(conds)]
    return CompiledRuleSet(rules)


messages = st.builds(MessageFacts, **{f: st.one_of(st.none(), st.text(alphabet="abAB ßsS", max_size=6))
                                      for f in FIELDS})


@settings(max_examples=1500, deadline=None)
@given(rulesets(), st.lists(messages, min_size=1, max_size=8))
def test_the_index_picks_the_rule_the_linear_engine_picks(ruleset, msgs):
    for msg in msgs:
        assert ruleset.evaluate(msg) == ruleset.evaluate_linear(msg)


def test_ties_keep_file_order_through_the_index():
    text = """
[[rules]]
name = "second-in-file"
priority = 5
decision = "Ignore"
match = { field = "text", contains_any = ["refund"] }

[[rules]]
name = "third"
priority = 5
decision = "Ignore"
match = { field = "channel", equals = "web" }
"""
    ruleset = parse_rules('[[rules]]\nname = "first"\npriority = 5\ndecision = "Ignore"\n'
                          'match = { field = "user_id", starts_with = "U" }\n' + text,
                          source="t", check=False, log=False).ruleset
    both = MessageFacts(text="a REFUND please", channel="Web", user_id="u1")
    assert ruleset.evaluate(both).rule.name == "first"
    assert ruleset.evaluate(MessageFacts(text="refund", channel="web")).rule.name == "second-in-file"
    assert ruleset.evaluate(MessageFacts(text="no", channel="WEB")).rule.name == "third"
    assert ruleset.evaluate(MessageFacts(text="no", channel="slack")).rule is None


def test_a_message_tries_only_the_rules_that_could_match_it():
    lines = [f'[[rules]]\nname = "r{i}"\npriority = 1\ndecision = "Ignore"\n'
             f'match = {{ all_of = [ {{ field = "input_mode", equals = "voice" }}, '
             f'{{ field = "text", contains_any = ["word{i}x"] }} ] }}\n' for i in range(500)]
    ruleset = parse_rules("\n".join(lines), source="t", check=False, log=False).ruleset
    # The shared, unselective atom (voice) is not the trigger: the rule's own needle is.
    tried = list(ruleset.index.candidates(MessageFacts(text="say word7x now", input_mode="voice")))
    assert tried == [7]
    assert ruleset.evaluate(MessageFacts(text="say word7x now", input_mode="voice")).rule.name == "r7"
