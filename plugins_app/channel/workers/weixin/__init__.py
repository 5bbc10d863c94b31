"""The Weixin (WeChat Official Account, 微信公众号) channel: the account's server URL in, customer service
messages out.

    python -m plugins_app.channel.workers.weixin [--bind 127.0.0.1:3000] [--path /weixin/callback]
                                                 [--max-retry-wait 120] [--max-age 300]

Environment: ``WEIXIN_APP_ID`` and ``WEIXIN_APP_SECRET`` (开发者ID(AppID), 开发者密码(AppSecret)),
``WEIXIN_TOKEN`` (the server configuration's Token), ``WEIXIN_ENCODING_AES_KEY`` (its EncodingAESKey:
set for safe mode, unset for plaintext mode), ``WEIXIN_API_BASE_URL`` (default
``https://api.weixin.qq.com``, only to point the worker at a test's fake). Operators' page:
docs/channels/weixin.md.

* **Inbound.** A callback server (``callback.py``): the URL check (GET, ``echostr``), messages (POST)
  in plaintext mode or safe mode (``encrypt_type=aes``, the WXBizMsgCrypt scheme of ``sdk/wxcrypto.py``
  with the AppID as the receive id), every signature checked in constant time, a timestamp older than
  ``--max-age`` refused. Answered ``success`` once the message is in the worker's outbox. Messages of
  type text, image, voice (its ``Recognition`` as the text when the account has speech recognition on),
  video, shortvideo, location and link become ``InboundMessage``s whose ``message_id`` is WeChat's
  ``MsgId``, so a POST WeChat makes again (no answer within 5 s) runs no second turn. The conversation
  and the sender are the user's OpenID (``FromUserName``). Media are downloaded with
  ``GET /cgi-bin/media/get`` and stored on the host. Events (follow, unfollow, menu clicks, scans) are
  not messages: answered ``success`` and logged at DEBUG (the OpenID is a personal identifier).
* **Outbound.** ``POST /cgi-bin/message/custom/send`` (customer service messages, within 48 hours of
  the user's last message): text split at 2,048 bytes of UTF-8. WeChat allows 5 messages in all for one
  message of the user, whatever number of deliveries the hub makes of it (notices, questions, the answer):
  the worker keeps the count left for each OpenID (reset to 5 when a message of the user is recorded, in a
  SQLite file of its own), and a delivery takes its room from it when it is first planned (a longer
  answer is cut, saying so; none left: the delivery fails for good, saying why); an image the agent attaches is
  uploaded with ``POST /cgi-bin/media/upload`` and sent as an image message. WeChat has no idempotency
  key: each message it took is journaled (``sdk/journal.py``), so a delivery resumed after a crash
  sends only what is missing.
* **Token.** ``POST /cgi-bin/stable_token``, kept until shortly before it expires, fetched again when
  a call says it is stale (40001, 40014, 42001) and the call made once more.
* **Busy.** -1, 45009, 45011 and HTTP 5xx are waited out in place (1 s doubling to 30 s) up to
  ``--max-retry-wait``; then the hub's own retries take over.
* **Refusals.** The AppID, the AppSecret, the IP whitelist or the account's rights refused (40001,
  40013, 40125, 40164, 48001, ...) raise ``ChannelRefused``: the plugin is disabled with the reason,
  not restarted. 45015 (the 48-hour window closed), 45047 (the quota spent), 43004 (unfollowed) fail
  that delivery permanently with WeChat's reason.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady)
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.messages import utc_from_epoch
from plugins_app.channel.sdk.tencent import media_id_of, media_url
from plugins_app.channel.sdk.text import split_text
from plugins_app.channel.sdk.webhook import WebhookInbox
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt

from .api import (DEFAULT_API_BASE_URL, TEXT_LIMIT_BYTES, TOKEN_STALE, AppRefused, RateLimited, Stopped,
                  UserUnreachable, WeixinApi, WeixinError)

KIND = "channel-weixin"
DESCRIPTION = "Weixin (微信公众号): an official account's server URL in, customer service messages out."
ENV_REFS = ("WEIXIN_APP_ID", "WEIXIN_APP_SECRET", "WEIXIN_TOKEN", "WEIXIN_ENCODING_AES_KEY")

APP_ID_ENV, APP_SECRET_ENV, TOKEN_ENV, AES_KEY_ENV = ENV_REFS
BASE_URL_ENV = "WEIXIN_API_BASE_URL"
REQUIRED = (APP_ID_ENV, APP_SECRET_ENV, TOKEN_ENV)

#: A message type's attachment kind and content type.
MEDIA = {"image": ("image", "image/jpeg"), "voice": ("audio", "audio/amr"), "video": ("video", "video/mp4"),
         "shortvideo": ("video", "video/mp4")}
VOICE_TYPES = {"amr": "audio/amr", "speex": "audio/speex", "mp3": "audio/mpeg"}
#: WeChat's quota: 5 customer service messages for one message of the user, within 48 hours (45047 past it).
MAX_MESSAGES = 5
#: How long the 5 last after the user's message (WeChat: 48 hours).
WINDOW_SECS = 48 * 3600
#: The journal's part that holds a delivery's room (the messages it may send), planned once.
PLAN_PART = -1
QUOTA_SPENT = ("WeChat's quota of customer service messages for the user's last message is spent (5 within "
               "48 hours, for every answer to it); the user must write again")
CUT_NOTE = "\n\n[…the answer was cut here: WeChat lets an account send 5 messages for one message of yours]"
#: Images WeChat's customer service image message takes (media/upload type image: PNG, JPEG, GIF). WeChat's
#: page gives both 2 MB and 10 MB for an image; the smaller is kept.
IMAGE_TYPES = {"image/jpeg", "image/png", "image/gif"}
IMAGE_MAX_BYTES = 2 * 1024 * 1024
#: put_media's mark for an image not uploaded: its message becomes a note saying so.
UNSENT = "unsent:"
#: Content errors sending again cannot fix: too long, empty, a bad media id, a bad message type.
CONTENT_REFUSED = {45002, 44002, 44004, 40007, 40008}
#: What media/upload answers for a file it will never take: the media type, the file type, the file's size, the
#: image's size, no media data. The image becomes a note; the rest of the answer goes out.
UPLOAD_REFUSED = {40004: "not a media type WeChat takes", 40005: "not a file type WeChat takes",
                  40006: "not a file size WeChat takes", 40009: "not an image size WeChat takes",
                  41005: "WeChat found no media data in it"}
CONTENT_REFUSED |= set(UPLOAD_REFUSED)
#: An uploaded image's file name extension, by its content type (WeChat reads the type from it).
IMAGE_EXTENSIONS = {"image/jpeg": ".jpg", "image/png": ".png", "image/gif": ".gif"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-weixin", description=DESCRIPTION)
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the server URL listens on (port 0: any)")
    p.add_argument("--path", default="/weixin/callback", help="the server URL's path")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a send waits out -1/45009/5xx in place; then the hub's retries take over")
    p.add_argument("--max-age", type=float, default=300.0,
                   help="refuse a request whose timestamp is further than this many seconds from the clock (0: off)")
    return p.parse_args(argv)


def utf8_len(text: str) -> int:
    """Length in bytes of UTF-8, as WeChat counts a text message."""
    return len(text.encode("utf-8"))


def message_parts(text: str, *, room: int = MAX_MESSAGES) -> list[str]:
    """An answer as the texts of the messages that carry it, each within 2,048 bytes, at most ``room`` of
    them (the last one cut, saying so, when the answer needs more)."""
    if not text.strip() or room < 1:
        return []
    parts = split_text(text, TEXT_LIMIT_BYTES, measure=utf8_len)
    if len(parts) <= room:
        return parts
    keep = parts[:room]
    budget = TEXT_LIMIT_BYTES - utf8_len(CUT_NOTE)
    last = split_text(keep[-1], budget, measure=utf8_len)[0]
    keep[-1] = last + CUT_NOTE
    return keep


def refused(exc: WeixinError) -> str:
    """The operator's reason for an account WeChat refuses, with what to fix."""
    fix = {40001: f"the AppSecret ({APP_SECRET_ENV}) is wrong, or was reset on the platform",
           40125: f"the AppSecret ({APP_SECRET_ENV}) is not valid (reset it under Settings and Development → Basic "
                  "Configuration)",
           40013: f"the AppID ({APP_ID_ENV}) is wrong",
           41002: f"the AppID ({APP_ID_ENV}) is missing",
           41004: f"the AppSecret ({APP_SECRET_ENV}) is missing",
           40164: "this server's IP is not in the account's IP whitelist (IP白名单, Basic Configuration)",
           48001: "the account has no right to this API (customer service messages need a verified account)",
           }.get(exc.errcode, "")
    return f"{exc}" + (f": {fix}" if fix else "")


