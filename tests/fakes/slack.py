"""A fake Slack on loopback, speaking Slack's wire formats, for the channel-slack tests and the bench.

* the **Web API** (``http://127.0.0.1:P/api/<method>``, what ``SLACK_API_BASE_URL`` points at):
  ``auth.test``, ``apps.connections.open``, ``chat.postMessage``, ``conversations.history``,
  ``conversations.replies``, ``files.getUploadURLExternal`` (+ the upload URL it hands out),
  ``files.completeUploadExternal``, and private file downloads, with Slack's answers
  (``{"ok": false, "error": "..."}``, HTTP 429 with ``Retry-After`` and ``ratelimited``);
* **Socket Mode** (``ws://127.0.0.1:W/link/?ticket=...``): ``hello``, ``events_api`` envelopes that
  must be acked with ``{"envelope_id"}`` or are sent again (``retry_attempt``/``retry_reason``),
  ``disconnect`` frames (``warning``, ``refresh_requested``, ``link_disabled``), dropped sockets;
* the **Events API** webhook: POSTs to the worker's Request URL signed with ``v0`` signatures, and
  retried with ``X-Slack-Retry-Num``/``X-Slack-Retry-Reason`` when not answered 200.

Shapes follow Slack's docs (api.slack.com/apis/socket-mode, /apis/events-api, the methods' pages)
and slack-sdk's own test fixtures. Drive it::

    with FakeSlack(mode="socket") as slack:
        env = slack.env()                         # SLACK_* variables for the worker
        slack.say("hello", channel="C1")          # a user's message, as a message event
        slack.posts()                             # what the bot posted (chat.postMessage bodies)
        slack.rate_limit("chat.postMessage", retry_after=1)
        slack.fail_downloads(503, times=2)        # the next file downloads answer 503
        slack.disconnect("refresh_requested"); slack.drop_sockets(); slack.revoke()
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlencode
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from tests.fakes import FakeHTTPServer

TEAM = "T0FAKE001"
APP_ID = "A0FAKE001"
BOT_USER = "U0BOT0001"
BOT_ID = "B0BOT0001"


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """Slack's v0 request signature."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


@dataclass
class Pending:
    """An event Slack owes the app until it is acked (socket) or answered 200 (webhook)."""

    payload: dict
    attempts: int = 0
    next_at: float = 0.0
    envelope_id: str | None = None
    reason: str = ""
    done: bool = False
    kind: str = "events_api"  # the Socket Mode envelope's type: interactive for a button press


@dataclass
class Call:
    method: str
    params: dict
    at: float
    status: int = 200
    answer: dict = field(default_factory=dict)


