"""One reader per stream per process (channels_app.fanout): many subscribers, each event once, in order,
each subscriber's visibility kept, a slow subscriber cut loose with a ugent.gap, no reader left behind.

Every subscriber here is a real /v1/ugent/events response, iterated on one event loop as one web
process serves them; events are appended through the real event log and wake readers through notify.
The 30 s timeouts only keep a broken build from hanging the suite: nothing is timed."""
from __future__ import annotations

import asyncio
import threading
from collections import deque

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection

from channels_app import fanout, notify, streams
from channels_app.events import conversation_topic, event_append
from channels_app.models import Conversation, Event
from tests.streams.conftest import ident, open_stream, threaded_turns, wait_for  # noqa: F401 (a fixture)
from tests.support.http import chat
from tests.support.http import parse_sse

pytestmark = pytest.mark.django_db(transaction=True)

GUARD = 30.0  # seconds before a missing frame fails the test instead of hanging it


_bodies: list = []


@pytest.fixture(autouse=True)
def _keep_bodies(monkeypatch):
    """Each stream's own generator (fanout.sse_body's), kept to close it as a server does when its
    client goes: the test client's wrapper closes only itself, leaving the body to the garbage collector."""
    real = fanout.sse_body

    def kept(sub, sink=None):
        body = real(sub, sink)
        _bodies.append(body)
        return body
    monkeypatch.setattr(fanout, "sse_body", kept)
    yield
    _bodies.clear()


class Sse:
    """One open SSE response read frame by frame."""

    def __init__(self, resp):
        assert resp.status_code == 200, resp.content
        self.it = resp._iterator
        self.body = _bodies[-1]
        self.buf = b""
        self.frames: deque = deque()
        self.ended = False

    async def frame(self) -> dict:
        while not self.frames:
            try:
                chunk = await asyncio.wait_for(self.it.__anext__(), GUARD)
            except StopAsyncIteration:
                self.ended = True
                raise
            self.buf += chunk
            while b"\n\n" in self.buf:
                block, self.buf = self.buf.split(b"\n\n", 1)
                for f in parse_sse(block + b"\n\n"):
                    if f["event"] is None and f["data"] is None and f["comment"] is None:
                        continue  # the retry: field
                    self.frames.append(f)
        return self.frames.popleft()

    async def event(self) -> dict:
        while True:
            f = await self.frame()
            if f["event"] is not None:
                return f

    async def caught_up(self) -> None:
        """Until its first keep-alive: it has read its history and waits on the reader."""
        while (await self.frame())["comment"] != "ping":
            pass

    async def close(self) -> None:
        await self.body.aclose()
        await self.it.aclose()


def _subscribers(who: dict, n: int, **params) -> list[Sse]:
    return [Sse(open_stream("/v1/ugent/events", who["key"], **ident(who), **params)) for _ in range(n)]


def _conversation(who: dict, conversation_id: str) -> Conversation:
    assert chat(who, "hello", conversation_id=conversation_id).status_code == 200
    return Conversation.objects.select_related("owner").get(external_id=conversation_id)


def _readers(conv_pk: int | None = None) -> list[fanout.Reader]:
    want = "log" if conv_pk is None else conversation_topic(conv_pk)
    return [r for r in fanout.hub().readers() if r.key[1] == want]


async def _append(conv: Conversation, k: int, audience=None) -> int:
    return await sync_to_async(event_append)(conversation_id=conv.pk, type="ugent.test", data={"k": k},
                                             audience=audience)


async def _events(s: Sse, n: int) -> list[int]:
    return [int((await s.event())["id"]) for _ in range(n)]


async def _until(s: Sse, last: int) -> list[int]:
    seen = []
    while not seen or seen[-1] < last:
        seen.append(int((await s.event())["id"]))
    return seen


async def _closed(subs: list[Sse]) -> None:
    for s in subs:
        if not s.ended:
            await s.close()


