"""A fake Weixin official account platform (微信公众号) on loopback, speaking its wire format, for the
channel-weixin tests.

* the **API** (``http://127.0.0.1:P``, what ``WEIXIN_API_BASE_URL`` points at):
  ``POST /cgi-bin/stable_token`` (JSON ``grant_type``, ``appid``, ``secret``, ``force_refresh``; answered
  ``{"access_token", "expires_in": 7200}``: the stable token, the same one again while it is valid unless
  ``force_refresh``), ``POST /cgi-bin/message/custom/send?access_token=`` (a text or image customer service
  message, answered ``{"errcode": 0, "errmsg": "ok"}``: no message id), ``POST /cgi-bin/media/upload?
  access_token&type=image`` (multipart field ``media``; answered ``{"type", "media_id", "created_at"}``) and
  ``GET /cgi-bin/media/get?access_token&media_id`` (the bytes, with ``Content-Type`` and
  ``Content-disposition``; a video answers ``{"video_url"}``). Every error is HTTP 200 with
  ``{"errcode": N, "errmsg": "..."}``: an unknown token 40001, an expired one 42001, a wrong secret 40125,
  a wrong AppID 40013, an IP not whitelisted 40164, a text over 2,048 bytes 45002, a user who has not
  written within 48 hours 45015, a sixth message for one message of the user 45047, and scripted answers
  (``script_send``: -1, 45009 and the like) for the next sends.
* the **server URL**, as WeChat calls it: ``verify_url`` (GET with ``signature``, ``timestamp``, ``nonce``,
  ``echostr``), ``post``/``say`` (a user's message, in plaintext mode as XML signed with the Token, in safe
  mode encrypted with the EncodingAESKey for the AppID and signed over ``Encrypt``, by the worker SDK's own
  crypto module, proven against the vectors in test_channel_weixin_parts.py), and ``resend`` (WeChat's
  retry of a POST it had no answer for: the same request again).

    with FakeWeixin(safe=True) as wx:
        env = wx.env()                           # WEIXIN_* variables for the worker
        wx.callback_url = url                    # the worker's server URL
        wx.say("hello")                          # a user's text message
        wx.texts()                               # what the account sent
"""
from __future__ import annotations

import hashlib
import itertools
import secrets
import threading
import time
from email.parser import BytesParser
from email.policy import HTTP
from urllib.parse import urlencode

import httpx

from plugins_app.channel.sdk.wxcrypto import MsgCrypt
from tests.fakes.tencent import OK, TencentFake

APP_ID = "wx5823bf96d3bd56c7"
ACCOUNT = "gh_7f083739789a"              # the account's original id: ToUserName of every message
USER = "oia2TjjewbmiOUlr6X-1crbLOvLw"   # an OpenID
OTHER_USER = "oia2Tj2Ka0fGbY8c3U9TQVZ4q1aE"

ERRORS = {
    -1: "system error",
    40001: "invalid credential, access_token is invalid or not latest rid: 6751a1c2-0d3b5a2e-1f2e3d4c",
    40003: "invalid openid rid: 6751a1c2-0d3b5a2e-1f2e3d4d",
    40007: "invalid media_id rid: 6751a1c2-0d3b5a2e-1f2e3d4e",
    40005: "invalid file type rid: 6751a1c2-0d3b5a2e-1f2e3d5a",
    40009: "invalid image size rid: 6751a1c2-0d3b5a2e-1f2e3d5b",
    40013: "invalid appid rid: 6751a1c2-0d3b5a2e-1f2e3d4f",
    40125: "invalid appsecret rid: 6751a1c2-0d3b5a2e-1f2e3d50",
    40164: "invalid ip 127.0.0.1 ipv6 ::ffff:127.0.0.1, not in whitelist rid: 6751a1c2-0d3b5a2e-1f2e3d51",
    41001: "access_token missing rid: 6751a1c2-0d3b5a2e-1f2e3d52",
    42001: "access_token expired rid: 6751a1c2-0d3b5a2e-1f2e3d53",
    44004: "empty content rid: 6751a1c2-0d3b5a2e-1f2e3d54",
    45002: "content size out of limit rid: 6751a1c2-0d3b5a2e-1f2e3d55",
    45009: "reach max api daily quota limit rid: 6751a1c2-0d3b5a2e-1f2e3d56",
    45011: "api minute-quota reach limit  mustslower  retry next minute rid: 6751a1c2-0d3b5a2e-1f2e3d5c",
    45015: "response out of time limit or subscription is canceled rid: 6751a1c2-0d3b5a2e-1f2e3d57",
    45047: "out of response count limit rid: 6751a1c2-0d3b5a2e-1f2e3d58",
    48001: "api unauthorized rid: 6751a1c2-0d3b5a2e-1f2e3d59",
}
WINDOW_SECS = 48 * 3600
QUOTA = 5