class FakeSlack:
    def __init__(self, *, mode: str = "socket", bot_token: str = "xoxb-fake-bot", app_token: str = "xapp-fake-app",
                 signing_secret: str = "fake-signing-secret", ack_timeout: float = 3.0,
                 retry_delays: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 8.0)):
        self.mode = mode
        self.bot_token, self.app_token, self.signing_secret = bot_token, app_token, signing_secret
        self.ack_timeout = ack_timeout
        self.retry_delays = retry_delays
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.messages: list[dict] = []          # what the bot posted, as Slack stores them
        self.uploads: dict[str, dict] = {}      # file_id -> {"filename", "length", "data"}
        self.shares: list[dict] = []            # files.completeUploadExternal calls
        self.files: dict[str, dict] = {}        # files users "uploaded", served at url_private_download
        self.downloads: list[tuple[str, int]] = []  # (file id, status) of each private file download, in order
        self._download_failures: list[int] = []     # statuses the next downloads answer (fail_downloads)
        self._download_hold: threading.Event | None = None  # set: downloads wait for it (hold_downloads)
        self.delivered: list[dict] = []         # event payloads the app took (acked / answered 200)
        self.acks: list[str] = []
        self.request_url: str | None = None     # webhook mode: the worker's Request URL
        self.hold_post_secs = 0.0               # answer chat.postMessage only this long after recording it
        self.revoked_bot = False
        self.revoked_app = False
        self.link_disabled = False
        self._limits: dict[str, list[float]] = {}   # method -> [times, retry_after]
        self._blocked_until: dict[str, float] = {}  # method -> end of the Retry-After it answered
        self.early_calls = 0                        # calls made before a Retry-After was over
        self._pending: dict[str, Pending] = {}
        self._tickets: set[str] = set()
        self._sockets: list[ServerConnection] = []
        self.sockets_opened = 0
        self.open_counts: list[int] = []        # how many sockets were open as each one said hello
        self._ts = itertools.count(1)
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._ws = serve(self._ws_session, "127.0.0.1", 0)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/api/"

    @property
    def ws_base(self) -> str:
        return f"ws://127.0.0.1:{self._ws.socket.getsockname()[1]}/link/"

    def start(self) -> "FakeSlack":
        for target in (self._http.serve_forever, self._ws.serve_forever, self._dispatch_loop):
            t = threading.Thread(target=target, daemon=True, name=f"fake-slack-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()
        self.drop_sockets()
        self._ws.shutdown()

    def __enter__(self) -> "FakeSlack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        return {"SLACK_BOT_TOKEN": self.bot_token, "SLACK_APP_TOKEN": self.app_token,
                "SLACK_SIGNING_SECRET": self.signing_secret, "SLACK_API_BASE_URL": self.api_base}

    # ------------------------------------------------------------------ what a test does

    def next_ts(self) -> str:
        return f"{1700000000 + next(self._ts)}.{next(self._ids):06d}"

    def event_payload(self, event: dict, *, event_id: str | None = None) -> dict:
        event_id = event_id or f"Ev{uuid.uuid4().hex[:10].upper()}"
        return {"token": "verification-token", "team_id": TEAM, "api_app_id": APP_ID, "event": event,
                "type": "event_callback", "event_id": event_id, "event_time": int(time.time()),
                "authorizations": [{"enterprise_id": None, "team_id": TEAM, "user_id": BOT_USER, "is_bot": True,
                                    "is_enterprise_install": False}],
                "is_ext_shared_channel": False, "event_context": f"4-{event.get('type')}-{TEAM}-"
                                                                 f"{event.get('channel', '')}"}

    def say(self, text: str, *, channel: str = "D0DM00001", user: str = "U0USER001", channel_type: str = "im",
            thread_ts: str | None = None, files: list[dict] | None = None, event_id: str | None = None,
            ts: str | None = None) -> dict:
        """A user's message as Slack's ``message`` event; returns the payload pushed."""
        ts = ts or self.next_ts()
        event: dict[str, Any] = {"client_msg_id": str(uuid.uuid4()), "type": "message", "text": text, "user": user,
                                 "ts": ts, "team": TEAM, "channel": channel, "event_ts": ts,
                                 "channel_type": channel_type}
        if thread_ts:
            event["thread_ts"] = thread_ts
        if files:
            event["files"], event["subtype"] = files, "file_share"
        payload = self.event_payload(event, event_id=event_id)
        self.push(payload)
        return payload

    def add_file(self, data: bytes, *, name: str = "photo.png", mimetype: str = "image/png") -> dict:
        """A file a user uploaded; returns its file object as message events carry it."""
        file_id = f"F{uuid.uuid4().hex[:10].upper()}"
        base = self.api_base.removesuffix("/api/")
        url = f"{base}/files-pri/{TEAM}-{file_id}/download/{name}"
        self.files[file_id] = {"data": data, "mimetype": mimetype}
        return {"id": file_id, "created": int(time.time()), "name": name, "title": name, "mimetype": mimetype,
                "filetype": name.rsplit(".", 1)[-1], "user": "U0USER001", "size": len(data),
                "url_private": url, "url_private_download": url, "mode": "hosted", "is_external": False}

    def hold_downloads(self, release: threading.Event | None) -> None:
        """Private file downloads begun from now on answer only once ``release`` is set (a large file on a slow
        link: the worker's download is under way meanwhile); None answers them at once again."""
        self._download_hold = release

    def fail_downloads(self, status: int = 503, times: int = 1) -> None:
        """The next ``times`` private file downloads answer ``status`` (a 5xx: Slack's file servers busy)."""
        with self.lock:
            self._download_failures += [status] * times

    def push(self, payload: dict) -> None:
        """Deliver an Events API payload the way this fake's mode does, until the app takes it."""
        with self.lock:
            self._pending[payload["event_id"]] = Pending(payload)

    def press(self, value: str, *, message: dict, user: str = "U0USER001", action_id: str = "ugent_option_0",
              action_ts: str | None = None) -> dict:
        """A user presses a button of ``message`` (one of the bot's posts): Slack's ``block_actions``
        payload, sent as an ``interactive`` envelope (Socket Mode only); returns the payload."""
        action_ts = action_ts or self.next_ts()
        container = {"type": "message", "message_ts": message["ts"], "channel_id": message["channel"],
                     "is_ephemeral": False}
        if message.get("thread_ts"):
            container["thread_ts"] = message["thread_ts"]
        payload = {"type": "block_actions", "team": {"id": TEAM}, "api_app_id": APP_ID,
                   "user": {"id": user, "name": "ada", "team_id": TEAM}, "container": container,
                   "channel": {"id": message["channel"]}, "message": {k: v for k, v in message.items()
                                                                       if k != "channel"},
                   "trigger_id": f"trig{uuid.uuid4().hex[:8]}",
                   "actions": [{"type": "button", "action_id": action_id, "block_id": "ugent_options",
                                "value": value, "action_ts": action_ts,
                                "text": {"type": "plain_text", "text": value}}]}
        with self.lock:
            self._pending[f"press-{action_ts}-{uuid.uuid4().hex[:4]}"] = Pending(payload, kind="interactive")
        return payload

    def slash(self, command: str, text: str = "", *, channel: str = "D0DM00001", user: str = "U0USER001",
              trigger_id: str | None = None) -> dict:
        """A user runs a slash command the app registered: Slack's payload, sent as a ``slash_commands``
        envelope (Socket Mode) or a form POST to the Request URL (webhook mode); returns the payload."""
        payload = {"token": "verification-token-unused", "team_id": TEAM, "team_domain": "fake",
                   "channel_id": channel, "channel_name": "directmessage" if channel.startswith("D") else "general",
                   "user_id": user, "user_name": "ada", "command": command, "text": text, "api_app_id": APP_ID,
                   "is_enterprise_install": "false",
                   "response_url": f"https://hooks.slack.com/commands/{TEAM}/1/x",
                   "trigger_id": trigger_id or f"{int(time.time())}.{uuid.uuid4().int % 10**12}.{uuid.uuid4().hex}"}
        with self.lock:
            self._pending[f"slash-{payload['trigger_id']}-{uuid.uuid4().hex[:4]}"] = Pending(payload,
                                                                                          kind="slash_commands")
        return payload

    def reslash(self, payload: dict) -> None:
        """Send a slash command the app already took once more (an envelope Slack thinks unacked)."""
        with self.lock:
            self._pending[f"slash-again-{uuid.uuid4().hex[:6]}"] = Pending(payload, attempts=1, kind="slash_commands")

    def repress(self, payload: dict) -> None:
        """Send a press the app already took once more (Socket Mode redelivers an unacked envelope)."""
        with self.lock:
            self._pending[f"press-again-{uuid.uuid4().hex[:6]}"] = Pending(payload, attempts=1, kind="interactive")

    def redeliver(self, payload: dict, reason: str = "timeout") -> None:
        """Send an event the app already took once more (Slack's at-least-once)."""
        with self.lock:
            self._pending[payload["event_id"] + "#again" + uuid.uuid4().hex[:4]] = Pending(payload, attempts=1,
                                                                                          reason=reason)

    def posts(self) -> list[dict]:
        with self.lock:
            return [dict(m) for m in self.messages]

    def texts(self) -> list[str]:
        return [m["text"] for m in self.posts()]

    def calls_of(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]

    def rate_limit(self, method: str, *, retry_after: float = 1, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` are answered HTTP 429 with this Retry-After."""
        with self.lock:
            self._limits[method] = [times, retry_after]

    def revoke(self, *, bot: bool = True, app: bool = False, event: bool = True) -> None:
        """Revoke tokens: every call with them answers ``token_revoked``; with ``event`` Slack also
        sends ``tokens_revoked`` (over the socket or the webhook while it still can)."""
        with self.lock:
            self.revoked_bot = self.revoked_bot or bot
            self.revoked_app = self.revoked_app or app
        if event and bot:
            self.push(self.event_payload({"type": "tokens_revoked", "tokens": {"oauth": [], "bot": [BOT_USER]},
                                          "event_ts": self.next_ts()}))
        if app:
            self.drop_sockets()

    def disconnect(self, reason: str = "refresh_requested") -> int:
        """Send a ``disconnect`` frame on every open socket; returns how many got one."""
        frame = json.dumps({"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake-1"}})
        sent = 0
        for conn in self.sockets():
            try:
                conn.send(frame)
                sent += 1
            except ConnectionClosed:
                pass
        return sent

    def drop_sockets(self) -> None:
        """Close every socket without a word (a network drop)."""
        for conn in self.sockets():
            try:
                conn.socket.close()
            except OSError:
                pass

    def sockets(self) -> list[ServerConnection]:
        with self.lock:
            self._sockets = [c for c in self._sockets if c.state.name == "OPEN"]
            return list(self._sockets)

    def settled(self) -> bool:
        """Every pushed event was taken by the app."""
        with self.lock:
            return all(p.done for p in self._pending.values())

    # ------------------------------------------------------------------ the event dispatcher

    def _dispatch_loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self.lock:
                due = [(k, p) for k, p in self._pending.items() if not p.done and p.next_at <= now]
            for key, p in due:
                if self.mode == "socket":
                    self._send_envelope(key, p)
                else:
                    self._post_event(key, p)

    def _send_envelope(self, key: str, p: Pending) -> None:
        socks = self.sockets()
        if not socks:
            return  # Slack keeps it until the app has a connection
        with self.lock:
            p.envelope_id = str(uuid.uuid4())
            frame = {"envelope_id": p.envelope_id, "payload": p.payload, "type": p.kind,
                     "accepts_response_payload": False, "retry_attempt": p.attempts,
                     "retry_reason": p.reason}
            p.attempts += 1
            p.reason = "timeout"
            p.next_at = time.monotonic() + self.ack_timeout
        try:
            socks[-1].send(json.dumps(frame))
        except ConnectionClosed:
            with self.lock:
                p.next_at = 0.0

    def _post_event(self, key: str, p: Pending) -> None:
        url = self.request_url
        if not url:
            return
        if p.kind == "slash_commands":  # Slack POSTs a slash command as a form, not JSON
            body, kind = urlencode(p.payload).encode(), "application/x-www-form-urlencoded"
        else:
            body, kind = json.dumps(p.payload).encode(), "application/json"
        ts = str(int(time.time()))
        headers = {"Content-Type": kind, "X-Slack-Request-Timestamp": ts,
                   "X-Slack-Signature": sign(self.signing_secret, ts, body)}
        if p.attempts and p.kind != "slash_commands":
            headers["X-Slack-Retry-Num"] = str(p.attempts)
            headers["X-Slack-Retry-Reason"] = p.reason or "http_error"
        with self.lock:
            p.next_at = float("inf")  # one request at a time per event
        try:
            status = httpx.post(url, content=body, headers=headers, timeout=3.0).status_code
            reason = "http_error"
        except httpx.TimeoutException:
            status, reason = 0, "http_timeout"
        except httpx.HTTPError:
            status, reason = 0, "connection_failed"
        with self.lock:
            if status == 200:
                p.done = True
                self.delivered.append(p.payload)
                return
            delay = self.retry_delays[min(p.attempts, len(self.retry_delays) - 1)]
            p.attempts += 1
            p.reason = reason
            p.next_at = time.monotonic() + delay if p.attempts <= len(self.retry_delays) else float("inf")

    # ------------------------------------------------------------------ Socket Mode

    def _ws_session(self, conn: ServerConnection) -> None:
        query = parse_qs(urlsplit(conn.request.path).query)
        ticket = (query.get("ticket") or [""])[0]
        with self.lock:
            known = ticket in self._tickets
            self._tickets.discard(ticket)
        if not known or self.revoked_app:
            conn.close(code=1008, reason="invalid ticket")
            return
        open_now = len(self.sockets()) + 1
        with self.lock:
            self.open_counts.append(open_now)
        conn.send(json.dumps({"type": "hello", "num_connections": open_now,
                              "debug_info": {"host": "applink-fake-1", "build_number": 1,
                                             "approximate_connection_time": 18060},
                              "connection_info": {"app_id": APP_ID}}))
        with self.lock:
            self._sockets.append(conn)
            self.sockets_opened += 1
        try:
            for raw in conn:
                try:
                    frame = json.loads(raw)
                except ValueError:
                    continue
                envelope_id = frame.get("envelope_id")
                with self.lock:
                    self.acks.append(envelope_id)
                    for p in self._pending.values():
                        if p.envelope_id == envelope_id and not p.done:
                            p.done = True
                            self.delivered.append(p.payload)
        except ConnectionClosed:
            pass
        finally:
            with self.lock:
                if conn in self._sockets:
                    self._sockets.remove(conn)

    # ------------------------------------------------------------------ the Web API

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                self._route()

            def do_POST(self):  # noqa: N802
                self._route()

            def _route(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                path = urlsplit(self.path)
                if path.path.startswith("/api/"):
                    status, answer, headers = fake._api(path.path[5:], self.headers, path.query, raw)
                    self._send(status, json.dumps(answer).encode(), "application/json; charset=utf-8", headers)
                elif path.path.startswith("/upload/v1/"):
                    status, body = fake._upload(path.path.rsplit("/", 1)[-1], raw)
                    self._send(status, body, "text/plain", {})
                elif path.path.startswith("/files-pri/"):
                    status, body, ctype = fake._download(path.path, self.headers)
                    self._send(status, body, ctype, {})
                else:
                    self._send(404, b"not found", "text/plain", {})

            def _send(self, status, body, ctype, headers):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _params(self, headers, query: str, raw: bytes) -> dict:
        params = {k: v[0] for k, v in parse_qs(query).items()}
        ctype = headers.get("Content-Type", "")
        if raw and "json" in ctype:
            params.update(json.loads(raw))
        elif raw:
            params.update({k: v[0] for k, v in parse_qs(raw.decode()).items()})
        return params

    def _api(self, method: str, headers, query: str, raw: bytes) -> tuple[int, dict, dict]:
        params = self._params(headers, query, raw)
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip() or params.get("token", "")
        call = Call(method, params, time.monotonic())
        with self.lock:
            self.calls.append(call)
            limit = self._limits.get(method)
            blocked = self._blocked_until.get(method, 0.0) - call.at
            if blocked > 0:
                # Like Slack: a call inside the Retry-After window is refused again (and counted).
                self.early_calls += 1
                call.status, call.answer = 429, {"ok": False, "error": "ratelimited"}
                return 429, call.answer, {"Retry-After": str(max(1, round(blocked)))}
            if limit and limit[0] > 0:
                limit[0] -= 1
                self._blocked_until[method] = call.at + float(limit[1])
                call.status, call.answer = 429, {"ok": False, "error": "ratelimited"}
                return 429, call.answer, {"Retry-After": str(int(limit[1]) if float(limit[1]).is_integer()
                                                             else limit[1])}
        answer = self._method(method, token, params)
        call.answer = answer
        return 200, answer, {}

    def _method(self, method: str, token: str, params: dict) -> dict:
        if method == "apps.connections.open":
            if token != self.app_token:
                return {"ok": False, "error": "invalid_auth"}
            if self.revoked_app:
                return {"ok": False, "error": "token_revoked"}
            ticket = uuid.uuid4().hex
            with self.lock:
                self._tickets.add(ticket)
            return {"ok": True, "url": f"{self.ws_base}?ticket={ticket}&app_id={APP_ID}"}
        if not token:
            return {"ok": False, "error": "not_authed"}
        if token != self.bot_token:
            return {"ok": False, "error": "invalid_auth"}
        if self.revoked_bot:
            return {"ok": False, "error": "token_revoked"}
        if method == "auth.test":
            return {"ok": True, "url": "https://fake-team.slack.com/", "team": "Fake Team", "user": "ugent",
                    "team_id": TEAM, "user_id": BOT_USER, "bot_id": BOT_ID, "is_enterprise_install": False}
        if method == "chat.postMessage":
            return self._post(params)
        if method in ("conversations.history", "conversations.replies"):
            return self._history(method, params)
        if method == "files.getUploadURLExternal":
            if not params.get("filename") or not str(params.get("length", "")).isdigit():
                return {"ok": False, "error": "invalid_arguments"}
            file_id = f"F{uuid.uuid4().hex[:10].upper()}"
            with self.lock:
                self.uploads[file_id] = {"filename": params["filename"], "length": int(params["length"]),
                                         "data": None}
            base = self.api_base.removesuffix("/api/")
            return {"ok": True, "upload_url": f"{base}/upload/v1/{file_id}", "file_id": file_id}
        if method == "files.completeUploadExternal":
            files = params.get("files")
            files = json.loads(files) if isinstance(files, str) else files
            with self.lock:
                if not files or any(f.get("id") not in self.uploads or self.uploads[f["id"]]["data"] is None
                                    for f in files):
                    return {"ok": False, "error": "file_not_found"}
                self.shares.append({"files": files, "channel_id": params.get("channel_id"),
                                    "thread_ts": params.get("thread_ts")})
            return {"ok": True, "files": [{"id": f["id"], "title": f.get("title", "")} for f in files]}
        return {"ok": False, "error": "unknown_method"}

    def _post(self, params: dict) -> dict:
        channel = params.get("channel")
        if not channel:
            return {"ok": False, "error": "channel_not_found"}
        if not params.get("text") and not params.get("blocks"):
            return {"ok": False, "error": "no_text"}
        ts = self.next_ts()
        message = {"type": "message", "subtype": "bot_message", "text": params["text"], "user": BOT_USER,
                   "bot_id": BOT_ID, "ts": ts, "team": TEAM, "channel": channel}
        blocks = params.get("blocks")
        if isinstance(blocks, str):
            blocks = json.loads(blocks)
        if blocks:
            message["blocks"] = blocks
        if params.get("thread_ts"):
            message["thread_ts"] = params["thread_ts"]
        meta = params.get("metadata")
        if isinstance(meta, str):
            meta = json.loads(meta)
        if meta:
            message["metadata"] = meta
        with self.lock:
            self.messages.append(message)
        if self.hold_post_secs:
            time.sleep(self.hold_post_secs)  # recorded, but the answer is late: a window to kill the sender in
        return {"ok": True, "channel": channel, "ts": ts,
                "message": {k: v for k, v in message.items() if k != "channel"}}

    def _history(self, method: str, params: dict) -> dict:
        channel = params.get("channel")
        with_meta = str(params.get("include_all_metadata", "")).lower() in ("1", "true")
        with self.lock:
            if method == "conversations.replies":
                found = [m for m in self.messages if m["channel"] == channel
                         and (m.get("thread_ts") == params.get("ts") or m["ts"] == params.get("ts"))]
            else:
                found = [m for m in self.messages if m["channel"] == channel and not m.get("thread_ts")]
        out = []
        for m in reversed(found) if method == "conversations.history" else found:
            m = {k: v for k, v in m.items() if k != "channel"}
            if not with_meta:
                m.pop("metadata", None)
            out.append(m)
        return {"ok": True, "messages": out, "has_more": False, "response_metadata": {"next_cursor": ""}}

    def _upload(self, file_id: str, raw: bytes) -> tuple[int, bytes]:
        with self.lock:
            entry = self.uploads.get(file_id)
            if entry is None:
                return 404, b"unknown upload"
            entry["data"] = raw
        return 200, f"OK - {len(raw)}".encode()

    def _download(self, path: str, headers) -> tuple[int, bytes, str]:
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        file_id = path.split("/")[2].split("-", 1)[-1]
        entry = self.files.get(file_id)
        with self.lock:
            failure = self._download_failures.pop(0) if self._download_failures else None
            self.downloads.append((file_id, failure or 200))
        hold = self._download_hold
        if hold is not None:
            hold.wait(10)
        if failure is not None:
            return failure, b"<html><body>Service Unavailable</body></html>", "text/html; charset=utf-8"
        if token != self.bot_token or self.revoked_bot or entry is None:
            # Slack answers an unauthenticated download with its sign-in page, not a 401
            return 200, b"<!DOCTYPE html><html><body>Sign in to Slack</body></html>", "text/html; charset=utf-8"
        return 200, entry["data"], entry["mimetype"]
