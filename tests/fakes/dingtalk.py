"""A fake DingTalk OpenAPI on loopback, speaking its wire format, for the channel-dingtalk tests.

* the **API** (``http://127.0.0.1:P``, what ``DINGTALK_API_BASE_URL`` points at):
  ``POST /v1.0/oauth2/accessToken`` (``{"appKey", "appSecret"}`` → ``{"accessToken", "expireIn": 7200}``),
  ``POST /v1.0/robot/oToMessages/batchSend`` (``{"robotCode", "userIds", "msgKey", "msgParam"}`` →
  ``{"processQueryKey", "invalidStaffIdList", "flowControlledStaffIdList"}``; a user not in the organisation is
  named in ``invalidStaffIdList``, answered 200 as DingTalk does), ``POST /v1.0/robot/groupMessages/send``
  (``{"robotCode", "openConversationId", "msgKey", "msgParam"}`` → ``{"processQueryKey"}``) and
  ``POST /v1.0/robot/messageFiles/download`` (``{"downloadCode", "robotCode"}`` → ``{"downloadUrl"}``, a URL
  on the fake that answers the bytes without any token). Each call but the token needs
  ``x-acs-dingtalk-access-token``. Errors are an HTTP status with ``{"code", "message", "requestid"}``:
  a bad app key or secret 400 ``invalidClientIdOrSecret``, an unknown or expired token 400 (not 401: so
  api.dingtalk.com answers it) ``InvalidAuthentication`` ``不合法的access_token``, an unknown robot code 400
  ``invalidParameter.robotCode.notExsit`` (also a group send to a group the robot is not in), a
  ``msgParam`` over 15,000 bytes 400 ``invalidParameter.msgParam.length``; scripted answers (``script``:
  429 ``Throttling.Api``, 500...) for the next sends, ``hold_next``: a send that never arrives, and
  ``hold_downloads``: ``messageFiles/download`` calls held unanswered while it is set.
* the **old OAPI** (``oapi.dingtalk.com``, the same server here): ``POST /media/upload?access_token=…&type=
  image|voice|video|file`` with the file as the multipart field ``media`` → ``{"errcode": 0, "errmsg": "ok",
  "type", "media_id", "created_at"}``; errors answered HTTP 200 with an ``errcode``: 40014 a token it does not
  take, 40004 an unknown type, 40005 a file type the media type does not take, 40006 over its size (image 20 MB
  JPG/GIF/PNG/BMP, voice 2 MB AMR/MP3/WAV, video 20 MB MP4, file 20 MB doc/docx/xls/xlsx/ppt/pptx/zip/pdf/rar),
  41005 no ``media``; ``upload_errcode`` refuses every upload with that errcode. The sends take
  ``sampleImageMsg`` (``photoURL``: a URL or an image's media id), ``sampleFile`` (``mediaId`` of an upload,
  ``fileName``, ``fileType``) and ``sampleAudio`` (``mediaId``, ``duration``) besides text and markdown;
  ``refuse_msg_key``: sends of that msgKey answered 400 ``invalidParameter.msgParam.invalid``.
* the **Stream mode gateway**: ``POST /v1.0/gateway/connections/open`` (``{"clientId", "clientSecret",
  "subscriptions", "ua", "localIp"}`` → ``{"endpoint", "ticket"}``; a bad Client ID or Secret 401 ``authFailed``
  鉴权失败, as api.dingtalk.com answers it) and a WebSocket server (``websockets``) at the endpoint, taking each
  ticket once. It sends frames as DingTalk does (``{"specVersion", "type", "headers", "data": "<JSON>"}``):
  ``push``/``stream_say`` a robot message as a CALLBACK of ``/v1.0/im/bot/messages/get`` on the newest
  connection, **once**: DingTalk's Stream protocol page says robot messages are "fire-forgot", never pushed
  again, whether the app acknowledges them (``{"code": 200, "headers": {"messageId"}, ...}``, kept in ``acks``)
  or not. ``resend = True`` is the opt-in exception, for a test of the worker's dedupe on ``msgId`` only: a
  push not acknowledged after ``ack_timeout`` seconds, or in flight when its connection closed, is pushed
  again (``lose_acks``: acknowledgements lost on the way). ``ping()`` a SYSTEM ping (its answer kept in
  ``pongs``), ``disconnect()`` a SYSTEM disconnect (no ``messageId``, wants no answer; nothing new is sent on
  that connection, closed after ``disconnect_grace`` seconds), ``drop_sockets()`` a connection closed without
  a word.
* the **callback**: ``post``/``say`` send a robot message to the worker's URL with the ``timestamp`` (ms) and
  ``sign`` headers DingTalk computes (base64(HMAC-SHA256(AppSecret, timestamp + "\\n" + AppSecret))), made
  here independently of the worker's code (with ``cryptography``'s HMAC).

Shapes follow DingTalk's open platform docs (open.dingtalk.com: "Receive messages" for an internal app robot
in HTTP mode, "Batch send one-on-one chat messages", "Send group messages", "Download the file content of a
robot message", "Obtain the access token of an internal app")::

    with FakeDingTalk() as ding:
        env = ding.env()                      # DINGTALK_* variables for the worker
        ding.webhook_url = url                # the worker's message receiving address
        ding.say("hello")                     # a one-to-one text message, signed, POSTed
        ding.texts()                          # what the robot sent
"""
from __future__ import annotations

