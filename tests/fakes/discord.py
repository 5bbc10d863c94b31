"""A fake Discord on loopback: the REST API and the Gateway, speaking Discord's wire format.

The shapes follow Discord's developer documentation (Gateway: HELLO ``{"heartbeat_interval"}``,
IDENTIFY, READY ``{"v", "user", "guilds", "session_id", "resume_gateway_url", "shard",
"application"}``, RESUME ``{"token", "session_id", "seq"}`` answered by the missed events and
``RESUMED``, RECONNECT op 7, INVALID_SESSION op 9, HEARTBEAT/ACK op 1/11, close codes 4004 and
4014; REST: ``GET /gateway/bot``, ``POST /channels/{id}/messages`` as JSON or multipart with
``payload_json`` and ``files[n]``, the Message object, 429 with ``retry_after``/``global`` and
``Retry-After``, ``nonce`` with ``enforce_nonce``).

    fake = FakeDiscord().start()
    fake.api_base_url                 # http://127.0.0.1:PORT/api/v10, for DISCORD_API_BASE_URL
    fake.push_message("chan-1", "hi") # a MESSAGE_CREATE on the session (replayed on RESUME if down)
    fake.sent()                       # the messages the bot created
    fake.inject_429(retry_after=0.5)  # the next create message answers 429
    fake.drop() / fake.reconnect() / fake.invalid_session(False) / fake.revoke()
    fake.stop()

Everything runs in two threads (an HTTP server and an asyncio loop for the websocket server).
"""
from __future__ import annotations

import asyncio
import email.parser
import email.policy
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import websockets
from websockets.asyncio.server import serve

from tests.fakes import FakeHTTPServer

BOT_USER = {"id": "1100000000000000001", "username": "ugent-bot", "discriminator": "0", "global_name": None,
            "avatar": None, "bot": True, "flags": 0}
MESSAGE_CONTENT = 1 << 15
_snowflakes = itertools.count(1300000000000000000)


def snowflake() -> str:
    return str(next(_snowflakes))


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + ".000000+00:00"


@dataclass
class Session:
    session_id: str
    events: list = field(default_factory=list)   # (seq, t, d) in order
    seq: int = 0


