"""A fake WhatsApp Business Cloud API on loopback, speaking Meta's wire formats, for channel-whatsapp's tests.

* the **Graph API** (``http://127.0.0.1:P/v21.0``, what ``WHATSAPP_API_BASE_URL`` points at):
  ``GET /{phone-number-id}``, ``POST /{phone-number-id}/messages`` (answered
  ``{"messaging_product":"whatsapp","contacts":[{"input","wa_id"}],"messages":[{"id":"wamid..."}]}``),
  ``GET /{media-id}`` (``{"url", "mime_type", "sha256", "file_size", "id", "messaging_product"}``) and
  the download of that URL with the bearer token; errors as Graph sends them,
  ``{"error": {"message", "type", "code", "error_subcode", "fbtrace_id"}}``, with scripted
  429 / 190 / 131047 answers (``fail_next``), a send answered 200 and later reported ``failed``
  in a status notification (``fail_after_send``, how Meta often reports a closed 24-hour window),
  a revoked token (``revoke``), and a send held open and never answered (``hold_next``: the
  worker killed while it waits); ``/media`` refuses a type Meta does not take (code 100); an
  ``interactive`` message is checked against Meta's limits (reply buttons: 1 to 3, id at most 256,
  title 1 to 20 and unique; a list: at most 10 rows in all, id at most 200, title at most 24,
  description at most 72, its button at most 20; a body of 1 to 1,024) and refused with 131009
  otherwise, or on demand (``refuse_interactive``: Meta refusing the type for this number or app,
  131051, or a parameter, 100/131008/131009), while text still goes;
* the **webhook**: notifications POSTed to the worker's callback URL as Meta sends them
  (``application/json``, ``X-Hub-Signature-256`` over the raw body with the app secret), sent
  again while not answered 200; a ``sent`` status notification after each message the bot sends;
  and the GET verification handshake (``verify``); ``press`` taps a reply button or a list row of an
  interactive message the bot sent: an ``interactive`` message carrying its ``id`` and ``title``.

Shapes follow developers.facebook.com/docs/whatsapp/cloud-api (webhooks payload examples, the
messages and media references, error codes). Drive it::

    fake = FakeWhatsApp().start()
    env = fake.env()                               # WHATSAPP_* variables for the worker
    fake.webhook_url = "http://127.0.0.1:N/whatsapp/webhook"
    fake.say("15551234567", "hello")               # a user's text message, as a notification
    fake.texts(); fake.sent()                      # what the bot sent
    fake.fail_next(429, 130429, "Rate limit hit", retry_after=1)
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
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

from tests.fakes import FakeHandler, FakeHTTPServer

VERSION = "v21.0"
PHONE_NUMBER_ID = "106540352242922"
DISPLAY_NUMBER = "15550783881"
BUSINESS_ACCOUNT = "102290129340398"
USER = "16315551181"

INVALID_TOKEN = ("Error validating access token: The session has been invalidated because the user changed their "
                 "password or Facebook has changed the session for security reasons.")
REENGAGEMENT = ("Re-engagement message", "Message failed to send because more than 24 hours have passed since "
                "the customer last replied to this number.")
#: What Meta's ``POST /{phone-number-id}/media`` takes, in the order its refusal lists them
#: (fbsamples/whatsapp-api-examples#10); anything else is refused with code 100.
UPLOAD_TYPES = ("audio/aac", "audio/mp4", "audio/mpeg", "audio/amr", "audio/ogg", "audio/opus",
                "application/vnd.ms-powerpoint", "application/msword",
                "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                "application/vnd.openxmlformats-officedocument.presentationml.presentation",
                "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet", "application/pdf", "text/plain",
                "application/vnd.ms-excel", "application/vnd.oasis.opendocument.text",
                "application/vnd.oasis.opendocument.spreadsheet", "application/vnd.oasis.opendocument.presentation",
                "image/jpeg", "image/png", "image/webp", "video/mp4", "video/3gpp")


def sign(app_secret: str, body: bytes) -> str:
    """Meta's ``X-Hub-Signature-256`` for ``body``."""
    return "sha256=" + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()


