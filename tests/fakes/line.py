"""A fake LINE Messaging API on loopback, speaking LINE's wire format, for the channel-line tests.

* the **API** (``http://127.0.0.1:P``, what ``LINE_API_BASE_URL`` and ``LINE_DATA_API_BASE_URL``
  point at): ``GET /v2/bot/info``, ``POST /v2/bot/message/push`` (``{"to", "messages"}``, one to
  five message objects, a text at most 5,000 characters; answered ``{"sentMessages": [{"id",
  "quoteToken"}]}``), ``X-Line-Retry-Key`` (a UUID; a key already accepted is answered 409 with
  ``x-line-accepted-request-id`` and the first request's ``sentMessages``) and
  ``GET /v2/bot/message/{messageId}/content`` (``prepare``: a large video or audio LINE is still
  preparing, answered 202 until ``GET .../content/transcoding`` has said ``processing`` so many
  times and then ``succeeded``, or ``failed``; ``fail_content``: passing 500s). Errors are LINE's: ``{"message": "...",
  "details": [{"message", "property"}]}``; scripted 429s (no ``Retry-After``, as LINE, unless
  asked for one) and a
  revoked token (401 for every call);
  A message may carry a ``quickReply`` (1 to 13 items, each ``{"type": "action", "action": ...}``; a
  ``postback`` action needs a ``label`` of 1 to 20 characters, ``data`` of at most 300 and a
  ``displayText`` of at most 300), refused with LINE's 400 details otherwise;
* the **webhook**: ``say``/``post`` send a payload (``destination``, ``events``) to the worker's
  URL signed with ``X-Line-Signature`` as LINE does; ``redeliver`` sends an event again with
  ``deliveryContext.isRedelivery`` true and the same ``webhookEventId``; ``press`` taps a quick
  reply button the bot pushed: a ``postback`` event carrying its ``data`` (LINE shows the
  ``displayText`` in the chat as the user's, and sends no message event for it).

Shapes follow LINE's Messaging API reference (developers.line.biz/en/reference/messaging-api/,
"Webhook event objects", "Send push message", "Get content", "Common specifications")::

    with FakeLine() as line:
        env = line.env()                      # LINE_* variables for the worker
        line.webhook_url = url                # the worker's webhook
        line.say("hello", source=line.user()) # a user's text message, signed, POSTed
        line.texts()                          # what the bot pushed
        line.rate_limit(times=1); line.revoke()
"""
from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import itertools
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx

from tests.fakes import FakeHandler, FakeHTTPServer

BOT_USER = "Ub07" + "0" * 29
DESTINATION = BOT_USER
USER = "U4af4980629f2d27b5ad1fc00a2cb0b1b"
GROUP = "Ca56f94637cc4347f90a25382909b24b9"
ROOM = "Ra8dbf4673c4c812cd491258042226c99"
UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
AUTH_FAILED = {"message": "Authentication failed. Confirm that the access token in the authorization header is "
                          "valid."}
RATE_LIMITED = {"message": "The API rate limit has been exceeded. Try again later."}


def sign(secret: str, body: bytes) -> str:
    """LINE's ``X-Line-Signature``: base64(HMAC-SHA256(channel secret, body))."""
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


@dataclass
class Call:
    method: str
    path: str
    headers: dict
    body: dict | None
    at: float
    status: int = 200
    answer: dict = field(default_factory=dict)