class FakeDiscord:
    def __init__(self, *, token: str = "bot-token", heartbeat_interval_ms: int = 500,
                 message_content_allowed: bool = True):
        self.token = token
        self.revoked = False
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.message_content_allowed = message_content_allowed
        self.lock = threading.Lock()
        self.messages: list[dict] = []            # what the bot created, in order
        self.requests: list[dict] = []            # every REST request: method, path, status
        self.connections: list[dict] = []         # every gateway connection: path, op (identify/resume), seq
        self.heartbeats = 0
        self.mute_acks = False                    # stop answering heartbeats (a zombied connection)
        self.hold_sends = 0.0                     # seconds to hold a create-message response after recording it
        self._429s: list[tuple[float, bool]] = []
        self._fail_next: list[tuple[int, dict]] = []
        self.sessions: dict[str, Session] = {}
        self.current: Session | None = None
        self._ws = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._files: dict[str, tuple[bytes, str]] = {}
        self._cdn_failures: list[int] = []         # statuses the next attachment downloads answer, in order
        self._ready = threading.Event()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "FakeDiscord":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                fake._http(self, "GET")

            def do_POST(self):
                fake._http(self, "POST")

        self.http = FakeHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.http_base = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.api_base_url = self.http_base + "/api/v10"
        self._thread = threading.Thread(target=self._ws_main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the fake gateway did not start"
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---------------------------------------------------------------- what a test drives

    def push_message(self, channel_id: str, content: str, *, guild_id: str | None = None,
                     author_id: str = "2200000000000000002", username: str = "alice", bot: bool = False,
                     attachments: list[dict] | None = None, reply_to: dict | None = None,
                     message_id: str | None = None) -> dict:
        """A MESSAGE_CREATE dispatched on the current session (sent now, or replayed on RESUME)."""
        author = {"id": author_id, "username": username, "discriminator": "0", "global_name": username.title(),
                  "avatar": None}
        if bot:
            author["bot"] = True
        d = {"id": message_id or snowflake(), "channel_id": channel_id, "author": author, "content": content,
             "timestamp": now_iso(), "edited_timestamp": None, "tts": False, "mention_everyone": False,
             "mentions": [], "mention_roles": [], "attachments": attachments or [], "embeds": [],
             "pinned": False, "type": 19 if reply_to else 0, "flags": 0, "components": []}
        if guild_id:
            d["guild_id"] = guild_id
            d["member"] = {"nick": None, "roles": [], "joined_at": now_iso(), "deaf": False, "mute": False}
        if reply_to:
            d["message_reference"] = {"type": 0, "message_id": reply_to["id"], "channel_id": channel_id}
            d["referenced_message"] = reply_to
        self.dispatch("MESSAGE_CREATE", d)
        return d

    def redeliver(self, d: dict) -> None:
        """Dispatch the same MESSAGE_CREATE again (a new seq, the same message id)."""
        self.dispatch("MESSAGE_CREATE", d)

    def attachment(self, filename: str, data: bytes, content_type: str) -> dict:
        """An Attachment object whose url this fake's CDN serves."""
        att_id = snowflake()
        self._files[f"{att_id}/{filename}"] = (data, content_type)
        url = f"{self.http_base}/attachments/{att_id}/{filename}"
        return {"id": att_id, "filename": filename, "size": len(data), "url": url, "proxy_url": url,
                "content_type": content_type}

    def dispatch(self, t: str, d: dict) -> None:
        self._call(self._dispatch(t, d))

    def drop(self) -> None:
        """Cut the socket without a close frame (a network failure)."""
        self._call(self._drop())

    def reconnect(self) -> None:
        self._call(self._send_op({"op": 7, "d": None}))

    def invalid_session(self, resumable: bool) -> None:
        self._call(self._send_op({"op": 9, "d": resumable}))

    def close(self, code: int, reason: str = "") -> None:
        self._call(self._close(code, reason))

    def revoke(self) -> None:
        """The token is reset: REST answers 401 and the gateway closes with 4004."""
        self.revoked = True
        self.close(4004, "Authentication failed.")

    def inject_429(self, retry_after: float = 0.5, *, is_global: bool = False) -> None:
        self._429s.append((retry_after, is_global))

    def fail_downloads(self, status: int = 503, times: int = 1) -> None:
        """The CDN answers the next ``times`` attachment downloads with ``status`` (a 5xx: busy for now)."""
        with self.lock:
            self._cdn_failures += [status] * times

    def downloads(self, att: dict) -> list[int | None]:
        """The statuses the CDN answered for one attachment (as ``attachment()`` returned it), in order."""
        path = "/" + att["url"].split("/", 3)[3]
        with self.lock:
            return [r["status"] for r in self.requests if r["method"] == "GET" and r["path"] == path]

    def fail_next_send(self, status: int, body: dict) -> None:
        self._fail_next.append((status, body))

    def sent(self) -> list[dict]:
        with self.lock:
            return list(self.messages)

    def connected(self) -> bool:
        return self._ws is not None

    # ---------------------------------------------------------------- REST

    def _http(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        path = h.path.split("?", 1)[0]
        record = {"method": method, "path": path, "status": None}  # status set once answered
        with self.lock:
            self.requests.append(record)
        status, payload, headers = self._route(method, path, h.headers, body)
        record["status"] = status
        if isinstance(payload, bytes):
            data, ctype = payload, headers.pop("Content-Type", "application/octet-stream")
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _route(self, method: str, path: str, headers, body: bytes):
        m = re.fullmatch(r"/attachments/(.+)", path)
        if m and method == "GET":
            if m.group(1) not in self._files:
                return 404, {"message": "Not Found", "code": 0}, {}
            with self.lock:
                failure = self._cdn_failures.pop(0) if self._cdn_failures else None
            if failure is not None:
                return failure, b"<html><body>upstream connect error</body></html>", {"Content-Type": "text/html"}
            data, ctype = self._files[m.group(1)]
            return 200, data, {"Content-Type": ctype}
        if not path.startswith("/api/v10/"):
            return 404, {"message": "404: Not Found", "code": 0}, {}
        if headers.get("Authorization") != f"Bot {self.token}" or self.revoked:
            return 401, {"message": "401: Unauthorized", "code": 0}, {}
        path = path[len("/api/v10"):]
        if method == "GET" and path == "/gateway/bot":
            return 200, {"url": self.gateway_url, "shards": 1, "session_start_limit": {
                "total": 1000, "remaining": 999, "reset_after": 14400000, "max_concurrency": 1}}, {}
        m = re.fullmatch(r"/channels/(\d+|[\w-]+)/messages", path)
        if m and method == "POST":
            return self._create_message(m.group(1), headers, body)
        return 404, {"message": "404: Not Found", "code": 0}, {}

    def _create_message(self, channel_id: str, headers, body: bytes):
        if self._429s:
            retry_after, is_global = self._429s.pop(0)
            hdrs = {"Retry-After": str(max(1, round(retry_after))), "X-RateLimit-Scope": "user"}
            if is_global:
                hdrs["X-RateLimit-Global"] = "true"
            return 429, {"message": "You are being rate limited.", "retry_after": retry_after,
                         "global": is_global}, hdrs
        if self._fail_next:
            status, payload = self._fail_next.pop(0)
            return status, payload, {}
        files: list[dict] = []
        ctype = headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + body)
            payload: dict = {}
            for part in msg.iter_parts():
                name = part.get_param("name", header="content-disposition")
                if name == "payload_json":
                    payload = json.loads(part.get_content())
                elif name and name.startswith("files["):
                    files.append({"field": name, "filename": part.get_filename(),
                                  "content_type": part.get_content_type(), "data": part.get_payload(decode=True)})
        else:
            payload = json.loads(body or b"{}")
        content = payload.get("content") or ""
        if len(content) > 2000:
            return 400, {"message": "Invalid Form Body", "code": 50035, "errors": {"content": {"_errors": [
                {"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 2000 or fewer in length."}]}}}, {}
        with self.lock:
            nonce = payload.get("nonce")
            if nonce and payload.get("enforce_nonce"):
                for old in self.messages:
                    if old["channel_id"] == channel_id and old.get("nonce") == nonce:
                        return 200, old, {}
            message = {"id": snowflake(), "channel_id": channel_id, "author": BOT_USER, "content": content,
                       "timestamp": now_iso(), "edited_timestamp": None, "tts": False, "mention_everyone": False,
                       "mentions": [], "mention_roles": [], "embeds": [], "pinned": False,
                       "type": 19 if payload.get("message_reference") else 0, "flags": 0, "nonce": nonce,
                       "attachments": [{"id": snowflake(), "filename": f["filename"], "size": len(f["data"]),
                                        "content_type": f["content_type"]} for f in files],
                       "message_reference": payload.get("message_reference"),
                       "_files": files, "_payload": payload}
            self.messages.append(message)
        if self.hold_sends:
            time.sleep(self.hold_sends)
        public = {k: v for k, v in message.items() if not k.startswith("_")}
        return 200, public, {"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "4",
                             "X-RateLimit-Reset-After": "1.0", "X-RateLimit-Bucket": "fake-bucket"}

    # ---------------------------------------------------------------- Gateway

    def _ws_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        loop.run_until_complete(self._ws_serve())
        loop.close()

    async def _ws_serve(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self._conn, "127.0.0.1", 0, ping_interval=None) as server:
            port = server.sockets[0].getsockname()[1]
            self.gateway_url = f"ws://127.0.0.1:{port}"
            self.resume_gateway_url = f"ws://127.0.0.1:{port}/resume"
            self._ready.set()
            await self._stop.wait()

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _conn(self, ws) -> None:
        record: dict = {"path": ws.request.path}
        self.connections.append(record)
        await ws.send(json.dumps({"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}, "s": None,
                                  "t": None}))
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), 20))
            op, d = first.get("op"), first.get("d") or {}
            record["op"] = {2: "identify", 6: "resume"}.get(op, str(op))
            if d.get("token") != self.token or self.revoked:
                await ws.close(4004, "Authentication failed.")
                return
            if op == 2:
                record["intents"] = d.get("intents")
                if d.get("intents", 0) & MESSAGE_CONTENT and not self.message_content_allowed:
                    await ws.close(4014, "Disallowed intent(s).")
                    return
                session = Session(session_id=f"s{snowflake()}")
                self.sessions[session.session_id] = session
                self.current, self._ws = session, ws
                await self._emit(session, "READY", {
                    "v": 10, "user": BOT_USER, "guilds": [], "session_id": session.session_id,
                    "resume_gateway_url": self.resume_gateway_url, "shard": [0, 1],
                    "application": {"id": BOT_USER["id"], "flags": 0}})
            elif op == 6:
                record["seq"] = d.get("seq")
                session = self.sessions.get(d.get("session_id"))
                if session is None:
                    await ws.send(json.dumps({"op": 9, "d": False, "s": None, "t": None}))
                    await ws.wait_closed()
                    return
                self.current, self._ws = session, ws
                for seq, t, ev in session.events:
                    if seq > (d.get("seq") or 0):
                        await ws.send(json.dumps({"op": 0, "s": seq, "t": t, "d": ev}))
                await self._emit(session, "RESUMED", {})
            else:
                await ws.close(4002, "Decode error.")
                return
            async for raw in ws:
                frame = json.loads(raw)
                if frame.get("op") == 1:
                    self.heartbeats += 1
                    if not self.mute_acks:
                        await ws.send(json.dumps({"op": 11, "d": None, "s": None, "t": None}))
        except (websockets.exceptions.ConnectionClosed, asyncio.TimeoutError):
            pass
        finally:
            if self._ws is ws:
                self._ws = None

    async def _emit(self, session: Session, t: str, d: dict) -> None:
        session.seq += 1
        session.events.append((session.seq, t, d))
        ws = self._ws
        if ws is not None and self.current is session:
            try:
                await ws.send(json.dumps({"op": 0, "s": session.seq, "t": t, "d": d}))
            except websockets.exceptions.ConnectionClosed:
                pass

    async def _dispatch(self, t: str, d: dict) -> None:
        if self.current is None:
            raise RuntimeError("no gateway session yet")
        await self._emit(self.current, t, d)

    async def _send_op(self, frame: dict) -> None:
        if self._ws is not None:
            await self._ws.send(json.dumps({**frame, "s": None, "t": None}))

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.transport.abort()

    async def _close(self, code: int, reason: str) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close(code, reason)