def test_fifty_subscribers_on_one_conversation_get_every_event_once_in_order_from_one_reader(tcast, monkeypatch):
    conv = _conversation(tcast.alice, "c1")
    subs = _subscribers(tcast.alice, 50, conversation_id="c1", cursor=str(streams.log_head()))
    own_reads = []
    real_read = fanout._read
    monkeypatch.setattr(fanout, "_read", lambda sub: (own_reads.append(sub), real_read(sub))[1])

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in subs))
            (reader,) = _readers(conv.pk)
            await reader.ready.wait()
            assert len(reader.taps) == 50
            batches_before, pushed_before = reader.batches, reader.pushed
            ids = [await _append(conv, k) for k in range(40)]
            got = await asyncio.gather(*(_events(s, len(ids)) for s in subs))
            return ids, got, reader.batches - batches_before, reader.pushed - pushed_before
        finally:
            await _closed(subs)

    ids, got, read, pushed = async_to_sync(run)()
    assert all(g == ids for g in got)
    # each subscriber read the log once, for its history; every live event came from the one reader,
    # which took each commit once, from its wake-up or (when one did not follow on) by reading it, never
    # once per subscriber; commits that came together are one batch
    assert len(own_reads) == 50
    assert pushed >= 1 and 1 <= read + pushed <= len(ids)


def test_many_subscribers_on_the_whole_log_each_see_only_what_their_user_may(tcast):
    a = _conversation(tcast.alice, "ca")
    b = _conversation(tcast.bob, "cb")
    head = str(streams.log_head())
    alices = _subscribers(tcast.alice, 15, cursor=head)
    bobs = _subscribers(tcast.bob, 15, cursor=head)
    ops = _subscribers({"key": tcast.keys["operator"]}, 5, cursor=head)

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in alices + bobs + ops))
            (reader,) = _readers(None)
            await reader.ready.wait()
            assert len(reader.taps) == 35
            plan = [(a, None), (a, [a.owner.key]), (a, ["someone-else"]), (b, None), (b, [b.owner.key]),
                    (a, [b.owner.key]), (b, [a.owner.key]), (a, None), (b, None)]
            appended = [(await _append(conv, k, audience), conv, audience) for k, (conv, audience) in enumerate(plan)]
            # each reads to the last event it may see: the stream is in order, so all it may see came before
            op_seen = await asyncio.gather(*(_until(s, appended[-1][0]) for s in ops))
            alice_seen = await asyncio.gather(*(_until(s, appended[-2][0]) for s in alices))
            bob_seen = await asyncio.gather(*(_until(s, appended[-1][0]) for s in bobs))
            return appended, op_seen, alice_seen, bob_seen
        finally:
            await _closed(alices + bobs + ops)

    appended, op_seen, alice_seen, bob_seen = async_to_sync(run)()
    everyone = [i for i, _c, _a in appended]
    for_alice = [i for i, c, aud in appended if c.pk == a.pk and (not aud or aud == [a.owner.key])]
    for_bob = [i for i, c, aud in appended if c.pk == b.pk and (not aud or aud == [b.owner.key])]
    assert len(for_alice) == 3 and len(for_bob) == 3
    assert all(s == everyone for s in op_seen)
    assert all(s == for_alice for s in alice_seen)
    assert all(s == for_bob for s in bob_seen)


