"""The channel-telegram worker: polling or webhook in, paced sends out, on python-telegram-bot (see the package)."""
from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import hmac
import json
import os
import re
import threading
import time
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, ConnectionLost, DeliveryFailed,
                                     MediaNotReady, MessageValidationError)
from plugins_app.channel.sdk.download import MEDIA_TIMEOUT_SECS
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.outbox import PENDING, outbox_path_for
from plugins_app.channel.sdk.text import split_text, utf16_len
from plugins_app.channel.sdk.webhook import (BodyRefused, BoundedHTTPServer, InboxLanes, WebhookInbox, json_loads_bounded,
                                             read_body)
from plugins_app.channel.sdk.worker import HOLD_ATTEMPTS

from . import DESCRIPTION, KIND
from .markup import keyboard_of, markdown_to_v2
from .updates import FILE_URL_PREFIX, normalise, parse_conversation, reply_message_id

TOKEN_ENV = "TELEGRAM_BOT_TOKEN"
BASE_URL_ENV = "TELEGRAM_API_BASE_URL"
WEBHOOK_SECRET_ENV = "TELEGRAM_WEBHOOK_SECRET"   # optional: else derived from the bot token
_SECRET_CHARS = re.compile(r"[A-Za-z0-9_-]{1,256}")
DEFAULT_BASE_URL = "https://api.telegram.org/bot"
MAX_FLOOD_RETRIES = 5        # 429s waited out in place for one send; then the hub's own retries take over
MESSAGE_LIMIT = 4096          # UTF-16 code units after entity parsing
ALLOWED_UPDATES = ["message", "channel_post", "callback_query"]
REVOKED = "401 Unauthorized: the bot token is wrong or was revoked (@BotFather /token or /revoke)"
#: Chats submitted at once (both modes), a thread each (their files downloading side by side).
INBOX_LANES = 16
#: The largest update body the webhook reads (Telegram's updates are a few KB; a larger one is answered 413).
WEBHOOK_MAX_BODY_BYTES = 10 * 1024 * 1024
#: The longest a lane waits between two tries while the hub is away (unreachable, its database down).
HOST_AWAY_MAX_WAIT_SECS = 30.0


def file_base_url(base_url: str) -> str:
    """Where files download from, beside the API: ``…/bot`` → ``…/file/bot`` (the Bot API's layout)."""
    if base_url.endswith("/bot"):
        return base_url[:-len("bot")] + "file/bot"
    return base_url.rstrip("/") + "/file/bot"


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


