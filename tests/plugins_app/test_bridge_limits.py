"""What keeps one worker, or anything that reaches a bridge socket, from stalling or exhausting the host: the limits
before hello (a small frame, a deadline, a few such connections), large frames parsed off the event loop in order, a
batch's finished calls giving their places back, hello saying the batch limit, and the plugin's submit rate (-32007),
which the SDK waits out and retries without losing or reordering a message.

A real BridgeServer on a real Unix socket, real client connections; no timing is asserted (deadlines are made short,
and the tests wait for what must happen)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import tempfile
import threading
import time

import pytest

from plugins_app.channel.bridge import BridgeServer, HelloGate, InMemoryHub, ServerThread, TokenBucket
from plugins_app.channel.bridge import transport as transport_module
from plugins_app.channel.sdk.jsonrpc import (INVALID_REQUEST, NOT_AUTHENTICATED, PARSE_ERROR, RATE_LIMITED,
                                             RPCError, parse_frame, parse_large_frame)
from plugins_app.channel.sdk.mock import MockBridge
from plugins_app.channel.sdk.outbox import ACKED, PENDING, Outbox
from tests.plugins_app.test_jsonrpc import LineConn
from tests.plugins_app.test_sdk import FileChannelWorker, Running, message

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

PLUGIN_ID = "telegram-main"
TOKEN = "per-start-token-1"
HELLO = {"plugin_id": PLUGIN_ID, "token": TOKEN, "kind": "channel-telegram", "version": "1.2.3"}


class Conn(LineConn):
    """Frames in, frames out, on a plain socket (test_jsonrpc's raw client): JSON objects sent, a longer wait."""

    def __init__(self, path: str):
        super().__init__(path)
        self.sock.settimeout(10)

    def send(self, *objs) -> None:
        super().send(b"".join(json.dumps(o, separators=(",", ":")).encode() + b"\n" for o in objs))

    def recv(self, timeout: float = 10.0):
        return super().recv(timeout)

    def call(self, method, params=None, id=1):
        self.send(call(method, params, id))
        return self.recv()

    def closed_by_server(self, timeout: float = 10.0) -> bool:
        """True once the server closed the connection (EOF or reset); False if it is still open at the timeout."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self):
        self.sock.close()


def call(method, params=None, id=1):
    obj = {"jsonrpc": "2.0", "method": method, "id": id}
    if params is not None:
        obj["params"] = params
    return obj


class Served:
    """A BridgeServer on its own loop, and the connections a test opened (closed at the end)."""

    def __init__(self, **kwargs):
        self.dir = tempfile.mkdtemp(prefix="ugb-")
        self.hub = kwargs.pop("hub", None) or InMemoryHub()
        self.server = BridgeServer(socket_path=os.path.join(self.dir, "bridge.sock"), plugin_id=PLUGIN_ID,
                                   token=TOKEN, hub=self.hub, **kwargs)
        self.thread = ServerThread(self.server).start()
        self.conns: list[Conn] = []

    def connect(self, hello: bool = False) -> Conn:
        c = Conn(self.server.socket_path)
        self.conns.append(c)
        if hello:
            answer = c.call("hello", HELLO, id="hello")
            assert "result" in answer, answer
        return c

    def on_loop(self, fn):
        return self.thread.call(fn)

    def close(self):
        for c in self.conns:
            c.close()
        self.thread.stop()


@pytest.fixture
def served():
    made: list[Served] = []

    def make(**kwargs) -> Served:
        s = Served(**kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.005)


def sized(n: int) -> str:
    return "x" * n


# -- before hello: a small frame, a deadline, a few connections -------------------------------------


def test_before_hello_a_frame_over_64_kib_is_refused_and_after_it_the_same_frame_is_taken(served):
    s = served(extra_methods={"size": lambda data: len(data)})  # the bridge's own frame limit: 16 MiB
    c = s.connect()
    big = call("size", {"data": sized(100 * 1024)}, id="big")
    c.send(big)
    refused = c.recv()
    assert refused["error"]["code"] == INVALID_REQUEST and refused["id"] is None
    assert refused["error"]["data"] == {"reason": "frame too large", "max_frame_bytes": 64 * 1024}
    assert s.hub.hellos == []
    # the connection survives, its hello works, and from then on the bridge's own limit holds
    assert "result" in c.call("hello", HELLO, id="hello")
    c.send(big)
    assert c.recv() == {"jsonrpc": "2.0", "result": 100 * 1024, "id": "big"}


@pytest.mark.parametrize("gate_bytes, size", [(1024, 3000), (64 * 1024, 300 * 1024)])
def test_a_frame_sent_with_the_hello_in_one_write_is_cut_by_the_limit_after_hello(served, gate_bytes, size):
    """The frame after the hello is split by the limit the hello lifted, even when both came in one read."""
    s = served(extra_methods={"size": lambda data: len(data)}, gate=HelloGate(max_frame_bytes=gate_bytes))
    c = s.connect()
    c.send(call("hello", HELLO, id="hello"), call("size", {"data": sized(size)}, id="big"))
    assert "result" in c.recv()
    assert c.recv() == {"jsonrpc": "2.0", "result": size, "id": "big"}


def test_a_connection_without_a_hello_in_time_is_closed_and_one_with_it_is_not(served, caplog):
    caplog.set_level(logging.WARNING)
    s = served(gate=HelloGate(deadline_secs=0.3))
    authenticated = s.connect(hello=True)
    silent = s.connect()
    refused = s.connect()
    assert refused.call("heartbeat", {}, id=1)["error"]["code"] == NOT_AUTHENTICATED  # answered, and still open
    wrong = s.connect()
    assert wrong.call("hello", dict(HELLO, token="wrong"), id=1)["error"]["code"] == -32002
    assert silent.closed_by_server() and refused.closed_by_server() and wrong.closed_by_server()
    # the one that said hello (before the others connected) is past its deadline too, and served
    assert authenticated.call("heartbeat", {}, id=2)["result"]["ok"] is True
    assert f"bridge {PLUGIN_ID}: a connection said no hello within 0.3 s: closed" in caplog.text
    assert s.on_loop(lambda: len(s.server.transport.unauthenticated)) == 0


def test_a_connection_that_sends_without_reading_its_answers_is_closed_at_the_deadline_all_the_same(served):
    s = served(gate=HelloGate(deadline_secs=0.3))
    c = s.connect()
    flood = b"".join(json.dumps(call("heartbeat", {}, id=i)).encode() + b"\n" for i in range(40000))

    def send():
        c.sock.settimeout(10)
        try:
            c.sock.sendall(flood)  # its answers (-32001 each) fill the socket: the bridge's writes block
        except OSError:
            pass  # (closed by the bridge meanwhile)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    wait_for(lambda: s.on_loop(lambda: len(s.server.transport.connections)) == 0)
    sender.join(10)
    assert s.connect(hello=True).call("heartbeat", {}, id=1)["result"]["ok"] is True


def _hellos_held(release: threading.Event):
    """A hub whose every hello waits until `release` is set."""
    class SlowHub(InMemoryHub):
        async def hello_ok(self, plugin_id, info):
            await asyncio.to_thread(release.wait, 10)
            return await super().hello_ok(plugin_id, info)
    return SlowHub


def test_a_hello_under_way_at_the_deadline_is_answered_and_its_session_kept(served):
    release = threading.Event()
    SlowHub = _hellos_held(release)

    s = served(hub=SlowHub(), gate=HelloGate(deadline_secs=0.2))
    c = s.connect()
    c.send(call("hello", HELLO, id="hello"))
    wait_for(lambda: s.on_loop(lambda: any(conn.overdue for conn in s.server.transport.connections)))
    release.set()
    assert "result" in c.recv()
    assert c.call("heartbeat", {}, id=2)["result"]["ok"] is True


def test_past_the_cap_of_connections_without_hello_the_oldest_is_closed_with_a_warning_naming_the_plugin(
        served, caplog):
    caplog.set_level(logging.WARNING)
    s = served()  # the default gate: 8 connections, 10 s
    idle = [s.connect() for _ in range(8)]
    wait_for(lambda: s.on_loop(lambda: len(s.server.transport.unauthenticated)) == 8)
    newcomer = s.connect()
    assert idle[0].closed_by_server()
    assert f"bridge {PLUGIN_ID}: 8 connections have not said hello yet: closed the oldest" in caplog.text
    assert "result" in newcomer.call("hello", HELLO, id="hello")  # the worker gets in
    for c in idle[1:]:  # the others are still open (and answered)
        assert c.call("heartbeat", {}, id=1)["error"]["code"] == NOT_AUTHENTICATED
    assert s.on_loop(lambda: len(s.server.transport.unauthenticated)) == 7


def test_a_hello_sent_at_the_connect_is_not_pushed_out_by_connections_that_came_after_it(served):
    """The worker's hello waits to be read while the loop serves others; eight idle connections that come meanwhile
    close one another, not the worker's (the oldest place past the cap must be an idle one, and a connection whose
    first bytes are waiting is not idle)."""
    s = served()  # the default gate: 8 connections
    busy, release = threading.Event(), threading.Event()

    def hold_the_loop():
        busy.set()
        release.wait(10)

    s.thread.loop.call_soon_threadsafe(hold_the_loop)
    assert busy.wait(10)
    try:
        worker = s.connect()
        worker.send(call("hello", HELLO, id="hello"))  # at once, as the SDK does
        idle = [s.connect() for _ in range(8)]  # (the socket's backlog takes them while the loop is held)
    finally:
        release.set()
    assert "result" in worker.recv()
    assert worker.call("heartbeat", {}, id=2)["result"]["ok"] is True
    assert idle[0].closed_by_server()  # the oldest idle one made the room
    assert s.on_loop(lambda: len(s.server.transport.unauthenticated)) == 7  # the worker said hello: not one


def test_when_every_place_has_a_hello_under_way_one_more_connection_is_refused(served, caplog):
    caplog.set_level(logging.WARNING)
    release = threading.Event()
    SlowHub = _hellos_held(release)

    s = served(hub=SlowHub(), gate=HelloGate(max_connections=2))
    first, second = s.connect(), s.connect()
    first.send(call("hello", HELLO, id="hello"))
    second.send(call("hello", HELLO, id="hello"))
    wait_for(lambda: s.on_loop(lambda: sum(c.busy for c in s.server.transport.unauthenticated)) == 2)
    third = s.connect()
    assert third.closed_by_server()
    assert f"bridge {PLUGIN_ID}: 2 connections have not said hello yet, each with a hello under way: refused one " \
           "more" in caplog.text
    release.set()
    assert "result" in second.recv()  # the newest hello wins, as always: the first's session is replaced
    assert second.call("heartbeat", {}, id=2)["result"]["ok"] is True


# -- large frames: off the loop, in order -----------------------------------------------------------


def test_a_large_frame_is_parsed_off_the_loop_and_its_connections_frames_keep_their_order(served, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real = transport_module.parse_large_frame

    def held_parse(frame):
        started.set()
        release.wait(10)  # held until the test has seen the bridge answer another connection meanwhile
        return real(frame)

    monkeypatch.setattr(transport_module, "parse_large_frame", held_parse)
    order: list[int] = []

    def record(n, pad=""):
        order.append(n)
        return n

    s = served(extra_methods={"record": record})
    c = s.connect(hello=True)
    c.send(call("record", {"n": 1, "pad": sized(300 * 1024)}, id=1), call("record", {"n": 2}, id=2),
           call("record", {"n": 3}, id=3))
    assert started.wait(10)
    other = s.connect()
    try:
        # the loop is free while the large frame is parsed: another connection is answered meanwhile
        assert other.call("heartbeat", {}, id="other")["error"]["code"] == NOT_AUTHENTICATED
        assert order == []  # and the frames after the large one wait for it
    finally:
        release.set()
    assert sorted(c.recv()["result"] for _ in range(3)) == [1, 2, 3]
    assert order == [1, 2, 3]


def test_a_frame_just_under_the_threshold_is_parsed_on_the_loop(served, monkeypatch):
    used = []
    real = transport_module.parse_large_frame
    monkeypatch.setattr(transport_module, "parse_large_frame", lambda frame: used.append(len(frame)) or real(frame))
    s = served(extra_methods={"size": lambda data: len(data)})
    c = s.connect(hello=True)
    assert c.call("size", {"data": sized(200 * 1024)}, id=1)["result"] == 200 * 1024
    assert c.call("size", {"data": sized(300 * 1024)}, id=2)["result"] == 300 * 1024
    assert len(used) == 1 and used[0] > 300 * 1024


@pytest.mark.parametrize("frame", [
    b'{"jsonrpc":"2.0","method":"m","params":{"a":[1,2.5,-3e2,true,false,null,"\\u00e9\\n"]},"id":7}',
    b'[{"a":{}},[],"s",0]',
    '{"text":"caf\u00e9"}'.encode(),
])
def test_the_large_frame_parser_gives_what_the_other_gives(frame):
    assert parse_large_frame(frame) == parse_frame(frame)


@pytest.mark.parametrize("frame", [b'{"a": NaN}', b'[Infinity]', b"\xff\xfe{}", b'{"a": [1, 2', b"[" * 100000,
                                   b'{"a": "\x01"}',
                                   # digits JSON does not have (the pure-Python scanner's regex took any Unicode digit)
                                   '{"id":1\u0662}'.encode(), '[1.\u0665]'.encode(), '[1e\uff11]'.encode(),
                                   # a number past a float's range: Infinity by another name
                                   b'[1e999]', b'{"id":-1.5e400}'])
def test_the_large_frame_parser_refuses_what_the_other_refuses(frame):
    for parse in (parse_frame, parse_large_frame):
        with pytest.raises(RPCError) as err:
            parse(frame)
        assert err.value.code == PARSE_ERROR


def test_a_number_past_a_floats_range_is_a_parse_error_and_the_connection_goes_on(served):
    """1e999 would be read as inf, which no answer can carry (JSON has no Infinity): the call went unanswered, and
    before hello its connection was closed."""
    s = served()
    for c in (s.connect(), s.connect(hello=True)):
        c.sock.sendall(b'{"jsonrpc":"2.0","method":"heartbeat","params":{},"id":1e999}\n')
        assert c.recv()["error"]["code"] == PARSE_ERROR
        assert c.call("heartbeat", {}, id=2)["id"] == 2  # answered (-32001 before hello): the connection goes on


# -- batches: the limit in hello, finished calls give their places back ------------------------------


def test_hello_says_the_batch_limit_the_bridge_refuses_batches_over(served):
    assert served().connect().call("hello", HELLO)["result"]["max_batch_calls"] == 64
    s = served(max_concurrent_requests=4, extra_methods={"ok": lambda n: n})
    c = s.connect()
    limit = c.call("hello", HELLO)["result"]["max_batch_calls"]
    assert limit == 4
    c.send([call("ok", [i], id=i) for i in range(limit + 1)])
    assert c.recv()["error"]["data"] == {"reason": "batch too long", "size": 5, "max_batch_calls": 4}
    c.send([call("ok", [i], id=i) for i in range(limit)])
    assert sorted(r["result"] for r in c.recv()) == [0, 1, 2, 3]


def _holding_bridge(served):
    release = threading.Event()
    ran: list[int] = []

    async def hold():
        await asyncio.to_thread(release.wait, 10)
        return "held"

    def quick(n):
        ran.append(n)
        return n

    s = served(max_concurrent_requests=4, extra_methods={"hold": hold, "quick": quick})
    return s, release, ran


def test_a_finished_call_of_a_batch_gives_its_place_back_while_a_slow_one_holds_the_batch(served):
    s, release, ran = _holding_bridge(served)
    c = s.connect(hello=True)
    try:
        c.send([call("hold", id="h"), call("quick", [1], id=1), call("quick", [2], id=2), call("quick", [3], id=3)])
        wait_for(lambda: len(ran) == 3)
        # every place was the batch's; its three finished calls gave theirs back: the next call runs at once
        assert c.call("quick", [4], id=4) == {"jsonrpc": "2.0", "result": 4, "id": 4}
    finally:
        release.set()
    batch = c.recv()
    assert sorted((r["id"], r["result"]) for r in batch if r["id"] != "h") == [(1, 1), (2, 2), (3, 3)]
    assert {"jsonrpc": "2.0", "result": "held", "id": "h"} in batch


def test_answers_kept_for_unanswered_batches_are_bounded_by_the_call_limit(served):
    s, release, ran = _holding_bridge(served)
    c = s.connect(hello=True)

    def kept():
        return s.on_loop(lambda: [conn.kept_answers for conn in s.server.transport.connections if conn.authenticated])

    try:
        c.send([call("hold", id="h1"), call("quick", [1], id=1), call("quick", [2], id=2), call("quick", [3], id=3)])
        wait_for(lambda: len(ran) == 3)
        assert kept() == [3]
        c.send([call("hold", id="h2"), call("quick", [4], id=4), call("quick", [5], id=5)])
        wait_for(lambda: len(ran) == 5)
        assert kept() == [4]  # the fifth finished answer kept its place rather than be one more kept
        assert c.call("quick", [6], id=6)["result"] == 6  # the one place left
    finally:
        release.set()
    answers = [c.recv(), c.recv()]
    assert sorted(len(a) for a in answers) == [3, 4]
    assert kept() == [0]


# -- the plugin's submit rate ----------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, secs: float) -> None:
        with self.lock:
            self.now += secs


def submit(c: Conn, message_id: str, id=None):
    return c.call("inbound.submit", {"message": message(message_id).to_dict()}, id=id or message_id)


def test_submits_over_the_plugins_rate_are_refused_with_a_retryable_code_and_reach_nothing(served, caplog):
    caplog.set_level(logging.WARNING)
    clock = Clock()
    s = served(submit_rate=2.0, submit_burst=2, clock=clock)
    c = s.connect(hello=True)
    assert submit(c, "m-1")["result"]["accepted"] and submit(c, "m-2")["result"]["accepted"]
    refused = submit(c, "m-3")
    assert refused["error"] == {"code": RATE_LIMITED, "message": "Rate limited",
                                "data": {"retry_after_secs": 0.5, "rate_per_sec": 2.0, "burst": 2}}
    assert [m.message_id for m in s.hub.submit_log] == ["m-1", "m-2"]  # the refused one reached nothing
    assert c.call("heartbeat", {}, id="beat")["result"]["ok"] is True  # other methods are not limited
    assert f"bridge {PLUGIN_ID}: inbound.submit over the plugin's rate (2.0 a second, 2 at once)" in caplog.text
    # the plugin's bucket, not the connection's: a new session does not refill it
    again = s.connect(hello=True)
    assert submit(again, "m-3")["error"]["code"] == RATE_LIMITED
    clock.advance(0.5)  # one token
    assert submit(again, "m-3")["result"]["accepted"]
    assert submit(again, "m-4")["error"]["data"]["retry_after_secs"] == 0.5
    assert s.server.rate_limited == 3
    assert [m.message_id for m in s.hub.inbound] == ["m-1", "m-2", "m-3"]


def test_the_bucket_the_bridge_and_the_gate_refuse_bad_limits():
    bucket = TokenBucket(1.0, 3, clock=lambda: 0.0)
    assert [bucket.take() for _ in range(4)] == [0.0, 0.0, 0.0, 1.0]
    for rate, burst in ((0, 1), (-1, 1), (1, 0), (1, 1.5), (1, True)):
        with pytest.raises(ValueError):
            TokenBucket(rate, burst)
    with pytest.raises(ValueError, match="submit_rate"):
        BridgeServer(socket_path="/nonexistent/x.sock", plugin_id="p", token="t", hub=InMemoryHub(), submit_rate=-1)
    with pytest.raises(ValueError, match="HelloGate"):
        BridgeServer(socket_path="/nonexistent/x.sock", plugin_id="p", token="t", hub=InMemoryHub(), gate=None)
    with pytest.raises(ValueError):
        HelloGate(deadline_secs=0)


def test_callers_refused_one_after_another_are_told_tokens_one_after_another_as_far_as_the_bucket_holds():
    """Told the same next token, every submit waiting came back at once and all but one were refused again (with 16
    chats waiting, some 13 refusals per message taken); told successive tokens, each comes back to its own."""
    clock = Clock()
    bucket = TokenBucket(10.0, 3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [bucket.take() for _ in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.3])  # (no further than 3 tokens)
    clock.advance(0.1)
    assert bucket.take() == 0.0  # the first caller's token, when it was told
    assert bucket.take() == pytest.approx(0.2)  # the next refused is told one after those still waiting
    clock.advance(10.0)  # the bucket full again: those told are served, or gone
    assert [bucket.take() for _ in range(4)] == pytest.approx([0.0, 0.0, 0.0, 0.1])


def _limited_bridge(burst: int) -> tuple[MockBridge, Clock]:
    bridge = MockBridge("test-plugin", heartbeat_secs=0.05, submit_rate=10.0, submit_burst=burst)
    clock = Clock()
    bridge.server.submits = TokenBucket(10.0, burst, clock=clock)  # tokens come only when the test says
    return bridge, clock


def test_the_sdk_waits_out_the_rate_and_sends_again_until_taken_in_order_counting_no_try(tmp_path):
    bridge, clock = _limited_bridge(burst=2)
    ids = [f"m-{i}" for i in range(1, 6)]
    with bridge:
        worker = FileChannelWorker(**bridge.worker_kwargs(sends=tmp_path / "sends", state_dir=str(tmp_path / "s"),
                                                          inbox=[message(i) for i in ids]))
        running = Running(worker)
        try:
            while len(bridge.hub.inbound) < len(ids):
                # no token until the host has refused one more: every message past the burst is refused first
                refusals = bridge.server.rate_limited
                bridge.wait_for(lambda: bridge.server.rate_limited > refusals or len(bridge.hub.inbound) == len(ids))
                clock.advance(0.1)  # one token
            bridge.wait_for(lambda: len(worker.submit_results) == len(ids))
            assert all(r.accepted and not r.queued for r in worker.submit_results), worker.submit_results
            assert [m.message_id for m in bridge.hub.submit_log] == ids  # each once, in order
            assert bridge.server.rate_limited >= 3
            rows = [worker.outbox.inbound_get(message(i).key) for i in ids]
            assert [(r.state, r.attempts) for r in rows] == [(ACKED, 1)] * len(ids)  # the refusals counted no try
        finally:
            assert running.stop() == 0


def test_a_message_refused_over_the_rate_when_the_worker_stops_stays_owed_and_goes_after_the_restart(tmp_path):
    bridge, clock = _limited_bridge(burst=1)
    state = str(tmp_path / "s")
    with bridge:
        worker = FileChannelWorker(**bridge.worker_kwargs(sends=tmp_path / "sends", state_dir=state,
                                                          inbox=[message("m-1"), message("m-2")],
                                                          drain_timeout_secs=0.2))
        running = Running(worker)
        bridge.wait_for(lambda: bridge.server.rate_limited >= 2)  # m-2 refused, waited out, refused again
        assert running.stop() == 0
        assert [m.message_id for m in bridge.hub.inbound] == ["m-1"]
        outbox = Outbox(worker.outbox_path, plugin_id=bridge.plugin_id, state_dir=state)
        try:
            assert outbox.inbound_get(message("m-2").key).state == PENDING
        finally:
            outbox.close()
        clock.advance(1.0)
        again = FileChannelWorker(**bridge.worker_kwargs(sends=tmp_path / "sends", state_dir=state))
        running = Running(again)
        bridge.wait_for(lambda: len(bridge.hub.inbound) == 2)
        assert [m.message_id for m in bridge.hub.submit_log] == ["m-1", "m-2"]
        assert running.stop() == 0


def test_a_backlog_owed_at_a_restart_does_not_hold_up_deliveries_while_it_waits_out_the_rate(tmp_path):
    """The opening replay ran before the first poll: after a restart with messages owed, every outbound
    delivery and new message waited until the whole backlog was taken, at the bridge's rate (found reviewing)."""
    bridge, clock = _limited_bridge(burst=1)
    state = str(tmp_path / "s")
    sends = tmp_path / "sends"
    with bridge:
        worker = FileChannelWorker(**bridge.worker_kwargs(sends=sends, state_dir=state, drain_timeout_secs=0.2,
                                                          inbox=[message(f"m-{i}") for i in range(1, 5)]))
        running = Running(worker)
        bridge.wait_for(lambda: bridge.server.rate_limited >= 1)  # m-1 taken; m-2 waits for a token
        assert running.stop() == 0
        again = FileChannelWorker(**bridge.worker_kwargs(sends=sends, state_dir=state))
        running = Running(again)
        try:
            delivery_id = bridge.queue_delivery("chat-9", "an answer")
            # no token comes: the backlog (m-2..m-4) cannot go, and the delivery goes all the same
            bridge.wait_for(lambda: bridge.delivery(delivery_id)["state"] == "delivered")
            assert delivery_id in sends.read_text().split()
            assert [m.message_id for m in bridge.hub.inbound] == ["m-1"]
            while len(bridge.hub.inbound) < 4:  # the backlog then goes, in order, as tokens come
                refusals = bridge.server.rate_limited
                bridge.wait_for(lambda: bridge.server.rate_limited > refusals or len(bridge.hub.inbound) == 4)
                clock.advance(0.1)
            assert [m.message_id for m in bridge.hub.submit_log] == ["m-1", "m-2", "m-3", "m-4"]
        finally:
            assert running.stop() == 0
