"""The worker SDK's webhook server (plugins_app/channel/sdk/webhook.py), the one home of what every channel's
HTTP endpoint needs: bodies read whole up to a limit, a refused body never read as a next request, a
stalled client let go, answers as JSON or text."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from plugins_app.channel.sdk.webhook import WebhookServer

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


class Recorder(WebhookServer):
    name = "test-webhook"
    max_body_bytes = 64
    timeout = 0.5

    def __init__(self):
        super().__init__("127.0.0.1:0", "/hook")
        self.seen: list = []

    def respond(self, method, target, headers, body):
        if body is None:
            return 413, "too large"
        self.seen.append((method, target, body))
        return (200, {"ok": True}) if method == "POST" else (200, "pong")


@pytest.fixture
def server():
    s = Recorder()
    s.start()
    yield s
    s.stop()


def test_answers_are_json_or_text_and_bodies_reach_the_handler(server):
    posted = httpx.post(server.url, content=b'{"a": 1}')
    assert (posted.status_code, posted.headers["content-type"], posted.json()) == (200, "application/json", {"ok": True})
    got = httpx.get(server.url + "?x=1")
    assert (got.text, got.headers["content-type"]) == ("pong", "text/plain; charset=utf-8")
    assert server.seen == [("POST", "/hook", b'{"a": 1}'), ("GET", "/hook?x=1", b"")]


def raw_exchange(server, data: bytes) -> bytes:
    with socket.create_connection(server.httpd.server_address[:2], timeout=5) as conn:
        conn.sendall(data)
        received = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                return received  # the server closed the connection
            received += chunk


def test_a_refused_body_is_never_read_as_a_next_request(server):
    inner = b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    outer = b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    answered = raw_exchange(server, outer + inner)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"413"] and server.seen == []


def test_a_client_that_stalls_mid_body_is_let_go(server):
    answered = raw_exchange(server, b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    assert server.seen == [] and b"200" not in answered  # closed after its timeout, nothing handled


def test_a_gets_body_is_never_read_as_a_next_request(server):
    """WhatsApp's and WeCom's webhooks answer GET (their verification): a body sent with one is not read, and
    must not be served as the next request on the connection."""
    inner = b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    outer = b"GET /hook HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(inner)).encode() + b"\r\n\r\n"
    answered = raw_exchange(server, outer + inner)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"200"] and server.seen == [("GET", "/hook", b"")]


class Narrow(Recorder):
    max_connections = 2
    timeout = 30.0  # the stalled connections below hold their threads for as long as the test needs


def test_connections_past_max_connections_wait_for_a_thread_and_are_then_served():
    server = Narrow()
    server.start()
    address = server.httpd.server_address[:2]
    stalled = [socket.create_connection(address, timeout=5) for _ in range(2)]  # each holds a thread, saying nothing
    try:
        for conn in stalled:
            conn.sendall(b"POST /hook HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        waiting = socket.create_connection(address, timeout=1)
        waiting.sendall(b"GET /hook HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with pytest.raises(socket.timeout):  # no third thread: it waits in the backlog
            waiting.recv(100)
        stalled.pop().close()  # a thread is free again
        waiting.settimeout(10)
        assert waiting.recv(100).startswith(b"HTTP/1.1 200")
        waiting.close()
    finally:
        for conn in stalled:
            conn.close()
        server.stop()


def test_a_connection_trickling_bytes_is_cut_at_its_deadline_and_frees_its_thread():
    class Short(Narrow):
        timeout = 5.0
        connection_deadline = 1.0

    server = Short()
    server.start()
    address = server.httpd.server_address[:2]
    trickling = [socket.create_connection(address, timeout=10) for _ in range(2)]
    try:
        for conn in trickling:
            conn.sendall(b"POST /hook HTTP/1.1\r\n")  # and a header line now and then, never the end
        waiting = socket.create_connection(address, timeout=10)
        waiting.sendall(b"GET /hook HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for conn in trickling:
            try:
                conn.sendall(b"X-Slow: 1\r\n")  # within the read timeout: only the deadline ends it
            except OSError:
                pass
        assert waiting.recv(100).startswith(b"HTTP/1.1 200")  # a thread was freed by the deadline
        assert all(conn.recv(100) == b"" for conn in trickling)  # cut
        waiting.close()
    finally:
        for conn in trickling:
            conn.close()
        server.stop()



def test_telegrams_webhook_and_gmails_push_endpoint_are_bounded_too():
    import inspect

    from plugins_app.channel.sdk.webhook import BoundedHTTPServer
    from plugins_app.channel.workers.email import gmail
    from plugins_app.channel.workers.telegram import worker as telegram
    for module in (telegram, gmail):  # (their handlers are their own; the server under them is the SDK's)
        source = inspect.getsource(module)
        assert "BoundedHTTPServer(" in source and "ThreadingHTTPServer(" not in source, module.__name__
    assert issubclass(BoundedHTTPServer, __import__("http.server").server.ThreadingHTTPServer)


def test_a_body_sent_chunked_is_answered_411_and_its_chunks_are_never_read_as_a_next_request(server, caplog):
    """(The stdlib reads no chunks: the body was taken as empty, and the chunk-size line parsed as a request.)"""
    body = b'{"a": 1}'
    chunked = (b"POST /hook HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    with caplog.at_level("WARNING", logger="ugent.worker.webhook"):
        answered = raw_exchange(server, chunked)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"411"] and server.seen == []
    assert "Transfer-Encoding" in caplog.text


@pytest.mark.parametrize("length", [b"abc", b"-5", b"1e3"])
def test_a_length_that_is_no_number_is_answered_400_unread(server, length):
    inner = b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    answered = raw_exchange(server, b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n" + inner)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"400"] and server.seen == []


def test_a_receiver_that_raises_is_answered_500_and_logged_once_with_its_traceback(caplog, capsys):
    import logging

    class Failing(Recorder):
        log = logging.getLogger("ugent.worker.test.failing")

        def respond(self, method, target, headers, body):
            raise RuntimeError("the receiver broke")

    server = Failing()
    server.start()
    try:
        with caplog.at_level("ERROR", logger="ugent.worker.test.failing"):
            answer = httpx.post(server.url, content=b"{}")
            again = httpx.post(server.url, content=b"{}")  # and the server goes on serving
    finally:
        server.stop()
    assert (answer.status_code, again.status_code) == (500, 500)
    failures = [r for r in caplog.records if r.name == "ugent.worker.test.failing"]
    assert len(failures) == 2 and all(r.exc_info and r.exc_info[0] is RuntimeError for r in failures)
    assert "Traceback" not in capsys.readouterr().err  # not the socketserver's own print as well


def test_a_body_that_ends_before_its_length_is_answered_400_and_never_handed_on(server):
    """A client that stops mid-body (a half-close, a proxy giving up, the connection's deadline) handed the
    part it sent to ``respond`` as the body: part of a message taken for the message."""
    with socket.create_connection(server.httpd.server_address[:2], timeout=5) as conn:
        conn.sendall(b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n" + b'{"a": "0123456789"')
        conn.shutdown(socket.SHUT_WR)
        answered = b""
        while chunk := conn.recv(65536):
            answered += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"400"] and server.seen == []
    assert answered.endswith(b"body ended after 18 of 40 bytes")


def test_content_lengths_that_differ_are_answered_400_unread_and_the_connection_closed(server):
    """(The first one was taken, and the bytes past it read as a next request: what a proxy that took the other
    one never saw. RFC 7230 §3.3.3: request smuggling.)"""
    smuggled = b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    answered = raw_exchange(server, b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: "
                                    + str(2 + len(smuggled)).encode() + b"\r\n\r\n{}" + smuggled)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answered) == [b"400"] and server.seen == []
    same = raw_exchange(server, b"POST /hook HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
                                b"Content-Length: 2\r\n\r\n{}")  # the same length twice is one length
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", same) == [b"200"] and server.seen == [("POST", "/hook", b"{}")]


def deeply_nested(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_nested_past_the_interpreters_depth_is_a_value_error():
    from plugins_app.channel.sdk.webhook import json_loads_bounded
    with pytest.raises(ValueError, match="nested too deep"):
        json_loads_bounded(deeply_nested())
    assert json_loads_bounded(b'{"a": [1]}') == {"a": [1]}


def signed_requests():
    """Each webhook's server and the headers that sign a body for it."""
    import hashlib
    import hmac
    import time

    from plugins_app.channel.workers.dingtalk.webhook import WebhookServer as DingTalk, signature as ding_sign
    from plugins_app.channel.workers.line.webhook import WebhookServer as Line, signature as line_sign
    from plugins_app.channel.workers.slack.webhook import EventsServer as Slack
    from plugins_app.channel.workers.whatsapp.webhook import (SIGNATURE_HEADER, WebhookServer as WhatsApp,
                                                                signature as meta_sign)

    def slack(body):
        ts = str(int(time.time()))
        digest = hmac.new(b"sec", f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
        return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": f"v0={digest}"}

    def ding(body):
        ts = str(int(time.time() * 1000))
        return {"timestamp": ts, "sign": ding_sign("sec", ts)}

    return {
        "slack": (lambda: Slack("127.0.0.1:0", "/h", "sec", print), slack),
        "line": (lambda: Line("127.0.0.1:0", "/h", "sec", print), lambda body: {"X-Line-Signature": line_sign("sec", body)}),
        "whatsapp": (lambda: WhatsApp("127.0.0.1:0", "/h", app_secret="sec", verify_token="v", on_payload=print),
                     lambda body: {SIGNATURE_HEADER: meta_sign("sec", body)}),
        "dingtalk": (lambda: DingTalk("127.0.0.1:0", "/h", "sec", print), ding),
    }


@pytest.mark.parametrize("channel", ["slack", "line", "whatsapp", "dingtalk"])
def test_a_signed_body_nested_too_deep_is_answered_400_by_every_channel_not_500(channel):
    make, sign = signed_requests()[channel]
    server = make()
    server.start()
    try:
        body = deeply_nested()
        answer = httpx.post(server.url, content=body, headers=dict(sign(body), **{"Content-Type": "application/json"}))
    finally:
        server.stop()
    assert answer.status_code == 400, answer.text


# A webhook in a worker that has reached its memory cap (RLIMIT_DATA, which each thread's whole stack counts
# against): the connection's own thread starts (the stack of one that just ended, which glibc keeps), its
# deadline timer's thread cannot. Then the cap eases, and the server must answer again.
# (in a script run apart) the process capped a little over what it holds, then threads started until no more can:
# `held` keeps them, each with the event that ends it
THREADS_TO_THE_CAP = '''
data = int([l for l in open("/proc/self/status") if l.startswith("VmData")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (data + (64 << 20), resource.RLIM_INFINITY))
held = []
try:
    while True:
        release = threading.Event()
        thread = threading.Thread(target=release.wait, daemon=True)
        thread.start()
        held.append((thread, release))
except RuntimeError:
    pass
'''

AT_THE_CAP = '''
import os, resource, socket, threading, time
from plugins_app.channel.sdk.webhook import WebhookServer

class One(WebhookServer):
    name = "capped-webhook"
    max_connections = 1
    def respond(self, method, target, headers, body):
        return 200, "pong"

server = One("127.0.0.1:0", "/hook")
server.start()
address = server.httpd.server_address[:2]
serving = set(os.listdir("/proc/self/task"))  # this thread and the server's

def get():
    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(b"GET /hook HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        try:
            return repr(conn.recv(100)[:15])
        except socket.timeout:
            return "no answer"
        except ConnectionResetError:
            return "reset"

print("before", get(), flush=True)
# its connection's thread and that one's deadline timer end a little after the answer: gone (their stacks back in
# glibc's cache) before the cap is reached, not after it, when they would leave room for the timer capped below
while set(os.listdir("/proc/self/task")) - serving:
    time.sleep(0.01)
''' + THREADS_TO_THE_CAP + '''thread, release = held.pop()  # room for one thread: the connection's
release.set(); thread.join()
while os.path.exists(f"/proc/self/task/{thread.native_id}"):  # its stack is back in glibc's cache
    time.sleep(0.01)
print("capped", get(), flush=True)
for thread, release in held:
    release.set(); thread.join()
while set(os.listdir("/proc/self/task")) - serving:  # (a join returns before its thread's stack is free)
    time.sleep(0.01)
print("after", get(), flush=True)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: RLIMIT_DATA counts thread stacks, /proc")
def test_a_connection_whose_deadline_gets_no_thread_is_let_go_and_frees_its_slot():
    """Held, the slot was gone for good: after max_connections such connections the webhook answered nobody,
    while the worker still heartbeated and so was never restarted."""
    out = subprocess.run([sys.executable, "-c", AT_THE_CAP], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said.get("before") == "b'HTTP/1.1 200 OK'", out.stderr
    assert said.get("capped") in ("b''", "reset"), out.stderr  # let go unanswered, not left hanging
    assert said.get("after") == "b'HTTP/1.1 200 OK'", out.stderr  # its slot was freed
    assert "let go unanswered, no thread for its deadline" in out.stderr


LANE_AT_THE_CAP = '''
import resource, threading
from plugins_app.channel.sdk.webhook import ChatLanes

handled = []
lanes = ChatLanes(handled.append, name="capped")
''' + THREADS_TO_THE_CAP + '''try:
    lanes.put("chat-1", "first")
    print("put", "queued", flush=True)
except RuntimeError as exc:
    print("put", f"RuntimeError: {exc}", flush=True)
print("lanes", len(lanes), flush=True)
for thread, release in held:
    release.set(); thread.join()
lanes.put("chat-1", "second")
print("joined", lanes.join(10), flush=True)
print("handled", handled, flush=True)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: RLIMIT_DATA counts thread stacks, /proc")
def test_a_chat_lane_that_gets_no_thread_is_not_left_behind():
    """Left behind, it took the chat's later messages and handled none, and held the listener's end to the
    drain timeout."""
    out = subprocess.run([sys.executable, "-c", LANE_AT_THE_CAP], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said.get("put") == "RuntimeError: can't start new thread", out.stderr
    assert said.get("lanes") == "0"
    assert (said.get("joined"), said.get("handled")) == ("True", "['second']"), out.stderr