def normalise(message: dict, *, base_url: str = DEFAULT_API_BASE_URL) -> InboundMessage | None:
    """A verified message as an InboundMessage; None for events and what carries nothing."""
    mtype = str(message.get("MsgType") or "")
    user = str(message.get("FromUserName") or "")
    msg_id = str(message.get("MsgId") or "")
    if mtype == "event" or not user or not msg_id:
        return None
    metadata = {"message_type": mtype, "weixin_msg_id": msg_id, "account": str(message.get("ToUserName") or "")}
    text, attachments = "", []
    if mtype == "text":
        text = str(message.get("Content") or "")
    elif mtype in MEDIA:
        kind, ctype = MEDIA[mtype]
        if mtype == "voice":
            fmt = str(message.get("Format") or "").lower()
            ctype = VOICE_TYPES.get(fmt, ctype)
            text = str(message.get("Recognition") or "")
            if text:
                metadata["recognition"] = text
        if message.get("PicUrl"):
            metadata["pic_url"] = str(message["PicUrl"])
        if message.get("ThumbMediaId"):
            metadata["thumb_media_id"] = str(message["ThumbMediaId"])
        if message.get("MediaId"):
            media_id = str(message["MediaId"])
            attachments.append(Attachment(kind=kind, content_type=ctype, url=media_url(base_url, media_id),
                                          channel_ref=media_id))
    elif mtype == "location":
        lat, lon = str(message.get("Location_X") or ""), str(message.get("Location_Y") or "")
        label = str(message.get("Label") or "").strip()
        metadata.update(latitude=lat, longitude=lon, scale=str(message.get("Scale") or ""), label=label)
        text = f"[location] {label + ' ' if label else ''}({lat}, {lon})"
    elif mtype == "link":
        title, description, url = (str(message.get(k) or "").strip() for k in ("Title", "Description", "Url"))
        metadata["url"] = url
        text = "\n".join(t for t in (f"[link] {title}".rstrip(), description, url) if t)
    else:
        return None
    if not text.strip() and not attachments:
        return None
    return InboundMessage(channel="weixin", conversation_id=user, message_id=msg_id, sender_id=user,
                          source_type="user", text=text, attachments=attachments, metadata=metadata,
                          timestamp=utc_from_epoch(message.get("CreateTime")))


