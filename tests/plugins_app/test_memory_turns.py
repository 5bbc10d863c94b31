"""Memory through the one message path: recall changes what the engine sees, the opt-outs recall
nothing, a turn's message is saved after it, extract_memory answers with the spec's texts."""
from __future__ import annotations

import pytest

from plugins_app.agent.memory import services
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.agent.memory.recall import RECALL_HEADER
from tests.rules_app.conftest import answer, chat, site  # noqa: F401
from tests.support.memory import memory_config  # noqa: F401
from tests.support.scripted import CALLS


def seen_recall():
    return [c for r, c in CALLS[-1]["messages"] if r == "system" and c.startswith(RECALL_HEADER)]


@pytest.fixture
def fts(memory_config, tcast):  # noqa: F811
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key="web:alice", text="User likes green tea.")
    return tcast


def test_recall_puts_the_users_facts_before_the_message_the_engine_sees(fts):
    answer(chat(fts.alice, "Which tea do I like?"))
    assert seen_recall() == [RECALL_HEADER + "\n- User likes green tea."]
    assert CALLS[-1]["messages"][-1] == ("user", "Which tea do I like?")


def test_bob_never_recalls_alices_facts_through_a_turn(fts):
    answer(chat(fts.bob, "Which tea do I like?"))
    assert seen_recall() == []


def test_disable_memory_recall_recalls_nothing(fts):
    answer(chat(fts.alice, "Which tea do I like?", ugent_disable_memory_recall=True))
    assert seen_recall() == []


def test_a_turns_message_is_saved_after_it_unless_memory_writes_are_off(fts):
    answer(chat(fts.alice, "my name is Alice", ugent_disable_memory_write=True))
    assert not MemoryFact.objects.filter(text="User's name is Alice.").exists()
    answer(chat(fts.alice, "my name is Alice"))
    assert MemoryFact.objects.get(text="User's name is Alice.").source == "turn"


def test_extract_memory_answers(site, fts):  # noqa: F811
    from tests.rules_app.test_django_seed import DECISIONS
    site.rules(DECISIONS)
    assert answer(chat(fts.alice, "remember this: I like black coffee")) == "Saved 1 fact to memory."
    assert answer(chat(fts.alice, "remember this: I like black coffee")) == "Found nothing new to save to memory."
