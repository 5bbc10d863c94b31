"""A fake WeCom (企业微信) server API on loopback, speaking its wire format, for the channel-wecom tests.

* the **API** (``http://127.0.0.1:P``, what ``WECOM_API_BASE_URL`` points at): ``GET /cgi-bin/gettoken``
  (``corpid``, ``corpsecret``; answered ``{"errcode": 0, "errmsg": "ok", "access_token", "expires_in":
  7200}``), ``POST /cgi-bin/message/send?access_token=`` (a text message to one user of the app,
  answered ``{"errcode": 0, "errmsg": "ok", "invaliduser": "", "msgid"}``) and
  ``GET /cgi-bin/media/get?access_token&media_id`` (the bytes, with ``Content-Type`` and
  ``Content-disposition``), ``POST /cgi-bin/media/upload?access_token&type=image|voice|video|file``
  (multipart, field ``media``; WeCom's limits: more than 5 bytes, image 10 MB JPG/PNG, voice 2 MB AMR,
  video 10 MB MP4, file 20 MB, else 40006/40005; an AMR-NB voice over 60 s 45007; answered ``{errcode, errmsg, type, media_id,
  created_at}``). ``message/send`` takes text, image, voice, video, file (``{"media_id"}``, 40007 for
  an unknown one) and ``template_card`` of type ``button_interaction`` (a ``task_id`` of letters, digits
  and ``_-@`` up to 128 bytes, used once per app, else 42014; 1 to 6 buttons whose keys are unique and
  up to 1,024 bytes, else 40058), answered with a ``response_code`` too;
  ``POST /cgi-bin/message/update_template_card?access_token=`` (``{"userids", "agentid", "response_code",
  "button": {"replace_name"}}``: the buttons of that card become one that cannot be pressed, saying
  ``replace_name``; a response code is the card's send's or a press's, good once within 72 hours, else 40058,
  WeCom documenting no code of its own for it; answered ``{"errcode": 0, "errmsg": "ok", "invaliduser": []}``,
  a user not the card's in ``invaliduser``). Every error is HTTP 200 with ``{"errcode": N, "errmsg": "..."}``:
  an unknown token 40014, an expired one 42001, a wrong secret at gettoken 40001, a user not in the app 81013,
  and scripted answers (``script_send``: 45009 and the like) for the next sends.
* **the duplicate check**: a send with ``enable_duplicate_check`` 1 whose content, type and user are
  those of one sent within ``duplicate_check_interval`` seconds is answered as a success and not
  delivered again (what WeCom documents for the option: the message is not sent twice).
  (For a media message the content is its media id; for a card, the card.)
* a text longer than 2,048 bytes is refused with 45002 here (WeCom itself cuts it off: a test should see it).
* the **callback**: ``verify_url`` checks the worker's URL as WeCom does when the operator saves it
  (GET with an encrypted ``echostr``); ``say``/``post`` send a message, encrypted with the app's
  EncodingAESKey and signed with its Token by the channel's own crypto module (proven against the
  vectors in test_channel_wecom_parts.py), as XML ``<xml><ToUserName/><AgentID/><Encrypt/></xml>``;
  ``resend`` calls again with the same message (WeCom's retry when it had no answer within 5 s);
  ``press`` sends the ``template_card_event`` of a press of a card's button (``EventKey`` the button's
  key, ``TaskId``, ``CardType``, ``ResponseCode``), as WeCom does for a ``button_interaction`` card; a card
  whose buttons were replaced cannot be pressed (``pressable``).

    with FakeWeCom() as wecom:
        env = wecom.env()                        # WECOM_* variables for the worker
        wecom.callback_url = url                 # the worker's callback
        wecom.say("hello")                       # a user's text message, encrypted, signed, POSTed
        wecom.texts()                            # what the app sent
        wecom.script_send(45009); wecom.expire_tokens(); wecom.reset_secret()
"""
from __future__ import annotations

import itertools
import json
import re
import secrets
import time
import uuid
from urllib.parse import urlencode

import httpx

from plugins_app.channel.sdk.wxcrypto import MsgCrypt
from tests.fakes.tencent import OK, TencentFake

CORP_ID = "ww1436e0e65a779aee"
AGENT_ID = "1000002"
USER = "ZhangSan"
OTHER_USER = "LiSi"

