"""Wake-ups for stream readers when events commit.

The database is the record; a notification says "read again". Embedded
mode wakes waiters in this process; servers mode also publishes on Redis so a
reader in another daphne process wakes. A lost notification costs at most one
poll interval, never an event.

A turn's event appends also carry what they wrote (`TurnBatch`): the rows and
the id of the turn's event before them. A reader whose cursor is that id takes
the rows as they are, without a trip to the database; any other reader (one
that missed a batch, or saw batches out of commit order) reads the database as
before. So a pushed batch can only save a read, never skip an event. The
conversation's topic gets the same rows as its stream reads them
(`ConversationBatch`: every field a stream's frame and visibility check need,
after the conversation's event before them), for the fan-out's readers
(channels_app.fanout) wherever one may listen: always in servers mode, in this
process when it has a waiter on that topic.

Why this and not the Django Channels layer (there is no CHANNEL_LAYERS). Measured by
`bench/events_fanout.py`, figures in docs/streams.md: N readers of one topic in one process.
channels_redis' RedisChannelLayer copies each group_send into every member's Redis list, so at 100
readers it ran 5 s behind and at 1,000 half a minute, at 5-15x this module's publisher CPU, and it
dropped events past its capacity. RedisPubSubChannelLayer sends one message per process, as this
module does: close at 10-100 readers (p99 1.5-4x), 9x at 1,000, with 1.2-1.5x the publisher CPU.
The in-memory layer belongs to one event loop, so turn threads must hop onto it for each send; it
fell furthest behind. And a layer tells a reader less than it needs: a reader here learns when it
must read the database (a plain wake-up), where a layer drops a message past its capacity without
a word. The database is the record, so the layer's queues buy nothing.

A WebSocket consumer (the live-call issue) runs without a layer (Channels then gives it no
channel_name) and waits here as the SSE views do: in `connect()`, `waiter = await
subscribe(topic)`; a task loops `await waiter.wait()`, `waiter.take()` (rows, or None: read the log
from its cursor) and sends; `disconnect()` cancels the task and calls `waiter.close()`. A Waiter is
bound to the loop that made it, and `publish` wakes it from any thread, or any process over Redis.
What a client sends back (stop, steer, answers) goes through the hub's services, as over HTTP.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

log = logging.getLogger("ugent.notify")
CHANNEL_PREFIX = "ugent:n:"


def channel_prefix() -> str:
    """This deployment's notification channels. Redis pub/sub ignores the database number, and
    two deployments may share a Redis (each with its own UGENT_CELERY_QUEUE): a wake-up carries
    event rows, so a reader must never hear another deployment's."""
    return f"{CHANNEL_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}:"
POLL_INTERVAL = 0.5

#: A waiter that is not taking its batches keeps at most this many; then its reader reads.
MAX_HELD_BATCHES = 64
#: Batches larger than this (JSON bytes) are not sent over Redis: the reader reads them instead.
REDIS_BATCH_LIMIT = 64 * 1024


@dataclass(frozen=True)
class TurnBatch:
    """Events one transaction appended to a turn, in id order, and the turn's event id before them."""

    prev: int
    rows: tuple  # ((id, type, data), ...)


@dataclass(frozen=True)
class ConversationBatch:
    """Events one transaction appended to a conversation, as a stream reads them (dicts of
    ROW_FIELDS below), in id order, and the conversation's event id before them."""

    prev: int
    rows: tuple


#: What a stream reads of an event (channels_app.streams renders and filters these), so what a
#: ConversationBatch's rows carry; over Redis in this order, created_at as ISO text.
ROW_FIELDS = ("id", "type", "audience", "data", "created_at", "conversation__external_id", "conversation__client_id",
              "conversation__channel", "conversation__owner_id", "turn__turn_id")


def rows_following(batches, cursor: int, id_of, *, prev_at_most: bool = False) -> list | None:
    """The rows `batches` carry (in the order given) that follow `cursor` without a gap, the one walk
    both kinds of reader take (channels_app.api's turn stream, channels_app.fanout's readers).

    A batch that ends at or before the cursor is skipped: the reader had it already (read from the
    database, or the same batch over Redis and from this process). Any other batch must start where the
    reader stands (`prev`), or None: the reader must read the database. `id_of(row)` is a row's event id
    (a TurnBatch's rows are tuples, a ConversationBatch's dicts).

    `prev_at_most`: a batch that starts at or before the cursor follows too, and its rows after the
    cursor are taken: for a reader of one conversation, whose cursor also moves with the log's head
    (channels_app.fanout) while `prev` is the conversation's own previous event: the conversation had
    nothing between `prev` and the batch's first row, so nothing between the cursor and it either."""
    taken = []
    for batch in batches:
        last = id_of(batch.rows[-1])
        if last <= cursor:
            continue  # had already
        if batch.prev > cursor if prev_at_most else batch.prev != cursor:
            return None
        taken.extend(row for row in batch.rows if id_of(row) > cursor)
        cursor = last
    return taken


