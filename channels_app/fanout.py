"""One reader per stream in each process, handing each batch of events to every local subscriber.

An SSE subscriber (`/v1/ugent/events`, `/v1/ugent/activity`) joins its process's reader for its
stream: one per conversation, and one for the whole log (the all-conversations stream), per event
loop. The reader wakes on channels_app.notify as readers always have, reads the new rows once from
the database and renders each row's frame once; then, for every subscriber, it applies that
subscriber's visibility filter in memory (streams.row_visible: the same check the per-subscriber
query made) and appends the frames it may see to the subscriber's queue. So a wake-up costs one read
per process, not one per subscriber.

A subscriber reads the database itself only where the reader cannot serve it: its history (from its
cursor up to where the reader stands, and any gap that cursor earns, exactly as before), and after a
batch whose start lies beyond its own cursor (it joined between two reads, or the reader saw the log
pruned under it). Each batch says where it starts (`prev`, the reader's cursor before it), so a
subscriber knows when to read instead: a batch can only save a read, never skip an event.

Queues are bounded (`UGENT_SSE_SUBSCRIBER_QUEUE` events). A subscriber whose queue would overflow
(its client does not take what is sent) is cut loose: its queue is dropped, the reader no longer
waits for it or holds anything for it, and its stream ends with one `ugent.gap` whose id is its own
cursor (streams.gap_frame_cut_loose): reconnecting with that Last-Event-ID reads the rest from the
log. A reader stops when its last subscriber leaves.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings

from channels_app import events, notify, streams
from channels_app.sse import PING

log = logging.getLogger("ugent.fanout")

#: A batch that starts here makes every subscriber read the log itself (the reader saw it pruned).
READ_YOURSELF = sys.maxsize


@dataclass(frozen=True)
class Batch:
    """Rows one read took, for one subscriber: where the reader stood before them, where after, and
    the frames of those rows this subscriber may see, as (id, frame)."""

    prev: int
    last: int
    frames: tuple


class Tap:
    """One local subscriber of a reader: its subscription, its bounded queue, its wake-up."""

    def __init__(self, sub: streams.Subscription, reader: "Reader", limit: int):
        self.sub = sub
        self.reader = reader
        self.limit = limit
        self.batches: deque[Batch] = deque()
        self.held = 0  # frames queued
        self.cut = False  # cut loose: it fell more than its queue behind
        self.event = asyncio.Event()
        # what row_visible depends on: the viewer (operator or which actor) and the activity feed
        viewer = sub.viewer
        self.filter_key = (viewer.is_operator, viewer.actor.pk, viewer.actor.key, sub.activity)

    def offer(self, prev: int, last: int, frames: tuple) -> bool:
        """Queue one batch; False when it overflowed, and the tap is then cut loose."""
        if self.held + len(frames) > self.limit:
            self.cut, self.batches, self.held = True, deque(), 0
            self.event.set()
            return False
        self.batches.append(Batch(prev, last, frames))
        self.held += len(frames)
        self.event.set()
        return True

    def pop(self) -> Batch | None:
        if not self.batches:
            return None
        batch = self.batches.popleft()
        self.held -= len(batch.frames)
        return batch

    async def wait(self, timeout: float) -> None:
        await notify.event_wait(self.event, timeout)


class Reader:
    """One stream's reader on one event loop: a conversation's (conversation_pk) or the log's (None)."""

    def __init__(self, key: tuple, conversation_pk: int | None, loop: asyncio.AbstractEventLoop):
        self.key = key
        self.conversation_pk = conversation_pk
        self.taps: set[Tap] = set()
        self.cursor: int | None = None
        self.batches = 0  # reads that found new rows, each handed out once to every subscriber
        self.ready = asyncio.Event()  # set once it knows where the log stands: batches follow from there
        topic = events.LOG_TOPIC if conversation_pk is None else events.conversation_topic(conversation_pk)
        self.waiter = notify.register(topic, loop)
        self.task = loop.create_task(self.run(), name=f"ugent-fanout-{topic}")

    def _read(self, cursor: int | None):
        streams.db_ready()
        if cursor is None:
            return streams.log_head(), [], 0
        rows = streams.log_rows_after(cursor, conversation_pk=self.conversation_pk)
        return cursor, rows, streams.log_pruned_through()

    async def run(self) -> None:
        read = sync_to_async(self._read, thread_sensitive=False)
        while True:
            try:
                cursor, rows, pruned = await read(self.cursor)
            except Exception as exc:  # the database is away: the subscribers wait, nothing is skipped
                log.warning("fan-out read failed (stream=%s, error=%s)", self.key[1], exc)
                await asyncio.sleep(notify.POLL_INTERVAL)
                continue
            if self.cursor is None:
                self.cursor = cursor
                self.ready.set()
                continue
            if rows:
                self.batches += 1
                # read after the rows: a prune that deleted any of them committed before it is seen
                prev = READ_YOURSELF if pruned > self.cursor else self.cursor
                self.cursor = rows[-1]["id"]
                self.hand_out(prev, rows)
                if len(rows) >= streams.READ_BATCH:
                    continue
            await self.waiter.wait(notify.POLL_INTERVAL)
            self.waiter.take()  # the rows a wake-up carries: the read above takes them with the rest

    def hand_out(self, prev: int, rows: list[dict]) -> None:
        """Each row rendered once; each subscriber gets the frames its filter lets through."""
        rendered = [(row, row["id"], streams.row_frame(row)) for row in rows]
        last = rows[-1]["id"]
        by_filter: dict[tuple, tuple] = {}  # subscribers with the same viewer and feed see the same frames
        for tap in list(self.taps):
            frames = by_filter.get(tap.filter_key)
            if frames is None:
                frames = by_filter[tap.filter_key] = tuple(
                    (i, f) for row, i, f in rendered if streams.row_visible(tap.sub, row))
            if not tap.offer(prev, last, frames):
                self.taps.discard(tap)  # cut loose: nothing more is held for it
        if not self.taps:
            _hub.reader_drop(self)

    def stop(self) -> None:
        self.task.cancel()
        self.waiter.close()