MB = 1024 * 1024
UPLOAD_LIMITS = {"image": 10 * MB, "voice": 2 * MB, "video": 10 * MB, "file": 20 * MB}
UPLOAD_EXTENSIONS = {"image": (".jpg", ".jpeg", ".png"), "voice": (".amr",), "video": (".mp4",)}
RESPONSE_CODE_SECS = 72 * 3600  # a response code is good for one update_template_card within 72 hours
VOICE_MAX_SECS = 60  # WeCom plays a voice of at most 60 s, and refuses a longer one (45007)
ERRORS = {
    40001: "invalid credential, hint: [1733482920_1_xxx], from ip: 127.0.0.1, more info at "
           "https://open.work.weixin.qq.com/devtool/query?e=40001",
    40007: "invalid media_id",
    40005: "invalid file type",
    40006: "invalid file size",
    40013: "invalid corpid",
    40014: "invalid access_token",
    40058: "invalid parameter",
    41001: "access_token missing",
    42014: "taskid has existed or empty or exceed max len",
    42001: "access_token expired",
    44004: "empty content",
    45001: "media size out of limit",
    45002: "content size out of limit",
    45007: "playtime out of limit",
    41005: "media data missing",
    48002: "api forbidden",
    44001: "empty media data",
    45009: "api freq out of limit",
    45033: "api concurrent out of limit",
    60020: "not allow to access from your ip",
    81013: "user & party & tag all invalid",
}


def error(code: int) -> dict:
    return {"errcode": code, "errmsg": ERRORS.get(code, "error")}


