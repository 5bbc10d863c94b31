"""Stream wake-ups go through channels_app.notify, and no Channels layer is half there beside it.

bench/events_fanout.py measured notify against channels_redis' layers and the in-memory layer
(docs/streams.md, "Why notify.py and not the channel layer"): notify stayed, CHANNEL_LAYERS went.
A layer that comes back configured but unused, or used without being the decision, fails here.
"""
from __future__ import annotations

import ast
import asyncio
import subprocess
import threading
import uuid
from pathlib import Path

from django.conf import settings

from channels_app import notify

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
#: the bench measures the layers on purpose; nothing else may reach for one
MEASURES_THE_LAYER = {"bench/events_fanout.py"}


def layer_uses(source: str) -> list[int]:
    """Lines that import a Channels layer or name one in code (docstrings and comments may say why not)."""
    if not any(word in source for word in ("channels.layers", "channels_redis", "channel_layer", "CHANNEL_LAYERS")):
        return []
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            mods = []
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if any(m.startswith(("channels.layers", "channels_redis")) for m in mods) or name in LAYER_NAMES:
            lines.append(node.lineno)
    return lines


LAYER_NAMES = {"CHANNEL_LAYERS", "get_channel_layer", "channel_layer", "channel_layers"}


def test_no_channel_layer_is_configured_and_no_code_reaches_for_one():
    from channels.layers import get_channel_layer

    assert not hasattr(settings, "CHANNEL_LAYERS")
    assert get_channel_layer() is None  # what a Channels consumer sees: it runs without a layer
    files = subprocess.run(["git", "ls-files", "--", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    offenders = [f"{f}:{n}" for f in files if f != THIS and f not in MEASURES_THE_LAYER and (ROOT / f).is_file()
                 for n in layer_uses((ROOT / f).read_text(errors="replace"))]
    assert offenders == []


def test_the_scan_sees_a_layer_in_code_and_not_in_prose():
    assert layer_uses('"""no CHANNEL_LAYERS, not channels_redis"""\n# get_channel_layer\n') == []
    assert layer_uses("from channels.layers import get_channel_layer\n") != []
    assert layer_uses("import channels_redis.core\n") != []
    assert layer_uses("CHANNEL_LAYERS = {}\n") != []
    assert layer_uses("async def f(self):\n    await self.channel_layer.group_send('g', {})\n") != []


class LoopThread:
    """An event loop running in its own thread, as a web process's loop is to a turn thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def waiters(self, topic: str, n: int) -> list[notify.Waiter]:
        return [notify.register(topic, self.loop) for _ in range(n)]

    def take_after_wait(self, waiter: notify.Waiter, timeout: float = 5.0):
        async def go():
            await waiter.wait(timeout)
            return waiter.take()
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout + 5)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def a_batch(k: int = 1) -> notify.TurnBatch:
    return notify.TurnBatch(prev=k - 1, rows=((k, "turn.delta", {"text": f"w{k}"}),))


def test_one_publish_wakes_every_waiter_on_every_loop_with_its_rows():
    topic = f"test:wakeups:{uuid.uuid4().hex}"
    loops = [LoopThread(), LoopThread()]
    try:
        waiters = [(lt, w) for lt in loops for w in lt.waiters(topic, 3)]
        batch = a_batch()
        notify.publish(topic, batch=(topic, batch))
        for lt, w in waiters:
            taken = lt.take_after_wait(w)
            assert taken is not None and batch in taken  # servers mode may add the same rows from Redis
        for _lt, w in waiters:
            w.close()
        assert topic not in notify._waiters
    finally:
        for lt in loops:
            lt.stop()


def test_a_waiter_whose_loop_has_closed_is_dropped_and_the_others_still_wake():
    topic = f"test:wakeups:{uuid.uuid4().hex}"
    gone, live = LoopThread(), LoopThread()
    try:
        (stale,) = gone.waiters(topic, 1)
        gone.stop()
        (w,) = live.waiters(topic, 1)
        batch = a_batch(7)
        notify.publish(topic, batch=(topic, batch))
        assert batch in live.take_after_wait(w)
        assert stale not in notify._waiters.get(topic, set())
        assert w in notify._waiters[topic]
        w.close()
    finally:
        live.stop()


def test_a_wait_ends_at_its_timeout_unwoken_and_a_wake_before_the_wait_is_not_lost():
    topic = f"test:wakeups:{uuid.uuid4().hex}"
    lt = LoopThread()
    try:
        (w,) = lt.waiters(topic, 1)
        assert lt.take_after_wait(w, timeout=0.01) == []  # nothing woke it: no rows, no read forced
        notify.publish(topic)  # a plain wake-up before anyone waits
        assert lt.take_after_wait(w) is None  # it is kept, and says "read the database"
        w.close()
    finally:
        lt.stop()


def test_a_conversation_batch_crosses_redis_as_the_rows_a_stream_reads():
    """What a web process gets over Redis is what the appending process handed its own readers: each
    field of the row, created_at as the same instant; a turn's batch keeps its own shape."""
    import datetime as dt

    from channels_app import streams
    at = dt.datetime(2026, 12, 3, 18, 40, 1, 234567, tzinfo=dt.timezone.utc)
    row = dict(zip(notify.ROW_FIELDS, (7, "turn.delta", ["alice@web"], {"text": "é", "n": [1, 2]}, at, "c1", "app",
                                       "web", 3, "t_1")))
    batch = notify.ConversationBatch(prev=5, rows=(row,))
    back = notify._batch_decode(notify._batch_encode(batch))
    assert back == batch
    assert streams.row_frame(back.rows[0]) == streams.row_frame(row)
    turn = a_batch(3)
    assert notify._batch_decode(notify._batch_encode(turn)) == turn
    assert notify._batch_decode(b'{"c": 1, "r": [[1, "x"]]}') is None  # a malformed one: the reader reads


def test_rows_following_takes_only_rows_that_follow_the_cursor_without_a_gap():
    """notify.rows_following is the one walk both readers take (the turn stream's tuples, the fan-out's
    dicts): a batch ending at or before the cursor is skipped as had already; any other must start at the
    cursor, which moves to each taken batch's last id; else None (read the database)."""
    def turn(prev, *ids):
        return notify.TurnBatch(prev=prev, rows=tuple((i, "turn.delta", {}) for i in ids))

    def conv(prev, *ids):
        return notify.ConversationBatch(prev=prev, rows=tuple({"id": i, "type": "turn.delta"} for i in ids))

    tuple_id, dict_id = (lambda row: row[0]), (lambda row: row["id"])
    for make, id_of in ((turn, tuple_id), (conv, dict_id)):
        def ids(batches, cursor):
            rows = notify.rows_following(batches, cursor, id_of)
            return None if rows is None else [id_of(r) for r in rows]
        # contiguous batches: taken in order, the cursor moving to each one's last id
        assert ids([make(4, 5, 6), make(6, 9)], 4) == [5, 6, 9]
        # a later batch that starts at the old cursor, not the moved one: a gap (or a repeat), so read
        assert ids([make(4, 5, 6), make(4, 7)], 4) is None
        # a batch that starts past the cursor (one was lost) or before it without ending there: read
        assert ids([make(5, 7)], 4) is None
        assert ids([make(3, 4, 5)], 4) is None
        # had already: batches ending at or before the cursor are skipped, and what follows is taken
        assert ids([make(2, 3, 4), make(4, 5)], 4) == [5]
        assert ids([make(1, 2), make(2, 3, 4), make(4, 5), make(5, 6)], 4) == [5, 6]
        assert ids([make(2, 3, 4), make(0, 1)], 4) == []  # nothing new, and nothing to read either
        assert ids([], 4) == []


# --- over Redis: a process skips its own wake-ups, and decodes nobody's rows for a topic it has no waiter on ---

class _Counting(notify.BlockingWaiter):
    def __init__(self, topic: str):
        super().__init__(topic)
        self.wakes = []

    def _wake(self, batch=None) -> None:
        self.wakes.append(batch)
        super()._wake(batch)


def _servers_only():
    import pytest
    if not settings.REDIS_URL:
        pytest.skip("servers mode: wake-ups over Redis")


def _raw_publish(topic: str, payload: bytes) -> None:
    import redis
    redis.Redis.from_url(settings.REDIS_URL).publish(notify.channel_prefix() + topic, payload)


def _settle(until, timeout: float = 5.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_process_hears_its_own_wake_up_once_and_another_process_s_over_redis():
    import time
    _servers_only()
    topic = f"test:wakeups:{uuid.uuid4().hex}"
    w = notify.register_waiter(_Counting(topic))
    try:
        _raw_publish(topic, b"@00000000|1")  # the listener is up once another's wake-up gets through
        _settle(lambda: len(w.wakes) == 1)
        assert w.wakes == [None]
        notify.publish(topic)
        time.sleep(0.5)  # the echo over Redis would have come by now
        assert w.wakes == [None, None]  # once, from publish() itself
        _raw_publish(topic, b"1")  # a wake-up with no tag (another version's): from elsewhere
        _settle(lambda: len(w.wakes) == 3)
        assert len(w.wakes) == 3
    finally:
        w.close()


def test_rows_are_decoded_only_for_a_topic_someone_here_waits_on(monkeypatch):
    _servers_only()
    decoded = []
    real = notify._batch_decode
    monkeypatch.setattr(notify, "_batch_decode", lambda data: decoded.append(data) or real(data))
    waited, unwatched = f"test:wakeups:{uuid.uuid4().hex}", f"test:wakeups:{uuid.uuid4().hex}"
    w = notify.register_waiter(_Counting(waited))
    try:
        _raw_publish(unwatched, b'@00000000|[0, [[1, "turn.delta", {"text": "x"}]]]')
        _raw_publish(waited, b'@00000000|[0, [[1, "turn.delta", {"text": "x"}]]]')
        _settle(lambda: len(w.wakes) == 1)
        assert decoded == [b'[0, [[1, "turn.delta", {"text": "x"}]]]']  # the waited topic's alone, untagged
        assert w.wakes[0].rows == ((1, "turn.delta", {"text": "x"}),)
    finally:
        w.close()


def test_a_forked_child_tags_its_wake_ups_as_its_own():
    import os
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.write(write, notify._own[0])
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64)
    os.close(read)
    os.close(write)
    assert len(child) == notify._OWN_LEN and child[:1] == b"@" and child != notify._own[0]
