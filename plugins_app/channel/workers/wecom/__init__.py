"""The WeCom (企业微信) channel: an internal app's encrypted callback in, its message API out.

    python -m plugins_app.channel.workers.wecom [--bind 127.0.0.1:3000] [--path /wecom/callback]
                                                [--max-retry-wait 120]

Environment: ``WECOM_CORP_ID`` (My Company → Company Information), ``WECOM_AGENT_ID`` and
``WECOM_SECRET`` (the app's AgentId and Secret), ``WECOM_TOKEN`` and ``WECOM_ENCODING_AES_KEY``
(the app's *Receive messages* API settings), ``WECOM_API_BASE_URL`` (default
``https://qyapi.weixin.qq.com``, only to point the worker at a test's fake).
Operators' page: docs/channels/wecom.md.

* **Inbound.** A callback server (``callback.py``): the URL check (GET, ``echostr``) and encrypted
  messages (POST), the signature checked in constant time and the receive id checked to be this
  corp (``sdk/wxcrypto.py``, the WXBizMsgCrypt scheme). Answered 200 once the message is in the worker's
  outbox. Messages of type text, image, voice, video and file become ``InboundMessage``s whose
  ``message_id`` is WeCom's ``MsgId``, so a callback WeCom calls again (no answer within 5 s) runs
  no second turn. An internal app's messages are 1:1: the conversation and the sender are
  ``FromUserName``. Media are downloaded with ``GET /cgi-bin/media/get`` and stored on the host.
  Events (``MsgType`` event: entering the app, menu clicks, ...) are not messages, except a press of a
  question card's button (``template_card_event``), which comes back as the option's label with
  ``metadata["option"]`` its value; its message id is ``card:<user>:<CreateTime>:<TaskId>:<key hash>``
  (WeCom's advice for events: ``FromUserName`` + ``CreateTime``; the button's key tells two presses
  within one second apart), so a press WeCom calls again answers once.
* **Outbound.** ``POST /cgi-bin/message/send`` with WeCom's duplicate check on
  (``enable_duplicate_check``, 1,800 s): a send repeated after a crash, with the same content to
  the same user, is not shown twice. Text is split at WeCom's 2,048 bytes of UTF-8. Each file is
  uploaded (``POST /cgi-bin/media/upload``, type image, voice, video or file by its type and WeCom's
  limits) and sent as a part of its own after the text; its media id is kept (``state.py``) the moment
  WeCom answers the upload, so a delivery resumed after a crash sends the same media id again and the
  duplicate check holds it. An AMR voice over WeCom's 60 s (its length from its frames) goes as a file.
  A file over its type's limit, or refused by the upload (any errcode but a transient one), is not
  sent: a note in the text says so. A question's ``metadata["options"]`` (up to 6) go out as a
  ``template_card`` of type ``button_interaction`` (``cards.py``); more, or a card WeCom refuses,
  as the numbered text. Once the host applied a press as the answer, the card is updated
  (``update_template_card`` with the press's ``ResponseCode``) so its buttons become the chosen option,
  not pressable: at most once a press, and a failure only logged (``update_cards``).
* **Token.** ``gettoken`` with the corp id and the app's secret (the SDK's ``sdk/tencent.py``, shared
  with the Weixin worker, keeps it and makes the calls), kept until shortly before it expires, fetched
  again at once when a call says it is stale (40014, 42001, 40001), and the call made once more.
* **Limits.** 45009/45033 are waited out in place (1 s doubling to 30 s) up to ``--max-retry-wait``;
  then the hub's own retries take over.
* **Refusals.** The corp id, the secret or the server's IP refused (gettoken's 40001, 40013, 40091,
  41004; 60020 anywhere) raises ``ChannelRefused``: the plugin is disabled with the reason, not
  restarted. A user not found or not in the app's visible range (81013, 60111) fails that
  delivery permanently with WeCom's reason.
"""
from __future__ import annotations

