"""Rendering turn events as the OpenAI-compatible chat stream ("What the chat stream sends").

Named events carry chunk-shaped data (one empty delta plus their own payload
field), because the official openai client JSON-parses every event's data
whatever its name; keep-alives are comment lines.
"""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled"}


ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def usage_or_zero(usage: dict | None) -> dict:
    """A turn's usage as OpenAI writes it; a turn no model ran (a rule's answer) used no tokens."""
    if not usage:
        return dict(ZERO_USAGE)
    return {k: int(usage.get(k) or 0) for k in ZERO_USAGE}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ChunkRenderer:
    """Turns Event rows of one turn into SSE bytes."""

    def __init__(self, *, turn_id: str, model: str, created: int, include_tool_events: bool = False,
                 include_usage: bool = False):
        self.id = f"chatcmpl-{turn_id}"
        # stream_options.include_usage: every chunk says "usage": null, and one last chunk (no
        # choices) carries the turn's usage before [DONE], as OpenAI's stream does
        self.include_usage = include_usage
        self.turn_id = turn_id
        self.model = model
        self.created = created
        self.include_tool_events = include_tool_events
        self.role_sent = False
        self.finished = False

    def chunk(self, delta: dict, finish_reason=None, **extra) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def usage_chunk(self, usage: dict | None) -> bytes:
        if not self.include_usage:
            return b""
        return self.data({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": [], "usage": usage_or_zero(usage)})

    def data(self, obj) -> bytes:
        return f"data: {_dumps(obj)}\n\n".encode()

    def named(self, name: str, field: str, payload, cursor: int | None = None) -> bytes:
        head = f"id: {cursor}\n" if cursor is not None else ""
        return f"{head}event: {name}\ndata: {_dumps(self.chunk({}, **{field: payload}))}\n\n".encode()

    def _delta(self, delta: dict) -> dict:
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        return delta

    def finish(self, reason: str = "stop", **extra) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        return self.data(self.chunk({}, finish_reason=reason, **extra))

    def error(self, message: str, *, code: str | None, type_: str = "api_error", param=None,
              extra: dict | None = None) -> bytes:
        err = {"message": message, "type": type_, "param": param, "code": code}
        err.update(extra or {})
        return self.data({"error": err, "ugent_segment": "error"})

    def render(self, event_type: str, data: dict) -> bytes:
        """The bytes for one event; b"" for an event the chat stream does not show."""
        if event_type == "ugent.user_message":
            return self.named("ugent.user_message", "ugent_user_message", data)
        if event_type == "turn.delta":
            segment = data.get("segment")
            if segment == "answer":
                return self.data(self.chunk(self._delta({"content": data.get("text", ""),
                                                         "ugent_segment": "answer"})))
            if segment == "thinking":
                return self.data(self.chunk(self._delta({"content": None,
                                                         "reasoning_content": data.get("text", ""),
                                                         "ugent_segment": "thinking"})))
            if segment == "answer_reset":
                return self.data(self.chunk(self._delta({"content": "", "ugent_segment": "answer_reset"})))
            if segment == "tool" and self.include_tool_events:
                return self.data(self.chunk(self._delta({"content": None, "ugent_segment": "tool",
                                                         "ugent_tool": data.get("tool", {})})))
            return b""
        if event_type in ("ugent.artifacts", "ugent.artifacts_pending"):
            return self.named(event_type, event_type.replace(".", "_"), data.get("artifacts", []))
        if event_type == "ugent.citations":
            return self.finish() + self.named("ugent.citations", "ugent_citations", data.get("citations", []))
        if event_type == "turn.completed":
            return self.finish() + self.usage_chunk(data.get("usage")) + DONE
        if event_type == "turn.cancelled":
            return self.finish(ugent_stopped=True) + self.usage_chunk(data.get("usage")) + DONE
        if event_type == "turn.failed":
            return self.error(data.get("reason", "The turn failed."), code=data.get("code")) + DONE
        return b""