class FakeLine:
    def __init__(self, *, token: str = "fake-line-channel-access-token", secret: str = "fake-line-channel-secret"):
        self.token, self.secret = token, secret
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.pushed: list[dict] = []              # each message object LINE delivered, with "to" and "id"
        self.accepted_keys: dict[str, dict] = {}  # retry key -> {"request_id", "sentMessages"}
        self.contents: dict[str, tuple[bytes, str]] = {}
        self.webhook_url: str | None = None
        self.hold_push_secs = 0.0                 # answer a push only this long after delivering it
        self.revoked = False
        self._limits = 0
        self._retry_after: int | None = None
        self._preparing: dict[str, int] = {}      # message id -> transcoding polls still "processing"
        self._transcoding_failed: set[str] = set()
        self._content_faults = 0
        self._ids = itertools.count(100000000000001)
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> "FakeLine":
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="fake-line")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> "FakeLine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        return {"LINE_CHANNEL_ACCESS_TOKEN": self.token, "LINE_CHANNEL_SECRET": self.secret,
                "LINE_API_BASE_URL": self.base_url, "LINE_DATA_API_BASE_URL": self.base_url}

    # ------------------------------------------------------------------ sources and events

    @staticmethod
    def user(user_id: str = USER) -> dict:
        return {"type": "user", "userId": user_id}

    @staticmethod
    def group(group_id: str = GROUP, user_id: str = USER) -> dict:
        return {"type": "group", "groupId": group_id, "userId": user_id}

    @staticmethod
    def room(room_id: str = ROOM, user_id: str = USER) -> dict:
        return {"type": "room", "roomId": room_id, "userId": user_id}

    def next_id(self) -> str:
        return str(next(self._ids))

    def event(self, message: dict | None = None, *, source: dict | None = None, etype: str = "message",
              **extra) -> dict:
        """A webhook event object as LINE sends it."""
        event = {"type": etype, "mode": "active", "timestamp": int(time.time() * 1000),
                 "source": source or self.user(), "webhookEventId": "01" + uuid.uuid4().hex[:24].upper(),
                 "deliveryContext": {"isRedelivery": False}}
        if etype in ("message", "postback", "follow", "join"):
            event["replyToken"] = uuid.uuid4().hex
        if message is not None:
            event["message"] = message
        event.update(extra)
        return event

    def text_message(self, text: str, **extra) -> dict:
        return {"id": self.next_id(), "type": "text", "quoteToken": "q" + uuid.uuid4().hex, "text": text, **extra}

    def media_message(self, data: bytes, *, mtype: str = "image", content_type: str = "image/jpeg",
                      file_name: str | None = None) -> dict:
        """An image/video/audio/file message whose content the data API serves."""
        mid = self.next_id()
        with self.lock:
            self.contents[mid] = (data, content_type)
        message = {"id": mid, "type": mtype, "contentProvider": {"type": "line"}}
        if mtype == "image":
            message["quoteToken"] = "q" + uuid.uuid4().hex
        if mtype in ("video", "audio"):
            message["duration"] = 1000
        if mtype == "file":
            message.pop("contentProvider")
            message.update({"fileName": file_name or "file.bin", "fileSize": len(data)})
        return message

    def payload(self, events: list[dict]) -> dict:
        return {"destination": DESTINATION, "events": events}

    def post(self, payload: dict, *, secret: str | None = None, signature: str | None = None) -> httpx.Response:
        """POST a webhook payload to the worker as LINE does (signed with the channel secret)."""
        assert self.webhook_url, "the worker's webhook URL is not known yet"
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json; charset=utf-8", "User-Agent": "LineBotWebhook/2.0"}
        if signature is None:
            signature = sign(secret or self.secret, body)
        if signature:
            headers["X-Line-Signature"] = signature
        return httpx.post(self.webhook_url, content=body, headers=headers, timeout=5.0)

    def say(self, text: str, *, source: dict | None = None, **extra) -> dict:
        """A user's text message as a ``message`` event, POSTed; returns the event (asserts a 200)."""
        event = self.event(self.text_message(text, **extra), source=source)
        response = self.post(self.payload([event]))
        assert response.status_code == 200, (response.status_code, response.text)
        return event

    def press(self, item: dict, *, source: dict | None = None) -> dict:
        """The user taps a quick reply button (an item of a pushed message's ``quickReply``): a ``postback``
        event with the action's ``data``, POSTed; returns the event (asserts a 200)."""
        action = item["action"]
        assert action["type"] == "postback", action
        event = self.event(source=source, etype="postback", postback={"data": action["data"]})
        response = self.post(self.payload([event]))
        assert response.status_code == 200, (response.status_code, response.text)
        return event

    def redeliver(self, event: dict) -> httpx.Response:
        """LINE's webhook redelivery: the same event (same ``webhookEventId``), marked as a redelivery."""
        again = copy.deepcopy(event)
        again["deliveryContext"] = {"isRedelivery": True}
        return self.post(self.payload([again]))

    # ------------------------------------------------------------------ what the bot did

    def texts(self) -> list[str]:
        with self.lock:
            return [m["text"] for m in self.pushed]

    def quick_replies(self) -> list[list[dict]]:
        """The quick reply items of each pushed message that carried some, in order."""
        with self.lock:
            return [m["quickReply"]["items"] for m in self.pushed if m.get("quickReply")]

    def pushes(self) -> list[Call]:
        """Every push request, refused or not."""
        with self.lock:
            return [c for c in self.calls if c.path == "/v2/bot/message/push"]

    def calls_to(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path == path]

    def rate_limit(self, *, times: int = 1, retry_after: int | None = None) -> None:
        """The next ``times`` pushes are answered 429 (no Retry-After, as LINE; ``retry_after``: one that
        a proxy or a future LINE might send)."""
        with self.lock:
            self._limits, self._retry_after = times, retry_after

    def prepare(self, message_id: str, *, polls: int = 2, fail: bool = False) -> None:
        """LINE is still preparing a message's content: GET content answers 202 until the transcoding
        endpoint has answered ``processing`` ``polls`` times and then ``succeeded`` (``failed`` if ``fail``:
        then the content stays 202)."""
        with self.lock:
            self._preparing[message_id] = polls
            if fail:
                self._transcoding_failed.add(message_id)

    def fail_content(self, *, times: int = 1) -> None:
        """The next ``times`` content downloads are answered 500 (a passing fault of the data API)."""
        with self.lock:
            self._content_faults = times

    def revoke(self) -> None:
        """The channel access token is revoked: every call answers 401."""
        with self.lock:
            self.revoked = True

    # ------------------------------------------------------------------ the API

    def _handler(self):
        fake = self

        class Handler(FakeHandler):
            def route(self, method, raw):
                status, answer, headers = fake._serve(method, self.path.split("?", 1)[0], self.headers, raw)
                if isinstance(answer, tuple):
                    body, ctype = answer
                else:
                    body, ctype = json.dumps(answer).encode(), "application/json"
                self.send(status, body, ctype, {"x-line-request-id": str(uuid.uuid4()), **headers})

        return Handler

    def _serve(self, method: str, path: str, headers, raw: bytes):
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        call = Call(method, path, {k.lower(): v for k, v in headers.items()}, body, time.monotonic())
        with self.lock:
            self.calls.append(call)
        status, answer, extra = self._answer(method, path, headers, body, raw)
        call.status = status
        call.answer = answer if isinstance(answer, dict) else {}
        return status, answer, extra

    def _answer(self, method: str, path: str, headers, body, raw: bytes):
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if token != self.token or self.revoked:
            return 401, dict(AUTH_FAILED), {}
        if method == "GET" and path == "/v2/bot/info":
            return 200, {"userId": BOT_USER, "basicId": "@216ru...", "displayName": "UGENT", "chatMode": "bot",
                         "markAsReadMode": "manual"}, {}
        transcoding = re.fullmatch(r"/v2/bot/message/([0-9]+)/content/transcoding", path)
        if method == "GET" and transcoding:
            mid = transcoding.group(1)
            with self.lock:
                if mid not in self.contents:
                    return 404, {"message": "Not found"}, {}
                if mid in self._transcoding_failed:
                    return 200, {"status": "failed"}, {}
                if self._preparing.get(mid, 0) > 0:
                    self._preparing[mid] -= 1
                    return 200, {"status": "processing"}, {}
                self._preparing.pop(mid, None)
                return 200, {"status": "succeeded"}, {}
        content = re.fullmatch(r"/v2/bot/message/([0-9]+)/content", path)
        if method == "GET" and content:
            with self.lock:
                found = self.contents.get(content.group(1))
                if self._content_faults > 0:
                    self._content_faults -= 1
                    return 500, {"message": "Internal server error"}, {}
                preparing = content.group(1) in self._preparing
            if found is None:
                return 404, {"message": "Not found"}, {}
            if preparing:
                return 202, ("".encode(), "text/plain"), {}
            return 200, found, {}
        if method == "POST" and path == "/v2/bot/message/push":
            return self._push(headers, body)
        return 404, {"message": "Not found"}, {}

    def _push(self, headers, body):
        key = headers.get("X-Line-Retry-Key")
        if key is not None and not UUID_RE.match(key):
            return 400, {"message": "The value for the 'X-Line-Retry-Key' header is invalid"}, {}
        with self.lock:
            if self._limits > 0:
                self._limits -= 1
                extra = {} if self._retry_after is None else {"Retry-After": str(self._retry_after)}
                return 429, dict(RATE_LIMITED), extra
            if key and key in self.accepted_keys:
                seen = self.accepted_keys[key]
                return 409, {"message": "The retry key is already accepted",
                             "sentMessages": seen["sentMessages"]}, {"x-line-accepted-request-id": seen["request_id"]}
        details = self._check_push(body)
        if details:
            return 400, {"message": f"The request body has {len(details)} error(s)", "details": details}, {}
        sent = []
        with self.lock:
            for message in body["messages"]:
                mid = self.next_id()
                sent.append({"id": mid, "quoteToken": "q" + uuid.uuid4().hex})
                self.pushed.append({**message, "to": body["to"], "id": mid, "retry_key": key})
            if key:
                self.accepted_keys[key] = {"request_id": str(uuid.uuid4()), "sentMessages": sent}
        if self.hold_push_secs:
            time.sleep(self.hold_push_secs)  # delivered, but the answer is late: a window to kill the sender in
        return 200, {"sentMessages": sent}, {}

    @staticmethod
    def _check_push(body) -> list[dict]:
        if not isinstance(body, dict):
            return [{"message": "must be a JSON object", "property": ""}]
        details = []
        to = body.get("to")
        if not isinstance(to, str) or not re.fullmatch(r"[UCR][0-9a-f]{32}", to):
            details.append({"message": "The property, 'to', in the request body is invalid (line: -, column: -)",
                            "property": "to"})
        messages = body.get("messages")
        if not isinstance(messages, list) or not 1 <= len(messages) <= 5:
            details.append({"message": "Size must be between 1 and 5", "property": "messages"})
            return details
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("type") != "text":
                details.append({"message": "Only text messages are served by this fake",
                                "property": f"messages[{i}].type"})
            elif not isinstance(m.get("text"), str) or not m["text"] or \
                    len(m["text"].encode("utf-16-le")) // 2 > 5000:
                details.append({"message": "Length must be between 0 and 5000", "property": f"messages[{i}].text"})
            if isinstance(m, dict) and "quickReply" in m:
                details.extend(FakeLine._check_quick_reply(m["quickReply"], f"messages[{i}].quickReply"))
        return details

    @staticmethod
    def _check_quick_reply(quick, where: str) -> list[dict]:
        def length(text) -> int:
            return len(text.encode("utf-16-le")) // 2 if isinstance(text, str) else -1

        items = quick.get("items") if isinstance(quick, dict) else None
        if not isinstance(items, list) or not 1 <= len(items) <= 13:
            return [{"message": "Size must be between 1 and 13", "property": f"{where}.items"}]
        details = []
        for j, item in enumerate(items):
            at = f"{where}.items[{j}]"
            action = item.get("action") if isinstance(item, dict) else None
            if not isinstance(item, dict) or item.get("type") != "action" or not isinstance(action, dict):
                details.append({"message": "must be an action item", "property": at})
                continue
            if action.get("type") != "postback":
                details.append({"message": "Only postback actions are served by this fake",
                                "property": f"{at}.action.type"})
                continue
            if not 1 <= length(action.get("label")) <= 20:
                details.append({"message": "Length must be between 1 and 20", "property": f"{at}.action.label"})
            if not 0 <= length(action.get("data")) <= 300:
                details.append({"message": "Length must be between 0 and 300", "property": f"{at}.action.data"})
            if "displayText" in action and not 1 <= length(action["displayText"]) <= 300:
                details.append({"message": "Length must be between 1 and 300",
                                "property": f"{at}.action.displayText"})
        return details
