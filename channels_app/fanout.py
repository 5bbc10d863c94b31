"""One reader per stream in each process, handing each batch of events to every local subscriber.

An SSE subscriber (`/v1/ugent/events`, `/v1/ugent/activity`) joins its process's reader for its
stream: one per conversation, and one for the whole log (the all-conversations stream), per event
loop. The reader wakes on channels_app.notify as readers always have, reads the new rows once from
the database and renders each row's frame once; then, for every subscriber, it applies that
subscriber's visibility filter in memory (streams.row_visible: the same check the per-subscriber
query made) and appends the frames it may see to the subscriber's queue. So a wake-up costs one read
per process, not one per subscriber.

Each batch is encoded once per kind of subscriber (alike in viewer and feed): its frames, and those
frames joined into the one chunk a subscriber standing where the batch starts is sent. A stream that
has caught up and waits is written to by the reader itself, when the ASGI server gave it the
response's `send` (ugent_site.api_handler hands it to the response's `Sink`): one `send` of that
pre-joined chunk per subscriber per batch, stepped in the reader's own task, with no task woken, no
generator resumed and nothing filtered or joined per subscriber. A write the transport holds back
(its client is not reading: flow control) is finished in a task of its own; the subscriber's stream
takes over from there and batches queue for it as before. Without a `send` (a test client, another
handler) each stream sends its queue itself.

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
import dataclasses
import logging
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings

from channels_app import auth, events, notify, streams
from ugent_common import config
from channels_app.sse import PING

log = logging.getLogger("ugent.fanout")

#: A batch that starts here makes every subscriber read the log itself (the reader saw it pruned).
READ_YOURSELF = sys.maxsize


@dataclass(frozen=True)
class Batch:
    """Rows one read took, for one kind of subscriber: where the reader stood before them, where
    after, the frames of those rows such a subscriber may see, as (id, frame), and those frames joined
    (`body`, what a subscriber whose cursor is `prev` is sent; `message`, the ASGI body message of it)."""

    prev: int
    last: int
    frames: tuple
    body: bytes = b""
    message: dict | None = None

    def body_after(self, cursor: int) -> bytes:
        """What a subscriber at `cursor` (prev <= cursor < last) has not had of this batch."""
        if cursor <= self.prev:
            return self.body
        return b"".join(frame for i, frame in self.frames if i > cursor)


def batch_make(prev: int, last: int, frames: tuple) -> Batch:
    body = b"".join(frame for _i, frame in frames)
    return Batch(prev, last, frames, body, {"type": "http.response.body", "body": body, "more_body": True})


class Sink:
    """Where a stream's response is sent: the ASGI `send` its server handed the response, once the
    response has started (ugent_site.api_handler sets it). None: the stream sends what it yields."""

    send = None


class _Rest:
    """The rest of a coroutine that was stepped once and suspended: awaiting this runs it on from
    where it stopped, as `await` would have (a write the reader started and the transport held)."""

    def __init__(self, coro, pending):
        self.coro, self.pending = coro, pending

    def __await__(self):
        value = self.pending
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # cancelled while held: the coroutine gets it, as under await
                try:
                    value = self.coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = self.coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(coro, pending) -> None:
    await _Rest(coro, pending)


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
        # while its stream waits caught up, the response's ASGI send: the reader writes to it directly
        self.send = None
        self.held_write: asyncio.Task | None = None  # a direct write the transport held back, finishing
        self.broken: BaseException | None = None  # a direct write failed: the stream ends with it
        self.sent_at = time.monotonic()  # the last write to its client, for the keep-alive
        self.recheck = False  # a key or caller changed: check the credentials before anything more goes out
        self.rechecks: _Recheck | None = None  # its loop's, when the stream was opened with credentials
        # what row_visible and streams.row_frame_for depend on: the viewer (operator or which actor) and the feed
        viewer = sub.viewer
        self.filter_key = (viewer.is_operator, viewer.actor.pk, viewer.actor.key, sub.activity)

    def offer(self, batch: Batch, now: float) -> bool:
        """Write one batch to the client, or queue it for the stream; False when the queue overflowed,
        and the tap is then cut loose."""
        if self.send is not None and not self.batches and self._write(batch, now):
            return True
        if not batch.frames and self.batches and self.batches[-1].last == batch.prev:
            # nothing for it, right after what it has queued: that batch ends there now (no more to wake for)
            self.batches[-1] = dataclasses.replace(self.batches[-1], last=batch.last)
            return True
        if self.held + len(batch.frames) > self.limit:
            self.cut, self.batches, self.held = True, deque(), 0
            self.event.set()
            return False
        self.batches.append(batch)
        self.held += len(batch.frames)
        self.reader.queued += 1
        self.event.set()
        return True

    def _write(self, batch: Batch, now: float) -> bool:
        """Send the batch straight to the client (the stream waits, caught up); False when the stream
        must take it itself: it starts beyond this subscriber's cursor (the log has the rows between)."""
        sub = self.sub
        if batch.last <= sub.cursor:
            return True  # its own read already took these
        if batch.prev > sub.cursor:
            return False
        if batch.prev == sub.cursor:
            body, message = batch.body, batch.message
        else:
            body = batch.body_after(sub.cursor)
            message = {"type": "http.response.body", "body": body, "more_body": True}
        sub.cursor = batch.last
        if not body:
            return True
        self.sent_at = now
        self.reader.written += 1
        coro = self.send(message)
        try:
            pending = coro.send(None)
        except StopIteration:
            return True  # written: the usual case, no task woken
        except Exception as exc:  # the response is unusable: its stream ends
            self.send, self.broken = None, exc
            self.event.set()
            return True
        # The transport holds it back (its client is not reading): finish it in a task of its own.
        # Until then batches queue, bounded, for the stream, which takes over once it is written.
        self.send = None
        self.held_write = asyncio.get_running_loop().create_task(_finish(coro, pending))
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
        self.pushed = 0  # batches handed out as a wake-up carried them, with no read
        self.written = 0  # batches the reader wrote to a subscriber's client itself
        self.queued = 0  # batches it queued for a subscriber's stream to send
        self.ready = asyncio.Event()  # set once it knows where the log stands: batches follow from there
        topic = events.LOG_TOPIC if conversation_pk is None else events.conversation_topic(conversation_pk)
        self.waiter = notify.register(topic, loop)
        self.task = loop.create_task(self.run(), name=f"ugent-fanout-{topic}")

    def _read(self, cursor: int | None):
        streams.db_ready()
        if cursor is None:
            return streams.log_head(), [], 0, 0
        newest = streams.log_newest_id()  # before the rows: every event up to it has committed
        rows = streams.log_rows_after(cursor, conversation_pk=self.conversation_pk)
        return cursor, rows, streams.log_pruned_through(), newest

    async def run(self) -> None:
        read = sync_to_async(self._read, thread_sensitive=False)
        taken = False
        while True:
            if taken:  # the wake-up's rows were handed out: nothing to read
                await self.waiter.wait(notify.POLL_INTERVAL)
                taken = self.take_pushed(self.waiter.take())
                continue
            try:
                cursor, rows, pruned, newest = await read(self.cursor)
            except Exception as exc:  # the database is away: the subscribers wait, nothing is skipped
                log.warning("fan-out read failed (stream=%s, error=%s)", self.key[1], exc)
                await asyncio.sleep(notify.POLL_INTERVAL)
                continue
            if self.cursor is None:
                self.cursor = cursor
                self.ready.set()
                continue
            full = len(rows) >= streams.READ_BATCH
            # A read that took every row up to `newest` moves the reader there, rows or none: a conversation's
            # reader moves with the log, so a stream idle while other conversations go on stays above the
            # pruned-through mark, and its subscribers (an empty batch moves them too) are never sent back
            # to the database by a batch that starts beyond them (docs/streams.md).
            last = rows[-1]["id"] if rows else self.cursor
            if not full:
                last = max(last, newest)
            if last > self.cursor:
                if rows:
                    self.batches += 1
                # read after the rows: a prune that deleted any of them committed before it is seen
                prev = READ_YOURSELF if pruned > self.cursor else self.cursor
                self.cursor = last
                self.hand_out(prev, rows, last)
                if full:
                    continue
            await self.waiter.wait(notify.POLL_INTERVAL)
            taken = self.take_pushed(self.waiter.take())

    def take_pushed(self, batches: list | None) -> bool:
        """Hand out the rows the wake-ups carried (notify.ConversationBatch) when they follow the
        reader's cursor without a gap; False when the log must be read instead: a plain wake-up, a
        poll's time-out, a batch that does not start where the reader stands (a lost or late one)."""
        pushed = [b for b in batches or () if isinstance(b, notify.ConversationBatch) and b.rows]
        if not pushed or len(pushed) != len(batches):
            return False
        ordered = sorted(pushed, key=lambda b: b.rows[0]["id"])  # two turns' commits may wake out of order
        rows = notify.rows_following(ordered, self.cursor, lambda row: row["id"],
                                     prev_at_most=self.conversation_pk is not None)
        if rows is None:
            return False
        if rows:
            prev, self.cursor = self.cursor, rows[-1]["id"]
            self.pushed += 1
            self.hand_out(prev, rows)
        return True

    def hand_out(self, prev: int, rows: list[dict], last: int | None = None) -> None:
        """Each row rendered once; each kind of subscriber's frames filtered and joined once; each
        subscriber written to (or queued for) with its kind's batch. `last`: where the batch ends, when
        the read took the log up to beyond its last row (rows may then be none)."""
        rendered = [(row, row["id"], streams.row_frame(row)) for row in rows]
        last = rows[-1]["id"] if last is None else last
        now = time.monotonic()
        by_filter: dict[tuple, Batch] = {}  # subscribers with the same viewer and feed see the same frames
        for tap in list(self.taps):
            batch = by_filter.get(tap.filter_key)
            if batch is None:
                batch = by_filter[tap.filter_key] = batch_make(prev, last, tuple(
                    (i, streams.row_frame_for(tap.sub.viewer, row, f)) for row, i, f in rendered
                    if streams.row_visible(tap.sub, row)))
            if not tap.offer(batch, now):
                self.taps.discard(tap)  # cut loose: nothing more is held for it
        if not self.taps:
            _hub.reader_drop(self)

    def stop(self) -> None:
        self.task.cancel()
        self.waiter.close()


