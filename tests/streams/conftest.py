"""Helpers for the stream tests: read an SSE response in-process for a while, run turns in threads."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from tests.support.http import parse_sse


@pytest.fixture(autouse=True)
def _fast_keepalive(settings):
    settings.UGENT_SSE_KEEPALIVE = 0.2


def ident(who: dict) -> dict:
    return {k: v for k, v in who.items() if k != "key"}


def open_stream(path: str, key: str | None, *, last_event_id: str | None = None, **params):
    headers = {}
    if key:
        headers["HTTP_X_API_KEY"] = key
    if last_event_id is not None:
        headers["HTTP_LAST_EVENT_ID"] = last_event_id
    return Client().get(path, params, **headers)


def read_frames(resp, *, until=None, timeout: float = 10.0, until_ping: bool = False) -> list[dict]:
    """Frames of an open SSE response until `until(frames)` holds, the stream caught up (`until_ping`), or the
    timeout.

    Caught up is a ping after an event, or a second ping: a stream also pings while its conversation's reader
    is still learning where the log stands, before it sends anything (channels_app.fanout.sse_body), so a
    first ping with nothing before it may come ahead of the history."""
    async def collect():
        frames, buf, pings = [], b"", 0
        it = resp._iterator
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    chunk = await asyncio.wait_for(it.__anext__(), deadline - time.monotonic())
                except (StopAsyncIteration, asyncio.TimeoutError):
                    break
                buf += chunk
                done = False
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    for f in parse_sse(block + b"\n\n"):
                        if f["event"] is None and f["data"] is None and f["comment"] is None:
                            continue  # retry: field
                        frames.append(f)
                        if until_ping and f["comment"] == "ping":
                            pings += 1
                            done = done or pings >= 2 or any(x["event"] is not None for x in frames)
                if done or (until is not None and until(frames)):
                    break
        finally:
            await it.aclose()
        return frames
    return async_to_sync(collect)()


def events_of(frames: list[dict]) -> list[dict]:
    return [f for f in frames if f["event"] is not None]


def stream(path, who: dict, *, last_event_id=None, until=None, timeout=10.0, until_ping=True, **params):
    resp = open_stream(path, who["key"], last_event_id=last_event_id, **ident(who), **params)
    assert resp.status_code == 200, resp.content
    return events_of(read_frames(resp, until=until, timeout=timeout, until_ping=until_ping and until is None))


def post(path: str, who: dict, **body):
    body = {**ident(who), **body}
    return Client().post(path, data=json.dumps(body), content_type="application/json", HTTP_X_API_KEY=who["key"])


def get(path: str, who: dict, **params):
    return Client().get(path, {**ident(who), **params}, HTTP_X_API_KEY=who["key"])


@pytest.fixture
def threaded_turns(monkeypatch):
    """Turns run in a thread of their own (a worker beside the API), so a test can stop or steer them."""
    from django.db import connection

    from channels_app import runner, tasks
    threads: list[threading.Thread] = []

    def delay(pk):
        def run():
            try:
                runner.turn_run(pk)
            finally:
                connection.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)

    monkeypatch.setattr(tasks.run_turn, "delay", delay)
    yield threads
    for t in threads:
        t.join(30)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")
