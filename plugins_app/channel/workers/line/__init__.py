"""The LINE channel: the Messaging API's webhook in, the push API out.

    python -m plugins_app.channel.workers.line [--bind 127.0.0.1:3000] [--path /line/webhook]
                                               [--max-retry-wait 120]

Environment: ``LINE_CHANNEL_ACCESS_TOKEN`` and ``LINE_CHANNEL_SECRET`` (the LINE Developers
console, the channel's *Messaging API* and *Basic settings* tabs), ``LINE_API_BASE_URL`` (default
``https://api.line.me``) and ``LINE_DATA_API_BASE_URL`` (default ``https://api-data.line.me``,
where message content downloads from), both only to point the worker at a test's fake.
Operators' page: docs/channels/line.md.

* **Inbound.** A webhook server (``webhook.py``): ``X-Line-Signature`` checked in constant time;
  answered 200 once the events are written to the worker's outbox. ``message`` events (text,
  image, video, audio, file; the bytes downloaded from the data API and stored on the host: a
  video or audio LINE is still preparing is waited for up to 60 s, a 5xx or network error tried
  again a few times; a file given up is logged, the message goes on without it) and
  ``postback`` events become ``InboundMessage``s whose ``message_id`` is the event's
  ``webhookEventId``, so a redelivered event (``deliveryContext.isRedelivery``) runs no second
  turn. A postback's ``data`` is its ``metadata.option`` and its text (the event carries no label,
  and the text must be the same in every copy LINE sends of it). The conversation is the ``source``'s ``userId``, ``groupId`` or ``roomId``; its
  ``type`` (user, group, room) is the source type; the sender is ``source.userId``.
* **Outbound.** The push API (a reply token lasts about a minute and works once, so it is not
  used). Text is split at LINE's 5,000 characters, at most five messages to a push; each push
  carries an ``X-Line-Retry-Key`` derived from the delivery id, the push's number and a digest of
  its messages, so one sent again after a crash or a lost answer is refused by LINE with 409, taken
  as delivered. A delivery's ``metadata["options"]`` (a question's buttons, up to 13) become a
  ``quickReply`` on the last message of the last push: one ``postback`` action each, its ``data``
  the option's value (a press comes back as a postback event), its ``displayText`` the label (what
  the chat shows the user said). More than 13: the numbered text alone. LINE keeps a key for 24 hours only: each push LINE took (200 or 409) is also written
  to a sent-pushes journal (a SQLite file beside the outbox), and a delivery resumed later skips the
  pushes it names.
* **Limits.** A 429 is waited out in place (LINE sends no ``Retry-After``: 1 s doubling to 30 s,
  a ``Retry-After`` that is there is honoured) up to ``--max-retry-wait``; then the hub's own
  retries take over. The monthly message quota (also a 429) is not waited on.
* **Refusals.** A 401 (the token wrong, expired or revoked), at the start (``GET /v2/bot/info``)
  or at a send, raises ``ChannelRefused``: the plugin is disabled with the reason, not restarted.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import mimetypes
import os
import sys

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady, ReplyContext)
from plugins_app.channel.sdk.download import says_later
from plugins_app.channel.sdk.outbox import outbox_path_for
from plugins_app.channel.sdk.webhook import WebhookInbox
from plugins_app.channel.sdk.text import shorten, split_text, utf16_len

from .api import (DEFAULT_API_BASE_URL, DEFAULT_DATA_API_BASE_URL, LineApi, LineError, RateLimited, Stopped,
                  TokenRefused, retry_key)

from plugins_app.channel.sdk.journal import SentJournal  # the sent-parts journal Telegram and WhatsApp keep too

KIND = "channel-line"
DESCRIPTION = "LINE: the Messaging API's webhook in, push messages out (with retry keys)."
ENV_REFS = ("LINE_CHANNEL_ACCESS_TOKEN", "LINE_CHANNEL_SECRET")

TOKEN_ENV = "LINE_CHANNEL_ACCESS_TOKEN"
SECRET_ENV = "LINE_CHANNEL_SECRET"
BASE_URL_ENV = "LINE_API_BASE_URL"
DATA_BASE_URL_ENV = "LINE_DATA_API_BASE_URL"

#: LINE's limit for one text message object (counted, like the app, in UTF-16 units: the safe side).
TEXT_LIMIT = 5000
#: Message objects one push request may carry.
MESSAGES_PER_PUSH = 5
#: Quick reply buttons one message may carry, and the limits of a postback action on one (LINE's
#: Messaging API reference, "Quick reply" and "Postback action"; counted in UTF-16 units, the safe side).
QUICK_REPLY_ITEMS = 13
QUICK_REPLY_LABEL_LIMIT = 20
POSTBACK_DATA_LIMIT = 300
DISPLAY_TEXT_LIMIT = 300
#: What each LINE source type is for the rule engine (LINE's own words are the same three).
SOURCE_TYPES = {"user": "user", "group": "group", "room": "room"}
#: A message type's attachment kind and the type of LINE's content when the event names none.
MEDIA = {"image": ("image", "image/jpeg"), "video": ("video", "video/mp4"), "audio": ("audio", "audio/m4a"),
         "file": ("document", "application/octet-stream")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-line", description=DESCRIPTION)
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the webhook listens on (port 0: any)")
    p.add_argument("--path", default="/line/webhook", help="the webhook URL's path")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a push waits out 429s in place; then the hub's retries take over")
    return p.parse_args(argv)


def refused(where: str) -> str:
    return (f"{where}: 401 Unauthorized: the channel access token ({TOKEN_ENV}) is wrong, expired or revoked "
            "(issue a new one in the LINE Developers console, Messaging API tab)")


def conversation_of(source: dict) -> tuple[str, str] | None:
    """(conversation id, source type) of an event's ``source``; None when it names no chat."""
    kind = source.get("type")
    chat = {"user": source.get("userId"), "group": source.get("groupId"), "room": source.get("roomId")}.get(kind)
    if not chat or kind not in SOURCE_TYPES:
        return None
    return str(chat), SOURCE_TYPES[kind]


