"""The JSON-RPC 2.0 layer and the bridge server: the spec's examples, malformed frames, hello, the socket."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from plugins_app.channel.bridge import (
    AddressInUse,
    BridgeServer,
    InMemoryHub,
    JsonRpcSocketServer,
    ServerThread,
)
from plugins_app.channel.sdk.jsonrpc import (
    AUTHENTICATION_FAILED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MEDIA_NOT_FOUND,
    METHOD_NOT_FOUND,
    NOT_AUTHENTICATED,
    PARSE_ERROR,
    UNKNOWN_DELIVERY,
    Dispatcher,
    LineSplitter,
    FrameTooLarge,
    RPCError,
)

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "jsonrpc2-examples.json"


SPEC = json.loads(SPEC_PATH.read_text())
EXAMPLES = SPEC["examples"]
PLUGIN_ID = "telegram-main"
TOKEN = "per-start-token-1"


# -- the spec's method table -----------------------------------------------------------

def subtract(minuend, subtrahend):
    return minuend - subtrahend


def sum_(*numbers):
    return sum(numbers)


NOTIFIED: list = []


def update(*args):
    NOTIFIED.append(("update", args))


def notify_hello(*args):
    NOTIFIED.append(("notify_hello", args))


def get_data():
    return ["hello", 5]


SPEC_METHODS = {"subtract": subtract, "sum": sum_, "update": update, "notify_hello": notify_hello,
                "get_data": get_data}


def canonical(response):
    """Batch responses may come in any order: compare them as a sorted list."""
    if isinstance(response, list):
        return sorted(json.dumps(r, sort_keys=True) for r in response)
    return response


# -- a raw line-oriented socket client -----------------------------------------------------


class LineConn:
    """Frames in, frames out, on a plain socket, so tests can send anything at all."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.splitter = LineSplitter(1 << 30)
        self.frames: list = []

    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode() if isinstance(data, str) else data)

    def send_line(self, text: str) -> None:
        # A frame may not contain a raw newline: compact the spec's pretty-printed text.
        self.send(text.replace("\n", " ") + "\n")

    def recv(self, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while not self.frames:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            self.frames.extend(json.loads(f) for f in self.splitter.feed(data))
        return self.frames.pop(0)

    def call(self, method: str, params=None, id=1):
        obj = {"jsonrpc": "2.0", "method": method, "id": id}
        if params is not None:
            obj["params"] = params
        self.send_line(json.dumps(obj))
        return self.recv()

    def exchange(self, text: str):
        """Send a frame; return its response, or None when the server (rightly) sent nothing.

        Silence is proven by two sentinel round trips after the frame: any answer to
        it would have been written before them.
        """
        self.send_line(text)
        got = []
        for sentinel in ("sentinel-1", "sentinel-2"):
            self.send_line(json.dumps({"jsonrpc": "2.0", "method": "get_data", "id": sentinel}))
            while True:
                frame = self.recv()
                if isinstance(frame, dict) and frame.get("id") == sentinel:
                    break
                got.append(frame)
        assert len(got) <= 1, got
        return got[0] if got else None

    def close(self):
        self.sock.close()


def short_socket_dir() -> str:
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="ugb-")


@pytest.fixture(scope="module")
def transport_server():
    path = os.path.join(short_socket_dir(), "rpc.sock")
    server = JsonRpcSocketServer(path, lambda conn: Dispatcher(SPEC_METHODS))
    with ServerThread(server):
        yield path


@pytest.fixture
def hub():
    return InMemoryHub(max_in_flight=4, max_retries=2, heartbeat_secs=7)


@pytest.fixture
def bridge(hub):
    path = os.path.join(short_socket_dir(), "bridge.sock")
    server = BridgeServer(socket_path=path, plugin_id=PLUGIN_ID, token=TOKEN, hub=hub,
                          extra_methods=SPEC_METHODS, max_frame_bytes=4096)
    with ServerThread(server):
        yield server


def hello_params(**over):
    p = {"plugin_id": PLUGIN_ID, "token": TOKEN, "kind": "channel-telegram", "version": "1.2.3",
         "capabilities": ["media"]}
    p.update(over)
    return p