class _Recheck(notify.Waiter):
    """One an event loop and caller: when the caller's credentials change (auth.credentials_topic, from any
    process), every stream of the loop opened by it checks them before anything more goes out to it: its
    reader stops writing to it directly and queues, and its stream wakes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, caller_pk: int):
        super().__init__(auth.credentials_topic(caller_pk), loop)
        self.key = (loop, caller_pk)
        self.taps: set[Tap] = set()

    def _wake(self, batch=None) -> None:
        for tap in self.taps:
            tap.recheck = True
            tap.send = None
            tap.event.set()


class Hub:
    """This process's readers, by (event loop, stream)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._readers: dict[tuple, Reader] = {}
        self._rechecks: dict[tuple, _Recheck] = {}  # (loop, caller pk) ->

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
        if sub.auth_check is not None:
            at = (loop, sub.viewer.caller.pk)
            with self._lock:
                rechecks = self._rechecks.get(at)
                if rechecks is None:
                    rechecks = self._rechecks[at] = notify.register_waiter(_Recheck(*at))
            rechecks.taps.add(tap)
            tap.rechecks = rechecks
        return tap

    def leave(self, tap: Tap) -> None:
        reader = tap.reader
        reader.taps.discard(tap)
        if not reader.taps:
            self.reader_drop(reader)
        rechecks, tap.rechecks = tap.rechecks, None
        if rechecks is not None:
            rechecks.taps.discard(tap)
            if not rechecks.taps:
                with self._lock:
                    if self._rechecks.get(rechecks.key) is rechecks:
                        del self._rechecks[rechecks.key]
                rechecks.close()

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


