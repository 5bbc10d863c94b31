"""The Telegram channel: a Bot API worker on python-telegram-bot, in polling or webhook mode.

    python -m plugins_app.channel.workers.telegram --mode polling|webhook [options]

Environment: ``TELEGRAM_BOT_TOKEN`` (from @BotFather) and ``TELEGRAM_API_BASE_URL`` (default
``https://api.telegram.org/bot``; the token is appended as the Bot API does, so a local Bot API
server or a test fake is one variable away). Files download from the same host's ``/file/bot``.

* inbound: ``getUpdates`` long polls (the offset moves past an update only once the hub accepted
  it) or a webhook listener (``X-Telegram-Bot-Api-Secret-Token`` checked; answered 200 only once
  the hub accepted, so Telegram redelivers what was not); ``update_id`` is the idempotency key;
  ``chat.type`` gives the source type (private → user, group/supergroup → group, channel → room);
* outbound: Markdown converted to MarkdownV2 (plain text again if Telegram cannot parse it), split
  at 4096 UTF-16 units, attachments as ``sendPhoto``/``sendDocument``, a delivery's
  ``metadata["options"]`` as an inline keyboard whose presses come back as messages; every part
  sent is journaled, so a restart after a crash sends only the parts still missing;
* limits: ``retry_after`` of a 429 waited out and the same send retried; at most one message a
  second per private chat, one every three seconds per group, thirty a second in all;
* refusals the operator must fix (401 bad or revoked token, 409 a second poller or a webhook still
  set, the webhook replaced) raise ``ChannelRefused``: the plugin is disabled with the reason.

docs/channels/telegram.md is the operator's page.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import sqlite3
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MessageValidationError, ReplyContext)
from plugins_app.channel.sdk.outbox import outbox_path_for
from plugins_app.channel.sdk.text import split_text, utf16_len

KIND = "channel-telegram"
DESCRIPTION = "Telegram: a Bot API bot, by getUpdates polling or a webhook (python-telegram-bot)."
ENV_REFS = ("TELEGRAM_BOT_TOKEN",)

TOKEN_ENV = "TELEGRAM_BOT_TOKEN"
BASE_URL_ENV = "TELEGRAM_API_BASE_URL"
WEBHOOK_SECRET_ENV = "TELEGRAM_WEBHOOK_SECRET"   # optional: else derived from the bot token
_SECRET_CHARS = re.compile(r"[A-Za-z0-9_-]{1,256}")
DEFAULT_BASE_URL = "https://api.telegram.org/bot"
MESSAGE_LIMIT = 4096          # UTF-16 code units after entity parsing
ALLOWED_UPDATES = ["message", "channel_post", "callback_query"]
SOURCE_TYPES = {"private": "user", "group": "group", "supergroup": "group", "channel": "room"}
FILE_URL_PREFIX = "tg-file:"
REVOKED = "401 Unauthorized: the bot token is wrong or was revoked (@BotFather /token or /revoke)"


def file_base_url(base_url: str) -> str:
    """Where files download from, beside the API: ``…/bot`` → ``…/file/bot`` (the Bot API's layout)."""
    if base_url.endswith("/bot"):
        return base_url[:-len("bot")] + "file/bot"
    return base_url.rstrip("/") + "/file/bot"


# --------------------------------------------------------------------------- Markdown → MarkdownV2

_V2_SPECIAL = re.compile(r"([_*\[\]()~`>#+\-=|{}.!\\])")
_INLINE = re.compile(
    r"(?P<code>(?P<ticks>`+)(?P<code_body>.+?)(?P=ticks))"
    r"|(?P<link>\[(?P<link_text>[^\]\n]+)\]\((?P<link_url>[^)\s]+)\))"
    r"|(?P<bold>\*\*(?P<bold_body>.+?)\*\*|(?<!\w)__(?P<bold2_body>.+?)__(?!\w))"
    r"|(?P<strike>~~(?P<strike_body>.+?)~~)"
    r"|(?P<em>(?<![\w*])\*(?![\s*])(?P<em_body>.+?)(?<![\s*])\*(?![\w*])"
    r"|(?<![\w_])_(?![\s_])(?P<em2_body>.+?)(?<![\s_])_(?![\w_]))")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_ORDERED = re.compile(r"^(\s*)(\d{1,9})[.)]\s+(.*)$")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_FENCE_LINE = re.compile(r"^\s{0,3}```\s*([\w+#.-]*)\s*$")


def escape_v2(text: str) -> str:
    """Plain text for MarkdownV2: every reserved character escaped."""
    return _V2_SPECIAL.sub(r"\\\1", text)


def _escape_code(text: str) -> str:
    return text.replace("\\", "\\\\").replace("`", "\\`")


def _inline(text: str) -> str:
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(escape_v2(text[pos:m.start()]))
        if m.group("code"):
            out.append(f"`{_escape_code(m.group('code_body').strip() or m.group('code_body'))}`")
        elif m.group("link"):
            url = m.group("link_url").replace("\\", "\\\\").replace(")", "\\)")
            out.append(f"[{_inline(m.group('link_text'))}]({url})")
        elif m.group("bold"):
            out.append(f"*{_inline(m.group('bold_body') or m.group('bold2_body'))}*")
        elif m.group("strike"):
            out.append(f"~{_inline(m.group('strike_body'))}~")
        else:
            out.append(f"_{_inline(m.group('em_body') or m.group('em2_body'))}_")
        pos = m.end()
    out.append(escape_v2(text[pos:]))
    return "".join(out)


def markdown_to_v2(text: str) -> str:
    """Common Markdown (what models write) as Telegram MarkdownV2.

    Bold, italic, strikethrough, inline code, fenced code (with its language), links, headings
    (bold), quotes, lists and rules; everything else is text with every reserved character escaped.
    """
    lines, out = text.split("\n"), []
    fence: list[str] | None = None
    lang = ""
    for line in lines:
        m = _FENCE_LINE.match(line)
        if fence is not None:
            if m and not m.group(1):
                out.append(f"```{lang}\n" + "\n".join(_escape_code(x) for x in fence) + "\n```")
                fence = None
            else:
                fence.append(line)
            continue
        if m:
            fence, lang = [], m.group(1)
            continue
        if (h := _HEADING.match(line)):
            out.append(f"*{_inline(h.group(1))}*")
        elif _RULE.match(line):
            out.append("\u2014" * 8)
        elif (q := _QUOTE.match(line)):
            out.append(">" + _inline(q.group(1)))
        elif (b := _BULLET.match(line)):
            out.append(f"{b.group(1)}\u2022 {_inline(b.group(2))}")
        elif (o := _ORDERED.match(line)):
            out.append(f"{o.group(1)}{o.group(2)}\\. {_inline(o.group(3))}")
        else:
            out.append(_inline(line))
    if fence is not None:  # an unclosed fence: close it, as the renderer of the web page would
        out.append(f"```{lang}\n" + "\n".join(_escape_code(x) for x in fence) + "\n```")
    return "\n".join(out)


# --------------------------------------------------------------------------- inbound normalisation

def _sender_name(user: dict | None) -> str | None:
    if not user:
        return None
    name = " ".join(p for p in (user.get("first_name"), user.get("last_name")) if p)
    return name or user.get("title") or user.get("username")


def conversation_of(chat_id: Any, thread_id: Any = None) -> str:
    """A chat, or a forum topic of a supergroup (``<chat_id>/<message_thread_id>``)."""
    return f"{chat_id}/{thread_id}" if thread_id else str(chat_id)


def parse_conversation(conversation_id: str) -> tuple[int | str, int | None]:
    chat, _, thread = conversation_id.partition("/")
    try:
        chat_id: int | str = int(chat)
    except ValueError:
        chat_id = chat  # a channel's @username
    return chat_id, int(thread) if thread.isdigit() else None


def _attachments(msg: dict) -> list[Attachment]:
    out = []
    if msg.get("photo"):
        best = max(msg["photo"], key=lambda p: (p.get("file_size") or 0, p.get("width", 0) * p.get("height", 0)))
        out.append(Attachment("image", "image/jpeg", url=FILE_URL_PREFIX + best["file_id"],
                              size=best.get("file_size")))
    for key, kind, default_type in (("document", "document", "application/octet-stream"),
                                    ("video", "video", "video/mp4"), ("animation", "video", "video/mp4"),
                                    ("audio", "audio", "audio/mpeg"), ("voice", "audio", "audio/ogg"),
                                    ("video_note", "video", "video/mp4"), ("sticker", "image", "image/webp")):
        f = msg.get(key)
        if f and (key != "document" or "animation" not in msg):
            ctype = f.get("mime_type") or default_type
            if kind == "document" and ctype.startswith("image/"):
                kind = "image"
            out.append(Attachment(kind, ctype, url=FILE_URL_PREFIX + f["file_id"], filename=f.get("file_name"),
                                  size=f.get("file_size")))
    return out


def normalise(update: dict) -> InboundMessage | None:
    """One Bot API ``Update`` as the hub's message, or None for an update the bot does not answer.

    The message id is ``<update_id>:<message_id>``: the update id is Telegram's dedupe key (a
    redelivered update repeats it), and the chat's message id is what an answer replies to.
    """
    update_id = update.get("update_id")
    if update_id is None:
        return None
    if (cq := update.get("callback_query")) is not None:
        msg = cq.get("message") or {}
        chat = msg.get("chat") or {}
        if not chat or not cq.get("data"):
            return None
        user = cq.get("from") or {}
        return InboundMessage(
            channel="telegram", conversation_id=conversation_of(chat["id"], msg.get("message_thread_id")
                                                                if msg.get("is_topic_message") else None),
            message_id=f"{update_id}:cb", sender_id=str(user.get("id") or chat["id"]),
            sender_name=_sender_name(user), source_type=SOURCE_TYPES.get(chat.get("type"), "unknown"),
            text=cq["data"], reply_to=ReplyContext(str(msg["message_id"])) if msg.get("message_id") else None,
            metadata={"telegram": {"update_id": update_id, "callback_query_id": cq.get("id"),
                                   "option": cq["data"]}})
    msg = update.get("message") or update.get("channel_post")
    if not msg or not msg.get("chat"):
        return None
    chat = msg["chat"]
    user = msg.get("from") or msg.get("sender_chat") or chat
    text = msg.get("text") or msg.get("caption") or ""
    attachments = _attachments(msg)
    if not text and not attachments:
        return None  # a service message (member joined, pinned, …): nothing to answer
    reply = msg.get("reply_to_message")
    return InboundMessage(
        channel="telegram",
        conversation_id=conversation_of(chat["id"], msg.get("message_thread_id") if msg.get("is_topic_message")
                                        else None),
        message_id=f"{update_id}:{msg['message_id']}", sender_id=str(user["id"]), sender_name=_sender_name(user),
        source_type=SOURCE_TYPES.get(chat.get("type"), "unknown"), text=text, attachments=attachments,
        reply_to=None if not reply else ReplyContext(
            str(reply["message_id"]), reply.get("text") or reply.get("caption"),
            str((reply.get("from") or {}).get("id")) if reply.get("from") else None),
        metadata={"telegram": {"update_id": update_id, "chat_type": chat.get("type"),
                               "username": user.get("username")}})


def reply_message_id(reply_to: str | None) -> int | None:
    """The Telegram message an answer replies to, from the hub's ``<update_id>:<message_id>``."""
    if not reply_to:
        return None
    tail = reply_to.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def keyboard_of(metadata: dict) -> dict | None:
    """A delivery's ``options`` (strings, or ``{"label", "value"}``) as an inline keyboard, one button a row."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not options:
        return None
    rows = []
    for opt in options[:100]:
        if isinstance(opt, dict):
            label, value = str(opt.get("label") or opt.get("value") or ""), str(opt.get("value") or opt.get("label"))
        else:
            label = value = str(opt)
        if label:
            # callback_data is at most 64 bytes: a longer value is cut (the label still shows it whole)
            rows.append([{"text": label[:128], "callback_data": value.encode()[:64].decode(errors="ignore")}])
    return {"inline_keyboard": rows} if rows else None


# --------------------------------------------------------------------------- rate limits

class RateLimiter:
    """Telegram's flood limits: a gap per chat (private and group differ) and a global rate."""

    def __init__(self, *, per_chat_secs: float = 1.0, group_secs: float = 3.0, global_per_sec: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.per_chat_secs, self.group_secs = per_chat_secs, group_secs
        self.global_gap = 1.0 / global_per_sec if global_per_sec > 0 else 0.0
        self.clock = clock
        self._lock = threading.Lock()
        self._chat_next: dict[Any, float] = {}
        self._global_next = 0.0

    def reserve(self, chat_id: Any) -> float:
        """Book the next send to ``chat_id``; returns how long to wait before making it."""
        with self._lock:
            now = self.clock()
            at = max(now, self._global_next, self._chat_next.get(chat_id, 0.0))
            self._global_next = at + self.global_gap
            gap = self.group_secs if isinstance(chat_id, int) and chat_id < 0 else self.per_chat_secs
            self._chat_next[chat_id] = at + gap
            return at - now

    def block(self, chat_id: Any, secs: float) -> None:
        """A 429 said ``retry_after``: nothing goes to that chat before then."""
        with self._lock:
            self._chat_next[chat_id] = max(self._chat_next.get(chat_id, 0.0), self.clock() + secs)


def retry_after_secs(exc: Exception) -> float:
    value = getattr(exc, "_retry_after", None) or getattr(exc, "retry_after", 1)
    return value.total_seconds() if hasattr(value, "total_seconds") else float(value)


# --------------------------------------------------------------------------- the sent-parts journal

class SentJournal:
    """Which parts of each delivery Telegram already took, so a resend after a crash skips them."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS sent (delivery_id TEXT, part INTEGER, message_id TEXT, "
                         "at REAL, PRIMARY KEY (delivery_id, part))")
        self._db.execute("DELETE FROM sent WHERE at < ?", (time.time() - 14 * 86400,))

    def done(self, delivery_id: str) -> dict[int, str]:
        with self._lock:
            return dict(self._db.execute("SELECT part, message_id FROM sent WHERE delivery_id = ?", (delivery_id,)))

    def record(self, delivery_id: str, part: int, message_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sent VALUES (?, ?, ?, ?)",
                             (delivery_id, part, message_id, time.time()))

    def close(self) -> None:
        with self._lock:
            self._db.close()


# --------------------------------------------------------------------------- the worker

class _Loop:
    """One asyncio loop in its own thread: python-telegram-bot is async, the SDK is threads."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="telegram-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, *, cancel: threading.Event | None = None) -> Any:
        fut = self.submit(coro)
        while cancel is not None and not fut.done():
            if cancel.wait(0.1):
                fut.cancel()
                raise _Cancelled()
        return fut.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class _Cancelled(Exception):
    pass


def webhook_secret(token: str) -> str:
    """The secret_token given to setWebhook, derived from the bot token (1-256 of A-Z a-z 0-9 _ -)."""
    return hmac.new(token.encode(), b"ugent telegram webhook", hashlib.sha256).hexdigest()


class TelegramWorker(ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "markdown", "media", "reply", "options")

    def __init__(self, *, options: argparse.Namespace, **kwargs):
        super().__init__(**kwargs)
        self.opts = options
        self.bot_token = os.environ.get(TOKEN_ENV, "")
        self.base_url = os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
        self.limiter = RateLimiter(per_chat_secs=options.per_chat_secs, group_secs=options.group_secs,
                                   global_per_sec=options.global_per_sec)
        self.bot = None
        self._loop: _Loop | None = None
        self._journal: SentJournal | None = None
        self._refusal: str | None = None      # set by any call that found the token revoked
        self._server: ThreadingHTTPServer | None = None
        self.webhook_url: str | None = None

    # ------------------------------------------------------------ the channel's part

    def connect(self) -> None:
        from telegram import Bot
        from telegram.error import InvalidToken, TelegramError
        from telegram.request import HTTPXRequest
        if not self.bot_token:
            raise ChannelRefused(f"{TOKEN_ENV} is not set (add it to the plugin's env_refs)")
        self._loop = _Loop()
        self.bot = Bot(self.bot_token, base_url=self.base_url, base_file_url=file_base_url(self.base_url),
                       request=HTTPXRequest(connection_pool_size=8, read_timeout=30, write_timeout=60),
                       get_updates_request=HTTPXRequest(read_timeout=self.opts.poll_timeout + 15))
        journal_path = str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.", ".telegram-sent.")
        self._journal = SentJournal(journal_path)
        try:
            me = self._run(self.bot.initialize())
            self.log.info("bot @%s (id %s) via %s", self.bot.username, self.bot.id, self.base_url.split("/bot")[0])
        except InvalidToken as exc:
            raise ChannelRefused(REVOKED) from exc
        except TelegramError as exc:
            raise RuntimeError(f"getMe failed: {exc}") from exc
        del me
        if self.opts.mode == "webhook":
            self._start_webhook()

    def listen(self, submit) -> None:
        if self.opts.mode == "webhook":
            self._listen_webhook()
        else:
            self._listen_polling(submit)

    def deliver(self, delivery) -> str | None:
        from telegram import InlineKeyboardButton, InlineKeyboardMarkup, ReplyParameters
        chat_id, thread_id = parse_conversation(delivery.conversation_id)
        steps = self._steps(delivery)
        done = self._journal.done(delivery.delivery_id)
        reply_to = reply_message_id(delivery.reply_to_message_id)
        keyboard = keyboard_of(delivery.metadata)
        first: str | None = done.get(0)
        for index, (kind, payload) in enumerate(steps):
            if index in done:
                continue
            common: dict[str, Any] = {}
            if thread_id:
                common["message_thread_id"] = thread_id
            if index == 0 and reply_to:
                common["reply_parameters"] = ReplyParameters(reply_to, allow_sending_without_reply=True)
            if keyboard and index == len(steps) - 1:
                common["reply_markup"] = InlineKeyboardMarkup(
                    [[InlineKeyboardButton(b["text"], callback_data=b["callback_data"]) for b in row]
                     for row in keyboard["inline_keyboard"]])
            if kind == "text":
                message = self._send_text(chat_id, payload, common)
            else:
                message = self._send_media(chat_id, payload, common)
            message_id = str(message.message_id)
            self._journal.record(delivery.delivery_id, index, message_id)
            first = first or message_id
        return first

    def already_delivered(self, delivery) -> bool:
        return len(self._journal.done(delivery.delivery_id)) >= len(self._steps(delivery))

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        if not (attachment.url or "").startswith(FILE_URL_PREFIX):
            return None
        file_id = attachment.url[len(FILE_URL_PREFIX):]

        async def download():
            f = await self.bot.get_file(file_id)
            return bytes(await f.download_as_bytearray())
        return self._run(download())

    def disconnect(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.bot is not None and self._loop is not None:
            try:
                self._run(self.bot.shutdown())
            except Exception:  # noqa: BLE001 - closing the HTTP pools is best effort
                pass
        if self._loop is not None:
            self._loop.close()
        if self._journal is not None:
            self._journal.close()

    # ------------------------------------------------------------ polling

    def _listen_polling(self, submit) -> None:
        from telegram.error import Conflict, InvalidToken, NetworkError, RetryAfter, TelegramError
        offset: int | None = None
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                updates = self._run(self.bot.get_updates(
                    offset=offset, timeout=self.opts.poll_timeout, allowed_updates=ALLOWED_UPDATES),
                    cancel=self.stopping)
            except _Cancelled:
                return
            except Conflict as exc:
                raise ChannelRefused(f"409 {exc.message} (another poller runs with this token, or a "
                                     "webhook is set: stop it, or run this plugin with --mode webhook)") from exc
            except InvalidToken as exc:
                raise ChannelRefused(REVOKED) from exc
            except RetryAfter as exc:
                self.stopping.wait(retry_after_secs(exc))
                continue
            except (NetworkError, TelegramError) as exc:
                # the network or Telegram is down: wait longer each time, never a hot loop
                self.log.warning("getUpdates failed (%s); again in %.0f s", exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 1.0
            for update in updates:
                if not self._take(update.to_dict(), submit):
                    return  # stopping before the hub took it: the offset stays, Telegram keeps it
                offset = update.update_id + 1  # confirmed to Telegram by the next getUpdates

    def _take(self, raw: dict, submit) -> bool:
        """Submit one update and wait until the hub has it; False if stopping first. Skips what it cannot read."""
        try:
            message = normalise(raw)
        except (KeyError, TypeError, ValueError):
            self.log.exception("update %s is not a message this worker reads; skipped", raw.get("update_id"))
            return True
        if message is None:
            return True
        while True:
            try:
                result = submit(message)
            except MessageValidationError as exc:
                self.log.error("update %s skipped: %s", raw.get("update_id"), exc)
                return True
            if not result.queued:
                break
            if self.stopping.wait(1.0):
                return False
        self.log.info("update %s: accepted=%s duplicate=%s reason=%s", raw.get("update_id"), result.accepted,
                      result.duplicate, result.reason)
        cq = (message.metadata.get("telegram") or {}).get("callback_query_id")
        if cq and not result.duplicate:
            try:  # stops the button's spinner; the answer itself comes as a message
                self._run(self.bot.answer_callback_query(cq))
            except Exception as exc:  # noqa: BLE001 - a query older than 15 minutes cannot be answered
                self.log.warning("answerCallbackQuery %s failed: %s", cq, exc)
        return True

    # ------------------------------------------------------------ webhook

    def _start_webhook(self) -> None:
        from telegram.error import InvalidToken
        worker = self
        secret = os.environ.get(WEBHOOK_SECRET_ENV) or webhook_secret(self.bot_token)
        if not _SECRET_CHARS.fullmatch(secret):
            raise ChannelRefused(f"{WEBHOOK_SECRET_ENV} must be 1-256 characters of A-Z, a-z, 0-9, _ and -")
        path = self.opts.webhook_path

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if 0 < length <= 10 * 1024 * 1024 else b""
                if self.path.split("?")[0] != path:
                    return self._reply(404)
                given = self.headers.get("X-Telegram-Bot-Api-Secret-Token") or ""
                if not hmac.compare_digest(given.encode(), secret.encode()):
                    worker.log.warning("webhook POST without the right secret token from %s", self.client_address[0])
                    return self._reply(403)
                try:
                    update = json.loads(body)
                    if not isinstance(update, dict):
                        raise ValueError("not an object")
                except ValueError:
                    return self._reply(400)
                taken = worker._take(update, worker.submit)
                self._reply(200 if taken else 503)  # 503: Telegram delivers it again later

            def _reply(self, status):
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer((self.opts.webhook_listen, self.opts.webhook_port), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.webhook_url = self.opts.webhook_url or f"http://{host}:{port}{path}"
        try:
            self._run(self.bot.set_webhook(self.webhook_url, secret_token=secret, allowed_updates=ALLOWED_UPDATES,
                                           max_connections=self.opts.webhook_connections))
        except InvalidToken as exc:
            raise ChannelRefused(REVOKED) from exc
        self.log.info("webhook set to %s (listening on %s:%s)", self.webhook_url, host, port)

    def _listen_webhook(self) -> None:
        from telegram.error import InvalidToken, TelegramError
        threading.Thread(target=self._server.serve_forever, name="telegram-webhook", daemon=True).start()
        while not self.stopping.wait(self.opts.webhook_check_secs):
            if self._refusal:
                raise ChannelRefused(self._refusal)
            try:  # a revoked token or a replaced webhook shows only here: Telegram just stops calling
                info = self._run(self.bot.get_webhook_info())
            except InvalidToken as exc:
                raise ChannelRefused(REVOKED) from exc
            except TelegramError as exc:
                self.log.warning("getWebhookInfo failed: %s", exc)
                continue
            if info.url != self.webhook_url:
                raise ChannelRefused(f"409 Conflict: the webhook now points at {info.url or 'nothing'!r}, not this "
                                     "worker (another instance, or a poller that deleted it)")
            if info.last_error_message:
                self.log.warning("Telegram reports webhook errors: %s", info.last_error_message)

    # ------------------------------------------------------------ sending

    def _steps(self, delivery) -> list[tuple[str, Any]]:
        steps: list[tuple[str, Any]] = []
        if delivery.text.strip():
            steps += [("text", part) for part in split_text(delivery.text, MESSAGE_LIMIT, measure=utf16_len)]
        steps += [("media", att) for att in delivery.attachments if att.media_id or att.url]
        return steps

    def _send_text(self, chat_id, text: str, common: dict):
        from telegram.error import BadRequest
        try:
            return self._api_call(chat_id, lambda: self.bot.send_message(chat_id, markdown_to_v2(text),
                                                                     parse_mode="MarkdownV2", **common))
        except BadRequest as exc:
            if "parse entities" not in exc.message.lower():
                raise DeliveryFailed(f"400 {exc.message}", permanent=True) from exc
            self.log.warning("MarkdownV2 refused (%s); sending as plain text", exc.message)
        return self._api_call(chat_id, lambda: self.bot.send_message(chat_id, text, **common))

    def _send_media(self, chat_id, att: Attachment, common: dict):
        from telegram.error import BadRequest
        try:
            return self._send_media_once(chat_id, att, common)
        except BadRequest as exc:
            raise DeliveryFailed(f"400 {exc.message}", permanent=True) from exc

    def _send_media_once(self, chat_id, att: Attachment, common: dict):
        from telegram import InputFile
        if att.media_id:
            media = self.media_get(att.media_id)
            data, ctype, name = media.data, media.content_type, att.filename or media.filename or "file"
            upload = InputFile(data, filename=name)
        else:
            ctype, upload = att.content_type, att.url  # a public URL Telegram fetches itself
        photo = att.kind == "image" and ctype in ("image/jpeg", "image/png", "image/webp") and \
            (not att.media_id or len(data) <= 10 * 1024 * 1024)
        if photo:
            return self._api_call(chat_id, lambda: self.bot.send_photo(chat_id, upload, **common))
        return self._api_call(chat_id, lambda: self.bot.send_document(chat_id, upload, **common))

    def _api_call(self, chat_id, make: Callable[[], Any]):
        """One Bot API send, paced by the limits, waiting out a 429's retry_after and trying again."""
        from telegram.error import (BadRequest, ChatMigrated, Forbidden, InvalidToken, NetworkError, RetryAfter,
                                    TelegramError)
        while True:
            wait = self.limiter.reserve(chat_id)
            if wait > 0:
                time.sleep(wait)
            try:
                return self._run(make())
            except RetryAfter as exc:
                secs = retry_after_secs(exc)
                self.limiter.block(chat_id, secs)
                if secs > self.opts.max_retry_wait:
                    raise DeliveryFailed(f"429 Too Many Requests: retry after {secs:.0f} s") from exc
                self.log.info("429 for chat %s: waiting %.1f s as Telegram asks", chat_id, secs)
            except ChatMigrated as exc:  # a group became a supergroup: same chat, new id
                raise DeliveryFailed(f"400 the group moved to chat {exc.new_chat_id}", permanent=True) from exc
            except Forbidden as exc:
                raise DeliveryFailed(f"403 {exc.message}", permanent=True) from exc
            except InvalidToken as exc:
                self._refusal = REVOKED
                raise DeliveryFailed(REVOKED) from exc
            except BadRequest:
                raise
            except (NetworkError, TelegramError) as exc:
                raise DeliveryFailed(f"telegram: {exc}") from exc

    def _run(self, coro, *, cancel: threading.Event | None = None):
        return self._loop.run(coro, cancel=cancel)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-telegram", description=DESCRIPTION)
    p.add_argument("--mode", choices=("polling", "webhook"), default="polling")
    p.add_argument("--poll-timeout", type=int, default=25, help="getUpdates long-poll seconds")
    p.add_argument("--webhook-listen", default="127.0.0.1", help="address the webhook listener binds")
    p.add_argument("--webhook-port", type=int, default=8443, help="port the webhook listener binds (0: any)")
    p.add_argument("--webhook-path", default="/telegram/webhook")
    p.add_argument("--webhook-url", default=None,
                   help="the public HTTPS URL given to setWebhook (default: the listener's own address)")
    p.add_argument("--webhook-connections", type=int, default=40)
    p.add_argument("--webhook-check-secs", type=float, default=60.0,
                   help="how often getWebhookInfo checks the token and that the webhook is still ours")
    p.add_argument("--per-chat-secs", type=float, default=1.0, help="gap between messages to one private chat")
    p.add_argument("--group-secs", type=float, default=3.0, help="gap between messages to one group")
    p.add_argument("--global-per-sec", type=float, default=30.0, help="messages per second in all")
    p.add_argument("--max-retry-wait", type=float, default=60.0,
                   help="the longest retry_after waited in place; longer ones go back to the hub's retries")
    return p.parse_args(argv)


def main() -> None:
    options = parse_args()
    # httpx logs each request's URL at INFO, and a Bot API URL carries the token
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    TelegramWorker.main(options=options)


if __name__ == "__main__":
    main()