def test_a_slow_subscriber_is_cut_loose_with_a_gap_while_the_others_keep_pace(tcast, settings):
    settings.UGENT_SSE_SUBSCRIBER_QUEUE = 5
    conv = _conversation(tcast.alice, "c1")
    start = streams.log_head()
    fast = _subscribers(tcast.alice, 10, conversation_id="c1", cursor=str(start))
    (slow,) = _subscribers(tcast.alice, 1, conversation_id="c1", cursor=str(start))

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in fast + [slow]))
            (reader,) = _readers(conv.pk)
            await reader.ready.wait()
            assert len(reader.taps) == 11
            ids, taps_after = [], []
            # lockstep: each event reaches every fast subscriber before the next is appended, so a
            # reader held back by the one that reads nothing could not get past its queue's size
            for k in range(20):
                ids.append(await _append(conv, k))
                got = await asyncio.gather(*(s.event() for s in fast))
                assert [int(f["id"]) for f in got] == [ids[-1]] * 10
                taps_after.append(len(reader.taps))
            held = max(t.held for t in reader.taps)
            # now the slow one reads: its gap, at its own cursor, then the end of its stream
            gap = await slow.event()
            with pytest.raises(StopAsyncIteration):
                await slow.frame()
            return ids, taps_after, held, gap
        finally:
            await _closed(fast + [slow])

    ids, taps_after, held, gap = async_to_sync(run)()
    # held five, cut loose by the sixth; the ten others were never cut and hold nothing back
    assert taps_after == [11] * 5 + [10] * 15
    assert held == 0
    assert gap["event"] == "ugent.gap" and gap["id"] == str(start)
    assert gap["data"]["reason"] == "pruned" and gap["data"]["cursor"] == start
    assert gap["data"]["conversation_id"] == "c1" and gap["data"]["snapshot"] is None
    assert set(gap["data"]) == {"id", "type", "reason", "conversation_id", "cursor", "ts", "snapshot"}
    # resuming from the gap's id loses nothing: every event, once, in order
    again = Sse(open_stream("/v1/ugent/events", tcast.alice["key"], last_event_id=gap["id"],
                            **ident(tcast.alice), conversation_id="c1"))

    async def resume():
        try:
            return [int((await again.event())["id"]) for _ in ids]
        finally:
            await again.close()
    assert async_to_sync(resume)() == ids


def test_readers_stop_when_their_last_subscriber_leaves(tcast):
    conv = _conversation(tcast.alice, "c1")
    head = str(streams.log_head())
    on_conv = _subscribers(tcast.alice, 20, conversation_id="c1", cursor=head)
    on_log = _subscribers(tcast.alice, 5, cursor=head)
    assert fanout.hub().reader_count() == 0

    async def run():
        await asyncio.gather(*(s.caught_up() for s in on_conv + on_log))
        readers = _readers(conv.pk) + _readers(None)
        counts = [fanout.hub().reader_count(), [len(r.taps) for r in readers]]
        for s in on_conv[:19] + on_log:
            await s.close()
        counts.append(fanout.hub().reader_count())  # the conversation's reader still serves one
        await on_conv[19].close()
        await asyncio.gather(*(r.task for r in readers), return_exceptions=True)
        return counts, readers

    counts, readers = async_to_sync(run)()
    assert counts == [2, [20, 5], 1]
    assert fanout.hub().reader_count() == 0
    assert all(r.task.done() for r in readers)
    # and their wake-ups are gone from notify: nothing is left to wake
    with notify._lock:
        assert conversation_topic(conv.pk) not in notify._waiters and "log" not in notify._waiters


def test_the_activity_filter_in_memory_is_the_query_s(tcast):
    conv = _conversation(tcast.alice, "c1")
    kinds = [("turn.delta", {"segment": "tool", "tool": {}}), ("turn.steered", {}), ("interaction.asked", {}),
             ("compaction.done", {}), ("tool.call", {}), ("ugent.tool_result", {}), ("activity.x", {}),
             ("turn.delta", {"segment": "answer"}), ("turn.completed", {}), ("ugent.citations", {})]
    ids = [event_append(conversation_id=conv.pk, type=t, data=d) for t, d in kinds]
    by_query = set(Event.objects.filter(streams.activity_q()).values_list("id", flat=True))
    in_memory = {e.id for e in Event.objects.all() if streams.activity_match(e.type, e.data)}
    assert in_memory == by_query
    assert set(ids[:7]) <= in_memory and not set(ids[7:]) & in_memory