_lock = threading.Lock()
_waiters: dict[str, set] = defaultdict(set)
_redis = None
_listener_thread: threading.Thread | None = None


async def event_wait(event: asyncio.Event, timeout: float) -> None:
    """Wait until `event` is set or `timeout` passes, then clear it.

    A timer that sets the event, not asyncio.wait_for: wait_for makes a task per wait, which at a
    thousand readers was most of their CPU (docs/streams.md). The timer is on the loop that waits: a
    waiter registered from another loop (the chat API's, inside the submitting transaction) may
    outlive that loop in a test client or a hand-over."""
    if not event.is_set():
        timer = asyncio.get_running_loop().call_later(timeout, event.set)
        try:
            await event.wait()
        finally:
            timer.cancel()
    event.clear()


class Waiter:
    """An asyncio.Event bound to the loop that waits on it, settable from any thread."""

    def __init__(self, topic: str, loop: asyncio.AbstractEventLoop | None = None):
        self.topic = topic
        self.loop = loop or asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.batches: list[TurnBatch] = []
        self.plain = False  # woken without rows since the last take: the reader must read

    def wake(self, batch: TurnBatch | None = None) -> None:
        self.loop.call_soon_threadsafe(self._wake, batch)

    def _wake(self, batch: TurnBatch | None) -> None:
        if batch is None or len(self.batches) >= MAX_HELD_BATCHES:
            self.plain, self.batches = True, []
        else:
            self.batches.append(batch)
        self.event.set()

    def take(self) -> list[TurnBatch] | None:
        """The batches that woke it since the last take, in arrival order; None when the reader must
        read the database (a plain wake-up, or too many batches held)."""
        batches, plain = self.batches, self.plain
        self.batches, self.plain = [], False
        return None if plain else batches

    async def wait(self, timeout: float = POLL_INTERVAL) -> None:
        await event_wait(self.event, timeout)

    def close(self) -> None:
        with _lock:
            _waiters[self.topic].discard(self)
            if not _waiters[self.topic]:
                _waiters.pop(self.topic, None)


class BlockingWaiter:
    """A waiter for a plain thread (a tool blocked on a question): `wait` blocks on a threading.Event.
    It has no loop, so a wake-up sets it directly from whichever thread publishes."""

    loop = None

    def __init__(self, topic: str):
        self.topic = topic
        self.event = threading.Event()

    def _wake(self, batch: TurnBatch | None = None) -> None:
        self.event.set()

    def wait(self, timeout: float = POLL_INTERVAL) -> bool:
        """True when woken (rather than timed out); the reader then reads the database."""
        woken = self.event.wait(timeout)
        self.event.clear()
        return woken

    def close(self) -> None:
        Waiter.close(self)  # type: ignore[arg-type]


def listening(topic: str) -> bool:
    """Whether a waiter of this process waits on `topic` now."""
    with _lock:
        return bool(_waiters.get(topic))


def register_blocking(topic: str) -> BlockingWaiter:
    """A blocking waiter on `topic`, woken by local and (servers mode) Redis publishes alike."""
    waiter = BlockingWaiter(topic)
    with _lock:
        _waiters[topic].add(waiter)
    if settings.REDIS_URL:
        _ensure_redis_listener()
    return waiter


async def subscribe(topic: str) -> Waiter:
    return register(topic, asyncio.get_running_loop())


def register(topic: str, loop: asyncio.AbstractEventLoop) -> Waiter:
    """A waiter for `loop`, subscribed from any thread: a reader can subscribe before the writes it
    waits for can commit (the chat API, inside the transaction that creates the turn)."""
    return register_waiter(Waiter(topic, loop))


def register_waiter(waiter: Waiter) -> Waiter:
    """Subscribe a waiter made elsewhere (a Waiter whose `_wake` does more than set its event)."""
    with _lock:
        _waiters[waiter.topic].add(waiter)
    if settings.REDIS_URL:
        _ensure_redis_listener()
    return waiter


