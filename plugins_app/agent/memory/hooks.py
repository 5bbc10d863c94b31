"""The hub's after-turn hook for memory: a completed turn's message goes to extraction after commit.

It runs inside the transaction that ends the turn, so it only decides and enqueues: the extraction
(a Celery task, plugins_app.tasks.memory_extract_turn) runs once that transaction has committed. The
task is handed the text rather than the turn's id because this room does not read the hub's rows.
"""
from __future__ import annotations

from django.db import transaction

from plugins_app.agent.memory.conf import memory_conf
from plugins_app.agent.memory.extract import extract_facts
from plugins_app.agent.memory.model_extract import extraction_server, model_server_known
from ugent_common.config import load_config
from ugent_common.tasks import task_named


def actor_identified(actor) -> bool:
    """False for an application's anonymous web user and for a sender with no id: no memory of theirs."""
    if actor is None or not getattr(actor, "user_id", ""):
        return False
    return not actor.key.startswith("web-user@")


def voice_keeps_out_of_memory() -> bool:
    """ugent.toml [voice] memory_write = false."""
    return (load_config().get("voice") or {}).get("memory_write", True) is False


def turn_may_write(turn) -> bool:
    """Whether this turn's message may go into memory: its opt-out, its caller's defaults (already in
    the turn's flag), voice, [voice] memory_write = false over a conversation that had voice."""
    if turn.disable_memory_write or turn.is_spoken:
        return False
    if not actor_identified(turn.actor):
        return False
    if voice_keeps_out_of_memory():
        # a conversation does not record which of its messages were spoken: the setting covers all of it
        if type(turn).objects.spoken().filter(conversation_id=turn.conversation_id).exists():
            return False
    return True


def memory_turn_ended(*, turn, state: str, answer: str) -> None:
    """UGENT_AFTER_TURN_HOOKS["memory"]: enqueue extraction of a completed turn's message."""
    conf = memory_conf()
    if state != "completed" or not conf.durable:
        return
    context = turn.context or {}
    if (context.get("native_action") or {}).get("action") == "extract_memory":
        return  # the action read this message itself
    text = context.get("text", "")
    # the cheap test first: most turns state nothing the offline rules find. The model reads every
    # message with words in it (what it finds is what the rules miss) when it has a server to ask
    if conf.extractor == "openai-compatible" and model_server_known(extraction_server(turn.profile_id)):
        if not text.strip():
            return
    elif not extract_facts(text):
        return
    if not turn_may_write(turn):
        return
    actor_key, turn_id, profile_id = turn.actor.key, turn.turn_id, turn.profile_id
    transaction.on_commit(
        lambda: task_named("plugins_app.tasks.memory_extract_turn").delay(actor_key, text, turn_id, profile_id))