class FakeWeCom(TencentFake):
    name = "fake-wecom"
    send_path = "/cgi-bin/message/send"
    errors = ERRORS
    unknown_token_errcode = 40014

    def __init__(self, *, corp_id: str = CORP_ID, agent_id: str = AGENT_ID, secret: str = "fake-wecom-app-secret",
                 token: str = "fakeWeComToken", encoding_aes_key: str = "6qkdMrq68nTKduznJYO1A37W2oEgpkMUvkttRToqhUt"):
        super().__init__()  # sent: each message delivered: touser, msgtype, content, msgid, at
        self.corp_id, self.agent_id, self.secret = corp_id, agent_id, secret
        self.token, self.encoding_aes_key = token, encoding_aes_key
        self.crypto = MsgCrypt(token, encoding_aes_key, corp_id)
        self.users = {USER, OTHER_USER}                   # the app's visible range
        self.uploads: dict[str, dict] = {}                # media_id -> type, data, filename, content_type
        self.task_ids: set[str] = set()                   # the template cards' task ids used
        self.card_errcode: int | None = None              # refuse every template card with this errcode
        self.upload_errcode: int | None = None            # refuse every upload with this errcode
        self.hold_msgtype: str | None = None              # hold_send_secs: only a send of this msgtype (None: any)
        self.response_codes: dict[str, dict] = {}         # response code -> task_id, user, issued (monotonic), used
        self.card_updates: list[dict] = []                # each update_template_card WeCom took: task_id, user, name
        self.replaced: dict[str, str] = {}                # task_id -> what its buttons say now (not pressable)
        self.update_errcode: int | None = None            # refuse every update_template_card with this errcode
        self._msg_ids = itertools.count(7400000000000000001)

    def env(self) -> dict[str, str]:
        return {"WECOM_CORP_ID": self.corp_id, "WECOM_AGENT_ID": self.agent_id, "WECOM_SECRET": self.secret,
                "WECOM_TOKEN": self.token, "WECOM_ENCODING_AES_KEY": self.encoding_aes_key,
                "WECOM_API_BASE_URL": self.base_url}

    # ------------------------------------------------------------------ scripting (reset_secret: gettoken 40001)

    def upload(self, data: bytes, content_type: str = "image/jpeg", filename: str = "image.jpg") -> str:
        """A temporary media file, as a user's image/voice/file message carries it; returns its media_id."""
        media_id = "3" + secrets.token_urlsafe(40)
        with self.lock:
            self.media_files[media_id] = (data, content_type, filename)
        return media_id

    # ------------------------------------------------------------------ what the app did

    def texts(self) -> list[str]:
        """The text messages the app sent."""
        with self.lock:
            return [m["content"] for m in self.sent if m["msgtype"] == "text"]

    def messages(self) -> list[dict]:
        """Every message the app sent (touser, msgtype, content, msgid)."""
        with self.lock:
            return [dict(m) for m in self.sent]

    # ------------------------------------------------------------------ the callback, as WeCom calls it

    def message(self, msg_type: str = "text", *, user: str = USER, **fields) -> dict:
        """A message as the callback carries it (before encryption)."""
        message = {"ToUserName": self.corp_id, "FromUserName": user, "CreateTime": str(int(time.time())),
                   "MsgType": msg_type, "MsgId": str(next(self._msg_ids)), "AgentID": self.agent_id}
        message.update({k: str(v) for k, v in fields.items()})
        return message

    def text(self, content: str, **kw) -> dict:
        return self.message("text", Content=content, **kw)

    def event(self, event: str = "enter_agent", *, user: str = USER) -> dict:
        message = self.message("event", user=user, Event=event, EventKey="")
        message.pop("MsgId")
        return message

    def signed(self, plaintext: str, *, crypto: MsgCrypt | None = None) -> tuple[dict, str]:
        """(the query string's fields, the encrypted text) for ``plaintext``, as WeCom signs a callback."""
        timestamp, nonce = str(int(time.time())), str(secrets.randbelow(10 ** 10))
        encrypt, sig = (crypto or self.crypto).seal(plaintext, timestamp, nonce)
        return {"msg_signature": sig, "timestamp": timestamp, "nonce": nonce}, encrypt

    def verify_url(self, *, echo: str | None = None, signature: str | None = None) -> httpx.Response:
        """WeCom's check of the callback URL: GET with an encrypted, signed echostr."""
        assert self.callback_url, "the worker's callback URL is not known yet"
        params, echostr = self.signed(echo or str(secrets.randbelow(10 ** 19)))
        if signature is not None:
            params["msg_signature"] = signature
        return httpx.get(f"{self.callback_url}?{urlencode({**params, 'echostr': echostr})}", timeout=5.0)

    def post(self, message: dict, *, crypto: MsgCrypt | None = None, signature: str | None = None,
             fmt: str = "xml") -> httpx.Response:
        """POST one message to the worker, encrypted and signed as WeCom does."""
        assert self.callback_url, "the worker's callback URL is not known yet"
        params, encrypt = self.signed(self.to_xml(message) if fmt == "xml" else json.dumps(message), crypto=crypto)
        if signature is not None:
            params["msg_signature"] = signature
        if fmt == "xml":
            body = (f"<xml><ToUserName><![CDATA[{self.corp_id}]]></ToUserName>"
                    f"<Encrypt><![CDATA[{encrypt}]]></Encrypt><AgentID><![CDATA[{self.agent_id}]]></AgentID></xml>")
        else:
            body = json.dumps({"tousername": self.corp_id, "encrypt": encrypt, "agentid": self.agent_id})
        return httpx.post(f"{self.callback_url}?{urlencode(params)}", content=body.encode(),
                          headers={"Content-Type": "text/xml" if fmt == "xml" else "application/json",
                                   "User-Agent": "Mozilla/4.0"}, timeout=5.0)

    def say(self, content: str, **kw) -> dict:
        """A user's text message, POSTed; returns the message (asserts a 200 with an empty body)."""
        message = self.text(content, **kw)
        response = self.post(message)
        assert (response.status_code, response.text) == (200, ""), (response.status_code, response.text)
        return message

    def press(self, task_id: str, key: str, *, user: str = USER) -> dict:
        """A user's press of a button of the card ``task_id``: the ``template_card_event``, POSTed (asserts a 200);
        returns the event, for ``resend``."""
        assert self.pressable(task_id), f"card {task_id} shows {self.replaced[task_id]!r}: no button to press"
        event = {"ToUserName": self.corp_id, "FromUserName": user, "CreateTime": str(int(time.time())),
                 "MsgType": "event", "Event": "template_card_event", "EventKey": key, "TaskId": task_id,
                 "CardType": "button_interaction", "ResponseCode": self._response_code(task_id, user),
                 "AgentID": self.agent_id}
        response = self.post(event)
        assert (response.status_code, response.text) == (200, ""), (response.status_code, response.text)
        return event

    def pressable(self, task_id: str) -> bool:
        """Whether the card's buttons can still be pressed (its buttons were not replaced)."""
        with self.lock:
            return task_id not in self.replaced

    def expire_response_codes(self) -> None:
        """Every response code issued so far is past its 72 hours."""
        with self.lock:
            for code in self.response_codes.values():
                code["issued"] = -RESPONSE_CODE_SECS

    def _response_code(self, task_id: str, user: str) -> str:
        code = secrets.token_urlsafe(32)
        with self.lock:
            self.response_codes[code] = {"task_id": task_id, "user": user, "issued": time.monotonic(), "used": False}
        return code

    def resend(self, message: dict) -> httpx.Response:
        """WeCom calling again with the same message (same MsgId), signed afresh."""
        return self.post(message)

    # ------------------------------------------------------------------ the API

    def _parse(self, raw: bytes, ctype: str):
        return multipart(raw, ctype) if ctype.startswith("multipart/form-data") else super()._parse(raw, ctype)

    def _answer(self, method: str, path: str, params: dict, body, raw: bytes = b"", ctype: str = ""):
        if method == "GET" and path == "/cgi-bin/gettoken":
            return self._gettoken(params), {}
        refused = self._check_token(params.get("access_token"))
        if refused:
            return refused, {}
        if method == "POST" and path == "/cgi-bin/message/send":
            return self._send(body), {}
        if method == "POST" and path == "/cgi-bin/message/update_template_card":
            return self._update_card(body), {}
        if method == "POST" and path == "/cgi-bin/media/upload":
            return self._upload(params.get("type", ""), body), {}
        if method == "GET" and path == "/cgi-bin/media/get":
            with self.lock:
                found = self.media_files.get(params.get("media_id", ""))
            if found is None:
                return error(40007), {}
            data, ctype, name = found
            return (data, ctype), {"Content-disposition": f'attachment; filename="{name}"'}
        return {"errcode": 404, "errmsg": "invalid url"}, {}

    def _gettoken(self, params: dict) -> dict:
        if params.get("corpid") != self.corp_id:
            return error(40013)
        if not params.get("corpsecret"):
            return {"errcode": 41004, "errmsg": "corpsecret missing"}
        with self.lock:
            if params["corpsecret"] != self.secret or self._secret_reset:
                return error(40001)
            token = secrets.token_urlsafe(48)
            self.tokens[token] = time.monotonic() + self.expires_in
        return {**OK, "access_token": token, "expires_in": self.expires_in}

    def _upload(self, mtype: str, parts) -> dict:
        if mtype not in UPLOAD_LIMITS:
            return {"errcode": 40004, "errmsg": "invalid media type"}
        if self.upload_errcode is not None:
            return error(self.upload_errcode)
        media = (parts or {}).get("media") if isinstance(parts, dict) else None
        if media is None or not media.get("filename"):
            return error(44001)
        data = media["data"]
        if len(data) <= 5:
            return error(44001)
        if len(data) > UPLOAD_LIMITS[mtype]:
            return error(40006)
        name = media["filename"].lower()
        if mtype in UPLOAD_EXTENSIONS and not name.endswith(UPLOAD_EXTENSIONS[mtype]):
            return error(40005)
        if mtype == "voice" and amr_nb_frames(data) * 0.02 > VOICE_MAX_SECS:
            return error(45007)
        media_id = "3" + secrets.token_urlsafe(40)
        created = int(time.time())
        with self.lock:
            self.uploads[media_id] = {"type": mtype, "data": data, "filename": media["filename"],
                                      "content_type": media["content_type"], "created_at": created}
        return {**OK, "type": mtype, "media_id": media_id, "created_at": str(created)}

    def _content(self, msgtype: str, body: dict):
        """The message's content, or the error it is refused with (a dict with errcode)."""
        obj = body.get(msgtype)
        if not isinstance(obj, dict):
            return {"errcode": 40008, "errmsg": "invalid message type"}
        if msgtype == "text":
            content = obj.get("content")
            if not isinstance(content, str) or not content:
                return error(44004)
            if len(content.encode("utf-8")) > 2048:
                return error(45002)
            return content
        if msgtype in UPLOAD_LIMITS:
            with self.lock:
                upload = self.uploads.get(str(obj.get("media_id") or ""))
            if upload is None or (upload["type"] != msgtype and msgtype != "file"):
                return error(40007)
            return obj["media_id"]
        if msgtype == "template_card":
            return self._card(obj)
        return {"errcode": 40008, "errmsg": "invalid message type"}

    def _card(self, card: dict):
        if self.card_errcode is not None:
            return error(self.card_errcode)
        task_id = card.get("task_id")
        buttons = card.get("button_list")
        if card.get("card_type") != "button_interaction" or not (card.get("main_title") or {}).get("title"):
            return error(40058)
        if not (isinstance(task_id, str) and re.fullmatch(r"[A-Za-z0-9_@-]{1,128}", task_id)):
            return error(42014)
        if not isinstance(buttons, list) or not 1 <= len(buttons) <= 6:
            return error(40058)
        keys = [b.get("key") for b in buttons if isinstance(b, dict)]
        if len(keys) != len(buttons) or len(set(keys)) != len(keys) or not all(
                isinstance(k, str) and k and len(k.encode()) <= 1024 and b.get("text")
                for k, b in zip(keys, buttons)):
            return error(40058)
        return card

    def _send(self, body) -> dict:
        if not isinstance(body, dict) or body.get("msgtype") not in ("text", "template_card", *UPLOAD_LIMITS):
            return {"errcode": 40008, "errmsg": "invalid message type"}
        if str(body.get("agentid")) != self.agent_id or not isinstance(body.get("agentid"), int):
            return {"errcode": 40056, "errmsg": "invalid agentid"}
        msgtype = body["msgtype"]
        content = self._content(msgtype, body)
        if isinstance(content, dict) and "errcode" in content:
            return content
        user = body.get("touser")
        with self.lock:
            if self._script:
                return error(self._script.pop(0))
            if user not in self.users:
                return {**error(81013), "invaliduser": str(user or "")}
            now = time.monotonic()
            if body.get("enable_duplicate_check") == 1:
                interval = int(body.get("duplicate_check_interval") or 1800)
                for m in self.sent:
                    if (m["touser"], m["msgtype"], m["content"]) == (user, msgtype, content) \
                            and now - m["at"] < interval:
                        return {**OK, "invaliduser": "", "msgid": m["msgid"]}
            extra = {}
            if msgtype == "template_card":
                if content["task_id"] in self.task_ids:
                    return error(42014)
                self.task_ids.add(content["task_id"])
                extra = {"response_code": self._response_code(content["task_id"], user)}
            msgid = uuid.uuid4().hex
            self.sent.append({"touser": user, "msgtype": msgtype, "content": content, "msgid": msgid, "at": now})
        if self.hold_send_secs and self.hold_msgtype in (None, msgtype):
            time.sleep(self.hold_send_secs)  # delivered, but the answer is late: a window to kill the sender in
        return {**OK, "invaliduser": "", "msgid": msgid, **extra}


    def _update_card(self, body) -> dict:
        if not isinstance(body, dict):
            return error(40058)
        if str(body.get("agentid")) != self.agent_id or not isinstance(body.get("agentid"), int):
            return {"errcode": 40056, "errmsg": "invalid agentid"}
        name = (body.get("button") or {}).get("replace_name") if isinstance(body.get("button"), dict) else None
        users = body.get("userids")
        if not (isinstance(name, str) and name) or not (isinstance(users, list) or body.get("atall") == 1):
            return error(40058)
        if self.update_errcode is not None:
            return error(self.update_errcode)
        with self.lock:
            code = self.response_codes.get(str(body.get("response_code") or ""))
            if code is None or code["used"] or time.monotonic() - code["issued"] > RESPONSE_CODE_SECS:
                return error(40058)
            invalid = [u for u in users or [] if u != code["user"]]
            if users is not None and not set(users) - set(invalid):
                return {**error(81013), "invaliduser": invalid}
            code["used"] = True
            self.card_updates.append({"task_id": code["task_id"], "user": code["user"], "replace_name": name})
            self.replaced[code["task_id"]] = name
        return {**OK, "invaliduser": invalid}