def ms_to_rfc3339(ms) -> str | None:
    try:
        moment = _dt.datetime.fromtimestamp(int(ms) / 1000, _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def content_url(data_base_url: str, message_id: str) -> str:
    return f"{data_base_url.rstrip('/')}/v2/bot/message/{message_id}/content"


def normalise(event: dict, *, data_base_url: str = DEFAULT_DATA_API_BASE_URL) -> InboundMessage | None:
    """A ``message`` or ``postback`` event as an InboundMessage; None for anything else."""
    etype = event.get("type")
    if etype not in ("message", "postback") or event.get("mode", "active") != "active":
        return None  # standby: another channel (module) owns the chat
    event_id = event.get("webhookEventId")
    source = event.get("source") or {}
    where = conversation_of(source)
    if not event_id or where is None:
        return None
    conversation_id, source_type = where
    metadata = {"event_type": etype, "source": source.get("type")}
    if event.get("replyToken"):
        metadata["reply_token"] = event["replyToken"]
    if (event.get("deliveryContext") or {}).get("isRedelivery"):
        metadata["redelivery"] = True
    text, attachments, reply_to = "", [], None
    if etype == "postback":
        data = str((event.get("postback") or {}).get("data") or "")
        if not data:
            return None
        text, metadata["option"] = data, data
    else:
        message = event.get("message") or {}
        mtype, mid = message.get("type"), str(message.get("id") or "")
        metadata.update({"line_message_id": mid, "message_type": mtype})
        if message.get("quoteToken"):
            metadata["quote_token"] = message["quoteToken"]
        if message.get("quotedMessageId"):
            reply_to = ReplyContext(message_id=str(message["quotedMessageId"]))
        if mtype == "text":
            text = str(message.get("text") or "")
        elif mtype in MEDIA and mid:
            kind, ctype = MEDIA[mtype]
            name = message.get("fileName") if mtype == "file" else None
            if name:
                ctype = mimetypes.guess_type(name)[0] or ctype
            provider = message.get("contentProvider") or {}
            url = provider.get("originalContentUrl") if provider.get("type") == "external" else None
            attachments.append(Attachment(kind=kind, content_type=ctype, url=url or content_url(data_base_url, mid),
                                          filename=name, size=message.get("fileSize"), channel_ref=mid))
        else:
            return None  # stickers, locations: nothing the agent reads
        if not text.strip() and not attachments:
            return None
    return InboundMessage(
        channel="line", conversation_id=conversation_id, message_id=str(event_id),
        sender_id=str(source.get("userId") or conversation_id), source_type=source_type, text=text,
        attachments=attachments, reply_to=reply_to, metadata=metadata,
        timestamp=ms_to_rfc3339(event.get("timestamp")) or
        _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"))


def message_parts(text: str) -> list[str]:
    """An answer as the texts of the message objects that carry it, each within LINE's limit."""
    return split_text(text, TEXT_LIMIT, measure=utf16_len) if text.strip() else []


def quick_reply(metadata) -> dict | None:
    """A delivery's ``options`` ({"label", "value"}, or strings) as a ``quickReply`` of postback actions; None
    when there are none, more than 13, or one LINE could not carry (a value past 300 or no label): then
    the user has the numbered text alone, never a set of buttons missing one."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not options or len(options) > QUICK_REPLY_ITEMS:
        return None
    items = []
    for opt in options:
        if isinstance(opt, dict):
            label, value = str(opt.get("label") or opt.get("value") or ""), str(opt.get("value") or "")
        else:
            label = value = str(opt)
        if not label.strip() or not value or utf16_len(value) > POSTBACK_DATA_LIMIT:
            return None
        items.append({"type": "action", "action": {
            "type": "postback", "label": shorten(label, QUICK_REPLY_LABEL_LIMIT, measure=utf16_len), "data": value,
            "displayText": shorten(label, DISPLAY_TEXT_LIMIT, measure=utf16_len)}})
    return {"items": items}


def push_batches(parts: list[str], quick: dict | None = None) -> list[list[dict]]:
    """The message objects of each push request: at most five to a request, in order; ``quick`` (a
    ``quickReply``) on the very last message, the one LINE shows quick replies under."""
    messages = [{"type": "text", "text": part} for part in parts]
    if messages and quick:
        messages[-1]["quickReply"] = quick
    return [messages[i:i + MESSAGES_PER_PUSH] for i in range(0, len(messages), MESSAGES_PER_PUSH)]


class LineWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments", "options")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.access_token = env.get(TOKEN_ENV, "")
        self.channel_secret = env.get(SECRET_ENV, "")
        self.base_url = env.get(BASE_URL_ENV) or DEFAULT_API_BASE_URL
        self.data_base_url = (env.get(DATA_BASE_URL_ENV) or DEFAULT_DATA_API_BASE_URL).rstrip("/")
        self.api = LineApi(self.access_token, base_url=self.base_url, data_base_url=self.data_base_url,
                           stopping=self.stopping, max_wait_secs=self.opts.max_retry_wait)
        self.inbox_init()
        self._journal: SentJournal | None = None
        self.bot_user_id: str | None = None
        self.server = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        if not self.access_token:
            raise ChannelRefused(f"{TOKEN_ENV} is not set")
        if not self.channel_secret:
            raise ChannelRefused(f"{SECRET_ENV} is not set; the webhook's signatures need it")
        try:
            info = self.api.bot_info()
        except TokenRefused as exc:
            raise ChannelRefused(refused("GET /v2/bot/info")) from exc
        self.bot_user_id = info.get("userId")
        journal_path = str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.", ".line-sent.")
        self._journal = SentJournal(journal_path)
        self.log.info("line: bot %s (%s, %s) via %s", info.get("displayName"), info.get("basicId"),
                      self.bot_user_id, self.base_url)
        from .webhook import WebhookServer
        self.server = WebhookServer(self.opts.bind, self.opts.path, self.channel_secret, self.accept)
        self.server.start()
        self.log.info("line: webhook listening on %s", self.server.url)

    # ------------------------------------------------------------------ inbound

    def accept(self, payload: dict) -> None:
        """One webhook payload: record each event it carries durably (the outbox), queue it for the hub.

        Returns once the records are written, so the webhook may answer LINE 200 at once.
        """
        for event in payload.get("events") or []:
            if not isinstance(event, dict):
                continue
            msg = normalise(event, data_base_url=self.data_base_url)
            if msg is None:
                self.log.debug("line: event %s (%s) is not a message; skipped", event.get("webhookEventId"),
                               event.get("type"))
                continue
            if msg.metadata.get("redelivery"):
                self.log.info("line: redelivered event %s", msg.message_id)
            self.inbox_record(msg)

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        prefix = f"{self.data_base_url}/v2/bot/message/"
        if not (attachment.url or "").startswith(prefix):
            return None  # an external provider's URL: never sent the token
        message_id = attachment.url[len(prefix):].split("/", 1)[0]
        try:
            data, _ = self.api.content(message_id)
        except TokenRefused:
            self._refusal = refused(f"GET /v2/bot/message/{message_id}/content")  # the listener stops the worker
            raise
        except (LineError, httpx.HTTPError, Stopped) as exc:
            if not isinstance(exc, LineError) or says_later(exc.status):
                # LINE keeps content for days: the message waits (its chat only) and the SDK tries again
                self.log.warning("line: the %s of message %s cannot be downloaded now (%s: %s); its message waits",
                                 attachment.kind, message_id, type(exc).__name__, exc)
                raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
            self.log.error("line: gave up downloading the %s of message %s (%s: %s): the message goes to the "
                           "host without the file, a note saying so", attachment.kind, message_id,
                           type(exc).__name__, exc)
            raise
        return data

    # ------------------------------------------------------------------ outbound

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("the channel access token was refused")
        batches = push_batches(message_parts(delivery.text), quick_reply(delivery.metadata))
        if not batches:
            raise DeliveryFailed("nothing LINE can show: the answer has no text (files are not sent to LINE)",
                                 permanent=True)
        # LINE keeps a retry key for 24 hours only: a push already taken (200 or 409) is journaled, and a
        # delivery resumed later (a token fixed the next day, a long outage) skips it. The 409 stays the
        # backstop for the one push in flight when the worker died (not journaled yet).
        done = self._journal.done(delivery.delivery_id)
        first: str | None = done.get(0) or None
        for n, messages in enumerate(batches):
            if n in done:
                continue
            key = retry_key(delivery.delivery_id, n, messages)
            try:
                sent, repeated = self.api.push(delivery.conversation_id, messages, key)
            except TokenRefused as exc:
                self._refusal = refused("POST /v2/bot/message/push")
                raise self.refused_failure("the channel access token was refused") from exc
            except RateLimited as exc:
                raise DeliveryFailed(f"push: {exc}") from exc
            except LineError as exc:
                # 400 (a bad recipient or message), 403 (not allowed), 404: sending again cannot help
                raise DeliveryFailed(f"push: {exc}", permanent=400 <= exc.status < 500) from exc
            except (Stopped, httpx.HTTPError) as exc:
                raise DeliveryFailed(f"push: {type(exc).__name__}: {exc}") from exc
            if repeated:
                self.log.info("push %d of %s was accepted before (409 for retry key %s): not sent again", n,
                              delivery.delivery_id, key)
            sent_id = str(sent[0].get("id") or "") if sent else ""
            self._journal.record(delivery.delivery_id, n, sent_id)  # before anything else can fail
            first = first or sent_id or None
        return first

    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): every push of the answer is in the sent journal."""
        batches = push_batches(message_parts(delivery.text), quick_reply(delivery.metadata))
        return bool(batches) and len(self._journal.done(delivery.delivery_id)) >= len(batches)


    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.api.close()
        if self._journal is not None:
            self._journal.close()


def main(argv: list[str] | None = None) -> None:
    LineWorker.main(argv=argv)
