"""Reading the live daemon's SSE streams over real HTTP (httpx), for the end-to-end stream tests."""
from __future__ import annotations

import json
import time

import httpx


def iter_frames(resp: httpx.Response):
    """SSE frames of a streaming httpx response: dicts with id, event, data (parsed) or comment."""
    frame: dict = {}
    data: list[str] = []
    for line in resp.iter_lines():
        if line == "":
            if data:
                frame["data"] = json.loads("\n".join(data))
                yield frame
            elif "comment" in frame:
                yield frame
            frame, data = {}, []
        elif line.startswith(":"):
            frame["comment"] = line[1:].strip()
        elif line.startswith("id: "):
            frame["id"] = int(line[4:])
        elif line.startswith("event: "):
            frame["event"] = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])


def read_events(base: str, key: str, *, until, timeout: float = 30.0, last_event_id=None, on_event=None,
                path: str = "/v1/ugent/events", **params) -> list[dict]:
    """Events (no comments) until `until(events)` holds; raises on timeout. The connection is then closed."""
    headers = {"x-api-key": key}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:  # a conversation that a request in flight is creating is a 404 for a moment
        with httpx.stream("GET", base + path, params=params, headers=headers,
                          timeout=httpx.Timeout(timeout, connect=5)) as resp:
            if resp.status_code == 404 and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            assert resp.status_code == 200, resp.read()
            return _collect(resp, events, until, deadline, on_event)


def _collect(resp, events, until, deadline, on_event):
    for frame in iter_frames(resp):
        if "event" in frame:
            events.append(frame)
            if on_event:
                on_event(frame)
        if until(events):
            return events
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"stream ended or timed out after {len(events)} events")


def has(event_type: str, count: int = 1):
    return lambda evs: sum(1 for e in evs if e["event"] == event_type) >= count


def post_chat(base: str, key: str, text: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, headers={"x-api-key": key}, timeout=60)
