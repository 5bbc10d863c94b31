"""The streaming contract between an agent engine and the turn runner.

OPM's ``ChatEngine.stream_tokens`` yields answer text only. UGENT's own engines
also implement ``stream_events``, which yields ``StreamItem``s so thinking,
tool calls, answer resets and citations reach the client as they happen.
A third-party engine without ``stream_events`` is streamed through its own
``stream_tokens`` (answer text only); one that keeps OPM's default (which only
splits ``continue_chat``'s answer on whitespace), or that sets ``supports_tools``
while the turn offers tools, is asked ``continue_chat`` once and its answer and
tool calls are taken whole. This module imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

# The segments of the chat stream ("What the chat stream sends").
ANSWER = "answer"
THINKING = "thinking"
TOOL = "tool"
ANSWER_RESET = "answer_reset"
CITATIONS = "citations"  # data: {"ids": [...]} -- reported after the answer, not a delta
ERROR = "error"
USAGE = "usage"  # data: {"prompt_tokens", "completion_tokens", "total_tokens"} -- the upstream's own count

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
    messages = messages_for(engine, messages)
    rich = getattr(engine, "stream_events", None)
    if callable(rich):
        yield from rich(messages, session_id=session_id, lang=lang, tools=tools,
                        should_stop=should_stop)
        return
    with_tools = tools is not None and bool(getattr(engine, "supports_tools", False))
    if with_tools or type(engine).stream_tokens is _opm_stream_tokens():
        # One continue_chat: OPM's stream_tokens takes no tools (an engine that sets supports_tools gets them
        # only there, and answers its calls on the message), and its default one splits the answer on
        # whitespace, which would lose its line breaks, lists and code blocks.
        # (The answer comes whole, and a stop is seen once it has: what the engine answered is kept, as a
        # streamed answer's received part is; the runner stops after it.)
        reply = engine.continue_chat(messages, session_id=session_id, lang=lang,
                                     **({"tools": tools} if with_tools else {}))
        yield from _reply_items(reply, tools_offered=with_tools and not should_stop())
        return
    for token in engine.stream_tokens(messages, session_id=session_id, lang=lang):
        if should_stop():
            return
        yield StreamItem(ANSWER, token)


def messages_for(engine: Any, messages: List[Any]) -> List[Any]:
    """The messages in the type the engine's contract names: a ``MultimodalChatEngine`` takes
    ``MultimodalAgentMessage``s, every one of them (history, system text and recall with empty media lists),
    so an engine reading ``image_content`` off any message finds it; any other engine gets them as they are."""
    import dataclasses

    from ovos_plugin_manager.templates.agents import MultimodalAgentMessage, MultimodalChatEngine
    if not isinstance(engine, MultimodalChatEngine):
        return messages
    # every field the message has (a tool round's tool_calls, tool_call_id, name), with empty media lists
    return [m if isinstance(m, MultimodalAgentMessage) else MultimodalAgentMessage(
        **{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}) for m in messages]


def _reply_items(reply: Any, *, tools_offered: bool) -> Iterator[StreamItem]:
    """A continue_chat reply as StreamItems: its text whole, then its tool calls (when tools were offered)."""
    text = getattr(reply, "content", "") or ""
    if text:
        yield StreamItem(ANSWER, text if isinstance(text, str) else str(text))
    if not tools_offered:
        return
    import json
    import uuid
    for idx, call in enumerate(getattr(reply, "tool_calls", None) or ()):
        arguments = getattr(call, "arguments", None)
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments or {}, ensure_ascii=False)
        yield StreamItem(TOOL, data={"index": idx, "id": getattr(call, "id", "") or "call_" + uuid.uuid4().hex[:24],
                                     "name": getattr(call, "name", "") or "", "arguments": arguments})


def _opm_stream_tokens():
    from ovos_plugin_manager.templates.agents import ChatEngine
    return ChatEngine.stream_tokens


_TOKEN = None


def count_tokens(text: str) -> int:
    """A tokenizer-free count for usage an engine does not report: words and punctuation marks,
    about what BPE tokenizers give for English prose. Labelled "counted" wherever it is shown."""
    global _TOKEN
    if _TOKEN is None:
        import re
        _TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)
    return len(_TOKEN.findall(text or ""))


def usage_of(data: Any) -> Optional[dict]:
    """An OpenAI ``usage`` object as three ints, or None when it is not one."""
    if not isinstance(data, dict):
        return None
    try:
        prompt = int(data.get("prompt_tokens") or 0)
        completion = int(data.get("completion_tokens") or 0)
        total = int(data.get("total_tokens") or (prompt + completion))
    except (TypeError, ValueError):
        return None
    if min(prompt, completion, total) < 0:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