def graph_error(code: int, message: str, *, kind: str = "OAuthException", subcode: int | None = None,
                details: str | None = None) -> dict:
    error: dict[str, Any] = {"message": message, "type": kind, "code": code,
                             "fbtrace_id": "A" + uuid.uuid4().hex[:22]}
    if subcode is not None:
        error["error_subcode"] = subcode
    if details:
        error["error_data"] = {"messaging_product": "whatsapp", "details": details}
    return {"error": error}


@dataclass
class Call:
    method: str          # "GET" / "POST"
    path: str            # the path after /v21.0
    body: dict
    status: int = 200
    answer: dict = field(default_factory=dict)


@dataclass
class _Failure:
    status: int
    body: dict
    retry_after: float | None
    times: int


@dataclass
class Pending:
    payload: dict
    attempts: int = 0
    next_at: float = 0.0
    done: bool = False


class FakeWhatsApp:
    def __init__(self, *, token: str = "EAAGfakeSystemUserToken", app_secret: str = "fake-app-secret",
                 verify_token: str = "fake-verify-token", phone_number_id: str = PHONE_NUMBER_ID,
                 retry_delays: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 8.0), send_statuses: bool = True):
        self.token, self.app_secret, self.verify_token = token, app_secret, verify_token
        self.phone_number_id = phone_number_id
        self.retry_delays = retry_delays
        self.send_statuses = send_statuses
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.messages: list[dict] = []       # what the bot sent (the request bodies), with "id" (the wamid)
        self.media: dict[str, tuple[bytes, str]] = {}   # media id -> (bytes, mime type): what users sent
        self.uploads: dict[str, dict] = {}   # media id -> {"data", "mime_type", "filename"}: what the bot uploaded
        self.delivered: list[dict] = []      # notifications the worker answered 200
        self.posts: list[tuple[str, int]] = []   # (what, status) of each webhook POST attempt
        self.webhook_url: str | None = None
        self.revoked = False
        self.held = threading.Event()        # set once a held send has arrived
        self._holds: int | None = None
        self._failures: list[_Failure] = []
        self._late_failures: list[dict] = []   # errors of "failed" statuses posted after a send answered 200
        self._interactive_refusals: list[int] = []   # codes the next interactive messages are refused with
        self._pending: dict[str, Pending] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True

    # ------------------------------------------------------------------ lifecycle

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/{VERSION}"

    def start(self) -> "FakeWhatsApp":
        for target in (self._http.serve_forever, self._dispatch_loop):
            threading.Thread(target=target, daemon=True, name=f"fake-whatsapp-{target.__name__}").start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()

    def env(self) -> dict[str, str]:
        return {"WHATSAPP_ACCESS_TOKEN": self.token, "WHATSAPP_APP_SECRET": self.app_secret,
                "WHATSAPP_VERIFY_TOKEN": self.verify_token, "WHATSAPP_PHONE_NUMBER_ID": self.phone_number_id,
                "WHATSAPP_API_BASE_URL": self.base_url}

    # ------------------------------------------------------------------ notifications (what users do)

    def wamid(self) -> str:
        return "wamid.HBgL" + uuid.uuid4().hex.upper()[:24] + "=="

    def notification(self, value: dict) -> dict:
        """A webhook body for one ``messages`` change carrying ``value`` (metadata added)."""
        value = {"messaging_product": "whatsapp",
                 "metadata": {"display_phone_number": DISPLAY_NUMBER, "phone_number_id": self.phone_number_id},
                 **value}
        return {"object": "whatsapp_business_account",
                "entry": [{"id": BUSINESS_ACCOUNT, "changes": [{"value": value, "field": "messages"}]}]}

    def message(self, wa_id: str = USER, text: str | None = "hi", *, name: str = "Ada", wamid: str | None = None,
                context: str | None = None, phone_number_id: str | None = None, kind: str = "text",
                media: dict | None = None) -> dict:
        """A user's message as a notification (text, or ``kind`` image/document/... with ``media``)."""
        msg: dict[str, Any] = {"from": wa_id, "id": wamid or self.wamid(), "timestamp": str(int(time.time())),
                               "type": kind}
        if kind == "text":
            msg["text"] = {"body": text}
        elif media is not None:
            msg[kind] = media
        if context:
            msg["context"] = {"from": DISPLAY_NUMBER, "id": context}
        payload = self.notification({"contacts": [{"profile": {"name": name}, "wa_id": wa_id}], "messages": [msg]})
        if phone_number_id is not None:
            payload["entry"][0]["changes"][0]["value"]["metadata"]["phone_number_id"] = phone_number_id
        return payload

    def status(self, wamid: str, status: str = "sent", *, recipient: str = USER, errors: list | None = None) -> dict:
        st: dict[str, Any] = {"id": wamid, "status": status, "timestamp": str(int(time.time())),
                              "recipient_id": recipient,
                              "conversation": {"id": uuid.uuid4().hex, "origin": {"type": "service"}},
                              "pricing": {"billable": True, "pricing_model": "CBP", "category": "service"}}
        if errors:
            st["errors"] = errors
        return self.notification({"statuses": [st]})

    def say(self, text: str, wa_id: str = USER, **kw) -> dict:
        """A user's text message, pushed to the webhook until it is answered 200; returns the payload."""
        payload = self.message(wa_id, text, **kw)
        self.push(payload)
        return payload

    def press(self, sent: dict, index: int, wa_id: str = USER, **kw) -> dict:
        """The user taps the ``index``-th reply button or list row of an interactive message the bot sent
        (an item of ``sent()``): Meta's ``interactive`` message (``button_reply`` or ``list_reply``, with
        the ``id`` and ``title``, in ``context`` the message pressed on), pushed; returns the payload."""
        inter = sent["interactive"]
        if inter["type"] == "button":
            reply = inter["action"]["buttons"][index]["reply"]
            content = {"type": "button_reply", "button_reply": {"id": reply["id"], "title": reply["title"]}}
        else:
            row = [r for section in inter["action"]["sections"] for r in section["rows"]][index]
            content = {"type": "list_reply", "list_reply": {k: row[k] for k in ("id", "title", "description")
                                                            if k in row}}
        payload = self.message(wa_id, None, kind="interactive", media=content, context=sent["id"], **kw)
        self.push(payload)
        return payload

    def add_media(self, data: bytes, mime_type: str = "image/jpeg") -> dict:
        """A file a user sent: stored under a media id; returns what a message's image/document carries."""
        media_id = str(1000000000000000 + next(self._ids))
        with self.lock:
            self.media[media_id] = (data, mime_type)
        return {"mime_type": mime_type, "sha256": hashlib.sha256(data).hexdigest(), "id": media_id}

    def push(self, payload: dict) -> str:
        """Deliver a notification as Meta does: POSTed, and again later while not answered 200."""
        key = uuid.uuid4().hex
        with self.lock:
            self._pending[key] = Pending(payload)
        return key

    def redeliver(self, payload: dict) -> None:
        """Send a notification the worker already answered once more (Meta's at-least-once)."""
        self.push(payload)

    def settled(self) -> bool:
        with self.lock:
            return all(p.done for p in self._pending.values())

    def post_webhook(self, payload: dict | bytes, signature: str | None = "auto", *, url: str | None = None) -> int:
        """POST one notification by hand; ``signature`` None sends no header, "auto" the right one."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "facebookexternalua"}
        if signature == "auto":
            signature = sign(self.app_secret, body)
        if signature is not None:
            headers["X-Hub-Signature-256"] = signature
        return httpx.post(url or self.webhook_url, content=body, headers=headers, timeout=10).status_code

    def verify(self, *, token: str | None = None, challenge: str = "1158201444", mode: str = "subscribe",
               url: str | None = None) -> httpx.Response:
        """Meta's verification request when the callback URL is saved in the app dashboard."""
        query = urlencode({"hub.mode": mode, "hub.challenge": challenge,
                           "hub.verify_token": self.verify_token if token is None else token})
        return httpx.get(f"{url or self.webhook_url}?{query}", timeout=10)

    # ------------------------------------------------------------------ scripting the API

    def fail_next(self, status: int, code: int, message: str, *, kind: str = "OAuthException",
                  subcode: int | None = None, details: str | None = None, retry_after: float | None = None,
                  times: int = 1) -> None:
        """The next ``times`` sends are answered ``status`` with this Graph error (and Retry-After)."""
        with self.lock:
            self._failures.append(_Failure(status, graph_error(code, message, kind=kind, subcode=subcode,
                                                               details=details), retry_after, times))

    def rate_limit(self, *, retry_after: float | None = 1, code: int = 130429, times: int = 1) -> None:
        self.fail_next(429, code, "(#130429) Rate limit hit", retry_after=retry_after, times=times,
                       details="Cloud API message throughput has been reached.")

    def window_closed(self) -> None:
        title, details = REENGAGEMENT
        self.fail_next(400, 131047, title, details=details)

    def fail_after_send(self, code: int = 131047, title: str = REENGAGEMENT[0], details: str = REENGAGEMENT[1],
                        *, times: int = 1) -> None:
        """The next ``times`` sends are answered 200 (a wamid) and then reported ``failed`` with this error in
        a status notification, as Meta often reports a closed 24-hour window (131047) or 131026."""
        with self.lock:
            self._late_failures.extend([{"code": code, "title": title, "message": title,
                                         "error_data": {"details": details}}] * times)

    def refuse_interactive(self, code: int = 131051, *, times: int = 1) -> None:
        """The next ``times`` interactive messages are refused with ``code`` (131051: the message type is not
        supported; 100, 131008, 131009: a parameter Meta will not take); other messages still go."""
        with self.lock:
            self._interactive_refusals.extend([code] * times)

    def hold_next(self, *, after: int = 0) -> None:
        """The send after the next ``after`` ones is held open: never answered, never recorded."""
        with self.lock:
            self._holds = after

    def revoke(self) -> None:
        """The access token is invalidated: every call now answers 401 with code 190."""
        with self.lock:
            self.revoked = True

    # ------------------------------------------------------------------ what the bot did

    def sent(self) -> list[dict]:
        with self.lock:
            return [dict(m) for m in self.messages]

    def texts(self) -> list[str]:
        return [m["text"]["body"] for m in self.sent() if m.get("type") == "text"]

    def interactives(self) -> list[dict]:
        """The interactive messages the bot sent (the request bodies, with "id")."""
        return [m for m in self.sent() if m.get("type") == "interactive"]

    def wait_sent(self, n: int, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.sent()) < n:
            time.sleep(0.05)
        return self.sent()

    def sends(self) -> list[Call]:
        """Every send attempt that was answered (any status)."""
        with self.lock:
            return [c for c in self.calls if c.method == "POST" and c.path.endswith("/messages")]

    # ------------------------------------------------------------------ the webhook dispatcher

    def _dispatch_loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self.lock:
                due = [p for p in self._pending.values() if not p.done and p.next_at <= now]
            for p in due:
                self._post(p)

    def _post(self, p: Pending) -> None:
        url = self.webhook_url
        if not url:
            return
        with self.lock:
            p.next_at = float("inf")  # one request at a time per notification
        try:
            status = self.post_webhook(p.payload)
        except httpx.HTTPError:
            status = 0
        what = "status" if "statuses" in p.payload["entry"][0]["changes"][0]["value"] else "message"
        with self.lock:
            self.posts.append((what, status))
            if status == 200:
                p.done = True
                self.delivered.append(p.payload)
                return
            delay = self.retry_delays[min(p.attempts, len(self.retry_delays) - 1)]
            p.attempts += 1
            p.next_at = time.monotonic() + delay

    # ------------------------------------------------------------------ the Graph API

    def _handler(self):
        fake = self

        class Handler(FakeHandler):
            def route(self, method: str, raw: bytes):
                parts = urlsplit(self.path)
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                if parts.path.startswith("/media-download/"):
                    status, body, ctype = fake._download(parts.path.rsplit("/", 1)[-1], token)
                    return self.send(status, body, ctype, {})
                if not parts.path.startswith(f"/{VERSION}/"):
                    return self.send(404, b"not found", "text/plain", {})
                answer = fake._graph(method, parts.path[len(VERSION) + 2:], parts.query, token, raw,
                                     self.headers.get("Content-Type") or "")
                if answer is None:
                    return  # held: never answered (the connection closes when the client goes)
                status, body, headers = answer
                self.send(status, json.dumps(body).encode(), "application/json; charset=UTF-8", headers)

        return Handler

    def _graph(self, method: str, path: str, query: str, token: str, raw: bytes, ctype: str = ""):
        if ctype.startswith("multipart/form-data"):
            body = multipart_fields(raw, ctype)
        else:
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
        call = Call(method, path, body)
        sending = method == "POST" and path == f"{self.phone_number_id}/messages"
        with self.lock:
            if sending and self._holds is not None:
                if self._holds == 0:
                    self._holds = None
                    self.held.set()
                    hold = True
                else:
                    self._holds -= 1
                    hold = False
            else:
                hold = False
        if hold:
            self._stop.wait()  # never answered, never recorded: the request was lost on the way
            return None
        with self.lock:
            self.calls.append(call)
            if token != self.token or self.revoked:
                call.status, call.answer = 401, graph_error(190, INVALID_TOKEN, subcode=460 if self.revoked else None)
                return call.status, call.answer, {"WWW-Authenticate": 'OAuth "Facebook Platform" "invalid_token"'}
            if sending and self._failures:
                failure = self._failures[0]
                failure.times -= 1
                if failure.times <= 0:
                    self._failures.pop(0)
                call.status, call.answer = failure.status, failure.body
                headers = {"Retry-After": f"{failure.retry_after:g}"} if failure.retry_after is not None else {}
                return call.status, call.answer, headers
        if method == "GET" and path == self.phone_number_id:
            call.answer = {"display_phone_number": "+1 555-078-3881", "verified_name": "UGENT Test",
                           "id": self.phone_number_id}
            return 200, call.answer, {}
        if sending:
            return self._send_message(call)
        if method == "POST" and path == f"{self.phone_number_id}/media":
            return self._upload(call)
        if method == "GET" and path in self.media:
            data, mime = self.media[path]
            call.answer = {"messaging_product": "whatsapp", "url": f"{self.root}/media-download/{path}?ext=1&hash=x",
                           "mime_type": mime, "sha256": hashlib.sha256(data).hexdigest(), "file_size": len(data),
                           "id": path}
            return 200, call.answer, {}
        call.status, call.answer = 400, graph_error(100, f"Unsupported {method} request. Object with ID '{path}' "
                                                         "does not exist", kind="GraphMethodException", subcode=33)
        return call.status, call.answer, {}

    def _send_message(self, call: Call):
        body = call.body
        problems = []
        if body.get("messaging_product") != "whatsapp":
            problems.append("messaging_product")
        if not body.get("to"):
            problems.append("to")
        if body.get("type") == "text" and not (body.get("text") or {}).get("body"):
            problems.append("text.body")
        if body.get("type") == "text" and len((body.get("text") or {}).get("body") or "") > 4096:
            call.status, call.answer = 400, graph_error(100, "(#100) Param text['body'] must be at most 4096 "
                                                             "characters long.", subcode=2494010)
            return call.status, call.answer, {}
        kind = body.get("type")
        if kind == "interactive":
            with self.lock:
                refusal = self._interactive_refusals.pop(0) if self._interactive_refusals else None
            if refusal is not None:
                message = {131051: "(#131051) Unsupported message type",
                           131008: "(#131008) Required parameter is missing",
                           100: "(#100) Invalid parameter"}.get(refusal, f"(#{refusal}) Parameter value is not valid")
                details = "Message type is not currently supported." if refusal == 131051 else None
                call.status, call.answer = 400, graph_error(refusal, message, details=details)
                return call.status, call.answer, {}
            problems.extend(interactive_problems(body.get("interactive")))
        if kind in ("image", "document", "audio", "video", "sticker"):
            media = body.get(kind) or {}
            if not (media.get("link") or media.get("id") in self.uploads):
                problems.append(f"{kind}.id")
        if problems:
            call.status, call.answer = 400, graph_error(131009, "(#131009) Parameter value is not valid",
                                                        details=f"missing or invalid: {', '.join(problems)}")
            return call.status, call.answer, {}
        wamid = self.wamid()
        with self.lock:
            self.messages.append(dict(body, id=wamid))
        call.answer = {"messaging_product": "whatsapp", "contacts": [{"input": body["to"], "wa_id": body["to"]}],
                       "messages": [{"id": wamid}]}
        with self.lock:
            late = self._late_failures.pop(0) if self._late_failures else None
        if late is not None:
            self.push(self.status(wamid, "failed", recipient=body["to"], errors=[late]))
        elif self.send_statuses:
            self.push(self.status(wamid, "sent", recipient=body["to"]))
        return 200, call.answer, {}

    def _upload(self, call: Call):
        file = call.body.get("file")
        if call.body.get("messaging_product") != "whatsapp" or not isinstance(file, dict) or not file.get("data"):
            call.status, call.answer = 400, graph_error(100, "(#100) The parameter messaging_product is required.")
            return call.status, call.answer, {}
        mime = call.body.get("type")
        if mime not in UPLOAD_TYPES:
            call.status, call.answer = 400, graph_error(
                100, f"(#100) Param file must be a file with one of the following types: {', '.join(UPLOAD_TYPES)}. "
                     f"Received file of type '{mime}'.")
            return call.status, call.answer, {}
        media_id = str(2000000000000000 + next(self._ids))
        with self.lock:
            self.uploads[media_id] = {"data": file["data"], "mime_type": call.body.get("type"),
                                      "filename": file.get("filename")}
        call.answer = {"id": media_id}
        return 200, call.answer, {}

    def _download(self, media_id: str, token: str) -> tuple[int, bytes, str]:
        entry = self.media.get(media_id)
        if token != self.token or self.revoked:
            return 401, json.dumps(graph_error(190, INVALID_TOKEN)).encode(), "application/json"
        if entry is None:
            return 404, b"", "text/plain"
        return 200, entry[0], entry[1]