class Hub:
    """This process's readers, by (event loop, stream)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._readers: dict[tuple, Reader] = {}

    def join(self, sub: streams.Subscription) -> Tap:
        """Join this loop's reader of the subscription's stream (starting it if it is the first)."""
        loop = asyncio.get_running_loop()
        pk = sub.conversation.pk if sub.conversation is not None else None
        key = (loop, "log" if pk is None else f"conv:{pk}")
        with self._lock:
            reader = self._readers.get(key)
            if reader is None:
                reader = self._readers[key] = Reader(key, pk, loop)
        tap = Tap(sub, reader, int(settings.UGENT_SSE_SUBSCRIBER_QUEUE))
        reader.taps.add(tap)
        return tap

    def leave(self, tap: Tap) -> None:
        reader = tap.reader
        reader.taps.discard(tap)
        if not reader.taps:
            self.reader_drop(reader)

    def reader_drop(self, reader: Reader) -> None:
        with self._lock:
            if self._readers.get(reader.key) is reader:
                del self._readers[reader.key]
        reader.stop()

    def readers(self) -> list[Reader]:
        with self._lock:
            return list(self._readers.values())

    def reader_count(self) -> int:
        with self._lock:
            return len(self._readers)


_hub = Hub()


def hub() -> Hub:
    return _hub


def _read(sub: streams.Subscription):
    streams.db_ready()
    return streams.subscription_read(sub)


async def sse_body(sub: streams.Subscription):
    """Frames after the cursor, in order, each once: history from the log, then the reader's batches."""
    tap = _hub.join(sub)  # first: every batch the reader hands out from now on is queued
    read = sync_to_async(_read, thread_sensitive=False)
    keepalive = float(settings.UGENT_SSE_KEEPALIVE)
    idle_since = time.monotonic()
    behind = True  # the log holds what this subscriber has not seen: read it
    try:
        yield f"retry: {streams.SSE_RETRY_MS}\n\n".encode()
        while True:
            if behind:
                frames, more = await read(sub)
                if frames:
                    idle_since = time.monotonic()
                    yield b"".join(frames)
                if more:
                    continue
                behind = False
            if tap.cut:
                yield streams.gap_frame_cut_loose(sub)
                return
            # every batch queued since the last send goes out as one chunk: one write per subscriber
            # per wake-up, whatever the number of events, so a loaded process catches up, not falls behind
            out = []
            while (batch := tap.pop()) is not None:
                if batch.last <= sub.cursor:
                    continue  # its own read already took these
                if batch.prev > sub.cursor:
                    behind = True  # it starts beyond this subscriber's cursor: the log has the rows between
                    break
                out.extend(frame for i, frame in batch.frames if i > sub.cursor)
                sub.cursor = batch.last
            if out:
                idle_since = time.monotonic()
                yield b"".join(out)
            if behind:
                continue
            if not out:
                if time.monotonic() - idle_since >= keepalive:
                    idle_since = time.monotonic()
                    yield PING
                await tap.wait(max(0.0, keepalive - (time.monotonic() - idle_since)))
    finally:
        _hub.leave(tap)
