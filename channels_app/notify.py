"""Wake-ups for stream readers when events commit.

The database is the record; a notification only says "read again". Embedded
mode wakes waiters in this process; servers mode also publishes on Redis so a
reader in another daphne process wakes. A lost notification costs at most one
poll interval, never an event.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict

from django.conf import settings

log = logging.getLogger("ugent.notify")
CHANNEL_PREFIX = "ugent:n:"
POLL_INTERVAL = 0.5

_lock = threading.Lock()
_waiters: dict[str, set] = defaultdict(set)
_redis = None
_listener_thread: threading.Thread | None = None


class Waiter:
    """An asyncio.Event bound to the loop that waits on it, settable from any thread."""

    def __init__(self, topic: str):
        self.topic = topic
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def wake(self) -> None:
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float = POLL_INTERVAL) -> None:
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self.event.clear()

    def close(self) -> None:
        with _lock:
            _waiters[self.topic].discard(self)
            if not _waiters[self.topic]:
                _waiters.pop(self.topic, None)


async def subscribe(topic: str) -> Waiter:
    waiter = Waiter(topic)
    with _lock:
        _waiters[topic].add(waiter)
    if settings.REDIS_URL:
        _ensure_redis_listener()
    return waiter


def _wake_local(topic: str) -> None:
    with _lock:
        waiters = list(_waiters.get(topic, ()))
    for w in waiters:
        try:
            w.wake()
        except RuntimeError:  # its loop has closed
            w.close()


def publish(*topics: str) -> None:
    """Wake every reader of these topics, here and (servers mode) in other processes."""
    for topic in topics:
        _wake_local(topic)
    if settings.REDIS_URL:
        global _redis
        try:
            if _redis is None:
                import redis
                _redis = redis.Redis.from_url(settings.REDIS_URL)
            pipe = _redis.pipeline(transaction=False)
            for topic in topics:
                pipe.publish(CHANNEL_PREFIX + topic, b"1")
            pipe.execute()
        except Exception as exc:  # readers still poll; a Redis hiccup delays, never loses
            log.warning("notify publish failed (error=%s)", exc)


def _ensure_redis_listener() -> None:
    """One listener thread per process: loop-agnostic, so short-lived event loops never own it."""
    global _listener_thread
    with _lock:
        if _listener_thread is not None and _listener_thread.is_alive():
            return
        _listener_thread = threading.Thread(target=_redis_listen_forever, name="ugent-notify", daemon=True)
        _listener_thread.start()


def _redis_listen_forever() -> None:
    import time

    import redis
    while True:
        try:
            client = redis.Redis.from_url(settings.REDIS_URL)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.psubscribe(CHANNEL_PREFIX + "*")
            for msg in pubsub.listen():
                if msg.get("type") != "pmessage":
                    continue
                channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
                _wake_local(channel[len(CHANNEL_PREFIX):])
        except Exception as exc:
            log.warning("notify listener reconnecting (error=%s)", exc)
            time.sleep(0.5)
