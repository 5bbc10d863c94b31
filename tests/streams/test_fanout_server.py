"""The fan-out behind a real ASGI server: uvicorn (httptools), serving ugent_site's API handler in this
test's event loop, and clients on real sockets. There the reader writes each batch to every caught-up
subscriber's response itself (channels_app.fanout, Sink), so no stream is resumed per batch; a client
that stops reading is held back by the transport's flow control, cut loose with its ugent.gap, and
resumes from it losing nothing, while the others keep pace.

The 30 s timeouts only keep a broken build from hanging the suite: nothing is timed."""
from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlencode

import pytest
import uvicorn
from asgiref.sync import async_to_sync, sync_to_async
from django.core.asgi import get_asgi_application

from channels_app import fanout, streams
from channels_app.events import conversation_topic, event_append
from tests.streams.conftest import ident
from tests.support.http import chat
from tests.support.http import parse_sse
from ugent_site.api_handler import ApiHandler, route

pytestmark = pytest.mark.django_db(transaction=True)

GUARD = 30.0


class SseClient(asyncio.Protocol):
    """One /v1/ugent/events response on its own socket: chunked framing undone, frames parsed."""

    def __init__(self, request: bytes):
        loop = asyncio.get_running_loop()
        self.request = request
        self.started, self.ended = loop.create_future(), loop.create_future()
        self.head, self.raw, self.text = True, b"", b""
        self.frames: asyncio.Queue = asyncio.Queue()

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc):
        if not self.ended.done():
            self.ended.set_result(False)

    def data_received(self, data: bytes) -> None:
        buf = self.raw + data
        if self.head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.raw = buf
                return
            assert buf.startswith(b"HTTP/1.1 200"), buf[:end]
            assert b"transfer-encoding: chunked" in buf[:end].lower()
            self.head, buf = False, buf[end + 4:]
            self.started.set_result(None)
        parts, pos = [], 0
        while (nl := buf.find(b"\r\n", pos)) >= 0:
            size = int(buf[pos:nl], 16)
            if len(buf) < nl + 4 + size:
                break
            if size == 0 and not self.ended.done():
                self.ended.set_result(True)  # the response's last chunk: the stream ended
            parts.append(buf[nl + 2:nl + 2 + size])
            pos = nl + 4 + size
        self.raw = buf[pos:]
        *blocks, self.text = (self.text + b"".join(parts)).split(b"\n\n")
        for block in blocks:
            for f in parse_sse(block + b"\n\n"):
                if f["event"] is not None:
                    self.frames.put_nowait(f)

    async def event(self) -> dict:
        return await asyncio.wait_for(self.frames.get(), GUARD)

    async def until(self, last: int) -> list[int]:
        seen: list[int] = []
        while not seen or seen[-1] < last:
            seen.append(int((await self.event())["id"]))
        return seen


class Server:
    """uvicorn on a free port, in the running loop, with the daemon's own application (minus enforce_here,
    which the test session already did)."""

    async def __aenter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = route(ApiHandler(), get_asgi_application())
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="none", http="httptools", ws="none",
                                lifespan="off", access_log=False, log_config=None, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            assert not self.task.done(), self.task.result()
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await asyncio.wait_for(self.task, GUARD)

    async def stream(self, who: dict, *, rcvbuf: int | None = None, last_event_id: str | None = None,
                     **params) -> SseClient:
        query = urlencode({**ident(who), **params})
        head = (f"GET /v1/ugent/events?{query} HTTP/1.1\r\nHost: testserver\r\nx-api-key: {who['key']}\r\n"
                + (f"Last-Event-ID: {last_event_id}\r\n" if last_event_id is not None else "") + "\r\n")
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        _t, client = await asyncio.get_running_loop().create_connection(lambda: SseClient(head.encode()), sock=sock)
        await asyncio.wait_for(client.started, GUARD)
        return client


def _reader(conv_pk: int) -> fanout.Reader:
    (reader,) = [r for r in fanout.hub().readers() if r.key[1] == conversation_topic(conv_pk)]
    return reader


async def _parked(reader: fanout.Reader, n: int) -> None:
    """Until n subscribers have caught up and wait with their response's send handed to the reader."""
    await asyncio.wait_for(reader.ready.wait(), GUARD)
    for _ in range(int(GUARD / 0.01)):
        if len(reader.taps) == n and all(t.send is not None for t in reader.taps):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the streams never caught up")