import base64
import itertools
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import httpx
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.hmac import HMAC
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from tests.fakes import FakeHandler, FakeHTTPServer
from tests.fakes.wecom import multipart

APP_KEY = "dingzvbx8fxmfhqgyk0a"
CORP_ID = "ding9f50b15bccd16741"
STAFF = "manager4220"
OTHER_STAFF = "0234183451381123"
GROUP = "cidDKVAOW8yHEX4Y5tL1hlM8g=="
BOT_USER = "$:LWCP_v1:$r3xyhJnjTmNHmjUNAaVNiD0ORWgj4ZJP"
MSGPARAM_LIMIT = 15000
BOT_MESSAGE_TOPIC = "/v1.0/im/bot/messages/get"
OPEN_PATH = "/v1.0/gateway/connections/open"
MB = 1024 * 1024
#: The old OAPI's media/upload: each type's size limit and the extensions it takes.
UPLOAD_RULES = {"image": (20 * MB, ("jpg", "jpeg", "gif", "png", "bmp")), "voice": (2 * MB, ("amr", "mp3", "wav")),
                "video": (20 * MB, ("mp4",)),
                "file": (20 * MB, ("doc", "docx", "xls", "xlsx", "ppt", "pptx", "zip", "pdf", "rar"))}


def sign(app_secret: str, timestamp: str) -> str:
    """DingTalk's ``sign`` header, computed with another library than the worker's."""
    mac = HMAC(app_secret.encode("utf-8"), hashes.SHA256())
    mac.update(f"{timestamp}\n{app_secret}".encode("utf-8"))
    return base64.b64encode(mac.finalize()).decode()


def error(code: str, message: str) -> dict:
    return {"code": code, "message": message, "requestid": str(uuid.uuid4()).upper()}


@dataclass
class Call:
    method: str
    path: str
    headers: dict
    body: dict | None
    at: float
    status: int = 200
    answer: dict = field(default_factory=dict)


@dataclass
class Push:
    """A robot message for the app over the stream: pushed once (again only with the fake's ``resend``)."""

    message: dict
    frame_ids: list = field(default_factory=list)   # the messageId of each frame that carried it
    next_at: float = 0.0
    sent: bool = False                              # a frame carrying it went out
    done: bool = False                              # a frame carrying it was acknowledged


