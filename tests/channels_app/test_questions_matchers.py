"""The offline option matcher and yes/no engines (OPM OptionMatcherEngine / YesNoEngine contracts, seed 001)."""
from __future__ import annotations

import pytest
from ovos_plugin_manager.templates.agents import OptionMatcherEngine, YesNoEngine

from plugins_app.agent.engines import registry
from plugins_app.agent.engines.matchers import KeywordYesNoEngine, OrdinalFuzzyOptionMatcher

OPTIONS = ["Low", "Medium", "High"]


@pytest.mark.parametrize("said, picked", [
    ("the second one", "Medium"), ("2", "Medium"), ("last", "High"), ("second to last", "Medium"),
    ("I want the first", "Low"), ("high please", "High"), ("hihg", "High"), ("Medium", "Medium"),
    ("banana", None), ("the fifth one", None), ("low or high", None), ("", None),
])
def test_the_option_matcher_reads_ordinals_labels_and_misspellings_and_answers_none_otherwise(said, picked):
    assert OrdinalFuzzyOptionMatcher().match_option(said, OPTIONS) == picked


@pytest.mark.parametrize("said, meant", [
    ("yes", True), ("Yeah sure", True), ("go ahead", True), ("ok", True), ("no", False), ("nope", False),
    ("not at all", False), ("I don't want that", False), ("not sure", None), ("maybe", None), ("yes no", None),
])
def test_the_yes_no_engine_answers_true_false_or_none(said, meant):
    assert KeywordYesNoEngine().yes_or_no("Delete the branch?", said) is meant


def test_the_registry_gives_the_builtin_engines_by_default(settings):
    registry.reset()
    assert isinstance(registry.option_matcher(), OptionMatcherEngine)
    assert isinstance(registry.yesno_engine(), YesNoEngine)
    assert registry.option_matcher() is registry.option_matcher()  # one instance per process
