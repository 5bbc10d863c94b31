"""A stub OpenAI-compatible upstream for tests and benchmarks (stdlib only).

An asyncio HTTP/1.1 server (keep-alive; request bodies by Content-Length or
chunked; non-stream replies with Content-Length, streams chunked as SSE) that
serves ``POST /v1/chat/completions`` (stream and non-stream) and ``GET /v1/models``.

In tests::

    with run_stub_upstream(script=Script(reasoning=["hmm"], delay=0.05)) as base_url:
        engine = OpenAICompatibleEngine({"base_url": base_url, "model": "m"})
        ...
        base_url.requests[-1].json["model"]      # what the engine sent
        base_url.script = Script(status=500)     # re-script between calls

``base_url`` is a ``str`` (``http://127.0.0.1:PORT/v1``) carrying ``.stub``,
``.requests`` and a settable ``.script``.

As a process (for the bench)::

    python tests/fakes/upstream.py --port 8765 [--delay 0] [--no-record]

prints ``READY http://127.0.0.1:PORT/v1`` on stdout once listening.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Union

DEFAULT_ANSWER = "Hello from the stub upstream."
DEFAULT_MODEL = "stub-model"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_TOKEN_RE = re.compile(r"\s*[\w']+|\s*[^\w\s]+|\s+$")


def split_tokens(text: str) -> List[str]:
    """Split text into word-ish tokens that join back to it ("Hello", " from", ...)."""
    return _TOKEN_RE.findall(text) or ([text] if text else [])


@dataclass
class Script:
    """What the stub answers to one chat completion request.

    answer: the reply text; None means ``DEFAULT_ANSWER``, or no text when
        ``tool_calls`` are scripted.
    tokens: explicit answer chunks (overrides ``answer``), e.g. to split a
        ``<think>`` tag across chunks.
    reasoning: chunks streamed before the answer in ``delta.<reasoning_field>``
        (non-stream: ``message.<reasoning_field>``).
    tool_calls: ``{"id", "name", "arguments"}`` dicts (arguments a JSON string or
        a dict); streamed OpenAI-style: a first piece with id and name, then the
        arguments split into ``tool_call_pieces`` pieces.
    status: an HTTP status >= 400 answers with an OpenAI error body made of
        ``error_message``, ``error_type`` and ``error_code``.
    require_key: answer 401 unless ``Authorization: Bearer <require_key>``.
    error_after: in a stream, send ``data: {"error": {...}}`` after this many
        content events (reasoning, answer and tool-call pieces), then end the
        body without ``[DONE]``.
    drop_after: in a stream, abort the TCP connection after this many content events.
    delay: seconds between stream events; first_delay: seconds before the
        response headers (for timeouts).
    events: a raw SSE override: each dict is sent as ``data: <json>``, each str
        verbatim as one line (``": comment"``, ``"event: x"``, ``"data: {bad"``);
        ``data: [DONE]`` follows unless ``done`` is False.
    finish_reason: overrides the final chunk's finish_reason.
    ignore_stream: answer a ``"stream": true`` request with one JSON completion,
        as some servers do.
    model: the model reported back (default: the model requested).
    headers: extra response header lines, e.g. ``"Set-Cookie: lb=a; Path=/"``.
    """

    answer: Optional[str] = None
    tokens: Optional[Sequence[str]] = None
    reasoning: Sequence[str] = ()
    reasoning_field: str = "reasoning_content"
    tool_calls: Sequence[Dict[str, Any]] = ()
    tool_call_pieces: int = 3
    status: int = 200
    error_message: str = "The stub upstream failed on purpose."
    error_type: str = "server_error"
    error_code: Optional[str] = None
    require_key: Optional[str] = None
    error_after: Optional[int] = None
    drop_after: Optional[int] = None
    delay: float = 0.0
    first_delay: float = 0.0
    events: Optional[Sequence[Union[str, Dict[str, Any]]]] = None
    done: bool = True
    finish_reason: Optional[str] = None
    ignore_stream: bool = False
    model: Optional[str] = None
    headers: Sequence[str] = ()

    def answer_tokens(self) -> List[str]:
        if self.tokens is not None:
            return list(self.tokens)
        text = self.answer
        if text is None:
            text = "" if self.tool_calls else DEFAULT_ANSWER
        return split_tokens(text)


ScriptArg = Union[None, Script, Dict[str, Any], Sequence[Union[Script, Dict[str, Any]]],
                  Callable[["RecordedRequest"], Union[Script, Dict[str, Any]]]]


@dataclass
class RecordedRequest:
    """One request the stub received, and how its response went."""

    method: str
    path: str
    headers: Dict[str, str]
    body: bytes
    conn_id: int
    json: Any = None
    events_sent: int = 0
    finished: bool = False
    aborted: bool = False  # the client went away before the response was complete
    received_at: float = field(default_factory=time.monotonic)

    @property
    def auth(self) -> Optional[str]:
        return self.headers.get("authorization")


def _as_script(value: Any) -> Script:
    if value is None:
        return Script()
    if isinstance(value, Script):
        return value
    if isinstance(value, dict):
        return Script(**value)
    raise TypeError(f"not a Script: {value!r}")


def _error_body(message: str, type_: str, code: Optional[str], param: Optional[str] = None) -> bytes:
    return _dumps({"error": {"message": message, "type": type_, "param": param,
                             "code": code}}).encode()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class _Conn(asyncio.Protocol):
    """One client connection: parses requests in order, one response at a time."""

    def __init__(self, stub: "StubUpstream", conn_id: int):
        self.stub = stub
        self.conn_id = conn_id
        self.buf = bytearray()
        self.transport: Optional[asyncio.Transport] = None
        self.busy = False
        self.lost = False
        self.lost_future: Optional[asyncio.Future] = None
        self.sent_continue = False
        self.current: Optional[RecordedRequest] = None

    def connection_made(self, transport):
        self.transport = transport
        self.stub._conns.add(self)

    def connection_lost(self, exc):
        self.lost = True
        self.stub._conns.discard(self)
        if self.current is not None and not self.current.finished:
            self.current.aborted = True
        if self.lost_future is not None and not self.lost_future.done():
            self.lost_future.set_result(None)

    def data_received(self, data):
        self.buf += data
        if not self.busy:
            self.process()

    def process(self):
        while not self.busy and not self.lost:
            try:
                req = self._parse()
            except ValueError:
                self.write_response(400, _error_body("malformed HTTP request",
                                                     "invalid_request_error", None), close=True)
                return
            if req is None:
                return
            self.busy = True
            coro = self.stub._handle(self, *req)
            if coro is not None:
                asyncio.get_running_loop().create_task(self._run(coro))
                return
            self.busy = False

    async def _run(self, coro):
        try:
            await coro
        finally:
            self.busy = False
        if not self.lost and self.buf:
            self.process()

    def _parse(self):
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > 65536:
                raise ValueError("header too large")
            return None
        head = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = head[0].split(" ")
        if len(parts) != 3:
            raise ValueError("bad request line")
        method, target, version = parts
        headers = {}
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError("bad header")
            headers[name.strip().lower()] = value.strip()
        pos = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = bytearray()
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return self._need_more(headers)
                size = int(bytes(buf[pos:eol]).split(b";")[0].strip() or b"0", 16)
                pos = eol + 2
                if size == 0:
                    if buf[pos:pos + 2] == b"\r\n":
                        pos += 2
                    else:
                        trailer_end = buf.find(b"\r\n\r\n", pos)
                        if trailer_end < 0:
                            return None
                        pos = trailer_end + 4
                    break
                if len(buf) < pos + size + 2:
                    return self._need_more(headers)
                body += buf[pos:pos + size]
                pos += size + 2
            body = bytes(body)
        else:
            length = int(headers.get("content-length") or 0)
            if len(buf) < pos + length:
                return self._need_more(headers)
            body = bytes(buf[pos:pos + length])
            pos += length
        del buf[:pos]
        self.sent_continue = False
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        return method, target, headers, body, keep_alive

    def _need_more(self, headers):
        if headers.get("expect", "").lower() == "100-continue" and not self.sent_continue:
            self.sent_continue = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def write_response(self, status: int, body: bytes, *, close: bool = False,
                       content_type: str = "application/json", headers: Sequence[str] = ()):
        if self.lost:
            return
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                + "".join(h + "\r\n" for h in headers) +
                f"{'Connection: close' if close else 'Connection: keep-alive'}\r\n\r\n")
        self.transport.write(head.encode("latin-1") + body)
        if close:
            self.transport.close()

    async def wait_lost(self, timeout: float) -> bool:
        """Sleep up to ``timeout``; True as soon as the client disconnects."""
        if self.lost:
            return True
        if self.lost_future is None:
            self.lost_future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self.lost_future), timeout)
        except asyncio.TimeoutError:
            pass
        return self.lost


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StubUpstream:
    """The stub server; see the module docstring. Start with ``start()`` or ``run_stub_upstream``."""

    def __init__(self, script: ScriptArg = None, *, host: str = "127.0.0.1", port: int = 0,
                 record: bool = True, max_records: int = 1000):
        self.script: ScriptArg = script
        self.host = host
        self.port = port
        self.record = record
        self.requests: Deque[RecordedRequest] = collections.deque(maxlen=max_records)
        self.connections_opened = 0
        self._conns: set = set()
        self._queue_pos = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- lifecycle ----------------------------------------------------------------

    async def listen(self) -> None:
        """Start listening on the running loop (sets ``port`` when it was 0)."""
        loop = asyncio.get_running_loop()
        self._loop = loop

        def factory():
            self.connections_opened += 1
            return _Conn(self, self.connections_opened)

        self._server = await loop.create_server(factory, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> "StubUpstream":
        """Run the server in a daemon thread with its own event loop."""
        ready = threading.Event()
        failure: List[BaseException] = []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.listen())
            except BaseException as exc:  # surface bind errors in the caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="stub-upstream", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and every open connection, then end the thread."""
        loop = self._loop
        if loop is None or self._thread is None:
            return

        def shutdown():
            if self._server is not None:
                self._server.close()
            for conn in list(self._conns):
                if conn.transport is not None:
                    conn.transport.abort()
            loop.call_soon(loop.stop)

        loop.call_soon_threadsafe(shutdown)
        self._thread.join(10)
        self._thread = None

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 2.0) -> bool:
        """Poll ``predicate`` until it holds or ``timeout`` passes (for asserting on the server side)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    # -- request handling ---------------------------------------------------------

    def _script_for(self, rec: RecordedRequest) -> Script:
        script = self.script
        if callable(script):
            return _as_script(script(rec))
        if isinstance(script, (list, tuple)):
            # a queue: one script per request, the last one repeats
            item = script[min(self._queue_pos, len(script) - 1)]
            self._queue_pos += 1
            return _as_script(item)
        return _as_script(script)

    def _handle(self, conn: _Conn, method: str, target: str, headers: Dict[str, str],
                body: bytes, keep_alive: bool):
        path = target.split("?", 1)[0]
        if path.startswith("/v1/"):
            path = path[3:]
        rec = RecordedRequest(method, target, headers, body, conn.conn_id)
        if self.record:
            self.requests.append(rec)
        conn.current = rec
        close = not keep_alive
        if path == "/models" and method == "GET":
            rec.finished = True
            model = (_as_script(self.script).model if not callable(self.script)
                     and not isinstance(self.script, (list, tuple)) else None) or DEFAULT_MODEL
            conn.write_response(200, _dumps({"object": "list", "data": [
                {"id": model, "object": "model", "created": 0, "owned_by": "stub"}]}).encode(),
                close=close)
            return None
        if path != "/chat/completions":
            rec.finished = True
            conn.write_response(404, _error_body(f"no route for {method} {target}",
                                                 "invalid_request_error", "not_found"), close=close)
            return None
        if method != "POST":
            rec.finished = True
            conn.write_response(405, _error_body("use POST", "invalid_request_error", None),
                                close=close)
            return None
        try:
            rec.json = json.loads(body)
            if not isinstance(rec.json, dict):
                raise ValueError
        except ValueError:
            rec.finished = True
            conn.write_response(400, _error_body("the body is not a JSON object",
                                                 "invalid_request_error", None), close=close)
            return None
        script = self._script_for(rec)
        if script.first_delay > 0:
            return self._delayed(conn, rec, script, close)
        return self._respond(conn, rec, script, close)

    async def _delayed(self, conn, rec, script, close):
        if await conn.wait_lost(script.first_delay):
            return
        coro = self._respond(conn, rec, script, close)
        if coro is not None:
            await coro

    def _respond(self, conn: _Conn, rec: RecordedRequest, script: Script, close: bool):
        req = rec.json
        if script.require_key is not None and \
                rec.headers.get("authorization") != f"Bearer {script.require_key}":
            rec.finished = True
            conn.write_response(401, _error_body(
                "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"),
                close=close)
            return None
        if script.status >= 400:
            rec.finished = True
            conn.write_response(script.status, _error_body(
                script.error_message, script.error_type, script.error_code), close=close)
            return None
        model = script.model or req.get("model") or DEFAULT_MODEL
        if not req.get("stream") or script.ignore_stream:
            rec.finished = True
            conn.write_response(200, self._completion(script, model), close=close, headers=script.headers)
            return None
        events = self._stream_events(script, model, req)
        if script.delay > 0 or script.drop_after is not None:
            return self._stream_slowly(conn, rec, events, script, close)
        body = b"".join(_chunk(e) for e in events)
        conn.transport.write(_STREAM_HEAD + "".join(h + "\r\n" for h in script.headers).encode("latin-1")
                             + (b"Connection: close\r\n\r\n" if close else b"\r\n")
                             + body + b"0\r\n\r\n")
        rec.events_sent = len(events)
        rec.finished = True
        if close:
            conn.transport.close()
        return None

    async def _stream_slowly(self, conn: _Conn, rec: RecordedRequest, events: List[bytes],
                             script: Script, close: bool):
        transport = conn.transport
        transport.write(_STREAM_HEAD + (b"Connection: close\r\n\r\n" if close else b"\r\n"))
        # events[0] is the role prelude; drop_after counts content events after it
        drop_at = None if script.drop_after is None else script.drop_after + 1
        for i, event in enumerate(events):
            if conn.lost:
                return
            if drop_at is not None and i >= drop_at:
                transport.abort()
                return
            if i and script.delay > 0 and await conn.wait_lost(script.delay):
                return
            transport.write(_chunk(event))
            rec.events_sent += 1
        transport.write(b"0\r\n\r\n")
        rec.finished = True
        if close:
            transport.close()

    def _completion(self, script: Script, model: str) -> bytes:
        message: Dict[str, Any] = {"role": "assistant",
                                   "content": "".join(script.answer_tokens()) or None,
                                   "refusal": None}
        if script.reasoning:
            message[script.reasoning_field] = "".join(script.reasoning)
        finish = "stop"
        if script.tool_calls:
            finish = "tool_calls"
            message["tool_calls"] = [
                {"id": tc.get("id") or f"call_{i}", "type": "function",
                 "function": {"name": tc["name"], "arguments": _args(tc)}}
                for i, tc in enumerate(script.tool_calls)]
        return _dumps({
            "id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": script.finish_reason or finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }).encode()

    def _stream_events(self, script: Script, model: str, req: Dict[str, Any]) -> List[bytes]:
        """The SSE events of one streamed reply, each ``data: ...\\n\\n`` as bytes."""
        if script.events is not None:
            out = []
            for ev in script.events:
                if isinstance(ev, dict):
                    out.append(b"data: " + _dumps(ev).encode() + b"\n\n")
                else:
                    out.append(ev.encode() + b"\n")
            if script.done:
                out.append(b"data: [DONE]\n\n")
            return out

        created = int(time.time())
        prefix = ('{"id":"chatcmpl-stub","object":"chat.completion.chunk","created":%d,'
                  '"model":%s,"choices":[{"index":0,"delta":' % (created, _dumps(model)))

        def chunk(delta: Dict[str, Any], finish: Optional[str] = None) -> bytes:
            return ("data: " + prefix + _dumps(delta) + ',"logprobs":null,"finish_reason":'
                    + _dumps(finish) + "}]}\n\n").encode()

        content: List[bytes] = []
        for piece in script.reasoning:
            content.append(chunk({script.reasoning_field: piece}))
        for token in script.answer_tokens():
            content.append(chunk({"content": token}))
        for i, tc in enumerate(script.tool_calls):
            content.append(chunk({"tool_calls": [{
                "index": i, "id": tc.get("id") or f"call_{i}", "type": "function",
                "function": {"name": tc["name"], "arguments": ""}}]}))
            for piece in _pieces(_args(tc), script.tool_call_pieces):
                content.append(chunk({"tool_calls": [{"index": i,
                                                      "function": {"arguments": piece}}]}))
        out = [chunk({"role": "assistant", "content": ""})]
        if script.error_after is not None:
            out.extend(content[:script.error_after])
            out.append(b"data: " + _error_body(script.error_message, script.error_type,
                                               script.error_code) + b"\n\n")
            return out
        out.extend(content)
        finish = script.finish_reason or ("tool_calls" if script.tool_calls else "stop")
        out.append(chunk({}, finish))
        if (req.get("stream_options") or {}).get("include_usage"):
            out.append(("data: " + _dumps({
                "id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": len(content),
                          "total_tokens": 1 + len(content)}}) + "\n\n").encode())
        if script.done:
            out.append(b"data: [DONE]\n\n")
        return out


def _args(tc: Dict[str, Any]) -> str:
    args = tc.get("arguments", "{}")
    return args if isinstance(args, str) else _dumps(args)


def _pieces(text: str, n: int) -> List[str]:
    n = max(1, min(n, len(text) or 1))
    size = -(-len(text) // n) or 1
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class StubURL(str):
    """The stub's base URL, with the running stub attached (``.stub``, ``.requests``, ``.script``)."""

    stub: StubUpstream

    @property
    def requests(self) -> Deque[RecordedRequest]:
        return self.stub.requests

    @property
    def script(self) -> ScriptArg:
        return self.stub.script

    @script.setter
    def script(self, value: ScriptArg) -> None:
        self.stub.script = value
        self.stub._queue_pos = 0


@contextlib.contextmanager
def run_stub_upstream(script: ScriptArg = None, **kwargs: Any) -> Iterator[StubURL]:
    """Run a stub upstream in a background thread for the ``with`` block.

    ``script`` is a ``Script``, a dict of ``Script`` fields, a list of them (one
    per request, the last repeating) or a callable ``(RecordedRequest) -> Script``.
    Yields the base URL (``http://127.0.0.1:PORT/v1``) as a ``StubURL``.
    """
    stub = StubUpstream(script, **kwargs).start()
    url = StubURL(stub.base_url)
    url.stub = stub
    try:
        yield url
    finally:
        stub.stop()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Stub OpenAI-compatible upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between stream chunks")
    parser.add_argument("--answer", default=None, help="reply text")
    parser.add_argument("--no-record", action="store_true", help="keep no request log")
    args = parser.parse_args(argv)

    async def serve():
        stub = StubUpstream(Script(answer=args.answer, delay=args.delay), host=args.host,
                            port=args.port, record=not args.no_record)
        await stub.listen()
        print(f"READY {stub.base_url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