@pytest.fixture
def conn(bridge):
    c = LineConn(bridge.socket_path)
    response = c.call("hello", hello_params(), id="hello")
    assert "result" in response, response
    yield c
    c.close()


# -- the spec's examples -------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["id"] for e in EXAMPLES])
def test_the_dispatcher_answers_each_spec_example_as_the_spec_shows(example):
    out = Dispatcher(SPEC_METHODS).handle_frame(example["request_text"])
    if example["response"] is None:
        assert out is None
    else:
        assert out.endswith(b"\n") and b"\n" not in out[:-1]
        assert canonical(json.loads(out)) == canonical(example["response"])


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["id"] for e in EXAMPLES])
def test_the_async_dispatcher_answers_each_spec_example_as_the_spec_shows(example):
    out = asyncio.run(Dispatcher(SPEC_METHODS).handle_frame_async(example["request_text"]))
    expected = example["response"]
    assert (out is None) if expected is None else canonical(json.loads(out)) == canonical(expected)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["id"] for e in EXAMPLES])
def test_each_spec_example_over_the_socket_transport(transport_server, example):
    c = LineConn(transport_server)
    try:
        assert canonical(c.exchange(example["request_text"])) == canonical(example["response"])
    finally:
        c.close()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["id"] for e in EXAMPLES])
def test_each_spec_example_through_the_bridge_after_hello(conn, example):
    assert canonical(conn.exchange(example["request_text"])) == canonical(example["response"])


def test_notifications_run_their_method_without_an_answer():
    NOTIFIED.clear()
    assert Dispatcher(SPEC_METHODS).handle_frame('{"jsonrpc": "2.0", "method": "update", "params": [1,2,3,4,5]}') is None
    assert NOTIFIED == [("update", (1, 2, 3, 4, 5))]


def test_the_spec_error_codes_are_the_tables():
    codes = {e["code"]: e["message"] for e in SPEC["error_codes"] if "code" in e}
    assert codes == {PARSE_ERROR: "Parse error", INVALID_REQUEST: "Invalid Request",
                     METHOD_NOT_FOUND: "Method not found", INVALID_PARAMS: "Invalid params",
                     INTERNAL_ERROR: "Internal error"}
    low, high = next(e["code_range"] for e in SPEC["error_codes"] if "code_range" in e)
    for code in (NOT_AUTHENTICATED, AUTHENTICATION_FAILED, UNKNOWN_DELIVERY, MEDIA_NOT_FOUND):
        assert low <= code <= high


# -- dispatcher details the examples do not show ---------------------------------------------


def _answer(frame, methods=SPEC_METHODS):
    out = Dispatcher(methods).handle_frame(frame)
    return None if out is None else json.loads(out)


def test_params_that_do_not_fit_the_method_are_invalid_params():
    r = _answer('{"jsonrpc": "2.0", "method": "subtract", "params": [1, 2, 3], "id": 7}')
    assert r["error"]["code"] == INVALID_PARAMS and r["id"] == 7
    r = _answer('{"jsonrpc": "2.0", "method": "subtract", "params": {"minuend": 1}, "id": 8}')
    assert r["error"]["code"] == INVALID_PARAMS


def test_a_failing_method_is_an_internal_error_that_leaks_nothing():
    def boom():
        raise KeyError("secret detail")

    r = _answer('{"jsonrpc": "2.0", "method": "boom", "id": 1}', {"boom": boom})
    assert r == {"jsonrpc": "2.0", "error": {"code": INTERNAL_ERROR, "message": "Internal error"}, "id": 1}


def test_a_notification_is_not_answered_even_when_it_fails():
    def boom():
        raise RuntimeError

    assert _answer('{"jsonrpc": "2.0", "method": "boom"}', {"boom": boom}) is None
    assert _answer('{"jsonrpc": "2.0", "method": "nope", "params": [1]}') is None