def test_an_event_committed_while_the_first_subscriber_joins_comes_without_waiting_for_another(tcast, monkeypatch):
    """The first subscriber of a conversation starts its reader, which first learns where the log stands.
    An event committed after the subscriber's own read of the log but before the reader's first look
    was in neither: it came only with the next event's batch, or never if none followed. The
    subscriber now reads the log once its reader knows where it stands."""
    import threading
    import time
    conv = _conversation(tcast.alice, "c-join")
    head_asked, release = threading.Event(), threading.Event()
    own_reads = []
    real_head_read, real_read = fanout.Reader._read, fanout._read

    def held_first_look(self, cursor):
        if cursor is None:
            head_asked.set()
            assert release.wait(GUARD)
        return real_head_read(self, cursor)
    def own_read(sub):
        found = real_read(sub)
        own_reads.append(found)  # once it has read
        return found
    monkeypatch.setattr(fanout.Reader, "_read", held_first_look)
    monkeypatch.setattr(fanout, "_read", own_read)
    (s,) = _subscribers(tcast.alice, 1, conversation_id="c-join", cursor=str(streams.log_head()))

    def commit_between():
        assert head_asked.wait(GUARD)
        deadline = time.monotonic() + 2  # room for the subscriber's own read to end, if it does not wait
        while not own_reads and time.monotonic() < deadline:
            time.sleep(0.01)
        appended = event_append(conversation_id=conv.pk, type="ugent.test", data={"k": "between"})
        release.set()
        return appended

    async def run():
        try:
            first = asyncio.ensure_future(s.event())
            appended = await sync_to_async(commit_between, thread_sensitive=False)()
            got = await asyncio.wait_for(first, GUARD)  # no other event follows: it must come by itself
            return appended, got
        finally:
            await _closed([s])

    appended, got = async_to_sync(run)()
    assert int(got["id"]) == appended


def test_the_reader_hands_out_the_rows_a_wake_up_carries_without_reading_the_log(tcast, monkeypatch):
    """Each append's wake-up carries its rows as the log holds them, after the conversation's event
    before them: a reader standing there hands them out without reading them."""
    conv = _conversation(tcast.alice, "c-push")
    subs = _subscribers(tcast.alice, 3, conversation_id="c-push", cursor=str(streams.log_head()))
    found = []  # rows each of the reader's reads found
    real = fanout.Reader._read

    def read(self, cursor):
        got = real(self, cursor)
        found.append(len(got[1]))
        return got
    monkeypatch.setattr(fanout.Reader, "_read", read)

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in subs))
            (reader,) = _readers(conv.pk)
            await reader.ready.wait()
            found.clear()
            ids = []
            for k in range(12):
                ids.append(await _append(conv, k))
                await asyncio.sleep(0)
            got = await asyncio.gather(*(_events_whole(s, len(ids)) for s in subs))
            return ids, got, reader.pushed
        finally:
            await _closed(subs)

    ids, got, pushed = async_to_sync(run)()
    assert all([int(e["id"]) for e in g] == ids for g in got)
    # before, every event was read (12 rows found); now only a poll's time-out reads, and what it finds
    # the wake-ups did not bring in time
    assert pushed >= 1 and sum(found) < len(ids) // 2, (pushed, found)
    # what the pushed rows render is what the log's rows render
    logged = {r["id"]: streams.event_payload(r) for r in streams.log_rows_after(0, conversation_pk=conv.pk)}
    assert [e for g in got for e in g if e["data"] != logged[int(e["id"])]] == []


async def _events_whole(s: Sse, n: int) -> list[dict]:
    return [await s.event() for _ in range(n)]


def test_a_wake_up_that_does_not_follow_on_makes_the_reader_read_and_nothing_is_lost(tcast, monkeypatch):
    """A lost wake-up (here: one append's publish dropped) leaves the next batch starting past the reader's
    cursor: the reader reads the log, and every subscriber gets both events, once, in order."""
    from channels_app import notify
    conv = _conversation(tcast.alice, "c-gap")
    subs = _subscribers(tcast.alice, 2, conversation_id="c-gap", cursor=str(streams.log_head()))
    real_publish = notify.publish
    dropped = []

    def publish(*topics, **kw):
        if not dropped and any(t == f"conv:{conv.pk}" for t in topics):
            dropped.append(topics)
            return  # lost, on every topic
        return real_publish(*topics, **kw)

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in subs))
            (reader,) = _readers(conv.pk)
            await reader.ready.wait()
            monkeypatch.setattr(notify, "publish", publish)
            first = await _append(conv, 1)
            second = await _append(conv, 2)
            got = await asyncio.gather(*(_events(s, 2) for s in subs))
            return [first, second], got, reader.batches
        finally:
            await _closed(subs)

    ids, got, read = async_to_sync(run)()
    assert dropped and all(g == ids for g in got)
    assert read >= 1  # the second batch did not start at the reader's cursor: it read


