"""A rule's native action (RunNativeAction) is the turn itself: the turn runner runs it after the receipt
commits, outside any transaction, and records it as the rule's answer, as the hook path always did."""
from __future__ import annotations

import json
import logging
import threading

import pytest
from django.db import connection
from django.test import Client
from ovos_plugin_manager.templates.agents import ChatSummarizerEngine

from channels_app.models import Event, Message, Receipt, Turn
from plugins_app.agent.engines import registry
from plugins_app.agent.models import AgentProfile
from rules_app import engine
from tests.rules_app.conftest import answer
from tests.support.http import chat
from tests.rules_app.test_django_seed import DECISIONS
from tests.support.memory import memory_config  # noqa: F401

COMPACTED = "Compacted the conversation: 4 earlier messages summarised; the last 1 exchange kept as they are."


class BlockedSummarizer(ChatSummarizerEngine):
    """Summarises only once the test releases it: a slow model call the test controls."""

    started = threading.Event()
    release = threading.Event()

    def summarize(self, messages, lang=None):
        BlockedSummarizer.started.set()
        assert BlockedSummarizer.release.wait(30)
        return "- a summary the test released"


@pytest.fixture
def blocked(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    BlockedSummarizer.started.clear()
    BlockedSummarizer.release.clear()
    registry.register_summarizer("test-blocked", BlockedSummarizer)
    AgentProfile.objects.filter(pk=tcast.profile.pk).update(summarizer_engine="test-blocked")
    yield BlockedSummarizer
    BlockedSummarizer.release.set()  # never leave a thread waiting past the test


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread of its own (its own database connection); .result holds what it returned."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test
            box["error"] = exc
        finally:
            connection.close()
    t = threading.Thread(target=run, daemon=True)
    t.box = box
    t.start()
    return t


def result_of(t: threading.Thread, timeout: float):
    t.join(timeout)
    assert not t.is_alive(), "still waiting"
    if "error" in t.box:
        raise t.box["error"]
    return t.box["result"]


def history(who, conversation_id: str, n: int = 3) -> None:
    for i in range(n):
        assert chat(who, f"question {i}. with more words", conversation_id=conversation_id).status_code == 200


def the_turn(conversation_id: str) -> Turn:
    return Turn.objects.filter(conversation__external_id=conversation_id).order_by("-id").first()


# --- the summariser holds no lock --------------------------------------------------------------

def test_while_a_rule_compaction_summarises_another_conversation_is_accepted_and_committed(site, tcast, blocked):
    site.rules(DECISIONS)
    history(tcast.alice, "k1")
    sender = in_thread(chat, tcast.alice, "compact please", conversation_id="k1")
    assert blocked.started.wait(20)
    # another user's message into another conversation: accepted, answered and committed meanwhile
    other = in_thread(chat, tcast.bob, "hello there", conversation_id="elsewhere")
    try:
        assert answer(result_of(other, 10)) == "echo: hello there (history=0)"
        assert Receipt.objects.get(conversation__external_id="elsewhere").state == "completed"
        assert sender.is_alive()  # the compaction still waits for its summariser
        turn = the_turn("k1")
        assert turn.state == "running"
        assert not Message.objects.filter(turn=turn, role="assistant").exists()
    finally:
        blocked.release.set()
    assert answer(result_of(sender, 20)) == COMPACTED
    turn.refresh_from_db()
    assert turn.state == "completed"
    assert list(Message.objects.filter(turn=turn).order_by("id").values_list("role", "content")) == [
        ("user", "compact please"), ("assistant", COMPACTED)]
    assert Event.objects.filter(turn=turn, type="turn.completed").count() == 1
    assert Message.objects.filter(conversation__external_id="k1", hidden=True).count() == 4
    assert Message.objects.get(role="system").content.endswith("- a summary the test released")


def test_a_stop_during_a_rule_compaction_does_not_stop_it(site, tcast, blocked):
    site.rules(DECISIONS)
    history(tcast.alice, "k1")
    sender = in_thread(chat, tcast.alice, "compact please", conversation_id="k1")
    try:
        assert blocked.started.wait(20)
        stop = Client().post("/v1/ugent/stop", data=json.dumps({"user": "alice", "conversation_id": "k1"}),
                             content_type="application/json", HTTP_X_API_KEY=tcast.keys["operator"])
        assert stop.status_code == 202, stop.content
    finally:
        blocked.release.set()
    assert answer(result_of(sender, 20)) == COMPACTED
    turn = the_turn("k1")
    assert turn.cancel_requested and turn.state == "completed"
    assert Receipt.objects.get(pk=turn.receipt_id).state == "completed"
    types = list(Event.objects.filter(turn=turn).order_by("id").values_list("type", flat=True))
    assert types == ["ugent.user_message", "turn.stop_requested", "turn.delta", "turn.completed"]
    assert Message.objects.filter(conversation__external_id="k1", hidden=True).count() == 4


# --- the records: those the hook path wrote ----------------------------------------------------

@pytest.mark.parametrize("text,rule,action,expected", [
    ("compact please", "compact", "compact_conversation", COMPACTED),
    ("remember this: I like tea", "remember", "extract_memory", engine.MEMORY_BACKEND_NEEDED),
])
def test_a_native_action_turn_records_what_a_rule_answer_records(site, tcast, settings, text, rule, action,
                                                                   expected):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    site.rules(DECISIONS)
    history(tcast.alice, "k1")
    resp = chat(tcast.alice, text, conversation_id="k1")
    assert answer(resp) == expected
    turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert (turn.state, receipt.state) == ("completed", "completed")
    assert receipt.answer == expected and receipt.reason == f"rule '{rule}' ran {action}"
    assert receipt.started_at and receipt.finished_at and turn.started_at and turn.finished_at
    types = list(Event.objects.filter(turn=turn).order_by("id").values_list("type", flat=True))
    assert types == ["ugent.user_message", "turn.delta", "turn.completed"]
    delta = Event.objects.get(turn=turn, type="turn.delta").data
    assert delta == {"turn_id": turn.turn_id, "segment": "answer", "text": expected}
    done = Event.objects.get(turn=turn, type="turn.completed").data
    assert done == {"turn_id": turn.turn_id, "state": "completed", "answer": expected, "citations": [],
                    "decided_by": rule}
    assert list(Message.objects.filter(turn=turn).order_by("id").values_list("role", "content")) == [
        ("user", text), ("assistant", expected)]


def test_a_failing_rule_compaction_answers_so_and_logs(site, tcast, settings, rules_log):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    site.rules(DECISIONS)
    history(tcast.alice, "k1")
    AgentProfile.objects.filter(pk=tcast.profile.pk).update(summarizer_engine="not-installed")
    rules_log.set_level(logging.ERROR, logger="ugent.compaction")
    resp = chat(tcast.alice, "compact please", conversation_id="k1")
    assert answer(resp) == "Compacting the conversation failed; the agent's log says why."
    assert any("compact_conversation failed" in m for m in rules_log.messages)
    assert not Message.objects.filter(hidden=True).exists()
    assert Receipt.objects.get(turn__turn_id=resp["x-ugent-turn-id"]).state == "completed"


# --- run again (a turn whose claim a crash undid runs again) -----------------------------------

def test_a_rule_compaction_run_again_for_its_turn_hides_nothing_more(site, tcast, settings):
    from rules_app.hooks import compact_conversation_action
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    site.rules(DECISIONS)
    history(tcast.alice, "k1")
    resp = chat(tcast.alice, "compact please", conversation_id="k1")
    assert answer(resp) == COMPACTED
    turn = Turn.objects.select_related("conversation", "actor", "profile").get(turn_id=resp["x-ugent-turn-id"])
    assert compact_conversation_action(turn=turn) == "There is nothing to compact yet."
    assert Message.objects.filter(hidden=True).count() == 4
    assert Message.objects.filter(role="system").count() == 1
    assert Event.objects.filter(type="compaction.completed").count() == 1


def test_extract_memory_reads_the_exchanges_before_it_and_run_again_saves_nothing_twice(site, tcast, settings,
                                                                                        memory_config):
    from plugins_app.agent.memory.models import MemoryFact
    from rules_app.hooks import extract_memory_action
    settings.UGENT_MEMORY_EXCHANGES = 1  # the one exchange before the message, not the message itself
    memory_config.backend("sqlite_fts")
    site.rules(DECISIONS)
    # said earlier, kept out of memory by that turn's own opt-out: only the rule's action saves it
    chat(tcast.alice, "my name is Alice", conversation_id="m1", ugent_disable_memory_write=True)
    resp = chat(tcast.alice, "remember this", conversation_id="m1")
    assert answer(resp) == "Saved 1 fact to memory."
    assert list(MemoryFact.objects.values_list("actor_key", "text")) == [("web:alice", "User's name is Alice.")]
    turn = Turn.objects.select_related("conversation", "actor", "profile").get(turn_id=resp["x-ugent-turn-id"])
    assert extract_memory_action(turn=turn) == "Found nothing new to save to memory."
    assert MemoryFact.objects.count() == 1
    # read again, the exchange it had read is not counted again
    assert MemoryFact.objects.get().seen_count == 1
    # a later extract_memory reads the same exchange, beside a new one stating the fact again: that one counts
    chat(tcast.alice, "my name is Alice", conversation_id="m1", ugent_disable_memory_write=True)
    settings.UGENT_MEMORY_EXCHANGES = 2
    assert answer(chat(tcast.alice, "remember this", conversation_id="m1")) == "Found nothing new to save to memory."
    assert MemoryFact.objects.get().seen_count == 2


def test_extract_memory_reads_only_the_senders_own_messages(site, tcast, settings, memory_config):
    # a group conversation holds other people's messages too: their facts are not the sender's
    from channels_app.models import Actor
    from plugins_app.agent.memory.models import MemoryFact
    memory_config.backend("sqlite_fts")
    site.rules(DECISIONS)
    chat(tcast.alice, "hello", conversation_id="g1")
    conv = the_turn("g1").conversation
    bob = Actor.objects.create(key="slack:bob", channel="slack", user_id="bob")
    Message.objects.create(conversation=conv, role=Message.Role.USER, content="my name is Bob", actor=bob)
    assert answer(chat(tcast.alice, "remember this", conversation_id="g1")) == "Found nothing new to save to memory."
    assert not MemoryFact.objects.exists()


def test_a_spoken_extract_memory_writes_nothing(site, tcast, memory_config):
    from plugins_app.agent.memory.models import MemoryFact
    memory_config.backend("sqlite_fts")
    site.rules(DECISIONS)
    resp = chat(tcast.alice, "remember this: my name is Alice", conversation_id="m1", ugent_input_mode="voice")
    assert answer(resp) == "Memory writes are off for this conversation."
    assert not MemoryFact.objects.exists()