def test_an_rpc_error_raised_by_a_method_reaches_the_caller():
    def refuse():
        raise RPCError(-32050, "Refused", {"why": "test"})

    r = _answer('{"jsonrpc": "2.0", "method": "refuse", "id": "x"}', {"refuse": refuse})
    assert r["error"] == {"code": -32050, "message": "Refused", "data": {"why": "test"}}


@pytest.mark.parametrize("frame, rid", [
    ('{"jsonrpc": "1.0", "method": "get_data", "id": 3}', 3),
    ('{"jsonrpc": "2.0", "method": "get_data", "params": 5, "id": "a"}', "a"),
    ('{"jsonrpc": "2.0", "method": "get_data", "id": {"x": 1}}', None),
    ('{"jsonrpc": "2.0", "method": "get_data", "id": true}', None),
    ('{"method": "get_data", "id": 4}', 4),
])
def test_invalid_request_objects_echo_a_readable_id_or_null(frame, rid):
    r = _answer(frame)
    assert r["error"]["code"] == INVALID_REQUEST and r["id"] == rid


def test_methods_beginning_with_rpc_dot_are_reserved():
    r = _answer('{"jsonrpc": "2.0", "method": "rpc.get_data", "id": 1}', {"rpc.get_data": get_data})
    assert r["error"]["code"] == METHOD_NOT_FOUND


def test_a_null_id_is_a_request_not_a_notification():
    assert _answer('{"jsonrpc": "2.0", "method": "get_data", "id": null}') == \
        {"jsonrpc": "2.0", "result": ["hello", 5], "id": None}


@pytest.mark.parametrize("frame", [b"\xff\xfe{}", b'{"jsonrpc": "2.0", "method": "sum", "params": [NaN], "id": 1}'])
def test_bytes_that_are_not_json_are_a_parse_error(frame):
    r = _answer(frame)
    assert r == {"jsonrpc": "2.0", "error": {"code": PARSE_ERROR, "message": "Parse error"}, "id": None}


def test_the_splitter_bounds_a_frame_and_recovers_at_the_next_newline():
    s = LineSplitter(10)
    assert s.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    out = s.feed(b":" + b"x" * 50)
    assert out == []
    out = s.feed(b"yyy\n\n  \r\n[1]\r\n")
    assert isinstance(out[0], FrameTooLarge) and out[0].size > 10
    assert out[1:] == [b"[1]"]  # blank lines are skipped, CRLF is tolerated


# -- malformed frames on a live connection ------------------------------------------------------


@pytest.mark.parametrize("frame, code", [
    ('{"jsonrpc": "2.0", "method": "sum", "params": [1,2', PARSE_ERROR),
    ("not json at all", PARSE_ERROR),
    ('"a string"', INVALID_REQUEST),
    ("42", INVALID_REQUEST),
    ("null", INVALID_REQUEST),
    ("true", INVALID_REQUEST),
    ("[]", INVALID_REQUEST),
])
def test_a_malformed_frame_gets_its_error_code_and_the_connection_survives(conn, frame, code):
    r = conn.exchange(frame)
    assert r["error"]["code"] == code and r["id"] is None
    assert conn.call("sum", [1, 2], id=99) == {"jsonrpc": "2.0", "result": 3, "id": 99}


def test_invalid_utf8_is_a_parse_error_and_the_connection_survives(conn):
    conn.send(b"\xc3\x28\xff\n")
    assert conn.recv()["error"]["code"] == PARSE_ERROR
    assert conn.call("sum", [2, 2], id=5)["result"] == 4


def test_a_huge_line_is_refused_and_the_connection_survives(conn):
    # Sent in pieces, as a real stream arrives; the server never buffers it whole.
    for _ in range(10):
        conn.send(b'{"jsonrpc":"2.0","method":"sum","params":[' + b"1," * 1000)
    conn.send(b"1]}\n")
    r = conn.recv()
    assert r["error"]["code"] == INVALID_REQUEST and r["id"] is None
    assert r["error"]["data"] == {"reason": "frame too large", "max_frame_bytes": 4096}
    assert conn.call("sum", [3, 4], id=6)["result"] == 7


