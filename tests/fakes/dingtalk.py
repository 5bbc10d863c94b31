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
  429 ``Throttling.Api``, 500...) for the next sends, and ``hold_next``: a send that never arrives.
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
from urllib.parse import urlsplit

import httpx
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.hmac import HMAC

from tests.fakes import FakeHandler, FakeHTTPServer

APP_KEY = "dingzvbx8fxmfhqgyk0a"
CORP_ID = "ding9f50b15bccd16741"
STAFF = "manager4220"
OTHER_STAFF = "0234183451381123"
GROUP = "cidDKVAOW8yHEX4Y5tL1hlM8g=="
BOT_USER = "$:LWCP_v1:$r3xyhJnjTmNHmjUNAaVNiD0ORWgj4ZJP"
MSGPARAM_LIMIT = 15000


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
        self._hold_after: int | None = None
        self._script: list[tuple[int, dict]] = []
        self._secret_reset = False
        self._flow_controlled = 0
        self._stopping = threading.Event()
        self._msg_ids = itertools.count(1)
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> "FakeDingTalk":
        threading.Thread(target=self._http.serve_forever, daemon=True, name="fake-dingtalk").start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._http.shutdown()
        self._http.server_close()

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
        call = Call(method, path, headers, body if isinstance(body, dict) else None, time.monotonic())
        status, answer = self._answer(method, path, headers, body)
        call.status, call.answer = status, answer
        with self.lock:
            self.calls.append(call)
        return status, answer

    def _answer(self, method: str, path: str, headers: dict, body):
        if method != "POST":
            return 404, error("NotFound", "the resource is not found")
        if path == "/v1.0/oauth2/accessToken":
            return self._access_token(body)
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
        need = {"sampleText": ("content",), "sampleMarkdown": ("title", "text")}.get(key)
        if need is None:
            return 400, error("template.not.existed", "机器人模板不存在")
        if not isinstance(values, dict) or not all(isinstance(values.get(k), str) and values[k] for k in need):
            return 400, error("invalidParameter.msgParam.invalid", "消息参数错误")
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

    def _session_send(self, target: str, raw: bytes) -> tuple[int, dict]:
        """A message's sessionWebhook: ``{"msgtype", "markdown"|"text"}``, no token; errors in errcode."""
        from urllib.parse import parse_qs
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