import argparse
import hashlib
import mimetypes
import os
import sys
import threading
import time

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady)
from plugins_app.channel.sdk.messages import utc_from_epoch
from plugins_app.channel.sdk.outbox import ACKED, PENDING, outbox_path_for
from plugins_app.channel.sdk.webhook import WebhookInbox
from plugins_app.channel.sdk.audio import amr_seconds  # noqa: F401 - also the tests' name for it
from plugins_app.channel.sdk.tencent import media_id_of, media_url
from plugins_app.channel.sdk.text import split_text, unsent_note

from .api import (DEFAULT_API_BASE_URL, RATE_LIMITED, SYSTEM_BUSY, TASK_ID_EXISTS, TEXT_LIMIT_BYTES, TOKEN_STALE,
                  AppRefused, RateLimited, Stopped, UserUnreachable, WeComApi, WeComError)
from .cards import TASK_ID_PREFIX, answered_button, option_label, question_card
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt
from ugent_common.digits import ascii_int

from .state import PRESS_FAILED, PRESS_SKIPPED, PRESS_UPDATED, PRESS_UPDATING, PRESS_WAITING, WeComState

KIND = "channel-wecom"
DESCRIPTION = "WeCom (企业微信): an internal app's encrypted callback in, the message API out."
ENV_REFS = ("WECOM_CORP_ID", "WECOM_AGENT_ID", "WECOM_SECRET", "WECOM_TOKEN", "WECOM_ENCODING_AES_KEY")

CORP_ID_ENV, AGENT_ID_ENV, SECRET_ENV, TOKEN_ENV, AES_KEY_ENV = ENV_REFS
BASE_URL_ENV = "WECOM_API_BASE_URL"

#: A message type's attachment kind and content type (WeCom's voice is AMR; a file keeps its name's type).
MEDIA = {"image": ("image", "image/jpeg"), "voice": ("audio", "audio/amr"), "video": ("video", "video/mp4"),
         "file": ("document", "application/octet-stream")}
#: Content errors sending again cannot fix: an empty or too long text, an unknown message type.
CONTENT_REFUSED = {44004, 45002, 40008}

MB = 1024 * 1024
#: WeCom's upload limits by media type (media/upload): image JPG/PNG, voice AMR, video MP4, any file.
MEDIA_LIMITS = {"image": 10 * MB, "voice": 2 * MB, "video": 10 * MB, "file": 20 * MB}
#: WeCom takes no file of 5 bytes or less.
MIN_MEDIA_BYTES = 6
#: The content types (and, for a file with no useful type, the name's extensions) each media type takes.
MEDIA_TYPES = {"image": ({"image/jpeg", "image/jpg", "image/pjpeg", "image/png"}, (".jpg", ".jpeg", ".png")),
               "voice": ({"audio/amr", "voice/amr"}, (".amr",)),
               "video": ({"video/mp4"}, (".mp4",))}
#: ``channel_ref`` of an uploaded file: ``wecom:<media type>:<media id>``.
UPLOADED = "wecom:"
#: ``channel_ref`` of a file not sent: ``unsent:<why>``; the text carries a note in its place.
UNSENT = "unsent:"
#: An upload refused for good, by errcode (``api.UPLOAD_REFUSED``): what the note says.
UPLOAD_REFUSALS = {40004: "WeCom does not take its type", 40005: "WeCom does not take its type",
                   40006: "WeCom refused its size", 40009: "WeCom refused its size", 40010: "WeCom refused its size",
                   40011: "WeCom refused its size", 44001: "it is empty", 41005: "WeCom received no data for it",
                   45001: "it is over WeCom's size limit", 45007: "it plays longer than WeCom's 60 s for a voice"}