def _auth_refused(sub: streams.Subscription):
    streams.db_ready()
    return sub.auth_check()


async def sse_body(sub: streams.Subscription, sink: Sink | None = None):
    """Frames after the cursor, in order, each once: history from the log, then the reader's batches,
    which the reader writes to `sink.send` itself while this stream waits caught up."""
    tap = _hub.join(sub)  # first: every batch the reader hands out from now on is queued
    # A change committed between the request's own check and this join woke nobody for this stream (its
    # caller's waiter comes with the join): asked once now, before anything goes out.
    tap.recheck = sub.auth_check is not None
    read = sync_to_async(_read, thread_sensitive=False)
    keepalive = float(settings.UGENT_SSE_KEEPALIVE)
    backstop = float(settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS)
    behind = True  # the log holds what this subscriber has not seen: read it
    # set by each check, the first of them at once (tap.recheck above)
    checked_at, checked_wall, config_seen = time.monotonic(), float("-inf"), None
    spread = random.uniform(0.75, 1.0)

    def check_in() -> float:
        """Seconds until the credentials must be asked again unprompted: the backstop interval since the
        last check (spread over its last quarter, so that streams opened together do not all ask at
        once), or the identity token's expiry once it passes (each expiry asked about once)."""
        due = backstop * spread - (time.monotonic() - checked_at)
        expires = sub.auth_expires_at
        if expires is not None and checked_wall < expires:
            due = min(due, expires - time.time())
        return due

    def check_due() -> bool:
        # a credentials change here or elsewhere (_Recheck), ugent.toml read anew (a configured key or an
        # issuer may have gone), the token expired, or the backstop for a change nothing announced
        return tap.recheck or config.generation() != config_seen or check_in() <= 0

    async def refused_now():
        """The credentials check, run again while a change woke the stream during it; its refusal or None."""
        nonlocal checked_at, checked_wall, config_seen, spread
        while True:
            checked_at, checked_wall, tap.recheck = time.monotonic(), time.time(), False
            spread = random.uniform(0.75, 1.0)
            config_seen = config.generation()
            refused = await sync_to_async(_auth_refused, thread_sensitive=False)(sub)
            if refused is not None or not tap.recheck:
                if refused is not None:
                    log.info("stream ended: its credentials no longer hold (code=%s)", refused.code)
                return refused
    try:
        yield f"retry: {streams.SSE_RETRY_MS}\n\n".encode()
        if not tap.reader.ready.is_set():
            # A new reader first learns where the log stands, and hands out only what comes after. Read
            # before it knows, and an event committed between the two reads is in neither. (While the
            # database is away it keeps trying: the stream pings meanwhile.)
            ready = asyncio.ensure_future(tap.reader.ready.wait())
            try:
                while not (await asyncio.wait({ready}, timeout=keepalive))[0]:
                    tap.sent_at = time.monotonic()
                    yield PING
            finally:
                ready.cancel()
        while True:
            if tap.held_write is not None:  # the reader's last write must reach the client before ours
                held, tap.held_write = tap.held_write, None
                await held
            if tap.broken is not None:
                return
            if sub.auth_check is not None and check_due():
                # what opened the stream must still hold: a revoked key, an expired token ends it (the
                # stream wakes at once when its caller's credentials change (_Recheck), when its token
                # expires, and at least once per keep-alive interval, whoever writes its batches)
                refused = await refused_now()
                if refused is not None:
                    yield streams.refused_frame(refused)
                    return
            if behind:
                frames, more = await read(sub)
                if frames and tap.recheck:  # a change woke it during the read: nothing goes out unchecked
                    refused = await refused_now()
                    if refused is not None:
                        yield streams.refused_frame(refused)
                        return
                if frames:
                    tap.sent_at = time.monotonic()
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
                out.append(batch.body_after(sub.cursor))
                sub.cursor = batch.last
            body = b"".join(out)
            if body and tap.recheck:  # woken by a change while it sent or read: checked first
                refused = await refused_now()
                if refused is not None:
                    yield streams.refused_frame(refused)
                    return
            if body:
                tap.sent_at = time.monotonic()
                yield body
            if behind or out:
                continue
            if time.monotonic() - tap.sent_at >= keepalive:
                tap.sent_at = time.monotonic()
                yield PING
                continue
            # caught up, nothing queued: until woken, the reader writes this stream's batches itself
            tap.send = sink.send if sink is not None else None
            try:
                now = time.monotonic()
                # woken by the next keep-alive or the next credentials check due, whichever comes first
                due = keepalive - (now - tap.sent_at)
                if sub.auth_check is not None:
                    due = min(due, check_in())
                await tap.wait(max(0.0, due))
            finally:
                tap.send = None
    finally:
        _hub.leave(tap)
        if tap.held_write is not None:
            tap.held_write.cancel()
