"""The streaming contract between an agent engine and the turn runner.

OPM's ``ChatEngine.stream_tokens`` yields answer text only. UGENT's own engines
also implement ``stream_events``, which yields ``StreamItem``s so thinking,
tool calls, answer resets and citations reach the client as they happen.
A third-party engine without ``stream_events`` is streamed through
``stream_tokens`` (answer text only). This module imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, List, Optional

# The segments of the chat stream ("What the chat stream sends").
ANSWER = "answer"
THINKING = "thinking"
TOOL = "tool"
ANSWER_RESET = "answer_reset"
CITATIONS = "citations"  # data: {"ids": [...]} -- reported after the answer, not a delta
ERROR = "error"

StopCheck = Callable[[], bool]


@dataclass
class StreamItem:
    kind: str
    text: str = ""
    data: Optional[dict] = field(default=None)


class EngineError(Exception):
    """An engine failure that ends the turn as failed with a readable reason."""

    def __init__(self, message: str, *, code: str = "engine_error"):
        super().__init__(message)
        self.message = message
        self.code = code


def never_stop() -> bool:
    return False


def stream_items(engine: Any, messages: List[Any], *, session_id: str = "default",
                 lang: Optional[str] = None, tools: Any = None,
                 should_stop: StopCheck = never_stop) -> Iterator[StreamItem]:
    """Stream any OPM ChatEngine as StreamItems, richly when it supports ``stream_events``."""
    rich = getattr(engine, "stream_events", None)
    if callable(rich):
        yield from rich(messages, session_id=session_id, lang=lang, tools=tools,
                        should_stop=should_stop)
        return
    tokens: Iterable[str] = engine.stream_tokens(messages, session_id=session_id, lang=lang)
    first = True
    for token in tokens:
        if should_stop():
            return
        # OPM's default stream_tokens splits on whitespace; put the spaces back.
        default_split = type(engine).stream_tokens is _opm_stream_tokens()
        text = token if not default_split or first else " " + token
        first = False
        yield StreamItem(ANSWER, text)


def _opm_stream_tokens():
    from ovos_plugin_manager.templates.agents import ChatEngine
    return ChatEngine.stream_tokens