class TelegramWorker(WebhookInbox, ChannelWorker):
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
        # _refusal: set by any call that found the token revoked; _inbox: recorded messages for the lanes (getUpdates'
        # or the webhook's); _inbox_error: what ended the thread feeding them (getUpdates, the webhook's check)
        self.inbox_init()
        self._in_hand: set[str] = set()            # keys queued or on a lane: a resent update is not queued twice
        self._in_hand_lock = threading.Lock()
        self._server: BoundedHTTPServer | None = None
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
                       # a connection for each chat's lane downloading a file, and some for the sends beside them
                       request=_request_class(HTTPXRequest)(connection_pool_size=8 + INBOX_LANES, read_timeout=30,
                                                            write_timeout=60),
                       get_updates_request=HTTPXRequest(read_timeout=self.opts.poll_timeout + 15))
        journal_path = str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.", ".telegram-sent.")
        self._journal = SentJournal(journal_path)
        try:
            self._run(self.bot.initialize())  # getMe: a wrong token is known before anything else
            self.log.info("bot @%s (id %s) via %s", self.bot.username, self.bot.id, self.base_url.split("/bot")[0])
        except InvalidToken as exc:
            raise ChannelRefused(REVOKED) from exc
        except TelegramError as exc:
            raise RuntimeError(f"getMe failed: {exc}") from exc
        if self.opts.mode == "webhook":
            self._start_webhook()

    def listen(self, submit) -> None:
        """Either mode: a thread records each update's message in the outbox and queues it before Telegram is
        told it is taken (getUpdates' next offset; the webhook's 200), and here each chat's recorded messages are
        submitted on a lane of that chat's (``InboxLanes``, ``_submit_taken``), so one user's file downloading
        for minutes holds back that chat only, and nothing Telegram waits on waits for the hub. A message
        recorded and not submitted (a stop, a crash) stays owed: the replay sends it."""
        if self.opts.mode == "webhook":
            threading.Thread(target=self._server.serve_forever, name="telegram-webhook", daemon=True).start()
            self._listen_lanes(submit, self._watch_webhook, what="the webhook check failed: ")
        else:
            self._listen_lanes(submit, self._poll, what="polling failed: ")

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

        from telegram.error import BadRequest, InvalidToken, NetworkError, RetryAfter, TimedOut

        # Short timeouts and no retries of its own: the SDK's hold retries, and while a fetch runs its chat's later
        # submits wait for it (other chats' go on in their own lanes).
        timeouts = {"read_timeout": MEDIA_TIMEOUT_SECS, "connect_timeout": MEDIA_TIMEOUT_SECS,
                    "pool_timeout": MEDIA_TIMEOUT_SECS}

        async def download():
            f = await self.bot.get_file(file_id, **timeouts)
            return bytes(await f.download_as_bytearray(**timeouts))
        try:
            return self._run(download())
        except BadRequest:
            raise  # (a NetworkError to the library) "file is too big" (over 20 MB), a wrong file_id: final
        except InvalidToken as exc:
            # a 401 (the token revoked), or a 404 (the library maps both so): getMe tells which
            self._confirm_token()
            raise LookupError(f"Telegram no longer has the file: {exc.message}") from exc
        except (RetryAfter, TimedOut) as exc:
            raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
        except NetworkError as exc:
            if not _not_now(exc):
                raise  # any other status the library has no case for (a 413, a 405...): final
            # a 5xx, or no answer at all: Telegram keeps the file, so the message waits (its chat only) and the
            # SDK fetches again
            raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc

    def _confirm_token(self) -> None:
        """After an InvalidToken: ``ChannelRefused`` (the refusal recorded, as the sends do) if getMe is refused
        too, ``MediaNotReady`` if Telegram does not answer it; returns if the token is fine."""
        from telegram.error import InvalidToken, NetworkError, RetryAfter
        try:
            self._run(self.bot.get_me(read_timeout=MEDIA_TIMEOUT_SECS, connect_timeout=MEDIA_TIMEOUT_SECS))
        except InvalidToken as exc:
            self._refusal = REVOKED
            raise ChannelRefused(REVOKED) from exc
        except (NetworkError, RetryAfter) as exc:
            raise MediaNotReady(f"the token cannot be checked now: {type(exc).__name__}: {exc}") from exc

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

    # ------------------------------------------------------------ the lanes (both modes)

    def _listen_lanes(self, submit, feed: Callable[[], None], *, what: str) -> None:
        """Run ``feed()`` in a thread of its own (polling: getUpdates, which records and queues; webhook:
        the getWebhookInfo check, the requests' threads recording and queueing) and submit what is queued, each
        chat's on its lane, until the worker stops, a refusal is found on any thread, or ``feed`` fails (raised
        with ``what`` before it: the worker is restarted)."""
        feeder = threading.Thread(target=self._feed_main, args=(feed,), name=f"telegram-{self.opts.mode}",
                                  daemon=True)
        feeder.start()
        lanes = InboxLanes(self, lambda message: self._submit_taken(submit, message, lanes.lanes),
                           max_lanes=INBOX_LANES, name="telegram-inbox")
        try:
            lanes.run(self._inbox, lambda: self._inbox_error, what=what)
        finally:
            # what the lanes dropped as they closed stays owed in the outbox, for the replay: a resend of it may be
            # queued again from now on
            with self._in_hand_lock:
                self._in_hand.clear()
            if self.stopping.is_set():
                feeder.join(5)  # (else the worker is stopped next, which ends it: ChannelWorker._listen_main)

    def _feed_main(self, feed: Callable[[], None]) -> None:
        try:
            feed()
        except ChannelRefused as exc:
            self._refusal = self._refusal or exc.reason  # the listener raises it: the plugin is disabled
        except Exception as exc:  # noqa: BLE001 - the listener raises it: the worker is restarted
            self._inbox_error = exc

    # ------------------------------------------------------------ polling

    def _poll(self) -> None:
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
                self._record(update.to_dict())  # (raises if it cannot: the offset stays, Telegram keeps it)
                offset = update.update_id + 1  # confirmed to Telegram by the next getUpdates

    # ------------------------------------------------------------ both modes: record, then submit on a lane

    def _record(self, raw: dict) -> None:
        """Record one update's message in the outbox and queue it for its chat's lane; returns once it is written
        (Telegram may be told it is taken then: the offset moves past it, the webhook answers 200), and raises
        if it cannot be (Telegram keeps it and sends it again). Skips what it cannot read, what the hub already
        took, and an update Telegram sent again while its message is still queued or on its lane."""
        try:
            message = normalise(raw, self.bot.username if self.bot is not None else None)
        except (KeyError, TypeError, ValueError):
            self.log.exception("update %s is not a message this worker reads; skipped", raw.get("update_id"))
            return
        if message is None:
            return
        try:
            message.validate()
        except MessageValidationError as exc:
            self.log.error("update %s skipped: %s", raw.get("update_id"), exc)
            return
        with self._in_hand_lock:
            if message.key in self._in_hand:
                self.log.info("update %s: duplicate (queued for the hub already)", raw.get("update_id"))
                return
            self._in_hand.add(message.key)  # (before it is queued: its lane takes it out when done)
        try:
            queued = self.inbox_record(message)
        except BaseException:
            self._in_hand_discard(message.key)
            raise
        if not queued:
            self._in_hand_discard(message.key)
            self.log.info("update %s: duplicate (the hub had it already)", raw.get("update_id"))

    def _submit_taken(self, submit, message, lanes) -> Any:
        """On its chat's lane: submit a recorded message, and while the hub cannot take it try again, its chat's
        later messages waiting behind it (as the listener itself waited before the lanes); then answer a button
        press the hub took. The hub failing it (or a file to wait for), each second for ``HOLD_ATTEMPTS`` tries,
        then it is left owed for the replay (every heartbeat), so a message the hub keeps failing does not hold
        its chat's lane for ever. The hub away (unreachable, or its database down: no reason given), it waits
        until the hub is back, trying again less and less often (up to every ``HOST_AWAY_MAX_WAIT_SECS``): each
        try reads the whole outbox, and the replay sends what is owed, in order, at the first heartbeat the hub
        answers. Once the lanes close (a stop, a refusal) it stays owed too."""
        try:
            return self._submit_held(submit, message, lanes)
        finally:
            self._in_hand_discard(message.key)

    def inbox_left(self, message) -> None:
        self._in_hand_discard(message.key)  # on no lane: the replay submits it

    def _in_hand_discard(self, key: str) -> None:
        with self._in_hand_lock:
            self._in_hand.discard(key)

    def _submit_held(self, submit, message, lanes) -> Any:
        fresh = self._still_owed(message)
        tries = 0
        wait = 1.0
        while True:
            result = submit(message)
            if not result.queued:
                break
            if result.reason is not None:
                tries += 1
                wait = 1.0
            if tries >= HOLD_ATTEMPTS or self.stopping.wait(wait) or lanes.closed:
                return result
            if result.reason is None:
                wait = min(wait * 2, HOST_AWAY_MAX_WAIT_SECS)
        self._answer_press(message, result, fresh)
        return result

    def _still_owed(self, message) -> bool:
        """Whether the hub has not taken this message yet (not recorded, or recorded and owed)."""
        row = self._outbox().inbound_get(message.key)
        return row is None or row.state == PENDING

    def _answer_press(self, message, result, fresh: bool) -> None:
        """Stop the spinner of a button press the hub took, unless the hub had it before this try (``fresh``
        False: a redelivery of a press answered then). A duplicate answer from the hub while fresh (our own first
        submit's answer lost, or the replay sent it meanwhile) is still this press's first answer."""
        from telegram.error import BadRequest
        cq = (message.metadata.get("telegram") or {}).get("callback_query_id")
        if cq and fresh and not result.queued:
            try:  # stops the button's spinner; the answer itself comes as a message
                self._run(self.bot.answer_callback_query(cq))
            except BadRequest as exc:  # a query answered already, or older than 15 minutes: harmless
                self.log.info("answerCallbackQuery %s refused: %s", cq, exc)
            except Exception as exc:  # noqa: BLE001 - the spinner times out by itself
                self.log.warning("answerCallbackQuery %s failed: %s", cq, exc)

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
            timeout = 10  # seconds a connection may keep the server waiting (a stalled client holds no thread)

            def log_message(self, *args):
                pass

            def do_POST(self):
                # the path and the secret before a byte of the body: a refused POST's body is never read, and
                # the connection is closed (its unread bytes must not be taken for a next request)
                if self.path.split("?")[0] != path:
                    self.close_connection = True
                    return self._reply(404)
                given = self.headers.get("X-Telegram-Bot-Api-Secret-Token") or ""
                if not hmac.compare_digest(given.encode(), secret.encode()):
                    worker.log.warning("webhook POST without the right secret token from %s", self.client_address[0])
                    self.close_connection = True
                    return self._reply(403)
                try:  # (a length that is no number, a chunked body, one too large or cut short: the connection closed)
                    body = read_body(self, WEBHOOK_MAX_BODY_BYTES)
                except BodyRefused as exc:
                    worker.log.warning("webhook POST from %s refused (%d): %s", self.client_address[0], exc.status,
                                       exc.reason)
                    return self._reply(exc.status)
                try:
                    update = json_loads_bounded(body)
                    if not isinstance(update, dict):
                        raise ValueError("not an object")
                except ValueError:
                    return self._reply(400)
                # recorded in the outbox (and queued for its chat's lane) before the 200; anything but a 2xx makes
                # Telegram send the update again later. Nothing here waits for a file or for the hub.
                try:
                    worker._record(update)
                except ConnectionLost:  # the worker is stopping: its outbox is closed
                    worker.log.info("update %s not recorded: the worker is stopping", update.get("update_id"))
                    return self._reply(503)
                except Exception:  # noqa: BLE001 - not recorded: Telegram keeps it and sends it again
                    worker.log.exception("update %s could not be recorded", update.get("update_id"))
                    return self._reply(500)
                self._reply(200)

            def _reply(self, status):
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        # at most as many connections as Telegram is told to open (and a few), none held past 60 s
        self._server = BoundedHTTPServer((self.opts.webhook_listen, self.opts.webhook_port), Handler,
                                         max_connections=self.opts.webhook_connections + 4, connection_deadline=60.0)
        host, port = self._server.server_address[:2]
        self.webhook_url = self.opts.webhook_url or f"http://{host}:{port}{path}"
        try:
            self._run(self.bot.set_webhook(self.webhook_url, secret_token=secret, allowed_updates=ALLOWED_UPDATES,
                                           max_connections=self.opts.webhook_connections))
        except InvalidToken as exc:
            raise ChannelRefused(REVOKED) from exc
        self.log.info("webhook set to %s (listening on %s:%s)", self.webhook_url, host, port)

    def _watch_webhook(self) -> None:
        """Webhook mode's thread beside the lanes (the requests' threads feed ``inbox``): every
        ``webhook_check_secs`` getWebhookInfo, raising ``ChannelRefused`` for a revoked token or a webhook no
        longer this worker's."""
        from telegram.error import InvalidToken, TelegramError
        while not self.stopping.wait(self.opts.webhook_check_secs):
            if self._refusal:
                return  # (found on another thread: the listener raises it)
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
        for _ in range(MAX_FLOOD_RETRIES):
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
        raise DeliveryFailed(f"429 Too Many Requests {MAX_FLOOD_RETRIES} times in a row")

    def _run(self, coro, *, cancel: threading.Event | None = None):
        return self._loop.run(coro, cancel=cancel)