async def _append(conv_pk: int, k: int, data: dict | None = None) -> int:
    return await sync_to_async(event_append)(conversation_id=conv_pk, type="ugent.test",
                                             data=data or {"k": k})


def _conversation(who: dict, conversation_id: str):
    from channels_app.models import Conversation
    assert chat(who, "hello", conversation_id=conversation_id).status_code == 200
    return Conversation.objects.get(external_id=conversation_id)


def test_the_reader_writes_each_batch_to_every_caught_up_subscriber_without_resuming_its_stream(tcast, settings):
    settings.UGENT_SSE_KEEPALIVE = 60  # no keep-alive wakes a stream during the test
    conv = _conversation(tcast.alice, "c1")
    start = streams.log_head()

    async def run():
        async with Server() as server:
            clients = [await server.stream(tcast.alice, conversation_id="c1", cursor=str(start)) for _ in range(20)]
            reader = _reader(conv.pk)
            await _parked(reader, 20)
            written, queued = reader.written, reader.queued
            ids = []
            for k in range(30):  # lockstep: one batch per event
                ids.append(await _append(conv.pk, k))
                got = await asyncio.gather(*(c.event() for c in clients))
                assert [int(f["id"]) for f in got] == [ids[-1]] * 20
                assert [f["data"]["data"] for f in got] == [{"k": k}] * 20
            counts = (reader.written - written, reader.queued - queued, reader.batches)
            still_parked = all(t.send is not None for t in reader.taps)
            for c in clients:
                c.transport.close()
            return ids, counts, still_parked

    ids, (written, queued, batches), still_parked = async_to_sync(run)()
    assert len(ids) == 30
    # every batch of every subscriber went out from the reader; none was queued for a stream to wake up to
    assert written == 20 * 30 and queued == 0 and still_parked


def test_a_client_that_stops_reading_is_cut_loose_through_the_server_and_resumes_from_its_gap(tcast, settings):
    settings.UGENT_SSE_KEEPALIVE = 60
    settings.UGENT_SSE_SUBSCRIBER_QUEUE = 5
    conv = _conversation(tcast.alice, "c1")
    start = streams.log_head()
    big = "x" * 256 * 1024  # a few of these fill the slow client's socket buffers and the transport's

    async def run():
        async with Server() as server:
            fast = [await server.stream(tcast.alice, conversation_id="c1", cursor=str(start)) for _ in range(4)]
            slow = await server.stream(tcast.alice, rcvbuf=4096, conversation_id="c1", cursor=str(start))
            reader = _reader(conv.pk)
            await _parked(reader, 5)
            slow.transport.pause_reading()  # its client takes nothing more
            ids = []
            for k in range(200):
                ids.append(await _append(conv.pk, k, {"k": k, "pad": big}))
                got = await asyncio.gather(*(c.event() for c in fast))
                assert [int(f["id"]) for f in got] == [ids[-1]] * 4
                if len(reader.taps) == 4:
                    break
            assert len(reader.taps) == 4, "the slow subscriber was never cut loose"
            for k in range(5):  # the others go on at the reader's pace
                ids.append(await _append(conv.pk, 1000 + k))
                got = await asyncio.gather(*(c.event() for c in fast))
                assert [int(f["id"]) for f in got] == [ids[-1]] * 4
            assert all(t.send is not None for t in reader.taps)  # and were never held back
            slow.transport.resume_reading()
            before = []
            while (f := await slow.event())["event"] != "ugent.gap":
                before.append(int(f["id"]))
            gap = f
            assert await asyncio.wait_for(slow.ended, GUARD)  # its stream ended after the gap
            again = await server.stream(tcast.alice, last_event_id=gap["id"], conversation_id="c1")
            after = await again.until(ids[-1])
            for c in fast + [slow, again]:
                c.transport.close()
            return ids, before, gap, after

    ids, before, gap, after = async_to_sync(run)()
    assert before and before == ids[:len(before)] and len(before) < len(ids)
    # the gap's id is the last event this client got: resuming there loses nothing and repeats nothing
    assert gap["data"]["reason"] == "pruned" and gap["data"]["snapshot"] is None
    assert gap["id"] == str(before[-1]) and gap["data"]["cursor"] == before[-1]
    assert before + after == ids