def error(code: int) -> dict:
    return {"errcode": code, "errmsg": ERRORS.get(code, "error")}


class FakeWeixin(TencentFake):
    name = "fake-weixin"
    send_path = "/cgi-bin/message/custom/send"
    errors = ERRORS
    unknown_token_errcode = 40001
    json_content_type = "application/json; encoding=utf-8"

    def __init__(self, *, safe: bool = False, app_id: str = APP_ID, secret: str = "fake-weixin-app-secret-0123456",
                 token: str = "fakeWeixinToken", encoding_aes_key: str = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"):
        super().__init__()  # sent: each message delivered: touser, msgtype, content/media_id
        self.safe = safe
        self.app_id, self.secret, self.token, self.encoding_aes_key = app_id, secret, token, encoding_aes_key
        self.crypto = MsgCrypt(token, encoding_aes_key, app_id)
        self.users = {USER, OTHER_USER}                   # the account's followers
        self.current_token: str | None = None
        self.videos: dict[str, bytes] = {}
        self.uploads: dict[str, tuple[bytes, str, str]] = {}
        self.last_message: dict[str, float] = {}          # user -> when the user last wrote (monotonic)
        self.quota: dict[str, int] = {}                   # user -> messages the account may still send
        self.ip_blocked = False
        self._hold_before: dict[int, threading.Event] = {}  # the nth send waits for the event before delivery
        self._dropped: set[int] = set()
        self._sends = 0
        self._upload_script: list[int] = []
        self._token_script: list[int] = []
        self._media_script: list[int] = []
        self._requests: dict[str, tuple[str, bytes]] = {}  # MsgId -> (url, body) as last posted
        self._msg_ids = itertools.count(24300000000000001)

    def stop(self) -> None:
        for event in list(self._hold_before.values()):
            event.set()
        super().stop()

    def env(self) -> dict[str, str]:
        env = {"WEIXIN_APP_ID": self.app_id, "WEIXIN_APP_SECRET": self.secret, "WEIXIN_TOKEN": self.token,
               "WEIXIN_API_BASE_URL": self.base_url}
        if self.safe:
            env["WEIXIN_ENCODING_AES_KEY"] = self.encoding_aes_key
        return env

    # ------------------------------------------------------------------ scripting

    # script_send: the next sends are answered with these errcodes, one each, before any is delivered (0: HTTP 502)

    def script_token(self, *errcodes: int) -> None:
        """The next stable_token calls are answered with these errcodes, one each (0: HTTP 502)."""
        with self.lock:
            self._token_script.extend(errcodes)

    def script_media(self, *errcodes: int) -> None:
        """The next media/get calls are answered with these errcodes, one each (0: HTTP 502)."""
        with self.lock:
            self._media_script.extend(errcodes)

    def script_upload(self, *errcodes: int) -> None:
        """The next media/upload calls are answered with these errcodes, one each."""
        with self.lock:
            self._upload_script.extend(errcodes)

    def hold_before(self, n: int) -> None:
        """The nth send (counting from 1) waits, not delivered, until ``release(n)``."""
        self._hold_before[n] = threading.Event()

    def release(self, n: int, *, deliver: bool) -> None:
        """Let the held nth send go on: delivered, or (its sender gone) dropped unseen."""
        if not deliver:
            self._dropped.add(n)
        self._hold_before[n].set()

    def held(self, n: int) -> bool:
        with self.lock:
            return self._sends >= n and n in self._hold_before and not self._hold_before[n].is_set()

    # reset_secret: the AppSecret was reset on the platform; stable_token with the old one answers 40125

    def upload(self, data: bytes, content_type: str = "image/jpeg", filename: str = "image.jpg") -> str:
        """A temporary media file, as a user's image/voice message carries it; returns its media_id."""
        media_id = secrets.token_urlsafe(48)
        with self.lock:
            self.media_files[media_id] = (data, content_type, filename)
        return media_id

    def upload_video(self, data: bytes) -> str:
        media_id = secrets.token_urlsafe(48)
        with self.lock:
            self.videos[media_id] = data
        return media_id

    # ------------------------------------------------------------------ what the account did

    def texts(self) -> list[str]:
        with self.lock:
            return [m["text"]["content"] for m in self.sent if m.get("msgtype") == "text"]

    # ------------------------------------------------------------------ the server URL, as WeChat calls it

    def message(self, msg_type: str = "text", *, user: str = USER, **fields) -> dict:
        """A message as WeChat pushes it (before any encryption)."""
        message = {"ToUserName": ACCOUNT, "FromUserName": user, "CreateTime": str(int(time.time())),
                   "MsgType": msg_type}
        message.update({k: str(v) for k, v in fields.items()})
        message["MsgId"] = str(next(self._msg_ids))
        return message

    def text(self, content: str, **kw) -> dict:
        return self.message("text", Content=content, **kw)

    def event(self, event: str = "subscribe", *, user: str = USER) -> dict:
        message = self.message("event", user=user, Event=event)
        message.pop("MsgId")
        return message

    def _signed(self, timestamp: str | None = None) -> dict:
        timestamp, nonce = timestamp or str(int(time.time())), str(secrets.randbelow(10 ** 10))
        sig = hashlib.sha1("".join(sorted([self.token, timestamp, nonce])).encode()).hexdigest()
        return {"signature": sig, "timestamp": timestamp, "nonce": nonce}

    def verify_url(self, *, echo: str | None = None, signature: str | None = None,
                   timestamp: str | None = None) -> httpx.Response:
        """WeChat's check of the server URL: GET with a signed echostr (the same in every mode)."""
        assert self.callback_url, "the worker's callback URL is not known yet"
        params = self._signed(timestamp)
        if signature is not None:
            params["signature"] = signature
        params["echostr"] = echo or str(secrets.randbelow(10 ** 19))
        return httpx.get(f"{self.callback_url}?{urlencode(params)}", timeout=5.0)

    def request(self, message: dict, *, safe: bool | None = None, crypto: MsgCrypt | None = None,
                signature: str | None = None, msg_signature: str | None = None,
                timestamp: str | None = None) -> tuple[str, bytes]:
        """The URL and body WeChat POSTs for ``message`` (safe mode when ``safe``, by default the fake's mode)."""
        assert self.callback_url, "the worker's callback URL is not known yet"
        safe = self.safe if safe is None else safe
        params = self._signed(timestamp)
        params["openid"] = str(message.get("FromUserName") or "")
        plaintext = self.to_xml(message)
        if safe:
            encrypt, msg_sig = (crypto or self.crypto).seal(plaintext, params["timestamp"], params["nonce"])
            params.update(encrypt_type="aes", msg_signature=msg_signature or msg_sig)
            body = f"<xml>\n<ToUserName><![CDATA[{ACCOUNT}]]></ToUserName>\n<Encrypt><![CDATA[{encrypt}]]></Encrypt>\n</xml>"
        else:
            body = plaintext
        if signature is not None:
            params["signature"] = signature
        return f"{self.callback_url}?{urlencode(params)}", body.encode()

    def send_request(self, url: str, body: bytes) -> httpx.Response:
        return httpx.post(url, content=body, headers={"Content-Type": "text/xml", "User-Agent": "Mozilla/4.0"},
                          timeout=5.0)

    def post(self, message: dict, **kw) -> httpx.Response:
        """POST one message to the worker, signed (and in safe mode encrypted) as WeChat does."""
        url, body = self.request(message, **kw)
        if message.get("MsgId"):
            self._requests[message["MsgId"]] = (url, body)
        self._opened_window(message)
        return self.send_request(url, body)

    def say(self, content: str, **kw) -> dict:
        """A user's text message, POSTed; returns the message (asserts a 200 answered ``success``)."""
        message = self.text(content, **kw)
        response = self.post(message)
        assert (response.status_code, response.text) == (200, "success"), (response.status_code, response.text)
        return message

    def resend(self, message: dict) -> httpx.Response:
        """WeChat calling again with the very request it had no answer for (same signature, same body)."""
        url, body = self._requests[message["MsgId"]]
        return self.send_request(url, body)

    def _opened_window(self, message: dict) -> None:
        """A user's message lets the account send 5 customer service messages within 48 hours (not added up)."""
        if message.get("MsgType") != "event" and message.get("FromUserName"):
            with self.lock:
                self.last_message[message["FromUserName"]] = time.monotonic()
                self.quota[message["FromUserName"]] = QUOTA

    # ------------------------------------------------------------------ the API

    def _answer(self, method: str, path: str, params: dict, body, raw: bytes, ctype: str):
        if method == "POST" and path == "/cgi-bin/stable_token":
            with self.lock:
                code = self._token_script.pop(0) if self._token_script else None
            if code is not None:
                return (None if code == 0 else error(code)), {}
            return self._stable_token(body), {}
        if method == "GET" and path.startswith("/video/"):
            with self.lock:
                data = self.videos.get(path[len("/video/"):])
            return ((data, "video/mp4") if data is not None else error(40007)), {}
        refused = self._check_token(params.get("access_token"))
        if refused:
            return refused, {}
        if method == "POST" and path == "/cgi-bin/message/custom/send":
            return self._send(body)
        if method == "POST" and path == "/cgi-bin/media/upload":
            return self._upload(params, raw, ctype), {}
        if method == "GET" and path == "/cgi-bin/media/get":
            with self.lock:
                code = self._media_script.pop(0) if self._media_script else None
            if code is not None:
                return (None if code == 0 else error(code)), {}
            media_id = params.get("media_id", "")
            with self.lock:
                found = self.media_files.get(media_id)
                video = media_id in self.videos
            if video:
                return {"video_url": f"{self.base_url}/video/{media_id}"}, {}
            if found is None:
                return error(40007), {}
            data, ctype, name = found
            return (data, ctype), {"Content-disposition": f'attachment; filename="{name}"'}
        return {"errcode": 40066, "errmsg": "invalid url"}, {}

    def _stable_token(self, body) -> dict:
        body = body if isinstance(body, dict) else {}
        if body.get("grant_type") != "client_credential":
            return {"errcode": 40002, "errmsg": "invalid grant_type"}
        if body.get("appid") != self.app_id:
            return error(40013)
        with self.lock:
            if self.ip_blocked:
                return error(40164)
            if body.get("secret") != self.secret or self._secret_reset:
                return error(40125)
            now = time.monotonic()
            current = self.current_token
            if body.get("force_refresh") or current is None or self.tokens.get(current, 0) <= now:
                if body.get("force_refresh") and current:
                    self.tokens[current] = 0.0
                current = self.current_token = secrets.token_urlsafe(96)
                self.tokens[current] = now + self.expires_in
            return {"access_token": current, "expires_in": round(self.tokens[current] - now)}

    def _check_token(self, token: str | None) -> dict | None:
        refused = super()._check_token(token)
        if refused is None and self.ip_blocked:
            return error(40164)
        return refused

    def _upload(self, params: dict, raw: bytes, ctype: str) -> dict:
        if params.get("type") not in ("image", "voice", "video", "thumb"):
            return {"errcode": 40004, "errmsg": "invalid media type"}
        with self.lock:
            if self._upload_script:
                return error(self._upload_script.pop(0))
        form = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + raw)
        for part in form.iter_parts() if form.is_multipart() else []:
            if part.get_param("name", header="content-disposition") == "media":
                name = (part.get_filename() or "").lower()
                if params["type"] == "image" and not name.endswith((".jpg", ".jpeg", ".png", ".gif")):
                    return error(40005)  # WeChat takes the file's type from its name's extension
                media_id = secrets.token_urlsafe(48)
                with self.lock:
                    self.uploads[media_id] = (part.get_payload(decode=True), part.get_content_type(),
                                              part.get_filename() or "")
                return {"type": params["type"], "media_id": media_id, "created_at": int(time.time())}
        return {"errcode": 41005, "errmsg": "media data missing"}

    def _send(self, body):
        if not isinstance(body, dict) or body.get("msgtype") not in ("text", "image"):
            return {"errcode": 40008, "errmsg": "invalid message type"}, {}
        if body["msgtype"] == "text":
            content = (body.get("text") or {}).get("content")
            if not isinstance(content, str) or not content:
                return error(44004), {}
            if len(content.encode("utf-8")) > 2048:
                return error(45002), {}
        elif (body.get("image") or {}).get("media_id") not in self.uploads:
            return error(40007), {}
        user = body.get("touser")
        with self.lock:
            self._sends += 1
            n = self._sends
            if self._script:
                code = self._script.pop(0)
                return (None if code == 0 else error(code)), {}
            if user not in self.users:
                return error(40003), {}
            if time.monotonic() - self.last_message.get(user, -WINDOW_SECS * 2) > WINDOW_SECS:
                return error(45015), {}
            if self.quota.get(user, 0) <= 0:
                return error(45047), {}
        hold = self._hold_before.get(n)
        if hold is not None:
            hold.wait(60)
            if n in self._dropped:
                return {"errcode": -1, "errmsg": "the sender went away"}, {}
        with self.lock:
            self.quota[user] -= 1
            self.sent.append(dict(body))
        if self.hold_send_secs:
            time.sleep(self.hold_send_secs)  # delivered, but the answer is late: a window to kill the sender in
        return dict(OK), {}
