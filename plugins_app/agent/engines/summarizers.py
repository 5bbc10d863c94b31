"""The project's ChatSummarizerEngines (opm.agents.summarizer.chat), which compaction uses.

``ugent-extractive`` (the default) is offline: one line per message, its role and its first
sentence, the lines of an earlier summary carried over. ``ugent-openai-compatible`` asks an
OpenAI-compatible server, through the project's own chat engine and the profile's config
(base_url, api_key, model; UGENT_LLM_* where they are missing). Both return the summary's body:
the hub heads it with how many messages it stands for (channels_app.compaction). Nothing here
imports Django.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from ovos_plugin_manager.templates.agents import AgentMessage, ChatSummarizerEngine, MessageRole

from plugins_app.agent.engines.base import EngineError

#: The first line of every summary message; an earlier summary is recognised by it.
SUMMARY_HEADER = "Summary of the earlier conversation ({count} messages compacted):"
_HEADER_START = SUMMARY_HEADER.split("(", 1)[0]
SUMMARY_MAX_LINES = 30
SUMMARY_LINE_CHARS = 160
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _role(m: Any) -> str:
    role = getattr(m, "role", "")
    return getattr(role, "value", role)


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    first = _SENTENCE_END.split(text, 1)[0]
    return first if len(first) <= SUMMARY_LINE_CHARS else first[: SUMMARY_LINE_CHARS - 1] + "…"


def is_summary(text: str) -> bool:
    """Whether a system message is a summary a compaction left."""
    return (text or "").startswith(_HEADER_START)


class ExtractiveChatSummarizer(ChatSummarizerEngine):
    """Offline and instant: each message's role and first sentence, at most 30 lines (newest kept)."""

    def summarize(self, messages: List[AgentMessage], lang: Optional[str] = None) -> str:
        lines: List[str] = []
        for m in messages:
            content = getattr(m, "content", "") or ""
            if _role(m) == "system" and is_summary(content):
                lines.extend(line for line in content.splitlines()[1:] if line.strip())
            elif content.strip():
                lines.append(f"- {_role(m)}: {_first_sentence(content)}")
        if len(lines) > SUMMARY_MAX_LINES:
            omitted = len(lines) - SUMMARY_MAX_LINES
            lines = [f"- ({omitted} earlier lines omitted)"] + lines[-SUMMARY_MAX_LINES:]
        return "\n".join(lines)


SUMMARY_PROMPT = ("Summarise the conversation below for the assistant who continues it: who asked for what, "
                  "what was decided or answered, names, numbers and open questions. Write short bullet lines "
                  "starting with \"- \", in the conversation's language. Answer with the summary only.")


class OpenAICompatibleChatSummarizer(ChatSummarizerEngine):
    """A summary written by an OpenAI-compatible model, through OpenAICompatibleEngine and its config.

    Config: the chat engine's keys (``base_url``, ``api_key``, ``model``, ``timeout``, …); ``prompt``
    replaces SUMMARY_PROMPT. An empty answer or an upstream failure raises EngineError.
    """

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        super().__init__(config)
        from plugins_app.agent.engines.openai_compat import OpenAICompatibleEngine
        chat_config = {k: v for k, v in self.config.items() if k not in ("system_prompt", "prompt")}
        self.engine = OpenAICompatibleEngine(chat_config)
        self.prompt = self.config.get("prompt") or SUMMARY_PROMPT

    def summarize(self, messages: List[AgentMessage], lang: Optional[str] = None) -> str:
        transcript = "\n\n".join(f"{_role(m)}: {m.content}" for m in messages if (m.content or "").strip())
        reply = self.engine.continue_chat([AgentMessage(role=MessageRole.SYSTEM, content=self.prompt),
                                           AgentMessage(role=MessageRole.USER, content=transcript)],
                                          session_id="compaction", lang=lang)
        text = (reply.content or "").strip()
        if not text:
            raise EngineError("The summariser answered nothing.", code="summary_empty")
        return text

    def close(self) -> None:
        self.engine.close()