class FakeDingTalk:
    def __init__(self, *, app_key: str = APP_KEY, app_secret: str = "fake-dingtalk-app-secret-0123456789abcdef"):
        self.app_key, self.app_secret = app_key, app_secret
        self.robot_code = app_key
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.sent: list[dict] = []                # each message delivered: kind, to, msgKey, param, key
        self.tokens: dict[str, float] = {}        # access token -> when it expires (time.time())
        self.staff = {STAFF, OTHER_STAFF}         # the organisation's users the robot may write to
        self.groups = {GROUP}                     # the groups the robot is in
        self.files: dict[str, tuple[bytes, str]] = {}
        self.files_without_length = False         # serve files with no Content-Length (read to the close)
        self.sessions: dict[str, int] = {}        # session webhook token -> its expiry (ms since the epoch)
        self.session_ttl_ms = 5400000             # a message's sessionWebhook lasts 90 minutes
        self.webhook_url: str | None = None
        self.permission = True                    # the app holds the robot's send permission
        self.ip_allowed = True                    # the app's IP whitelist (服务器出口IP) lets the caller in
        self.held = threading.Event()             # a held send arrived
        self.hold_downloads = False               # messageFiles/download held unanswered while set
        self.download_held = threading.Event()    # a held download arrived
        self.uploads: dict[str, dict] = {}        # media_id -> type, data, filename, content_type
        self.upload_errcode: int | None = None     # refuse every media/upload with this errcode
        self.refuse_msg_key: str | None = None     # sends of this msgKey answered 400
        self._hold_after: int | None = None
        self._script: list[tuple[int, dict]] = []
        self._secret_reset = False
        self._flow_controlled = 0
        self._stopping = threading.Event()
        self._msg_ids = itertools.count(1)
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        # the Stream mode gateway
        self.resend = False                       # opt-in, not DingTalk's behaviour: push again what is not acked
        self.ack_timeout = 3.0                    # with resend: an unacknowledged push is sent again after this long
        self.disconnect_grace = 2.0               # a connection told to disconnect is closed after this long
        self.lose_acks = False                    # acknowledgements are lost on the way (never counted)
        self.pushes: list[Push] = []
        self.acks: list[dict] = []                # every acknowledgement frame the app sent
        self.pongs: dict[str, dict] = {}          # a ping's messageId -> the app's answer
        self.opens: list[dict] = []               # each connections/open body that got a ticket
        self.sockets_opened = 0
        self._tickets: set[str] = set()
        self._sockets: list[ServerConnection] = []
        self._draining: set[int] = set()          # id() of connections told to disconnect
        self._open_script: list[tuple[int, dict]] = []
        self._ws = serve(self._ws_session, "127.0.0.1", 0)

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def ws_endpoint(self) -> str:
        return f"ws://127.0.0.1:{self._ws.socket.getsockname()[1]}/connect"

    def start(self) -> "FakeDingTalk":
        threading.Thread(target=self._http.serve_forever, daemon=True, name="fake-dingtalk").start()
        threading.Thread(target=self._ws.serve_forever, daemon=True, name="fake-dingtalk-gateway").start()
        threading.Thread(target=self._dispatch_loop, daemon=True, name="fake-dingtalk-dispatch").start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._http.shutdown()
        self._http.server_close()
        self.drop_sockets()
        self._ws.shutdown()

    def __enter__(self) -> "FakeDingTalk":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        return {"DINGTALK_APP_KEY": self.app_key, "DINGTALK_APP_SECRET": self.app_secret,
                "DINGTALK_API_BASE_URL": self.base_url, "DINGTALK_OAPI_BASE_URL": self.base_url}

    # ------------------------------------------------------------------ scripting

    def script(self, status: int, code: str = "", message: str = "", times: int = 1) -> None:
        """The next ``times`` sends are answered ``status`` with this error, before any is delivered."""
        defaults = {429: ("Throttling.Api", "Request was denied due to api flow control."),
                    500: ("ServiceUnavailable", "The request has failed due to a temporary failure of the server."),
                    503: ("ServiceUnavailable", "The service is unavailable.")}
        code, message = code or defaults.get(status, ("", ""))[0], message or defaults.get(status, ("", "error"))[1]
        with self.lock:
            self._script.extend([(status, error(code, message))] * times)

    def flow_control(self, times: int = 1) -> None:
        """The next ``times`` one-to-one sends are answered 200 with the user in ``flowControlledStaffIdList``
        and not delivered (DingTalk's flow control of one user)."""
        with self.lock:
            self._flow_controlled += times

    def script_answer(self, status: int, body: dict | bytes) -> None:
        """The next send is answered with exactly this (a session webhook's errcode, say; bytes: sent as they
        are, as ``text/html``, the page a proxy in the way would answer)."""
        with self.lock:
            self._script.append((status, body))

    def hold_next(self, *, after: int = 0) -> None:
        """The send after the next ``after`` ones never arrives: held open, not recorded, never delivered (the
        request lost on the way, or the worker killed while it waits)."""
        with self.lock:
            self._hold_after = after

    def expire_tokens(self) -> None:
        with self.lock:
            for token in self.tokens:
                self.tokens[token] = 0.0

    def reset_secret(self) -> None:
        """The app's secret was reset in the developer console: the old one gets no token."""
        with self.lock:
            self._secret_reset = True

    def upload(self, data: bytes, content_type: str = "image/jpeg") -> str:
        """A file a user sent to the robot; returns its downloadCode."""
        code = "mIofN681YE3f/+m+NntqpT" + secrets.token_urlsafe(24)
        with self.lock:
            self.files[code] = (data, content_type)
        return code

    # ------------------------------------------------------------------ what the robot did

    def texts(self) -> list[str]:
        with self.lock:
            return [m["param"].get("text", m["param"].get("content", "")) for m in self.sent]

    def calls_to(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path == path]

    def sends(self) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path in ("/v1.0/robot/oToMessages/batchSend",
                                                        "/v1.0/robot/groupMessages/send", "/robot/sendBySession")]

    def expire_sessions(self) -> None:
        """Every session webhook handed out so far has expired."""
        with self.lock:
            for session in self.sessions:
                self.sessions[session] = 0

    # ------------------------------------------------------------------ the callback, as DingTalk calls it

    def message(self, msgtype: str = "text", *, group: bool = False, staff: str = STAFF, **fields) -> dict:
        """A robot message as DingTalk POSTs it (HTTP mode)."""
        now = int(time.time() * 1000)
        session = secrets.token_hex(16)
        with self.lock:
            self.sessions[session] = now + self.session_ttl_ms
        message = {
            "conversationId": GROUP if group else "cidqO7vJ3QkEOGbqNb2mGSx4Q==",
            "atUsers": [{"dingtalkId": BOT_USER}],
            "chatbotCorpId": CORP_ID, "chatbotUserId": BOT_USER,
            "msgId": f"msg{next(self._msg_ids):04d}" + secrets.token_urlsafe(12),
            "senderNick": "张三", "isAdmin": False, "senderStaffId": staff,
            "sessionWebhookExpiredTime": now + self.session_ttl_ms, "createAt": now, "senderCorpId": CORP_ID,
            "conversationType": "2" if group else "1", "senderId": "$:LWCP_v1:$Ff09GIxxxxx" + staff,
            "sessionWebhook": f"{self.base_url}/robot/sendBySession?session={session}",
            "robotCode": self.robot_code, "msgtype": msgtype,
        }
        if group:
            message.update({"conversationTitle": "机器人测试-TEST", "isInAtList": True})
        message.update(fields)
        return message

    def text(self, content: str, **kw) -> dict:
        return self.message("text", text={"content": content}, **kw)

    def post(self, message: dict, *, timestamp: str | None = None, secret: str | None = None,
             signature: str | None = None) -> httpx.Response:
        """POST one message to the worker, signed as DingTalk does (or as told)."""
        assert self.webhook_url, "the worker's webhook URL is not known yet"
        ts = timestamp or str(int(time.time() * 1000))
        headers = {"Content-Type": "application/json; charset=utf-8", "timestamp": ts,
                   "sign": sign(secret or self.app_secret, ts) if signature is None else signature}
        return httpx.post(self.webhook_url, content=json.dumps(message, ensure_ascii=False).encode(),
                          headers=headers, timeout=5.0)

    def say(self, content: str, **kw) -> dict:
        """A user's text message (one-to-one unless ``group=True``), POSTed; asserts the 200."""
        message = self.text((" " if kw.get("group") else "") + content, **kw)
        response = self.post(message)
        assert response.status_code == 200, (response.status_code, response.text)
        return message

    # ------------------------------------------------------------------ the Stream mode gateway

    def script_open(self, status: int, code: str = "ServiceUnavailable", message: str = "busy") -> None:
        """The next ``connections/open`` is answered ``status`` with this error."""
        with self.lock:
            self._open_script.append((status, error(code, message)))

    def push(self, message: dict) -> Push:
        """A robot message for the app over the stream: sent once on the newest connection (as soon as there is
        one); with ``resend``, again until acknowledged."""
        p = Push(message)
        with self.lock:
            self.pushes.append(p)
        return p

    def stream_say(self, content: str, **kw) -> dict:
        """A user's text message (one-to-one unless ``group=True``), pushed over the stream."""
        message = self.text((" " if kw.get("group") else "") + content, **kw)
        self.push(message)
        return message

    def settled(self) -> bool:
        """Every pushed message was acknowledged."""
        with self.lock:
            return all(p.done for p in self.pushes)

    def pushed(self) -> bool:
        """Every pushed message went out on a connection."""
        with self.lock:
            return all(p.sent for p in self.pushes)

    def sockets(self) -> list[ServerConnection]:
        with self.lock:
            self._sockets = [c for c in self._sockets if c.state.name == "OPEN"]
            return list(self._sockets)

    def ping(self) -> list[str]:
        """A SYSTEM ping on every open connection; returns the pings' messageIds (answers land in ``pongs``)."""
        ids = []
        for conn in self.sockets():
            mid = str(uuid.uuid4())
            data = json.dumps({"opaque": secrets.token_hex(8)})
            try:
                conn.send(json.dumps(self._frame("SYSTEM", "ping", mid, data)))
                ids.append(mid)
            except ConnectionClosed:
                pass
            with self.lock:
                self.pongs.setdefault(mid, {"expected": data})
        return ids

    def disconnect(self) -> int:
        """A SYSTEM disconnect on every open connection: nothing new goes on it, and it is closed after
        ``disconnect_grace`` seconds. The frame carries no ``messageId`` (it wants no answer)."""
        told = 0
        for conn in self.sockets():
            with self.lock:
                self._draining.add(id(conn))
            try:
                conn.send(json.dumps(self._frame("SYSTEM", "disconnect", None,
                                                 json.dumps({"reason": "server will restart"}))))
                told += 1
            except ConnectionClosed:
                continue
            timer = threading.Timer(self.disconnect_grace, conn.close)
            timer.daemon = True
            timer.start()
        return told

    def drop_sockets(self) -> None:
        """Close every connection without a word (a network drop)."""
        for conn in self.sockets():
            try:
                conn.socket.close()
            except OSError:
                pass

    def _frame(self, kind: str, topic: str, message_id: str | None, data: str) -> dict:
        headers = {"contentType": "application/json", "time": str(int(time.time() * 1000)), "topic": topic}
        if message_id is not None:
            headers["messageId"] = message_id
        if kind == "CALLBACK":
            headers.update({"appId": "fake-app-id", "connectionId": "fake-connection"})
        return {"specVersion": "1.0", "type": kind, "headers": headers, "data": data}

    def _dispatch_loop(self) -> None:
        while not self._stopping.wait(0.05):
            socks = [c for c in self.sockets() if id(c) not in self._draining]
            if not socks:
                continue  # a push made with no connection open waits for one (a convenience of the fake)
            now = time.monotonic()
            with self.lock:
                due = [p for p in self.pushes
                       if not p.sent or (self.resend and not p.done and p.next_at <= now)]
            for p in due:
                mid = str(uuid.uuid4())
                frame = self._frame("CALLBACK", BOT_MESSAGE_TOPIC, mid, json.dumps(p.message, ensure_ascii=False))
                with self.lock:
                    p.frame_ids.append(mid)
                    p.next_at = time.monotonic() + self.ack_timeout
                try:
                    socks[-1].send(json.dumps(frame, ensure_ascii=False))
                except ConnectionClosed:  # it never left: tried on the next connection
                    with self.lock:
                        p.frame_ids.remove(mid)
                        p.next_at = 0.0
                    continue
                with self.lock:
                    p.sent = True

    def _ws_session(self, conn: ServerConnection) -> None:
        ticket = (parse_qs(urlsplit(conn.request.path).query).get("ticket") or [""])[0]
        with self.lock:
            known = ticket in self._tickets
            self._tickets.discard(ticket)  # a ticket opens one connection
        if not known or urlsplit(conn.request.path).path != "/connect":
            conn.close(code=1008, reason="invalid ticket")
            return
        with self.lock:
            self._sockets.append(conn)
            self.sockets_opened += 1
        try:
            for raw in conn:
                try:
                    answer = json.loads(raw)
                except ValueError:
                    continue
                mid = str(((answer.get("headers") or {}) if isinstance(answer, dict) else {}).get("messageId") or "")
                with self.lock:
                    self.acks.append(answer)
                    if mid in self.pongs:
                        self.pongs[mid]["answer"] = answer
                    if self.lose_acks or answer.get("code") != 200:
                        continue
                    for p in self.pushes:
                        if p.frame_ids and p.frame_ids[-1] == mid:
                            p.done = True
        except ConnectionClosed:
            pass
        finally:
            with self.lock:
                if conn in self._sockets:
                    self._sockets.remove(conn)
                if self.resend:  # (opt-in) what was in flight on it goes out again at once on the next one
                    for p in self.pushes:
                        if not p.done:
                            p.next_at = 0.0

    def _open_connection(self, body) -> tuple[int, dict]:
        if not isinstance(body, dict):
            return 400, error("MissingBody", "body is mandatory for this action.")
        with self.lock:
            if self._open_script:
                return self._open_script.pop(0)
            if body.get("clientId") != self.app_key or body.get("clientSecret") != self.app_secret or self._secret_reset:
                return 401, error("authFailed", "鉴权失败")
            subs = body.get("subscriptions")
            if not isinstance(subs, list) or not subs:
                return 400, error("invalidParameter.subscriptions", "subscriptions不能为空")
            ticket = str(uuid.uuid4())
            self._tickets.add(ticket)
            self.opens.append(body)
        return 200, {"endpoint": self.ws_endpoint, "ticket": ticket}

    # ------------------------------------------------------------------ the API

    def _handler(self):
        fake = self

        class Handler(FakeHandler):
            def route(self, method, raw):
                path = urlsplit(self.path).path
                if method == "GET" and path.startswith("/files/"):
                    with fake.lock:
                        found = fake.files.get(path[len("/files/"):])
                    if found is None:
                        return self.send(404, b"<Error><Code>NoSuchKey</Code></Error>", "application/xml")
                    if fake.files_without_length:
                        self.send_response(200)
                        self.send_header("Content-Type", found[1])
                        self.send_header("Connection", "close")
                        self.end_headers()
                        self.wfile.write(found[0])
                        self.close_connection = True
                        return None
                    return self.send(200, found[0], found[1])
                if method == "POST" and path == "/media/upload":
                    status, answer = fake._media_upload(self.path, raw, self.headers.get("Content-Type") or "")
                    return self.send(status, json.dumps(answer, ensure_ascii=False).encode(), "application/json")
                if method == "POST" and path == "/robot/sendBySession":
                    status, answer = fake._session_send(self.path, raw)
                    if isinstance(answer, bytes):
                        return self.send(status, answer, "text/html")
                    return self.send(status, json.dumps(answer, ensure_ascii=False).encode(), "application/json")
                result = fake._serve(method, path, {k.lower(): v for k, v in self.headers.items()}, raw)
                if result is None:
                    self.close_connection = True
                    return
                status, answer = result
                self.send(status, json.dumps(answer, ensure_ascii=False).encode(), "application/json;charset=utf-8")

        return Handler

    def _serve(self, method: str, path: str, headers: dict, raw: bytes):
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if path in ("/v1.0/robot/oToMessages/batchSend", "/v1.0/robot/groupMessages/send"):
            with self.lock:
                hold = self._hold_after is not None and self._hold_after == 0
                if self._hold_after is not None:
                    self._hold_after = None if hold else self._hold_after - 1
            if hold:
                self.held.set()
                self._stopping.wait()  # never answered, never recorded: the request was lost on the way
                return None
        if path == "/v1.0/robot/messageFiles/download" and self.hold_downloads:
            self.download_held.set()
            while self.hold_downloads and not self._stopping.wait(0.05):
                pass
            return None  # never answered: the caller is gone (or gives up)
        call = Call(method, path, headers, body if isinstance(body, dict) else None, time.monotonic())
        with self.lock:  # (one step: a test that sees a message sent also sees the call that sent it)
            status, answer = self._answer(method, path, headers, body)
            call.status, call.answer = status, answer
            self.calls.append(call)
        return status, answer

    def _answer(self, method: str, path: str, headers: dict, body):
        if method != "POST":
            return 404, error("NotFound", "the resource is not found")
        if path == "/v1.0/oauth2/accessToken":
            return self._access_token(body)
        if path == OPEN_PATH:
            return self._open_connection(body)
        refused = self._check_token(headers.get("x-acs-dingtalk-access-token"))
        if refused:
            return refused
        if not self.ip_allowed:  # every call with a token, sends and file downloads alike
            return 403, error("Forbidden.AccessDenied.IpNotInWhiteList", "访问ip不在白名单之中")
        if not isinstance(body, dict):
            return 400, error("MissingBody", "body is mandatory for this action.")
        if body.get("robotCode") != self.robot_code:
            return 400, error("invalidParameter.robotCode.notExsit", "机器人不存在")
        if path == "/v1.0/robot/messageFiles/download":
            with self.lock:
                found = body.get("downloadCode") in self.files
            if not found:
                return 400, error("invalidParameter.downloadCode.invalid", "downloadCode不合法")
            return 200, {"downloadUrl": f"{self.base_url}/files/{body['downloadCode']}"}
        if path not in ("/v1.0/robot/oToMessages/batchSend", "/v1.0/robot/groupMessages/send"):
            return 404, error("NotFound", "the resource is not found")
        if not self.permission:
            return 403, error("Forbidden.AccessDenied.AccessTokenPermissionDenied",
                              "没有调用该接口的权限，接口权限申请参考：https://open.dingtalk.com/document/orgapp-server/"
                              "add-api-permission, requiredScopes=[qyapi_robot_sendmsg]")
        param = body.get("msgParam")
        if not isinstance(param, str) or len(param.encode("utf-8")) > MSGPARAM_LIMIT:
            return 400, error("invalidParameter.msgParam.length", "msgParam超过长度限制")
        try:
            values = json.loads(param)
        except ValueError:
            return 400, error("invalidParameter.msgParam.invalid", "msgParam不是合法的JSON")
        key = body.get("msgKey")
        need = {"sampleText": ("content",), "sampleMarkdown": ("title", "text"), "sampleImageMsg": ("photoURL",),
                "sampleFile": ("mediaId", "fileName", "fileType"), "sampleAudio": ("mediaId", "duration")}.get(key)
        if need is None:
            return 400, error("template.not.existed", "机器人模板不存在")
        if not isinstance(values, dict) or not all(isinstance(values.get(k), str) and values[k] for k in need):
            return 400, error("invalidParameter.msgParam.invalid", "消息参数错误")
        if key == self.refuse_msg_key:
            return 400, error("invalidParameter.msgParam.invalid", "消息参数错误")
        with self.lock:
            media = self.uploads.get(values.get("mediaId") or values.get("photoURL") or "")
        if key == "sampleImageMsg" and not values["photoURL"].startswith("http") and (
                media is None or media["type"] != "image"):
            return 400, error("invalidParameter.msgParam.photoURL", "图片不存在")
        if key in ("sampleFile", "sampleAudio") and media is None:
            return 400, error("invalidParameter.msgParam.mediaId", "mediaId不存在")
        with self.lock:
            if self._script:
                return self._script.pop(0)
            pqk = base64.b64encode(secrets.token_bytes(24)).decode()
            if path.endswith("batchSend"):
                users = body.get("userIds")
                if not isinstance(users, list) or not users or len(users) > 20:
                    return 400, error("invalidParameter.userIds.invalid", "userIds不合法")
                invalid = [u for u in users if u not in self.staff]
                if self._flow_controlled:
                    self._flow_controlled -= 1
                    return 200, {"processQueryKey": pqk, "invalidStaffIdList": invalid,
                                 "flowControlledStaffIdList": [u for u in users if u not in invalid]}
                for user in users:
                    if user not in invalid:
                        self.sent.append({"kind": "user", "to": user, "msgKey": key, "param": values, "key": pqk})
                return 200, {"processQueryKey": pqk, "invalidStaffIdList": invalid, "flowControlledStaffIdList": []}
            group = body.get("openConversationId")
            if group not in self.groups:
                # DingTalk's answer for a group the robot is not (or no longer) in: "请检查机器人是否在群内"
                return 400, error("invalidParameter.robotCode.notExsit", "机器人不存在")
            self.sent.append({"kind": "group", "to": group, "msgKey": key, "param": values, "key": pqk})
            return 200, {"processQueryKey": pqk}

    def _media_upload(self, target: str, raw: bytes, ctype: str) -> tuple[int, dict]:
        """The old OAPI's ``media/upload``: HTTP 200 whatever happened, the outcome in ``errcode``."""
        params = {k: v[0] for k, v in parse_qs(urlsplit(target).query).items()}
        parts = multipart(raw, ctype) if ctype.startswith("multipart/form-data") else {}
        call = Call("POST", "/media/upload", {}, {"params": params, "fields": sorted(parts)}, time.monotonic())
        call.answer = self._upload_answer(params, parts)
        with self.lock:
            self.calls.append(call)
        return 200, call.answer

    def _upload_answer(self, params: dict, parts: dict) -> dict:
        with self.lock:
            expires = self.tokens.get(params.get("access_token") or "")
        if expires is None or time.time() >= expires:
            return {"errcode": 40014, "errmsg": "不合法的access_token"}
        mtype = params.get("type") or ""
        if mtype not in UPLOAD_RULES:
            return {"errcode": 40004, "errmsg": "不合法的媒体文件类型"}
        if self.upload_errcode is not None:
            return {"errcode": self.upload_errcode, "errmsg": "上传失败"}
        media = parts.get("media")
        if not media or not media.get("filename"):
            return {"errcode": 41005, "errmsg": "缺少多媒体文件数据"}
        limit, extensions = UPLOAD_RULES[mtype]
        if media["filename"].rsplit(".", 1)[-1].lower() not in extensions:
            return {"errcode": 40005, "errmsg": "不合法的文件类型"}
        if len(media["data"]) > limit:
            return {"errcode": 40006, "errmsg": "不合法的文件大小"}
        media_id = "@lA" + secrets.token_urlsafe(30)
        created = int(time.time() * 1000)
        with self.lock:
            self.uploads[media_id] = {"type": mtype, "data": media["data"], "filename": media["filename"],
                                      "content_type": media["content_type"]}
        return {"errcode": 0, "errmsg": "ok", "type": mtype, "media_id": media_id, "created_at": created}

    def _session_send(self, target: str, raw: bytes) -> tuple[int, dict]:
        """A message's sessionWebhook: ``{"msgtype", "markdown"|"text"}``, no token; errors in errcode."""
        session = (parse_qs(urlsplit(target).query).get("session") or [""])[0]
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        call = Call("POST", "/robot/sendBySession", {}, body if isinstance(body, dict) else None, time.monotonic())
        with self.lock:
            self.calls.append(call)
            expires = self.sessions.get(session)
            if expires is None or time.time() * 1000 >= expires:
                call.answer = {"errcode": 300001, "errmsg": "session is expired or not exist"}
            elif not isinstance(body, dict) or body.get("msgtype") not in ("text", "markdown"):
                call.answer = {"errcode": 40035, "errmsg": "缺少参数 msgtype"}
            elif self._script:
                call.status, call.answer = self._script.pop(0)
                return call.status, call.answer
            else:
                param = body.get(body["msgtype"]) or {}
                self.sent.append({"kind": "session", "to": session, "msgKey": body["msgtype"], "param": param,
                                  "key": ""})
                call.answer = {"errcode": 0, "errmsg": "ok"}
        return 200, call.answer

    def _access_token(self, body):
        if not isinstance(body, dict):
            return 400, error("MissingBody", "body is mandatory for this action.")
        with self.lock:
            if (body.get("appKey") != self.app_key or body.get("appSecret") != self.app_secret
                    or self._secret_reset):
                return 400, error("invalidClientIdOrSecret", "无效的clientId或者clientSecret")
            token = secrets.token_hex(16)
            self.tokens[token] = time.time() + 7200
        return 200, {"accessToken": token, "expireIn": 7200}

    def _check_token(self, token: str | None):
        with self.lock:
            expires = self.tokens.get(token or "")
        if expires is None or time.time() >= expires:
            # api.dingtalk.com answers a token it does not take with 400, not 401
            return 400, error("InvalidAuthentication", "不合法的access_token")
        return None