def test_a_huge_line_before_hello_is_refused_and_hello_still_works(bridge):
    c = LineConn(bridge.socket_path)
    try:
        c.send(b"x" * 10000 + b"\n")
        assert c.recv()["error"]["code"] == INVALID_REQUEST
        assert "result" in c.call("hello", hello_params())
    finally:
        c.close()


# -- hello and the token ------------------------------------------------------------------


def test_methods_before_hello_are_refused_with_a_documented_code_and_the_connection_stays(bridge, hub):
    c = LineConn(bridge.socket_path)
    try:
        for method, params in (("heartbeat", {}), ("outbound.poll", {"timeout_secs": 0}), ("sum", [1, 2])):
            r = c.call(method, params, id=method)
            assert r["error"] == {"code": NOT_AUTHENTICATED, "message": "Not authenticated: call hello first"}
        assert hub.heartbeats == 0
        assert "result" in c.call("hello", hello_params())
        assert c.call("heartbeat", {}, id=2)["result"]["ok"] is True
        assert hub.heartbeats == 1
    finally:
        c.close()


@pytest.mark.parametrize("over", [{"token": "wrong"}, {"plugin_id": "other-plugin"}, {"token": TOKEN + "x"}])
def test_hello_with_a_wrong_token_or_plugin_id_is_refused_and_a_right_one_then_works(bridge, hub, over):
    c = LineConn(bridge.socket_path)
    try:
        r = c.call("hello", hello_params(**over))
        assert r["error"] == {"code": AUTHENTICATION_FAILED, "message": "Authentication failed"}
        assert c.call("heartbeat", {}, id=2)["error"]["code"] == NOT_AUTHENTICATED
        assert hub.hellos == []
        ok = c.call("hello", hello_params(), id=3)["result"]
        assert ok["plugin_id"] == PLUGIN_ID and ok["protocol_version"] == 1
        assert (ok["heartbeat_secs"], ok["max_in_flight"], ok["max_retries"]) == (7, 4, 2)
        info = hub.hellos[0]
        assert (info["kind"], info["version"], info["capabilities"]) == ("channel-telegram", "1.2.3", ["media"])
        assert info["peer_pid"] == os.getpid()
    finally:
        c.close()


def test_hello_with_a_missing_field_names_it(bridge):
    c = LineConn(bridge.socket_path)
    try:
        params = hello_params()
        del params["token"]
        r = c.call("hello", params)
        assert r["error"]["code"] == INVALID_PARAMS and "token" in r["error"]["message"]
        r = c.call("hello", ["positional"], id=2)
        assert r["error"]["code"] == INVALID_PARAMS
    finally:
        c.close()


def test_a_rotated_token_refuses_the_old_one(bridge):
    bridge.set_token("per-start-token-2")
    c = LineConn(bridge.socket_path)
    try:
        assert c.call("hello", hello_params())["error"]["code"] == AUTHENTICATION_FAILED
        assert "result" in c.call("hello", hello_params(token="per-start-token-2"), id=2)
    finally:
        c.close()


def test_a_new_hello_replaces_the_previous_session(bridge, hub):
    first = LineConn(bridge.socket_path)
    second = LineConn(bridge.socket_path)
    try:
        assert "result" in first.call("hello", hello_params())
        delivery_id = hub.enqueue("chat", "hi")
        assert first.call("outbound.poll", {"timeout_secs": 0}, id=2)["result"]["deliveries"][0]["delivery_id"] \
            == delivery_id
        assert "result" in second.call("hello", hello_params())
        with pytest.raises((ConnectionError, OSError)):
            first.recv(timeout=2)  # the old session's connection is closed
        # What the old session held is handed out again.
        again = second.call("outbound.poll", {"timeout_secs": 0}, id=3)["result"]["deliveries"]
        assert [d["delivery_id"] for d in again] == [delivery_id]
    finally:
        first.close()
        second.close()


# -- the socket file ------------------------------------------------------------------


