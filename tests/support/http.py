"""Helpers for reading the chat API's responses in tests."""
from __future__ import annotations

import json

from asgiref.sync import async_to_sync
from django.test import Client


def body_bytes(resp) -> bytes:
    if not getattr(resp, "streaming", False):
        return resp.content

    async def collect():
        out = []
        async for part in resp.streaming_content:
            out.append(part)
        return b"".join(out)
    if hasattr(resp, "_iterator") and hasattr(resp._iterator, "__aiter__"):
        return async_to_sync(collect)()
    return b"".join(resp.streaming_content)


def parse_sse(raw: bytes) -> list[dict]:
    """SSE frames as dicts: {"event", "id", "data" (parsed JSON or the raw string), "comment"}."""
    frames = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        frame = {"event": None, "id": None, "data": None, "comment": None}
        data_lines = []
        for line in block.split("\n"):
            if line.startswith(":"):
                frame["comment"] = line[1:].strip()
            elif line.startswith("event: "):
                frame["event"] = line[7:]
            elif line.startswith("id: "):
                frame["id"] = line[4:]
            elif line.startswith("data: "):
                data_lines.append(line[6:])
        if data_lines:
            text = "\n".join(data_lines)
            frame["data"] = text if text == "[DONE]" else json.loads(text)
        frames.append(frame)
    return frames


def answer_text(frames: list[dict]) -> str:
    out = []
    for f in frames:
        d = f["data"]
        if f["event"] is None and isinstance(d, dict) and d.get("choices"):
            delta = d["choices"][0]["delta"]
            if delta.get("ugent_segment") == "answer_reset":
                out.clear()
            elif delta.get("ugent_segment") == "answer":
                out.append(delta.get("content") or "")
    return "".join(out)


def chat(who: dict, text: str = "hello", **extra):
    """POST one user message to /v1/chat/completions as `who` ({"key": ..., and body fields such as user or
    conversation_id}) through Django's test client; `extra` adds body fields."""
    body = {"messages": [{"role": "user", "content": text}]}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(extra)
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])
