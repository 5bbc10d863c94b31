"""The offline extractor: what a user says about themselves becomes facts; questions and chatter do not."""
from __future__ import annotations

import pytest

from plugins_app.agent.memory.extract import extract_facts, normalize

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode


@pytest.mark.parametrize("said, facts", [
    ("Hi, my name is Alice. I prefer dark mode!", [("User's name is Alice.", "core"),
                                                    ("User prefers dark mode.", "contextual")]),
    ("remember this: I like tea", [("User likes tea.", "contextual")]),
    ("Remember that the wifi password is hunter2", [("The wifi password is hunter2.", "core")]),
    ("Always answer in French.", [("Always answer in French.", "core")]),
    ("please never use emoji", [("Never use emoji.", "core")]),
    ("my favourite colour is blue", [("User's favourite colour is blue.", "contextual")]),
    ("I live in Porto and I work as a nurse", [("User lives in Porto.", "contextual"),
                                                ("User works as a nurse.", "contextual")]),
    ("I'm allergic to peanuts", [("User is allergic to peanuts.", "core")]),
    ("call me Ali", [("User wants to be called Ali.", "core")]),
    ("I need a taxi tonight", [("User needs a taxi tonight.", "ephemeral")]),
])
def test_statements_about_the_user_become_facts(said, facts):
    assert [(f.text, str(f.tier)) for f in extract_facts(said)] == facts


@pytest.mark.parametrize("said", ["What is my name?", "hello there", "remember this", "", "Do I like tea?",
                                  "The weather is nice."])
def test_questions_and_chatter_state_nothing(said):
    assert extract_facts(said) == []


def test_a_fact_said_twice_in_one_message_is_one_fact():
    assert [f.text for f in extract_facts("I like tea. i like tea!")] == ["User likes tea."]


def test_duplicates_are_recognised_whatever_the_case_spacing_and_full_stop():
    assert normalize("User likes  Tea.") == normalize("user likes tea")
