"""A fake Telegram Bot API on loopback, speaking the Bot API's wire format (stdlib only).

Shapes follow https://core.telegram.org/bots/api: every method is ``POST /bot<token>/<method>``
with a JSON, url-encoded or multipart/form-data body (python-telegram-bot sends the latter two,
nested values JSON-encoded); every answer is ``{"ok": true, "result": ...}`` or
``{"ok": false, "error_code": N, "description": "...", "parameters": {"retry_after": S}}``;
files download from ``GET /file/bot<token>/<file_path>``. Webhook mode POSTs each ``Update`` to
the URL given to ``setWebhook`` with ``X-Telegram-Bot-Api-Secret-Token`` and, like Telegram,
delivers it again until the receiver answers 2xx.

    fake = FakeTelegram().start()          # fake.base_url -> TELEGRAM_API_BASE_URL
    update = fake.push_message(42, "hi")   # a user writes to the bot
    fake.wait_sent(1)                      # what the bot sent: fake.sent("sendMessage")
    fake.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", retry_after=1)
    fake.revoke()                          # every call now 401 Unauthorized
    fake.stop()

Methods served: getMe, getUpdates (long poll, ``offset`` confirms, a newer poll ends an older
one with 409), setWebhook, deleteWebhook, getWebhookInfo, sendMessage, sendPhoto,
sendDocument, getFile, answerCallbackQuery.
"""
from __future__ import annotations

import email.parser
import email.policy
import hmac
import itertools
import json
import re
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes import FakeHTTPServer

DEFAULT_TOKEN = "123456:TEST-token_abc"
BOT_USER = {"id": 123456, "is_bot": True, "first_name": "UGENT test bot", "username": "ugent_test_bot",
            "can_join_groups": True, "can_read_all_group_messages": False, "supports_inline_queries": False}
CONFLICT_OTHER_POLLER = ("Conflict: terminated by other getUpdates request; make sure that only one bot "
                         "instance is running")
CONFLICT_WEBHOOK = "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first"


@dataclass
class Call:
    """One Bot API request the fake answered (or refused)."""

    method: str
    params: dict
    files: dict = field(default_factory=dict)  # field name -> (filename, content_type, bytes)
    status: int = 200
    result: Any = None  # what the fake answered (a Message for the send methods)


@dataclass
class _Failure:
    status: int
    description: str
    parameters: dict | None
    count: int