def test_a_stop_by_another_application_s_user_is_handed_out_live_without_their_name(tcast, threaded_turns):  # noqa: F811
    """The reader renders each row once, but turn.stop_requested's `by` is the stopper's and the operator's
    to read (streams.event_data_for): subscribers alike share a frame, carol's shows "someone else"."""
    from channels_app.models import Turn
    from tests.streams.conftest import post
    carol = tcast.carol
    dave = {"key": tcast.keys["outsider"], "federation_issuer": "elsewhere", "federation_subject": "dave"}
    started = chat(carol, "script:sleep=60|answer=x", conversation_id="cc", stream=True)
    turn_id = started["x-ugent-turn-id"]
    head = str(streams.log_head())
    carols = [Sse(open_stream("/v1/ugent/activity", carol["key"], **ident(carol), conversation_id="cc", cursor=head))
              for _ in range(2)]
    ops = [Sse(open_stream("/v1/ugent/activity", tcast.keys["operator"], conversation_id="cc", cursor=head))]

    async def stopped_as_seen(s: Sse) -> dict:
        while True:
            f = await s.event()
            if f["event"] == "turn.stop_requested":
                return f["data"]["data"]

    async def run():
        try:
            await asyncio.gather(*(s.caught_up() for s in carols + ops))
            resp = await sync_to_async(post)("/v1/ugent/stop", dave, conversation_id="cc", turn_id=turn_id)
            assert resp.status_code == 202, resp.content
            return await asyncio.gather(*(stopped_as_seen(s) for s in carols + ops))
        finally:
            await _closed(carols + ops)

    seen = async_to_sync(run)()
    assert seen == [{"turn_id": turn_id, "by": "someone else"}] * 2 + [{"turn_id": turn_id, "by": "fed:elsewhere:dave"}]
    wait_for(lambda: Turn.objects.filter(turn_id=turn_id, finished_at__isnull=False).exists(), timeout=30)


def test_a_caught_up_conversation_stream_idle_while_the_log_moves_on_and_is_pruned_loses_nothing(tcast):
    """A conversation's reader and subscribers move with the log, not only with their conversation's
    rows: so retention's mark, raised past other conversations' events, never falls above an idle stream's
    cursor, and its next live events come without a gap (a false gap once skipped them to the head)."""
    ca = _conversation(tcast.alice, "ca")
    cb = _conversation(tcast.bob, "cb")
    (s,) = _subscribers(tcast.alice, 1, conversation_id="ca")

    async def moved_to(head: int) -> None:
        while not (_readers(ca.pk) and all(r.cursor >= head for r in _readers(ca.pk))):
            await asyncio.sleep(0.02)

    async def run():
        try:
            await s.caught_up()
            for k in range(3):
                await _append(cb, k)
            # the reader's next poll takes it to the log's head (no row of its own among them), and hands its
            # subscriber the empty batch that takes it there too
            await asyncio.wait_for(moved_to(await sync_to_async(streams.log_head)()), GUARD)
            await sync_to_async(streams.events_prune)(older_than_seconds=0)
            ids = [await _append(ca, k) for k in range(3)]
            got = []
            while len(got) < 3:
                got.append(await s.event())
            return ids, got
        finally:
            await _closed([s])
    ids, got = async_to_sync(run)()
    assert [(f["event"], int(f["id"])) for f in got] == [("ugent.test", i) for i in ids]


@pytest.mark.parametrize("path,params,moves", [("/v1/ugent/events", {}, "cb"),
                                               ("/v1/ugent/activity", {"conversation_id": "ca"}, "ca")])