def test_the_socket_is_created_with_mode_0600(bridge):
    mode = os.stat(bridge.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_stale_socket_file_is_replaced_and_removed_on_close():
    path = os.path.join(short_socket_dir(), "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, with nobody listening: what a crashed host leaves
    server = BridgeServer(socket_path=path, plugin_id=PLUGIN_ID, token=TOKEN, hub=InMemoryHub())
    with ServerThread(server):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        c = LineConn(path)
        assert "result" in c.call("hello", hello_params())
        c.close()
    assert not os.path.exists(path)


def test_a_live_socket_is_not_taken_over_and_a_regular_file_is_not_deleted(bridge):
    other = BridgeServer(socket_path=bridge.socket_path, plugin_id=PLUGIN_ID, token=TOKEN, hub=InMemoryHub())
    with pytest.raises(AddressInUse):
        ServerThread(other).start()
    plain = os.path.join(short_socket_dir(), "plain.sock")
    Path(plain).write_text("keep me")
    with pytest.raises(FileExistsError):
        ServerThread(BridgeServer(socket_path=plain, plugin_id=PLUGIN_ID, token=TOKEN, hub=InMemoryHub())).start()
    assert Path(plain).read_text() == "keep me"


# -- method params ----------------------------------------------------------------------


def _message(**over):
    m = {"channel": "telegram", "conversation_id": "chat-1", "message_id": "m-1", "sender_id": "u-1",
         "source_type": "user", "sender_name": "Ada", "text": "hi", "timestamp": "2024-05-01T12:00:00Z"}
    m.update(over)
    return m


@pytest.mark.parametrize("message, field", [
    (_message(sender_id=None), "message.sender_id"),
    (_message(source_type="channel"), "message.source_type"),
    (_message(timestamp="yesterday"), "message.timestamp"),
    (_message(timestamp="2024-05-01T12:00:00"), "message.timestamp"),
    (_message(attachments=[{"kind": "sticker", "content_type": "image/webp", "url": "https://x"}]),
     "message.attachments[0].kind"),
    (_message(attachments=[{"kind": "image", "content_type": "png", "url": "https://x"}]),
     "message.attachments[0].content_type"),
    (_message(attachments=[{"kind": "image", "content_type": "image/png"}]), "message.attachments[0].media_id"),
    (_message(text="", attachments=[]), "message.text"),
    (_message(reply_to={"text": "x"}), "message.reply_to.message_id"),
    ("not an object", "message"),
])
def test_an_invalid_inbound_message_is_invalid_params_naming_the_field(conn, hub, message, field):
    r = conn.call("inbound.submit", {"message": message}, id=1)
    assert r["error"]["code"] == INVALID_PARAMS
    assert r["error"]["message"].startswith(f"Invalid params: {field}:")
    assert r["error"]["data"]["field"] == field
    assert hub.submit_log == []


def test_a_valid_inbound_message_is_accepted_once(conn, hub):
    first = conn.call("inbound.submit", {"message": _message()}, id=1)["result"]
    again = conn.call("inbound.submit", {"message": _message()}, id=2)["result"]
    assert (first["accepted"], first["duplicate"]) == (True, False)
    assert (again["accepted"], again["duplicate"]) == (True, True)
    assert [m.message_id for m in hub.inbound] == ["m-1"]


@pytest.mark.parametrize("params, field", [
    ({"status": "delivered"}, "delivery_id"),
    ({"delivery_id": "d", "status": "sent"}, "status"),
    ({"delivery_id": "d", "status": "failed", "reason": "x"}, "retryable"),
    ({"delivery_id": "d", "status": "failed", "retryable": True}, "reason"),
    ({"delivery_id": "d", "status": "failed", "retryable": "yes", "reason": "x"}, "retryable"),
])
def test_an_invalid_ack_is_invalid_params_naming_the_field(conn, params, field):
    r = conn.call("outbound.ack", params)
    assert r["error"]["code"] == INVALID_PARAMS and r["error"]["data"]["field"] == field


def test_an_ack_for_an_unknown_delivery_is_its_own_code(conn):
    r = conn.call("outbound.ack", {"delivery_id": "nope", "status": "delivered"})
    assert r["error"]["code"] == UNKNOWN_DELIVERY


@pytest.mark.parametrize("params, field", [
    ({"max_items": 0}, "max_items"), ({"max_items": True}, "max_items"), ({"timeout_secs": -1}, "timeout_secs"),
])
def test_invalid_poll_params_name_the_field(conn, params, field):
    assert conn.call("outbound.poll", params)["error"]["data"]["field"] == field


def test_media_round_trips_and_errors_have_codes(conn):
    put = conn.call("media.put", {"content_type": "image/png", "filename": "a.png",
                                  "data_base64": base64.b64encode(b"\x89PNG").decode()})["result"]
    assert put["size"] == 4
    got = conn.call("media.get", {"media_id": put["media_id"]}, id=2)["result"]
    assert base64.b64decode(got["data_base64"]) == b"\x89PNG" and got["content_type"] == "image/png"
    assert conn.call("media.get", {"media_id": "missing"}, id=3)["error"]["code"] == MEDIA_NOT_FOUND
    bad = conn.call("media.put", {"content_type": "image/png", "data_base64": "***"}, id=4)["error"]
    assert bad["code"] == INVALID_PARAMS and bad["data"]["field"] == "data_base64"


def test_a_long_poll_of_a_replaced_session_takes_nothing_from_the_new_one(bridge, hub):
    old = LineConn(bridge.socket_path)
    new = LineConn(bridge.socket_path)
    try:
        assert "result" in old.call("hello", hello_params())
        delivery_id = hub.enqueue("chat", "hi")
        assert old.call("outbound.poll", {"timeout_secs": 0}, id=2)["result"]["deliveries"]
        # The old worker waits in a long-poll when the new one says hello and the
        # delivery is requeued: the stale poll must not snatch it back.
        old.send_line(json.dumps({"jsonrpc": "2.0", "method": "outbound.poll", "params": {"timeout_secs": 30},
                                  "id": 3}))
        time.sleep(0.05)
        assert "result" in new.call("hello", hello_params())
        again = new.call("outbound.poll", {"timeout_secs": 1}, id=4)["result"]["deliveries"]
        assert [d["delivery_id"] for d in again] == [delivery_id]
    finally:
        old.close()
        new.close()


class ClaimRecordingHub(InMemoryHub):
    """Records the claim each ack reaches the hub with."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.acked_claims = []

    async def ack_outbound(self, plugin_id, delivery_id, status, retryable, reason, channel_message_id=None,
                           claim=None):
        self.acked_claims.append((delivery_id, claim))
        return await super().ack_outbound(plugin_id, delivery_id, status, retryable, reason, channel_message_id,
                                          claim=claim)


def test_a_delivery_carries_its_claim_and_an_ack_without_one_is_matched_to_its_sessions_claim():
    hub = ClaimRecordingHub(max_in_flight=4, max_retries=2, heartbeat_secs=7)
    path = os.path.join(short_socket_dir(), "bridge.sock")
    server = BridgeServer(socket_path=path, plugin_id=PLUGIN_ID, token=TOKEN, hub=hub)
    with ServerThread(server):
        c = LineConn(path)
        try:
            assert "result" in c.call("hello", hello_params(), id="hello")
            delivery_id = hub.enqueue("chat", "hi")
            [wire] = c.call("outbound.poll", {"timeout_secs": 0}, id=2)["result"]["deliveries"]
            assert wire["claim"] and wire["claim"] == hub.delivery(delivery_id)["claim"]
            # a worker that predates claims acks without one: the bridge supplies its session's
            out = c.call("outbound.ack", {"delivery_id": delivery_id, "status": "failed", "retryable": True,
                                          "reason": "try again"}, id=3)["result"]
            assert (out["state"], out["attempt"], out["duplicate"]) == ("pending", 2, False)
            other = hub.enqueue("chat", "not polled by this session")
            c.call("outbound.ack", {"delivery_id": other, "status": "delivered"}, id=4)
        finally:
            c.close()
    # the unpolled delivery: this session holds no claim on it ("" , not "unknown")
    assert hub.acked_claims == [(delivery_id, wire["claim"]), (other, "")]
    assert hub.delivery(other)["state"] == "delivered"  # the truth is accepted whoever tells it


@pytest.mark.parametrize("method, params, field, reason", [
    ("heartbeat", {"stats": []}, "stats", "must be an object"),
    ("inbound.submit", {}, "message", "is required"),
    ("inbound.submit", {"message": _message(attachments=[{"kind": "sticker", "content_type": "image/webp",
                                                          "url": "https://x"}])},
     "message.attachments[0].kind", "must be one of image, audio, video, document, other"),
    ("outbound.poll", {"max_items": "3"}, "max_items", "must be an integer"),
    ("outbound.poll", {"max_items": 0}, "max_items", "must be at least 1"),
    ("outbound.poll", {"timeout_secs": True}, "timeout_secs", "must be a number"),
    ("outbound.ack", {"delivery_id": "d", "status": "sent"}, "status", "must be one of delivered, failed"),
    ("outbound.ack", {"delivery_id": "d", "status": "failed", "reason": "x"}, "retryable",
     "is required when status is failed"),
    ("outbound.ack", {"delivery_id": "", "status": "delivered"}, "delivery_id", "must not be empty"),
    ("outbound.ack", {"delivery_id": "d", "status": "delivered", "claim": 7}, "claim", "must be a string"),
    ("media.get", {"media_id": None}, "media_id", "is required"),
    ("media.put", {"content_type": "png", "data_base64": ""}, "content_type", "must be a MIME type such as image/png"),
    ("media.put", {"content_type": "image/png", "data_base64": "***"}, "data_base64", "must be standard base64"),
])
def test_bad_params_are_one_error_style_naming_the_field_and_changing_nothing(conn, hub, method, params, field,
                                                                              reason):
    error = conn.call(method, params)["error"]
    assert (error["code"], error["message"], error["data"]) == \
        (INVALID_PARAMS, f"Invalid params: {field}: {reason}", {"field": field, "reason": reason})
    assert hub.submit_log == [] and hub.ack_log == [] and hub.deliveries() == []


def test_hello_with_another_protocol_version_is_refused_naming_the_field(bridge):
    c = LineConn(bridge.socket_path)
    try:
        error = c.call("hello", hello_params(protocol_version=2))["error"]
        assert error["message"] == "Invalid params: protocol_version: unsupported; this host speaks 1"
        assert c.call("hello", ["positional"], id=2)["error"]["message"] == \
            "Invalid params: params must be an object (named parameters)"
    finally:
        c.close()


# -- batches: each call takes a slot of the connection's limit -------------------------------


def _batch(method, n, params=None):
    return json.dumps([{"jsonrpc": "2.0", "method": method, "params": params or [i], "id": i} for i in range(n)],
                      separators=(",", ":"))


def test_a_batch_longer_than_the_in_flight_limit_is_refused_whole_and_runs_nothing(transport_server):
    c = LineConn(transport_server)
    try:
        before = len(NOTIFIED)
        answer = c.exchange(_batch("update", 65))
        # One Response object, not an array: the batch as a whole is invalid (like an empty one).
        assert answer == {"jsonrpc": "2.0", "id": None, "error": {
            "code": INVALID_REQUEST, "message": "Invalid Request: a batch of 65 calls is over the limit of 64",
            "data": {"reason": "batch too long", "size": 65, "max_batch_calls": 64}}}
        assert len(NOTIFIED) == before
        assert c.call("sum", [1, 2], id="after")["result"] == 3
    finally:
        c.close()


def test_a_batch_within_the_limit_is_answered_call_by_call(conn):
    answer = conn.exchange(_batch("sum", 64, [2, 3]))
    assert sorted(r["id"] for r in answer) == list(range(64))
    assert {r["result"] for r in answer} == {5}


def test_a_batch_longer_than_the_limit_before_hello_is_refused_and_hello_still_works(bridge):
    c = LineConn(bridge.socket_path)
    try:
        c.send_line(_batch("x", 65))  # the bridge's frames are at most 4096 bytes here
        assert c.recv()["error"]["data"]["reason"] == "batch too long"
        assert "result" in c.call("hello", hello_params())
    finally:
        c.close()
