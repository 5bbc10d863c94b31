"""A profile's own AgentContextManager (AgentProfile.memory_engine) over what a turn's engine is shown."""
from __future__ import annotations

import logging

from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

log = logging.getLogger("ugent.memory")
ROLES = {r.value for r in MessageRole}


def _role(message) -> str:
    return getattr(message.role, "value", message.role)


def context_of(*, profile, messages: list, session_id: str) -> list:
    if not getattr(profile, "memory_engine", "") or not messages:
        return messages
    users = [i for i, m in enumerate(messages) if _role(m) == MessageRole.USER.value]
    if not users:
        return messages
    at = users[-1]
    try:
        from plugins_app.agent.engines.registry import memory_engine_for_profile
        manager = memory_engine_for_profile(profile)
        manager.update_history(list(messages[:at]), session_id)
        built = list(manager.build_conversation_context(messages[at].content, session_id))
        if not built or not all(isinstance(m, AgentMessage) and _role(m) in ROLES for m in built):
            raise TypeError("its context is not a list of AgentMessage")
        if _role(built[-1]) != MessageRole.USER.value:
            raise TypeError("its context does not end with the user's message")
    except Exception as exc:  # a plugin's failure costs its context, never the turn
        log.warning("memory engine failed; the turn goes on without it (profile=%s, engine=%s, error=%s: %s)",
                    profile.name, profile.memory_engine, type(exc).__name__, exc)
        return messages
    # The engine rebuilt the user's message from its text. Seed 001: what it returns is what the chat engine
    # sees (a RAG plugin puts its context into that message), so its text is taken; the turn's own message
    # is kept for the rest (a MultimodalAgentMessage's files).
    own = messages[at]
    last = own if built[-1].content == own.content else _with_content(own, built[-1].content)
    return built[:-1] + [last] + list(messages[at + 1:])


def _with_content(message, content: str):
    import dataclasses
    if dataclasses.is_dataclass(message):
        return dataclasses.replace(message, content=content)
    return AgentMessage(role=message.role, content=content)