#: An upload answered with one of these is tried again (by the hub's retries), not taken as the file refused.
UPLOAD_TRANSIENT = {SYSTEM_BUSY, *TOKEN_STALE, *RATE_LIMITED}
#: WeCom plays a voice message of at most this many seconds; a longer AMR goes as a file.
VOICE_MAX_SECS = 60
#: How often the pressed cards are looked at besides right after a press's submit (a press the replay submitted).
CARD_UPDATE_SECS = 10.0
#: A press's response code is good for one update_template_card within this long (WeCom: 72 hours).
RESPONSE_CODE_SECS = 72 * 3600


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-wecom", description=DESCRIPTION)
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the callback listens on (port 0: any)")
    p.add_argument("--path", default="/wecom/callback", help="the callback URL's path")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a send waits out 45009/45033 in place; then the hub's retries take over")
    return p.parse_args(argv)


def mime_of(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def media_type(content_type: str | None, filename: str | None = None) -> str:
    """The media type a file is uploaded and sent as: image (JPG, PNG), voice (AMR), video (MP4) by its
    content type, or by its name's extension when the type says nothing (``application/octet-stream``);
    anything else is a file."""
    mime = mime_of(content_type)
    name = (filename or "").lower()
    for mtype, (types, extensions) in MEDIA_TYPES.items():
        if mime in types:
            return mtype
    if mime in ("", "application/octet-stream", "binary/octet-stream"):
        for mtype, (_, extensions) in MEDIA_TYPES.items():
            if name.endswith(extensions):
                return mtype
    return "file"


def size_refusal(mtype: str, size: int) -> str | None:
    """Why WeCom will not take a file of this type and size, or None when it will."""
    if size < MIN_MEDIA_BYTES:
        return f"it is {size} bytes, and WeCom takes no file of 5 bytes or less"
    limit = MEDIA_LIMITS[mtype]
    if size > limit:
        what = "file" if mtype == "file" else f"{mtype} ({', '.join(MEDIA_TYPES[mtype][1]).replace('.', '')})"
        return f"it is {size / MB:.1f} MB, over WeCom's {limit // MB} MB limit for a {what}"
    return None


def file_name(attachment: Attachment, media_name: str | None, mtype: str, content_type: str) -> str:
    """The name a file is uploaded with (a file message shows it). An image, voice or video whose name lacks
    its type's extension gets it (WeCom takes JPG/PNG, AMR, MP4: the name should say so)."""
    name = attachment.filename or media_name or (attachment.kind or "file")
    if mtype in MEDIA_TYPES and not name.lower().endswith(MEDIA_TYPES[mtype][1]):
        name += {"image": ".png" if "png" in content_type else ".jpg", "voice": ".amr", "video": ".mp4"}[mtype]
    elif mtype == "file" and not (attachment.filename or media_name):
        name += mimetypes.guess_extension(content_type) or ""
    return name


def utf8_len(text: str) -> int:
    """Length in bytes of UTF-8, as WeCom counts a text message."""
    return len(text.encode("utf-8"))


def message_parts(text: str) -> list[str]:
    """An answer as the texts of the messages that carry it, each within WeCom's 2,048 bytes."""
    return split_text(text, TEXT_LIMIT_BYTES, measure=utf8_len) if text.strip() else []


def refused(exc: WeComError) -> str:
    """The operator's reason for an app WeCom refuses, with what to fix."""
    fix = {40001: f"the app's secret ({SECRET_ENV}) is wrong, or was reset in the admin console",
           40091: f"the app's secret ({SECRET_ENV}) is not valid",
           41004: f"the app's secret ({SECRET_ENV}) is missing",
           40013: f"the corp id ({CORP_ID_ENV}) is wrong",
           40056: f"the agent id ({AGENT_ID_ENV}) is not this app's",
           60020: "this server's IP is not in the app's trusted IPs (企业可信IP)"}.get(exc.errcode, "")
    return f"{exc}" + (f": {fix}" if fix else "")


def normalise(message: dict, *, agent_id: str | None = None,
              base_url: str = DEFAULT_API_BASE_URL) -> InboundMessage | None:
    """A decrypted callback message as an InboundMessage; None for events and what the agent cannot read."""
    mtype = str(message.get("MsgType") or "")
    user = str(message.get("FromUserName") or "")
    msg_id = str(message.get("MsgId") or "")
    if mtype == "event" and message.get("Event") == "template_card_event":
        return None  # a press of a card's button: read by normalise_press, which knows the card
    if mtype == "event" or not user or not msg_id:
        return None
    if agent_id and message.get("AgentID") and str(message["AgentID"]) != str(agent_id):
        return None  # another app's message: not this worker's to answer
    metadata = {"message_type": mtype, "wecom_msg_id": msg_id, "agent_id": str(message.get("AgentID") or "")}
    text, attachments = "", []
    if mtype == "text":
        text = str(message.get("Content") or "")
    elif mtype in MEDIA and message.get("MediaId"):
        kind, ctype = MEDIA[mtype]
        media_id = str(message["MediaId"])
        name = str(message.get("FileName") or message.get("Title") or "") or None
        if mtype == "voice" and message.get("Format"):
            ctype = (mimetypes.guess_type(f"x.{str(message['Format']).lower()}")[0] or ctype).lower()
        if name and mtype == "file":
            ctype = mimetypes.guess_type(name)[0] or ctype
        if message.get("PicUrl"):
            metadata["pic_url"] = str(message["PicUrl"])
        attachments.append(Attachment(kind=kind, content_type=ctype, url=media_url(base_url, media_id),
                                      filename=name, channel_ref=media_id))
    else:
        return None  # locations, links: nothing the agent reads
    if not text.strip() and not attachments:
        return None
    return InboundMessage(channel="wecom", conversation_id=user, message_id=msg_id, sender_id=user,
                          source_type="user", text=text, attachments=attachments, metadata=metadata,
                          timestamp=utc_from_epoch(message.get("CreateTime")))


def press_id(user: str, created: str, task_id: str, key: str) -> str:
    """A press's message id: ``card:<user>:<CreateTime>:<TaskId>:<12 hex of the EventKey's SHA-256>``. The same
    event called again has the same id; two buttons of one card pressed within one second do not (the key
    is hashed: it may be 1,024 bytes, and the id stays within the host's 255 characters)."""
    return f"card:{user}:{created}:{task_id}:{hashlib.sha256(key.encode('utf-8')).hexdigest()[:12]}"


def normalise_press(message: dict, options: list[dict] | None, *, agent_id: str | None = None) -> InboundMessage | None:
    """A ``template_card_event`` (a press of a question card's button) as an InboundMessage: the option's
    label as text, its value (the button's ``EventKey``) as ``metadata["option"]``. ``options`` are the
    card's, as this worker sent it (None: no card of this worker's; a task id of its own still counts, the
    key being a reply token the host checks). The message id is the user, the ``CreateTime``, the
    ``TaskId`` and the key (``press_id``): WeCom calls again a callback it had no answer for with the same
    event, and a press is answered once. None for anything else."""
    if message.get("MsgType") != "event" or message.get("Event") != "template_card_event":
        return None
    user, key = str(message.get("FromUserName") or ""), str(message.get("EventKey") or "")
    task_id, created = str(message.get("TaskId") or ""), str(message.get("CreateTime") or "")
    if not (user and key and task_id and created):
        return None
    if agent_id and message.get("AgentID") and str(message["AgentID"]) != str(agent_id):
        return None
    if options is None and not task_id.startswith(TASK_ID_PREFIX):
        return None  # another sender's card: not a question of this worker's
    label = option_label(options or [], key)
    metadata = {"option": key, "message_type": "template_card_event", "task_id": task_id,
                "card_type": str(message.get("CardType") or ""), "agent_id": str(message.get("AgentID") or "")}
    if message.get("ResponseCode"):
        metadata["response_code"] = str(message["ResponseCode"])
    return InboundMessage(channel="wecom", conversation_id=user, message_id=press_id(user, created, task_id, key),
                          sender_id=user, source_type="user", text=label or key, metadata=metadata,
                          timestamp=utc_from_epoch(created))


def press_applied(result: dict) -> bool:
    """Whether the host's answer to a press (``inbound.submit``) says it applied the press as the question's
    answer: ``reply`` "applied"; or, for a press submitted again because the host's first answer never reached
    the worker (a call timed out, a worker killed before it recorded the answer), the duplicate of a message whose
    receipt ``completed`` with no turn. Only a reply applied makes such a receipt: a reply refused or not fitting
    leaves it ``refused``, and a message that is no reply has a turn, made in its receipt's transaction
    (channels_app.questions.question_reply_from_channel; channels_app.services.message_submit)."""
    if not result.get("accepted"):
        return False
    if "reply" in result:
        return result["reply"] == "applied"
    return (result.get("duplicate") is True and result.get("code") == "DuplicateProcessed"
            and result.get("receipt_state") == "completed" and not result.get("turn_id"))


class WeComWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments", "options")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.settings = {name: env.get(name, "") for name in ENV_REFS}
        self.corp_id, self.agent_id = self.settings[CORP_ID_ENV], self.settings[AGENT_ID_ENV]
        self.base_url = (env.get(BASE_URL_ENV) or DEFAULT_API_BASE_URL).rstrip("/")
        self.api = WeComApi(self.corp_id, self.settings[SECRET_ENV], self.agent_id, base_url=self.base_url,
                            stopping=self.stopping, max_wait_secs=self.opts.max_retry_wait)
        self.inbox_init()
        self.server = None
        self.state: WeComState | None = None
        self._cards_due = threading.Event()
        self._card_updater: threading.Thread | None = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        missing = [name for name, value in self.settings.items() if not value]
        if missing:
            raise ChannelRefused(f"{', '.join(missing)} not set")
        if ascii_int(str(self.agent_id)) is None:
            raise ChannelRefused(f"{AGENT_ID_ENV} must be the app's AgentId, a number (it is {self.agent_id!r})")
        try:
            crypto = MsgCrypt(self.settings[TOKEN_ENV], self.settings[AES_KEY_ENV], self.corp_id)
        except CryptoError as exc:
            raise ChannelRefused(f"{AES_KEY_ENV}: {exc}") from exc
        try:
            self.api.token()
        except AppRefused as exc:
            raise ChannelRefused(refused(exc)) from exc
        path = str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.", ".wecom.")
        self.state = WeComState(path)
        self._presses_cut_short()
        self.log.info("wecom: corp %s, agent %s via %s", self.corp_id, self.agent_id, self.base_url)
        from .callback import CallbackServer
        self.server = CallbackServer(self.opts.bind, self.opts.path, crypto, self.accept)
        self.server.start()
        self.log.info("wecom: callback listening on %s", self.server.url)
        self._card_updater = threading.Thread(target=self._card_updater_loop, name="wecom-cards", daemon=True)
        self._card_updater.start()

    # ------------------------------------------------------------------ inbound

    def accept(self, message: dict) -> None:
        """One decrypted callback message: recorded durably (the outbox), queued for the hub. Returns once
        the record is written, so the callback may answer WeCom 200 at once."""
        other = str(message.get("AgentID") or "")
        if other and other != str(self.agent_id) and not self._refusal:
            # Only this app's Token and EncodingAESKey verify a callback: a verified one naming another agent
            # means WECOM_AGENT_ID is wrong, and every message would be dropped in silence. Said, and stopped.
            self._refusal = (f"a callback for agent {other} arrived, but {AGENT_ID_ENV} is {self.agent_id}: the "
                             f"callback's Token and EncodingAESKey are agent {other}'s (set {AGENT_ID_ENV} to the "
                             "app's AgentId, on its page in the admin console)")
            self.log.error("wecom: %s", self._refusal)
        options = None
        if message.get("MsgType") == "event" and message.get("Event") == "template_card_event":
            task_id = str(message.get("TaskId") or "")
            options = self.state.card(task_id) if self.state and task_id else None
            msg = normalise_press(message, options, agent_id=self.agent_id)
        else:
            msg = normalise(message, agent_id=self.agent_id, base_url=self.base_url)
        if msg is None:
            self.log.debug("wecom: %s %s is not a message; skipped", message.get("MsgType"), message.get("Event"))
            return
        code = msg.metadata.get("response_code")
        if code and msg.metadata.get("message_type") == "template_card_event" and self.state is not None:
            # before the outbox: a press the host takes is always known here (a redelivery is the same row)
            self.state.record_press(msg.key, msg.conversation_id, code,
                                    answered_button(option_label(options or [], msg.metadata["option"])))
        if not self.inbox_record(msg):
            self.log.info("wecom: message %s was taken before (WeCom called again)", msg.message_id)

    def listen(self, submit) -> None:
        def submit_then_update(message):
            result = submit(message)
            if message.metadata.get("message_type") == "template_card_event":
                self._cards_due.set()  # the host answered the press (or will, from the outbox): its card next
            return result
        super().listen(submit_then_update)

    # ------------------------------------------------------------------ a pressed card, updated

    def _presses_cut_short(self) -> None:
        """At start, before the card updater runs: a press still ``updating`` had its update_template_card call
        cut short (the worker killed, or stopped while the call outlasted the stop's wait). Whether WeCom made
        the update is unknown, and a response code is good for one update: each is logged and marked ``failed``,
        not tried again (at most once)."""
        for key in self.state.presses_updating_to_failed():
            self.log.warning("wecom: the card update of press %s was cut short by the worker's stop; whether WeCom "
                             "made it is unknown, and it is not tried again (the answer stands)",
                             key.partition("\x1f")[2])

    def _card_updater_loop(self) -> None:
        """Updates the cards of answered presses: woken after a press is submitted, and every
        ``CARD_UPDATE_SECS`` for a press the outbox's replay submitted (after a restart, or the host away)."""
        while not self.stopping.is_set():
            self._cards_due.wait(CARD_UPDATE_SECS)
            self._cards_due.clear()
            if self.stopping.is_set():
                return
            try:
                self.update_cards()
            except Exception:  # noqa: BLE001 - the answer is the host's already; a card left as it was is logged
                self.log.exception("wecom: updating the pressed cards failed")

    def update_cards(self) -> int:
        """Update the card of each press the host applied as the answer (``update_template_card`` with the press's
        response code: the buttons become the chosen option's, not pressable); returns how many. A press the host
        did not apply (the question already answered, or expired) leaves its card as it is. Each press is claimed
        before its call (``state.move_press``), so it is updated at most once, whatever thread or redelivery; a
        failure is logged and never touches the answer, which the host holds already."""
        if self.state is None:
            return 0
        outbox, updated = self._outbox(), 0
        for key, user, code, name, at in self.state.presses_waiting():
            row = outbox.inbound_get(key)
            if row is None or row.state == PENDING:  # the host has not answered yet
                if time.time() - at > RESPONSE_CODE_SECS and self.state.move_press(key, PRESS_WAITING, PRESS_SKIPPED):
                    self.log.warning("wecom: press %s was answered after its response code's 72 hours; its card "
                                     "stays as it was", key.partition("\x1f")[2])
                continue
            result = row.result or {}
            if row.state != ACKED or not press_applied(result):
                if self.state.move_press(key, PRESS_WAITING, PRESS_SKIPPED):
                    self.log.info("wecom: press %s was not taken as the answer (%s); its card stays as it was",
                                  key.partition("\x1f")[2], result.get("reply") or result.get("reason")
                                  or result.get("receipt_state") or row.state)
                continue
            if not self.state.move_press(key, PRESS_WAITING, PRESS_UPDATING):
                continue  # another thread has it
            try:
                self.api.update_card_button(user, code, name)
            except Stopped:
                self.state.move_press(key, PRESS_UPDATING, PRESS_WAITING)  # never sent: the next start tries it
                return updated
            except Exception as exc:  # noqa: BLE001 - the answer stands; the card keeps its buttons
                self.state.move_press(key, PRESS_UPDATING, PRESS_FAILED)
                self.log.warning("wecom: the card of press %s could not be updated (%s: %s); the answer stands, and a "
                                 "second press gets the host's notice", key.partition("\x1f")[2],
                                 type(exc).__name__, exc)
                continue
            self.state.move_press(key, PRESS_UPDATING, PRESS_UPDATED)
            updated += 1
            self.log.info("wecom: the card of press %s now shows %r", key.partition("\x1f")[2], name)
        return updated

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        media_id = media_id_of(self.base_url, attachment.url)
        if media_id is None:
            return None
        try:
            data, _, _ = self.api.media(media_id)
        except AppRefused as exc:
            self._refusal = refused(exc)  # the listener stops the worker
            raise
        except (RateLimited, Stopped, httpx.TransportError) as exc:  # WeCom keeps media 3 days: the message waits
            raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
        except WeComError as exc:
            if exc.errcode == -1:  # busy
                raise MediaNotReady(str(exc)) from exc
            raise
        return data

    # ------------------------------------------------------------------ outbound

    def put_media(self, media, attachment, delivery) -> str | None:
        """Upload one file of an answer (``POST /cgi-bin/media/upload``); its part sends the media id next.

        A media id uploaded for this file before (a delivery resumed after a crash) is used again while WeCom
        keeps it, so the resent part is the same content and WeCom's duplicate check holds it. A file over
        its type's limit, or one the upload refuses for good, is not uploaded: ``UNSENT`` and why, and the
        text carries a note in its place."""
        index = next(i for i, a in enumerate(delivery.attachments) if a is attachment)
        stored = self.state.upload_of(delivery.delivery_id, index)
        if stored is not None:
            return f"{UPLOADED}{stored[0]}:{stored[1]}"
        ctype = mime_of(attachment.content_type) or mime_of(media.content_type) or "application/octet-stream"
        mtype = media_type(ctype, attachment.filename or media.filename)
        if mtype == "voice" and (amr_seconds(media.data) or 0) > VOICE_MAX_SECS:
            mtype = "file"  # WeCom refuses a voice over 60 s (45007); as a file it still reaches the user
        why = size_refusal(mtype, len(media.data))
        if why is not None:
            self.log.warning("wecom: delivery %s: %s", delivery.delivery_id, unsent_note(attachment, why))
            return UNSENT + why
        name = file_name(attachment, media.filename, mtype, ctype)
        try:
            answer = self.api.upload(media.data, mtype, name, ctype)
        except WeComError as exc:
            # Any errcode but a transient one is this file refused: a note, and the text still goes out, instead
            # of the whole answer held back (and dead-lettered) over one file.
            if exc.errcode not in UPLOAD_TRANSIENT and not isinstance(exc, (AppRefused, RateLimited)):
                why = (f"{UPLOAD_REFUSALS[exc.errcode]} (errcode {exc.errcode})" if exc.errcode in UPLOAD_REFUSALS
                       else f"WeCom refused it (errcode {exc.errcode})")
                self.log.warning("wecom: delivery %s: %s", delivery.delivery_id, unsent_note(attachment, why))
                return UNSENT + why
            raise self._failure(exc) from exc
        except (Stopped, httpx.HTTPError) as exc:
            raise DeliveryFailed(f"media/upload: {type(exc).__name__}: {exc}") from exc
        media_id = str(answer["media_id"])
        try:
            created = float(answer.get("created_at") or 0)
        except (TypeError, ValueError):
            created = 0.0
        self.state.record_upload(delivery.delivery_id, index, mtype, media_id, created or None)
        return f"{UPLOADED}{mtype}:{media_id}"

    def parts(self, delivery) -> list[tuple[str, dict]]:
        """What a delivery sends, in order, as (msgtype, its object): a question card, or the text parts
        (with a note for each file not sent, and the link of a file that has only one); then one message per
        uploaded file. The same delivery gives the same parts, so a resend is held by the duplicate check."""
        notes = []
        files: list[tuple[str, dict]] = []
        for att in delivery.attachments:
            ref = att.channel_ref or ""
            if ref.startswith(UPLOADED):
                mtype, _, media_id = ref[len(UPLOADED):].partition(":")
                files.append((mtype, {"media_id": media_id}))
            elif ref.startswith(UNSENT):
                notes.append(unsent_note(att, ref[len(UNSENT):]))
            elif att.url:
                notes.append(f"[{att.filename or att.kind or 'file'}: {att.url}]")
        card = question_card(delivery.delivery_id, delivery.text, delivery.metadata)
        text = "\n\n".join(t for t in [delivery.text if card is None else "", *notes] if t.strip())
        steps: list[tuple[str, dict]] = [("template_card", card)] if card is not None else []
        steps += [("text", {"content": part}) for part in message_parts(text)]
        return steps + files

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("WeCom refused the app's credentials")
        steps = self.parts(delivery)
        if not steps:
            raise DeliveryFailed("nothing WeCom can show: the answer has no text and no file", permanent=True)
        first: str | None = None
        for msgtype, content in steps:
            if msgtype == "template_card":
                answer = self._send_card(delivery, content)
            else:
                answer = self._send(delivery.conversation_id, msgtype, content)
            if first is None and answer is not None:
                first = str(answer.get("msgid") or "") or None
        return first

    def _send_card(self, delivery, card: dict) -> dict | None:
        """A question card; its options recorded first, so a press is read back even by a restarted worker.
        A card WeCom refuses for its content goes out as the numbered text; a task id WeCom already has was
        this delivery's card, sent before a crash (the duplicate check's 30 minutes past)."""
        self.state.record_card(card["task_id"], delivery.delivery_id, delivery.metadata.get("options") or [])
        try:
            return self._send(delivery.conversation_id, "template_card", card, card=True)
        except _CardRefused as exc:
            if exc.errcode == TASK_ID_EXISTS:
                self.log.info("wecom: delivery %s: card %s was sent before", delivery.delivery_id, card["task_id"])
                return None
            self.log.warning("wecom: delivery %s: WeCom refused the question card (%s); sending the numbered text",
                             delivery.delivery_id, exc)
        first = None
        for part in message_parts(delivery.text):
            answer = self._send(delivery.conversation_id, "text", {"content": part})
            first = first or answer
        return first

    def _send(self, user: str, msgtype: str, content: dict, *, card: bool = False) -> dict:
        try:
            return self.api.send(user, msgtype, content)
        except (AppRefused, UserUnreachable, RateLimited) as exc:
            raise self._failure(exc) from exc
        except WeComError as exc:
            # A card refused for its content goes as the numbered text; -1 (busy) and a token still stale after
            # the one refresh say nothing of the card, and are retried as any send is.
            if card and exc.errcode not in (SYSTEM_BUSY, *TOKEN_STALE):
                raise _CardRefused(exc.errcode, str(exc)) from exc
            raise self._failure(exc) from exc
        except (Stopped, httpx.HTTPError) as exc:
            raise DeliveryFailed(f"message/send: {type(exc).__name__}: {exc}") from exc

    def _failure(self, exc: WeComError) -> DeliveryFailed:
        if isinstance(exc, AppRefused):
            self._refusal = refused(exc)
            return self.refused_failure("WeCom refused the app's credentials")
        if isinstance(exc, UserUnreachable):
            return DeliveryFailed(f"{exc} (the user does not exist or is not in the app's visible range)",
                                  permanent=True)
        if isinstance(exc, RateLimited):
            return DeliveryFailed(str(exc))
        # -1 (system busy) and the rest: worth the hub's retries; a content WeCom refuses is not
        return DeliveryFailed(str(exc), permanent=exc.errcode in CONTENT_REFUSED)


    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._cards_due.set()
        if self._card_updater is not None:
            self._card_updater.join(timeout=5)
        self.api.close()
        if self.state is not None:
            self.state.close()


class _CardRefused(Exception):
    def __init__(self, errcode: int, reason: str):
        super().__init__(reason)
        self.errcode = errcode


def main(argv: list[str] | None = None) -> None:
    WeComWorker.main(argv=argv)