def interactive_problems(inter) -> list[str]:
    """What Meta would refuse in an ``interactive`` object of type button or list (empty: it is fine)."""
    def text(value, low: int, high: int) -> bool:
        return isinstance(value, str) and low <= len(value) <= high

    if not isinstance(inter, dict) or inter.get("type") not in ("button", "list"):
        return ["interactive.type"]
    problems = []
    if not text((inter.get("body") or {}).get("text"), 1, 1024):
        problems.append("interactive.body.text")
    action = inter.get("action") or {}
    if inter["type"] == "button":
        buttons = action.get("buttons")
        if not isinstance(buttons, list) or not 1 <= len(buttons) <= 3:
            return problems + ["interactive.action.buttons"]
        replies = [b.get("reply") or {} for b in buttons if isinstance(b, dict) and b.get("type") == "reply"]
        if len(replies) != len(buttons):
            problems.append("interactive.action.buttons.type")
        if not all(text(r.get("id"), 1, 256) and r["id"] == r["id"].strip() for r in replies):
            problems.append("interactive.action.buttons.reply.id")
        if not all(text(r.get("title"), 1, 20) for r in replies):
            problems.append("interactive.action.buttons.reply.title")
        elif len({r["title"].casefold() for r in replies}) != len(replies) or \
                len({r.get("id") for r in replies}) != len(replies):
            problems.append("interactive.action.buttons (titles and ids must be unique)")
        return problems
    if not text(action.get("button"), 1, 20):
        problems.append("interactive.action.button")
    sections = action.get("sections")
    if not isinstance(sections, list) or not 1 <= len(sections) <= 10:
        return problems + ["interactive.action.sections"]
    if len(sections) > 1 and not all(text(s.get("title"), 1, 24) for s in sections):
        problems.append("interactive.action.sections.title")
    rows = [r for s in sections for r in (s.get("rows") or [])]
    if not 1 <= len(rows) <= 10:
        problems.append("interactive.action.sections.rows")
    if not all(text(r.get("id"), 1, 200) for r in rows) or len({r.get("id") for r in rows}) != len(rows):
        problems.append("interactive.action.sections.rows.id")
    if not all(text(r.get("title"), 1, 24) for r in rows):
        problems.append("interactive.action.sections.rows.title")
    if not all(text(r.get("description", "-"), 1, 72) for r in rows):
        problems.append("interactive.action.sections.rows.description")
    return problems


def multipart_fields(raw: bytes, ctype: str) -> dict:
    """A multipart/form-data body's fields: text as str, a file as {"filename", "content_type", "data"}."""
    import email
    import email.policy
    message = email.message_from_bytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw,
                                       policy=email.policy.HTTP)
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        filename = part.get_filename()
        data = part.get_payload(decode=True) or b""
        fields[name] = ({"filename": filename, "content_type": part.get_content_type(), "data": data}
                        if filename is not None else data.decode())
    return fields