@functools.cache
def _request_class(base):
    """python-telegram-bot's ``HTTPXRequest`` that marks a 5xx or 429 answer with its status: the library
    raises them as a bare ``NetworkError``, as it does a 413 or any status it has no case for, and only the
    first are "not now" (see ``_not_now``). An answer whose ``parameters`` carry a ``migrate_to_chat_id`` or a
    ``retry_after`` is left to the library (``ChatMigrated``, ``RetryAfter``: its only cases there). The error
    raised is the library's class with the library's text for the status, so a send sees what it saw before;
    only a body that is not JSON no longer adds "Parsing the server response ... failed" to that text."""
    from telegram.error import NetworkError

    class Request(base):
        async def do_request(self, *args, **kwargs):
            code, payload = await super().do_request(*args, **kwargs)
            if code >= 500 or code == 429:
                try:
                    body = json.loads(payload.decode("utf-8", "replace"))
                except ValueError:
                    body = {}
                body = body if isinstance(body, dict) else {}
                parameters = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
                if not (parameters.get("migrate_to_chat_id") or parameters.get("retry_after")):
                    try:
                        text = f"{HTTPStatus(code).phrase} ({code})"
                    except ValueError:
                        text = f"Unknown HTTPError ({code})"
                    exc = NetworkError(body.get("description") or text)  # the library's own text for it
                    exc.http_status = code
                    raise exc
            return code, payload
    return Request


def _not_now(exc) -> bool:
    """Whether a ``NetworkError`` says Telegram cannot answer now: a 5xx or 429 (``_request_class``), or no answer
    at all (httpx's transport errors: refused, reset, timed out)."""
    import httpx
    return bool(getattr(exc, "http_status", 0)) or isinstance(exc.__cause__, httpx.TransportError)


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
    TelegramWorker.main(options=options)