class FakeTelegram:
    def __init__(self, token: str = DEFAULT_TOKEN):
        self.token = token
        self.calls: list[Call] = []
        self.updates: list[dict] = []        # not yet confirmed by a getUpdates offset
        self.webhook: dict = {"url": "", "secret_token": None}
        self.webhook_posts: list[tuple[int, int]] = []  # (update_id, status) of each webhook attempt
        self.files: dict[str, tuple[str, bytes]] = {}    # file_id -> (file_path, bytes)
        self.downloads: list[tuple[str, int]] = []       # (file_path, status) of each file download, in order
        self._download_failures: list[int] = []          # statuses the next file downloads answer
        self._download_hold: threading.Event | None = None  # set: downloads dribble until it is (hold_downloads)
        self.revoked = False
        self._cond = threading.Condition()
        self._ids = itertools.count(1000)
        self._message_ids = itertools.count(1)
        self._poll_generation = 0
        self.polls_begun = 0                 # getUpdates calls that got past the checks and may now wait
        self._failures: dict[str, list[_Failure]] = {}
        self._holds: dict[str, int] = {}
        self.held = threading.Event()       # set once a held call has arrived
        self._drop_polls = 0
        self._chats: dict[int, dict] = {}
        self._webhook_queue: list[dict] = []
        self._server: FakeHTTPServer | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "FakeTelegram":
        fake = self

        class Handler(_Handler):
            pass
        Handler.fake = fake
        self._server = FakeHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fake-telegram", daemon=True).start()
        threading.Thread(target=self._webhook_loop, name="fake-telegram-webhook", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def root(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        """What TELEGRAM_API_BASE_URL is set to: the token is appended, as the Bot API does."""
        return f"{self.root}/bot"

    # ------------------------------------------------------------------ what users do

    def chat(self, chat_id: int, chat_type: str = "private", title: str | None = None) -> dict:
        chat = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat.update(first_name="Ada", username=f"user{chat_id}")
        else:
            chat["title"] = title or f"chat {chat_id}"
        self._chats[chat_id] = chat
        return chat

    def push_update(self, update: dict) -> dict:
        """Queue an Update for getUpdates, or POST it to the webhook if one is set."""
        with self._cond:
            if self.webhook["url"]:
                self._webhook_queue.append(update)
            else:
                self.updates.append(update)
            self._cond.notify_all()
        return update

    def new_update(self, **body) -> dict:
        return {"update_id": next(self._ids), **body}

    def message(self, chat_id: int, text: str | None = None, *, chat_type: str = "private", from_id: int | None = None,
                first_name: str = "Ada", reply_to: dict | None = None, thread_id: int | None = None,
                **extra) -> dict:
        chat = self._chats.get(chat_id) or self.chat(chat_id, chat_type)
        msg: dict[str, Any] = {"message_id": next(self._message_ids), "date": int(time.time()), "chat": chat}
        if chat["type"] != "channel":
            uid = from_id if from_id is not None else chat_id
            msg["from"] = {"id": uid, "is_bot": False, "first_name": first_name, "username": f"user{uid}"}
        else:
            msg["sender_chat"] = chat
        if text is not None:
            msg["text" if not ({"photo", "document", "voice", "video", "audio"} & set(extra)) else "caption"] = text
        if reply_to is not None:
            msg["reply_to_message"] = reply_to
        if thread_id is not None:
            msg.update(message_thread_id=thread_id, is_topic_message=True)
        msg.update(extra)
        return msg

    def push_message(self, chat_id: int, text: str | None = None, **kwargs) -> dict:
        """A user (or a channel) writes to the bot; returns the Update."""
        chat_type = kwargs.get("chat_type", "private")
        msg = self.message(chat_id, text, **kwargs)
        key = "channel_post" if chat_type == "channel" else "message"
        return self.push_update(self.new_update(**{key: msg}))

    def push_callback(self, chat_id: int, data: str, *, message: dict, from_id: int | None = None) -> dict:
        """A user presses an inline keyboard button under ``message``."""
        uid = from_id if from_id is not None else chat_id
        return self.push_update(self.new_update(callback_query={
            "id": f"cq{next(self._ids)}", "from": {"id": uid, "is_bot": False, "first_name": "Ada"},
            "chat_instance": f"ci{chat_id}", "data": data, "message": message}))

    def add_file(self, data: bytes, file_path: str) -> dict:
        """A file on Telegram's side; returns the ids to put in a message's photo/document."""
        n = next(self._ids)
        file_id = f"FILE{n}"
        self.files[file_id] = (file_path, data)
        return {"file_id": file_id, "file_unique_id": f"U{n}", "file_size": len(data)}

    def redeliver(self, update: dict) -> None:
        """The platform sends the same update again (a lost answer, a retry)."""
        self.push_update(dict(update))

    # ------------------------------------------------------------------ faults

    def fail_next(self, method: str, status: int, description: str, *, retry_after: int | None = None,
                  count: int = 1, parameters: dict | None = None) -> None:
        params = dict(parameters or {})
        if retry_after is not None:
            params["retry_after"] = retry_after
        with self._cond:
            self._failures.setdefault(method, []).append(_Failure(status, description, params or None, count))

    def fail_downloads(self, status: int = 503, times: int = 1) -> None:
        """The next ``times`` downloads from ``/file/bot<token>/`` answer ``status`` (a 5xx: busy for now)."""
        with self._cond:
            self._download_failures += [status] * times

    def hold_downloads(self, release: threading.Event | None) -> None:
        """File downloads begun from now on send their headers at once, then the body a byte every 50 ms until
        ``release`` is set (or 20 s passed), then the rest: a large file over a slow link, under way meanwhile
        and never silent long enough for a read to time out. None serves them at once again."""
        self._download_hold = release

    def hold_next(self, method: str, *, after: int = 0) -> None:
        """The call of ``method`` after the next ``after`` ones never arrives: held open, not recorded,
        never answered (the request lost on the way, or the bot killed while it waits)."""
        with self._cond:
            self._holds[method] = after

    def drop_next_poll(self) -> None:
        """The next getUpdates that has updates to give closes its connection instead of answering."""
        with self._cond:
            self._drop_polls += 1

    def revoke(self) -> None:
        """The bot's token is revoked (@BotFather /revoke): every call now answers 401."""
        with self._cond:
            self.revoked = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ what the bot did

    def sent(self, method: str | None = None) -> list[Call]:
        kinds = ("sendMessage", "sendPhoto", "sendDocument") if method is None else (method,)
        with self._cond:
            return [c for c in self.calls if c.method in kinds and c.status == 200]

    def texts(self) -> list[str]:
        return [c.params.get("text") or c.params.get("caption") or "" for c in self.sent()]

    def wait_sent(self, n: int, timeout: float = 20.0, method: str | None = None) -> list[Call]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.sent(method)) < n:
            time.sleep(0.05)
        return self.sent(method)

    def count(self, method: str) -> int:
        with self._cond:
            return sum(1 for c in self.calls if c.method == method)

    # ------------------------------------------------------------------ the server side

    def _answer(self, method: str, params: dict, files: dict, handler: "_Handler") -> tuple[int, dict] | None:
        with self._cond:
            hold = False
            if method in self._holds:
                if self._holds[method] == 0:
                    del self._holds[method]
                    self.held.set()
                    hold = True
                else:
                    self._holds[method] -= 1
        if hold:
            self._stopping.wait()  # never answered, never recorded: the request was lost on the way
            return None
        with self._cond:
            if self.revoked:
                return self._record(method, params, files, 401, {"ok": False, "error_code": 401,
                                                                  "description": "Unauthorized"})
            queue = self._failures.get(method)
            if queue:
                failure = queue[0]
                failure.count -= 1
                if failure.count <= 0:
                    queue.pop(0)
                body = {"ok": False, "error_code": failure.status, "description": failure.description}
                if failure.parameters:
                    body["parameters"] = failure.parameters
                return self._record(method, params, files, failure.status, body)
        fn = getattr(self, f"_m_{method}", None)
        if fn is None:
            return self._record(method, params, files, 404, {"ok": False, "error_code": 404,
                                                              "description": "Not Found: method not found"})
        if method == "getUpdates":
            return fn(params, files, handler)
        with self._cond:
            try:
                result = fn(params, files)
            except _ApiError as exc:
                return self._record(method, params, files, exc.status, {"ok": False, "error_code": exc.status,
                                                                         "description": exc.description})
            return self._record(method, params, files, 200, {"ok": True, "result": result})

    def _record(self, method, params, files, status, body):
        self.calls.append(Call(method, params, files, status, body.get("result")))
        return status, body

    def _m_getMe(self, params, files):
        return BOT_USER

    def _m_getUpdates(self, params, files, handler):
        offset = int(params.get("offset") or 0)
        timeout = float(params.get("timeout") or 0)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self.webhook["url"]:
                return self._record("getUpdates", params, files, 409,
                                    {"ok": False, "error_code": 409, "description": CONFLICT_WEBHOOK})
            self._poll_generation += 1
            self.polls_begun += 1
            mine = self._poll_generation
            self._cond.notify_all()
            if offset:
                self.updates = [u for u in self.updates if u["update_id"] >= offset]  # confirmed
            while True:
                if self.revoked:
                    return self._record("getUpdates", params, files, 401,
                                        {"ok": False, "error_code": 401, "description": "Unauthorized"})
                if self._poll_generation != mine:
                    return self._record("getUpdates", params, files, 409,
                                        {"ok": False, "error_code": 409, "description": CONFLICT_OTHER_POLLER})
                ready = [u for u in self.updates if u["update_id"] >= offset][:int(params.get("limit") or 100)]
                if ready and self._drop_polls:
                    self._drop_polls -= 1
                    self.calls.append(Call("getUpdates", params, files, 0))
                    handler.close_connection = True
                    return None  # the socket drops with updates in hand: none of them is confirmed
                if ready or self._stopping.is_set():
                    return self._record("getUpdates", params, files, 200, {"ok": True, "result": ready})
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._record("getUpdates", params, files, 200, {"ok": True, "result": []})
                self._cond.wait(min(left, 0.5))

    def _m_setWebhook(self, params, files):
        self.webhook = {"url": params.get("url") or "", "secret_token": params.get("secret_token"),
                        "allowed_updates": params.get("allowed_updates")}
        self._cond.notify_all()
        return True

    def _m_deleteWebhook(self, params, files):
        self.webhook = {"url": "", "secret_token": None}
        if params.get("drop_pending_updates") in (True, "true"):
            self.updates.clear()
        self.updates.extend(self._webhook_queue)
        self._webhook_queue.clear()
        return True

    def _m_getWebhookInfo(self, params, files):
        return {"url": self.webhook["url"], "has_custom_certificate": False,
                "pending_update_count": len(self._webhook_queue) if self.webhook["url"] else len(self.updates)}

    def _message_out(self, params, **content):
        chat_id = int(params["chat_id"])
        if chat_id not in self._chats:
            raise _ApiError(400, "Bad Request: chat not found")
        msg = {"message_id": next(self._message_ids), "date": int(time.time()), "chat": self._chats[chat_id],
               "from": BOT_USER, **content}
        if params.get("reply_markup"):
            msg["reply_markup"] = params["reply_markup"]
        return msg

    def _m_sendMessage(self, params, files):
        text = params.get("text") or ""
        if params.get("parse_mode") == "MarkdownV2":
            problem = markdown_v2_problem(text)
            if problem:
                raise _ApiError(400, f"Bad Request: can't parse entities: {problem}")
            visible = re.sub(r"\\(.)|[*_~|`]", lambda m: m.group(1) or "", text)
        else:
            visible = text
        if not visible.strip():
            raise _ApiError(400, "Bad Request: message text is empty")
        if len(visible.encode("utf-16-le")) // 2 > 4096:  # the limit counts the text after entity parsing
            raise _ApiError(400, "Bad Request: message is too long")
        return self._message_out(params, text=text)

    def _upload(self, params, files, name):
        value = params.get(name)
        if isinstance(value, str) and value.startswith("attach://"):
            upload = files.get(value[len("attach://"):])
        else:
            upload = files.get(name)
        if upload is None:
            raise _ApiError(400, f"Bad Request: there is no {name} in the request")
        filename, content_type, data = upload
        return self.add_file(data, f"{name}s/{filename or 'file'}"), filename, content_type

    def _m_sendPhoto(self, params, files):
        ref, _, _ = self._upload(params, files, "photo")
        return self._message_out(params, photo=[{**ref, "width": 1, "height": 1}],
                                 **({"caption": params["caption"]} if params.get("caption") else {}))

    def _m_sendDocument(self, params, files):
        ref, filename, content_type = self._upload(params, files, "document")
        return self._message_out(params, document={**ref, "file_name": filename, "mime_type": content_type},
                                 **({"caption": params["caption"]} if params.get("caption") else {}))

    def _m_getFile(self, params, files):
        file_id = params.get("file_id")
        if file_id not in self.files:
            raise _ApiError(400, "Bad Request: invalid file_id")
        path, data = self.files[file_id]
        return {"file_id": file_id, "file_unique_id": f"U{file_id}", "file_size": len(data), "file_path": path}

    def _m_answerCallbackQuery(self, params, files):
        return True

    def _file(self, path: str) -> bytes | None:
        with self._cond:
            for file_path, data in self.files.values():
                if file_path == path:
                    return data
        return None

    def _webhook_loop(self) -> None:
        while not self._stopping.is_set():
            with self._cond:
                while not (self._webhook_queue and self.webhook["url"]) and not self._stopping.is_set():
                    self._cond.wait(0.5)
                if self._stopping.is_set():
                    return
                update, hook = self._webhook_queue[0], dict(self.webhook)
            status = self._post_webhook(hook, update)
            with self._cond:
                self.webhook_posts.append((update["update_id"], status))
                if 200 <= status < 300 and self._webhook_queue and self._webhook_queue[0] is update:
                    self._webhook_queue.pop(0)
            if not 200 <= status < 300:
                self._stopping.wait(0.3)  # Telegram retries a failed delivery later

    def _post_webhook(self, hook: dict, update: dict) -> int:
        headers = {"Content-Type": "application/json"}
        if hook.get("secret_token"):
            headers["X-Telegram-Bot-Api-Secret-Token"] = hook["secret_token"]
        req = urllib.request.Request(hook["url"], data=json.dumps(update).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def post_webhook(self, body: dict, secret: str | None) -> int:
        """POST an update to the webhook as a forger would (any secret); returns the status."""
        return self._post_webhook({"url": self.webhook["url"], "secret_token": secret}, body)


class _ApiError(Exception):
    def __init__(self, status: int, description: str):
        super().__init__(description)
        self.status = status
        self.description = description


MARKDOWN_V2_SPECIAL = set("_*[]()~`>#+-=|{}.!")


def markdown_v2_problem(text: str) -> str | None:
    """What Telegram's MarkdownV2 parser would refuse in ``text`` (a reserved character left unescaped
    outside an entity, or an entity left open), else None. Enough of the grammar to catch a bad escaper."""
    i, n = 0, len(text)
    open_marks: list[str] = []
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "`":
            fence = "```" if text.startswith("```", i) else "`"
            end = i + len(fence)
            while end < n and not text.startswith(fence, end):
                end += 2 if text[end] == "\\" else 1
            if end >= n:
                return f"can't find end of the entity starting at byte offset {i}"
            i = end + len(fence)
            continue
        if ch == "[":
            close = text.find("](", i)
            if close < 0:
                return "character '[' is reserved and must be escaped with the preceding '\\'"
            open_marks.append("]")
            i += 1
            continue
        if ch == "]" and open_marks and open_marks[-1] == "]":
            open_marks.pop()
            end = i + 2
            while end < n and text[end] != ")":
                end += 2 if text[end] == "\\" else 1
            if end >= n:
                return "can't find end of a url"
            i = end + 1
            continue
        if ch == ">" and (i == 0 or text[i - 1] == "\n"):
            i += 1
            continue
        if ch in "*_~|":
            mark = "||" if text.startswith("||", i) else ("__" if text.startswith("__", i) else ch)
            if open_marks and open_marks[-1] == mark:
                open_marks.pop()
            else:
                open_marks.append(mark)
            i += len(mark)
            continue
        if ch in MARKDOWN_V2_SPECIAL:
            return f"character '{ch}' is reserved and must be escaped with the preceding '\\'"
        i += 1
    if open_marks:
        return f"can't find end of {open_marks[-1]} entity"
    return None


class _Handler(BaseHTTPRequestHandler):
    fake: FakeTelegram
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _split(self):
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        return [p for p in path.split("/") if p]

    def do_GET(self):
        parts = self._split()
        token = self.fake.token
        if len(parts) >= 3 and parts[0] == "file" and parts[1] == f"bot{token}":
            path = "/".join(parts[2:])
            with self.fake._cond:
                failure = self.fake._download_failures.pop(0) if self.fake._download_failures else None
                data = None if self.fake.revoked else self.fake._file(path)
                self.fake.downloads.append((path, failure or (404 if data is None else 200)))
            if failure is not None:
                return self._send(failure, {"ok": False, "error_code": failure,
                                            "description": HTTPStatus(failure).phrase})
            if data is None:
                return self._send(404, {"ok": False, "error_code": 404, "description": "Not Found"})
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            hold, at = self.fake._download_hold, 0
            if hold is not None:
                deadline = time.monotonic() + 20
                while at < len(data) - 1 and time.monotonic() < deadline and not hold.wait(0.05):
                    self.wfile.write(data[at:at + 1])
                    self.wfile.flush()
                    at += 1
            self.wfile.write(data[at:])
            return
        self._api(parts, {}, {})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        ctype = self.headers.get("Content-Type", "")
        params, files = _parse_body(ctype, body)
        self._api(self._split(), params, files)

    def _api(self, parts, params, files):
        if len(parts) != 2 or not parts[0].startswith("bot"):
            return self._send(404, {"ok": False, "error_code": 404, "description": "Not Found"})
        if not hmac.compare_digest(parts[0][3:], self.fake.token):
            return self._send(401, {"ok": False, "error_code": 401, "description": "Unauthorized"})
        answer = self.fake._answer(parts[1], params, files, self)
        if answer is None:
            self.close_connection = True
            return
        self._send(*answer)

    def _send(self, status: int, body: dict):
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the bot hung up (a cancelled long poll, a killed worker)


def _json_value(value: str) -> Any:
    if value[:1] in "[{" or value in ("true", "false"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _parse_body(ctype: str, body: bytes) -> tuple[dict, dict]:
    if not body:
        return {}, {}
    if ctype.startswith("application/json"):
        return json.loads(body), {}
    if ctype.startswith("application/x-www-form-urlencoded"):
        return {k: _json_value(v) for k, v in urllib.parse.parse_qsl(body.decode(), keep_blank_values=True)}, {}
    if ctype.startswith("multipart/form-data"):
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {ctype}\r\n\r\n".encode() + body)
        params, files = {}, {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            filename = part.get_filename()
            payload = part.get_payload(decode=True) or b""
            if filename is not None:
                files[name] = (filename, part.get_content_type(), payload)
            else:
                params[name] = _json_value(payload.decode())
        return params, files
    return {}, {}