def amr_nb_frames(data: bytes) -> int:
    """The frames of an AMR-NB file (``#!AMR\\n``, then frames of 20 ms whose size the mode in each one's header
    byte gives, 3GPP TS 26.101); 0 for anything else."""
    if not data.startswith(b"#!AMR\n"):
        return 0
    sizes = (13, 14, 16, 18, 20, 21, 27, 32, 6) + (1,) * 7
    frames, at = 0, 6
    while at < len(data):
        at += sizes[(data[at] >> 3) & 0x0F]
        frames += 1
    return frames


def amr_nb(seconds: float, mode: int = 7) -> bytes:
    """An AMR-NB file of ``seconds`` of frames of ``mode`` (7: 12.2 kbit/s, 32 bytes a frame; 0: 4.75, 13)."""
    size = (13, 14, 16, 18, 20, 21, 27, 32)[mode]
    frame = bytes([(mode << 3) | 0x04]) + b"\x55" * (size - 1)
    return b"#!AMR\n" + frame * round(seconds / 0.02)


def multipart(raw: bytes, ctype: str) -> dict:
    """A multipart/form-data body's parts by field name: {"data", "filename", "content_type"}."""
    from email.parser import BytesParser
    from email.policy import HTTP
    message = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + raw)
    parts = {}
    for part in message.iter_parts() if message.is_multipart() else []:
        name = part.get_param("name", header="content-disposition")
        if name:
            parts[name] = {"data": part.get_payload(decode=True) or b"", "filename": part.get_filename(),
                           "content_type": part.get_content_type()}
    return parts