def test_a_filtered_subscriber_that_resumed_reads_nothing_itself_once_caught_up(tcast, monkeypatch, path, params,
                                                                               moves):
    """docs/streams.md: one read per commit per process. A subscriber whose filter hides the log's last rows
    (alice on the whole log while bob's conversation moves; the activity feed while answers stream) stands
    where its read took the log, not at its own last row: the reader's batches follow on, and it reads
    nothing itself (it once did one read of its own per commit, for ever)."""
    ca = _conversation(tcast.alice, "ca")
    cb = _conversation(tcast.bob, "cb")
    target = ca if moves == "ca" else cb
    last_alice = Event.objects.filter(conversation=ca).order_by("-id").values_list("id", flat=True)[0]
    event_append(conversation_id=target.pk, type="turn.delta", data={"segment": "answer", "text": "x"})
    reads = []
    real = fanout._read
    monkeypatch.setattr(fanout, "_read", lambda sub: (reads.append(sub.cursor), real(sub))[1])
    s = Sse(open_stream(path, tcast.alice["key"], last_event_id=str(last_alice), **ident(tcast.alice), **params))

    async def run():
        try:
            await s.caught_up()
            before = len(reads)
            appended = []
            for k in range(20):
                appended.append(await sync_to_async(event_append)(
                    conversation_id=target.pk, type="turn.delta", data={"segment": "answer", "text": str(k)}))
            # then one it may see, in its conversation: everything before it was handed out when it comes
            mark = await sync_to_async(event_append)(conversation_id=ca.pk, type="tool.started", data={"k": 1})
            assert int((await s.event())["id"]) == mark
            return len(reads) - before
        finally:
            await _closed([s])
    assert async_to_sync(run)() == 0


def test_writers_in_several_conversations_each_subscriber_gets_its_visible_events_once_in_order(tcast):
    """Stress of cursors that move with the log's head (streams.log_newest_id): threads append to three
    conversations at once while filtered subscribers (each user's /events, the operator's) and conversation
    streams read. Every subscriber gets exactly the events it may see, each once, in id order: none
    skipped by a cursor moved past an event that committed late."""
    ca = _conversation(tcast.alice, "ca")
    cb = _conversation(tcast.bob, "cb")
    cc = _conversation(tcast.alice, "cc")
    head = str(streams.log_head())
    alice, bob = tcast.alice, tcast.bob
    subs = {
        "alice": _subscribers(alice, 2, cursor=head),
        "bob": _subscribers(bob, 2, cursor=head),
        "op": _subscribers({"key": tcast.keys["operator"]}, 1, cursor=head),
        "alice_ca": _subscribers(alice, 2, cursor=head, conversation_id="ca"),
        "bob_cb": _subscribers(bob, 1, cursor=head, conversation_id="cb"),
        "alice_cc": _subscribers(alice, 1, cursor=head, conversation_id="cc"),
    }
    appended: list = []  # (id, conversation, audience)
    lock = threading.Lock()
    audiences = [None, None, "owner", ["someone-else"]]

    def write(conv: Conversation, n: int) -> None:
        try:
            for k in range(n):
                aud = audiences[k % len(audiences)]
                aud = [conv.owner.key] if aud == "owner" else aud
                i = event_append(conversation_id=conv.pk, type="ugent.test", data={"k": k}, audience=aud)
                with lock:
                    appended.append((i, conv.pk, aud))
        finally:
            connection.close()

    def write_all() -> None:
        threads = [threading.Thread(target=write, args=(c, 60)) for c in (ca, cb, cc, ca)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    owners = {c.pk: c.owner.key for c in (ca, cb, cc)}
    convs = {"ca": ca.pk, "cb": cb.pk, "cc": cc.pk}
    users = {"alice": ca.owner.key, "bob": cb.owner.key}

    def visible(name: str) -> list[int]:
        """The ids this group's subscribers may see: the operator all; a user those of their conversations
        (the one the stream names, if any) whose audience is empty or names them."""
        if name == "op":
            return sorted(i for i, _pk, _aud in appended)
        user, conv = (name.split("_") + [None])[:2]
        return sorted(i for i, pk, aud in appended
                      if owners[pk] == users[user] and (conv is None or pk == convs[conv])
                      and (not aud or aud == [users[user]]))

    async def run():
        try:
            everyone = [s for group in subs.values() for s in group]
            await asyncio.gather(*(s.caught_up() for s in everyone))
            await sync_to_async(write_all, thread_sensitive=False)()
            result = {}
            for name, group in subs.items():
                want = visible(name)
                result[name] = (want, await asyncio.gather(*(_until(s, want[-1]) for s in group)))
            return result
        finally:
            await _closed([s for group in subs.values() for s in group])

    result = async_to_sync(run)()
    assert len(appended) == 240
    for name, (want, seen) in result.items():
        for got in seen:
            assert got == want, name
