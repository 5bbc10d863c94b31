"""Durable memory per user (issue #16).

The hub and the commands read memory only through the functions here; the backends (none,
sqlite_fts, lance_embedded) live beside them (`backends.py`), the facts in `models.py`, writes in
`services.py`, recall in `recall.py`, the offline extractor in `extract.py`, the after-turn hook in
`hooks.py` and the memory_control tool in `tools.py`. With no backend configured there is no durable
memory: recall finds nothing and says why. Memory is scoped to the acting user's actor key.
"""
from __future__ import annotations


def recall_preview(*, actor_key: str, text: str) -> dict:
    """What recall would inject for this user before a turn on `text`, without injecting it.

    {"backend": the configured backend's name, or None when there is none,
     "facts": [{"text", "tier", "score"}...], "tokens_est": int}
    """
    from plugins_app.agent.memory.recall import recall
    found = recall(actor_key=actor_key, text=text)
    return {"backend": found.backend, "facts": [f.as_dict() for f in found.facts], "tokens_est": found.tokens_est}


def turn_recall(*, actor_key: str, disabled: bool, session_id: str = "default"):
    """The recall of one turn (recall.TurnRecall): `.messages(messages)` before each engine call."""
    from plugins_app.agent.memory.recall import TurnRecall
    return TurnRecall(actor_key=actor_key, disabled=disabled, session_id=session_id)


def profile_context(*, profile, messages: list, session_id: str) -> list:
    """`messages` as the profile's memory engine (AgentProfile.memory_engine, an AgentContextManager) builds
    them, where it names one: it is handed the history before the newest user message and asked for the
    context of that message; what follows the message (a tool loop's calls and results) stays after it.
    An engine that fails, or answers without the user's message last, leaves `messages` as they were
    (logged): a memory plugin never fails a turn."""
    from plugins_app.agent.memory.context import context_of
    return context_of(profile=profile, messages=messages, session_id=session_id)