def unsent_note(attachment: Attachment) -> str:
    """The note in place of an image not sent: ``channel_ref`` is ``UNSENT<size>:<why>``."""
    size, _, why = (attachment.channel_ref or "")[len(UNSENT):].partition(":")
    return f"[{attachment.filename or 'an image'} ({size} bytes) was not sent: {why}]"


def upload_name(attachment: Attachment, content_type: str) -> str:
    """The file name an image is uploaded with: the agent's, with the extension of its content type."""
    ext = IMAGE_EXTENSIONS.get(content_type, ".jpg")
    name = (attachment.filename or "").strip() or "image"
    if os.path.splitext(name)[1].lower() not in {*IMAGE_EXTENSIONS.values(), ".jpeg"}:
        name += ext
    return name


def sendable_image(attachment: Attachment) -> bool:
    return (attachment.kind == "image" and (attachment.content_type or "").split(";")[0].strip().lower()
            in IMAGE_TYPES)


class WeixinWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.settings = {name: env.get(name, "") for name in ENV_REFS}
        self.app_id = self.settings[APP_ID_ENV]
        self.base_url = (env.get(BASE_URL_ENV) or DEFAULT_API_BASE_URL).rstrip("/")
        self.api = WeixinApi(self.app_id, self.settings[APP_SECRET_ENV], base_url=self.base_url,
                             stopping=self.stopping, max_wait_secs=self.opts.max_retry_wait)
        self.inbox_init()
        self._journal: SentJournal | None = None
        self._quota: SentJournal | None = None   # "quota:<OpenID>" -> "<messages left> <when the user wrote>"
        self._plan_lock = threading.Lock()
        self.server = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        missing = [name for name in REQUIRED if not self.settings[name]]
        if missing:
            raise ChannelRefused(f"{', '.join(missing)} not set")
        crypto = None
        if self.settings[AES_KEY_ENV]:
            try:
                crypto = MsgCrypt(self.settings[TOKEN_ENV], self.settings[AES_KEY_ENV], self.app_id)
            except CryptoError as exc:
                raise ChannelRefused(f"{AES_KEY_ENV}: {exc}") from exc
        try:
            self.api.token()
        except AppRefused as exc:
            raise ChannelRefused(refused(exc)) from exc
        except (WeixinError, httpx.HTTPError) as exc:
            # passing (busy, 5xx, the network): inbound needs no token, and WeChat's retries of a POST need an
            # answer; the token is fetched again at the first call that needs it (a refusal then stops the worker)
            self.log.warning("weixin: the access token could not be fetched yet (%s: %s); listening anyway",
                             type(exc).__name__, exc)
        self._journal = SentJournal(self.journal_path())
        self._quota = SentJournal(self.state_path("quota", "sqlite3"))
        self.log.info("weixin: account %s via %s, %s mode", self.app_id, self.base_url,
                      "safe" if crypto else "plaintext")
        from .callback import CallbackServer
        if crypto is None and not self.opts.max_age:
            self.log.warning("weixin: plaintext mode with --max-age 0: a signature is refused with another body "
                             "for 120 s only; a request from a log older than that is taken (prefer safe mode)")
        self.server = CallbackServer(self.opts.bind, self.opts.path, self.settings[TOKEN_ENV], crypto, self.accept,
                                     max_age_secs=self.opts.max_age, seen_path=self.state_path("seen", "log"))
        self.server.start()
        self.log.info("weixin: callback listening on %s", self.server.url)

    def journal_path(self) -> str:
        return self.state_path("sent", "sqlite3")

    # ------------------------------------------------------------------ inbound

    def accept(self, message: dict) -> None:
        """One verified message: recorded durably (the outbox), queued for the hub. Returns once the record
        is written, so the callback may answer ``success`` at once."""
        msg = normalise(message, base_url=self.base_url)
        if msg is None:
            self.log.debug("weixin: %s %s from %s is not a message; not taken", message.get("MsgType"),
                          message.get("Event") or "", message.get("FromUserName"))
            return
        if not self.inbox_record(msg):
            self.log.info("weixin: message %s was taken before (WeChat called again)", msg.message_id)
            return
        self._set_left(msg.conversation_id, MAX_MESSAGES, time.time())  # a message of the user: 5 again

    # ------------------------------------------------------------------ WeChat's 5 messages a user message

    def _left(self, openid: str) -> tuple[int, float]:
        """The messages left for the user's last message, and when the user wrote it. Unknown (a message
        recorded before this count was kept) or past 48 hours: 5, and WeChat's answer decides."""
        value = self._quota.done(f"quota:{openid}").get(0, "")
        try:
            left, at = value.split()
            left, at = int(left), float(at)
        except ValueError:
            return MAX_MESSAGES, 0.0
        if time.time() - at > WINDOW_SECS:
            return MAX_MESSAGES, 0.0
        return max(0, min(left, MAX_MESSAGES)), at

    def _set_left(self, openid: str, left: int, at: float) -> None:
        self._quota.record(f"quota:{openid}", 0, f"{max(0, left)} {at:.3f}")

    def room(self, delivery) -> int:
        """The messages this delivery may send: planned once (journaled, so a resumed delivery keeps its plan),
        taken from what is left for the user's last message when it is first planned."""
        with self._plan_lock:
            planned = self._journal.done(delivery.delivery_id).get(PLAN_PART)
            if planned is not None:
                return int(planned)
            left, at = self._left(delivery.conversation_id)
            steps = self._plan_steps(delivery, left)
            if steps:
                self._journal.record(delivery.delivery_id, PLAN_PART, str(left))
                self._set_left(delivery.conversation_id, left - len(steps), at or time.time())
            return left

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        media_id = media_id_of(self.base_url, attachment.url)
        if media_id is None:
            return None
        try:
            data, _, _ = self.api.media(media_id)
        except AppRefused as exc:
            self._refusal = refused(exc)  # the listener stops the worker
            raise
        except (RateLimited, Stopped, httpx.HTTPError) as exc:  # WeChat keeps a file 3 days: wait for it
            raise MediaNotReady(str(exc) or type(exc).__name__) from exc
        except WeixinError as exc:
            if exc.errcode == -1 or exc.errcode in TOKEN_STALE:
                raise MediaNotReady(str(exc)) from exc
            raise  # (40007: the file is gone) the message goes on without it, saying so
        return data

    # ------------------------------------------------------------------ outbound

    def put_media(self, media, attachment, delivery) -> str | None:
        """Upload an image of the answer (``media/upload``, type image); other files are not sent."""
        steps = self._steps(delivery)
        index = next((i for i, (kind, payload) in enumerate(steps) if payload is attachment), None)
        if index is None:
            return None  # not sent: not an image WeChat takes, or past the 5 messages
        if index in self._journal.done(delivery.delivery_id):
            return "sent"  # that message went out before a crash: no second upload
        if len(media.data) > IMAGE_MAX_BYTES:
            self.log.warning("delivery %s: image %s (%d bytes) is over WeChat's 2 MB; a note is sent instead",
                             delivery.delivery_id, attachment.filename or attachment.media_id, len(media.data))
            return f"{UNSENT}{len(media.data)}:over WeChat's {IMAGE_MAX_BYTES // (1024 * 1024)} MB for an image"
        ctype = attachment.content_type.split(";")[0].strip().lower()
        try:
            return self.api.upload(media.data, ctype, upload_name(attachment, ctype))
        except WeixinError as exc:
            if exc.errcode in UPLOAD_REFUSED and not isinstance(exc, (AppRefused, RateLimited)):
                self.log.warning("delivery %s: image %s refused by media/upload (%s); a note is sent instead",
                                 delivery.delivery_id, attachment.filename or attachment.media_id, exc)
                return (f"{UNSENT}{len(media.data)}:{UPLOAD_REFUSED[exc.errcode]} (errcode {exc.errcode}: "
                        f"{exc.errmsg})")
            raise self._failure(exc, "media/upload") from exc
        except Exception as exc:  # noqa: BLE001 - classified as a send is
            raise self._failure(exc, "media/upload") from exc

    def _steps(self, delivery) -> list[tuple[str, object]]:
        return self._plan_steps(delivery, self.room(delivery))

    @staticmethod
    def _plan_steps(delivery, room: int) -> list[tuple[str, object]]:
        """What a delivery sends, in order: its text parts, then one image message per image the agent
        attached; at most ``room`` messages in all (what is left of WeChat's 5 for the user's message)."""
        # a file the host does not hold (no media_id: never uploaded, so no image message) is its link in the text
        links = [f"[{att.filename or att.kind or 'file'}: {att.url}]" for att in delivery.attachments
                 if not att.media_id and att.url]
        text = "\n\n".join(t for t in [delivery.text, *links] if t.strip())
        has_text = bool(text.strip())
        images = [att for att in delivery.attachments
                  if att.media_id and sendable_image(att)][:max(0, room - has_text)]
        text_room = room - len(images) if has_text else 0
        steps: list[tuple[str, object]] = [("text", p) for p in message_parts(text, room=text_room)]
        steps += [("image", att) for att in images]
        return steps

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("WeChat refused the account's credentials")
        steps = self._steps(delivery)
        if not steps:
            if self._plan_steps(delivery, MAX_MESSAGES):
                raise DeliveryFailed(f"nothing sent: {QUOTA_SPENT}", permanent=True)
            raise DeliveryFailed("nothing WeChat can show: the answer has no text and no image", permanent=True)
        done = self._journal.done(delivery.delivery_id)
        for index, (kind, payload) in enumerate(steps):
            if index in done:
                continue
            if kind == "image" and (payload.channel_ref or "").startswith(UNSENT):
                kind, payload = "text", unsent_note(payload)
            elif kind == "image" and (not payload.channel_ref or payload.channel_ref == "sent"):
                continue  # no upload was asked for, or it was sent before a crash
            try:
                if kind == "text":
                    self.api.send_text(delivery.conversation_id, payload)
                else:
                    self.api.send_image(delivery.conversation_id, payload.channel_ref)
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, UserUnreachable) and exc.errcode == 45047:  # spent elsewhere: stop here
                    self._set_left(delivery.conversation_id, 0, self._left(delivery.conversation_id)[1] or time.time())
                    sent = len([i for i in self._journal.done(delivery.delivery_id) if i >= 0])
                    raise DeliveryFailed(f"{exc} ({QUOTA_SPENT}; {sent} of this answer's {len(steps)} messages "
                                         "went out)", permanent=True) from exc
                raise self._failure(exc, "message/custom/send") from exc
            # WeChat took it: recorded before anything else can fail, so a resend after a crash skips it
            self._journal.record(delivery.delivery_id, index, "")
        return None  # customer service messages get no message id

    def _failure(self, exc: Exception, where: str) -> DeliveryFailed:
        if isinstance(exc, AppRefused):
            self._refusal = refused(exc)
            return self.refused_failure("WeChat refused the account's credentials")
        if isinstance(exc, UserUnreachable):
            why = {45015: "the user last wrote more than 48 hours ago (or unfollowed): WeChat takes customer "
                          "service messages only within 48 hours of the user's last message",
                   45047: "WeChat's quota of customer service messages for the user's last message is spent",
                   43004: "the user does not follow the account",
                   40003: "the OpenID is not this account's"}.get(exc.errcode, "")
            return DeliveryFailed(f"{exc}" + (f" ({why})" if why else ""), permanent=True)
        if isinstance(exc, RateLimited):
            return DeliveryFailed(str(exc))
        if isinstance(exc, WeixinError):
            return DeliveryFailed(str(exc), permanent=exc.errcode in CONTENT_REFUSED)
        return DeliveryFailed(f"{where}: {type(exc).__name__}: {exc}")  # anything else: worth the hub's retries

    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): every message of the answer is in the sent journal."""
        steps = self._steps(delivery)
        sent = [i for i in self._journal.done(delivery.delivery_id) if i >= 0]
        return bool(steps) and len(sent) >= len(steps)


    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.api.close()
        if self._journal is not None:
            self._journal.close()
        if self._quota is not None:
            self._quota.close()


def main(argv: list[str] | None = None) -> None:
    WeixinWorker.main(argv=argv)