def _wake_local(topic: str, batch: TurnBatch | ConversationBatch | None = None) -> None:
    """One hand-over per event loop, not per waiter: a thousand readers on one loop cost one
    call_soon_threadsafe (one self-pipe write, one GIL hand-over), which is what kept notify behind
    the Redis pub/sub channel layer at 100+ readers (docs/streams.md)."""
    with _lock:
        waiters = list(_waiters.get(topic, ()))
    by_loop: dict[asyncio.AbstractEventLoop, list[Waiter]] = defaultdict(list)
    for w in waiters:
        if w.loop is None:  # a BlockingWaiter: its thread waits on a threading.Event
            w._wake(batch)
            continue
        by_loop[w.loop].append(w)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake_group, group, batch)
        except RuntimeError:  # its loop has closed
            for w in group:
                w.close()


def _wake_group(group: list[Waiter], batch: TurnBatch | None) -> None:
    for w in group:
        w._wake(batch)


def publish(*topics: str, batch: tuple[str, TurnBatch] | None = None, batches: tuple = ()) -> None:
    """Wake every reader of these topics, here and (servers mode) in other processes.

    `batch` is (topic, TurnBatch), `batches` more (topic, TurnBatch or ConversationBatch) pairs:
    readers of that topic get the rows with their wake-up."""
    carried = dict(batches)
    if batch:
        carried[batch[0]] = batch[1]
    for topic in topics:
        _wake_local(topic, carried.get(topic))
    if settings.REDIS_URL:
        global _redis
        try:
            if _redis is None:
                import redis
                _redis = redis.Redis.from_url(settings.REDIS_URL)
            pipe = _redis.pipeline(transaction=False)
            for topic in topics:
                message = b"1"
                if topic in carried:
                    encoded = _batch_encode(carried[topic])
                    if len(encoded) <= REDIS_BATCH_LIMIT:
                        message = encoded
                pipe.publish(channel_prefix() + topic, _own[0] + message)
            pipe.execute()
        except Exception as exc:  # readers still poll; a Redis hiccup delays, never loses
            log.warning("notify publish failed (error=%s)", exc)


def _batch_encode(batch: TurnBatch | ConversationBatch) -> bytes:
    if isinstance(batch, ConversationBatch):
        wire = {"c": batch.prev, "r": [[row[f] if f != "created_at" else row[f].isoformat() for f in ROW_FIELDS]
                                       for row in batch.rows]}
    else:
        wire = [batch.prev, batch.rows]
    return json.dumps(wire, separators=(",", ":"), default=str).encode()


def _batch_decode(data) -> TurnBatch | ConversationBatch | None:
    if not data or data in (b"1", "1"):
        return None
    try:
        wire = json.loads(data)
        if isinstance(wire, dict):
            rows = []
            for values in wire["r"]:
                row = dict(zip(ROW_FIELDS, values, strict=True))
                row["id"], row["created_at"] = int(row["id"]), datetime.fromisoformat(row["created_at"])
                rows.append(row)
            return ConversationBatch(prev=int(wire["c"]), rows=tuple(rows))
        prev, rows = wire
        return TurnBatch(prev=int(prev), rows=tuple((int(i), str(t), d) for i, t, d in rows))
    except (ValueError, TypeError, KeyError):
        return None  # a plain wake-up: the reader reads


# What this process puts in front of each wake-up it publishes over Redis ("@" and 8 hex digits and "|"), so
# that its own listener, which hears every process's, skips the ones publish() already delivered here. A
# wake-up without it (another version's, a test's) is heard as from elsewhere.
_OWN_LEN = 10
_own = [b""]


def _own_tag() -> None:
    _own[0] = b"@" + secrets.token_hex(4).encode() + b"|"


_own_tag()
os.register_at_fork(after_in_child=_own_tag)  # a forked child is another process


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
            prefix = channel_prefix()
            pubsub.psubscribe(prefix.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?") + "*")
            for msg in pubsub.listen():
                if msg.get("type") != "pmessage":
                    continue
                channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
                if not channel.startswith(prefix):
                    continue
                data = msg.get("data")
                if isinstance(data, bytes) and data[:1] == b"@":
                    if data[:_OWN_LEN] == _own[0]:
                        continue  # this process's own: publish() woke its waiters already
                    data = data[_OWN_LEN:]
                topic = channel[len(prefix):]
                if listening(topic):  # else nobody here waits: the rows are not even decoded
                    _wake_local(topic, _batch_decode(data))
        except Exception as exc:
            log.warning("notify listener reconnecting (error=%s)", exc)
            time.sleep(0.5)
