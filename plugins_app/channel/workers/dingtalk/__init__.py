"""The DingTalk (钉钉) channel: an internal app's robot, its messages in (HTTP mode's callback or Stream mode's
WebSocket), the robot OpenAPI out.

    python -m plugins_app.channel.workers.dingtalk [--mode http|stream] [--bind 127.0.0.1:3000]
                                                   [--path /dingtalk/robot] [--max-retry-wait 120]

Environment: ``DINGTALK_APP_KEY`` and ``DINGTALK_APP_SECRET`` (the app's Client ID and Client Secret, on its
*Credentials* page in the developer console), ``DINGTALK_ROBOT_CODE`` (the robot's code; the app key when not
set, which is what DingTalk gives an app's robot), ``DINGTALK_API_BASE_URL`` (default
``https://api.dingtalk.com``, only to point the worker at a test's fake). Operators' page: docs/channels/dingtalk.md.

* **Inbound.** A webhook server (``webhook.py``) at the robot's *message receiving address* (HTTP mode):
  ``timestamp`` and ``sign`` checked in constant time, a timestamp more than an hour away refused, and a
  sign taken with one message only (it does not cover the body: another message under it is a forgery;
  the same one sent again, however serialised, is DingTalk's retry); answered
  200 once the message is in the worker's outbox. Messages of type text, richText, picture, file, audio
  (with DingTalk's recognition text as the message's text) and video become ``InboundMessage``s whose
  ``message_id`` is DingTalk's ``msgId``, so a message DingTalk sends again (HTTP mode: it retries a callback
  that got no 200) runs no second turn. A one-to-one chat
  (``conversationType`` "1") is the conversation ``user:<senderStaffId>``; a group ("2", where the robot
  hears only @mentions) is ``group:<conversationId>`` with the leading @mention taken off the text. The
  sender is ``senderStaffId`` (``senderId`` when there is none). Files are downloaded with
  ``POST /v1.0/robot/messageFiles/download`` and stored on the host.
* **Inbound, Stream mode** (``--mode stream``; ``stream.py``): the worker opens a WebSocket to DingTalk's
  gateway (``POST /v1.0/gateway/connections/open`` with the app's Client ID and Secret, then the endpoint
  with its ticket); no public address, no sign. Each robot message (a CALLBACK of
  ``/v1.0/im/bot/messages/get``, the same JSON HTTP mode is POSTed) is recorded as above and then
  acknowledged; DingTalk pushes a robot message once and never again (the acknowledgement is only
  diagnostic), so one that could not be recorded is lost: it is logged at ERROR with its ``msgId`` and the
  worker fails (the supervisor restarts it). Pings are answered; a ``disconnect`` opens the next connection
  before the old one closes; a dropped socket is replaced with backoff; a refused Client ID or Secret
  disables the plugin.
* **Outbound.** The robot OpenAPI, which, unlike a message's ``sessionWebhook``, works at any time:
  ``oToMessages/batchSend`` to the one user of a one-to-one chat, ``groupMessages/send`` to a group, as
  ``sampleMarkdown`` (a title and the text). An answer is split at 5,000 bytes of JSON-escaped UTF-8 a
  message (DingTalk allows a ``msgParam`` of 15,000 bytes: a third of it, on the safe side). DingTalk
  has no idempotency key: each part DingTalk took is written to a sent-parts journal (a SQLite file
  beside the outbox) and a delivery resumed after a crash skips the parts it names; only the one part
  in flight at the crash may be sent twice.
* **Files out.** Each file of an answer is a part of its own after the text: uploaded with the old OAPI's
  ``POST {DINGTALK_OAPI_BASE_URL}/media/upload`` (type ``image``, ``voice`` or ``file``, multipart ``media``),
  then sent as
  ``sampleImageMsg`` (the media id as ``photoURL``), ``sampleAudio`` (with its duration in ms: AMR and WAV) or
  ``sampleFile``. The upload's media id (or why the file is
  not sent) is journaled under its part, so a resend after a crash uploads nothing again. A file the robot
  does not send (its type, over 20 MB, refused by DingTalk) is a note in its place; the rest still goes.
* **Token.** ``POST /v1.0/oauth2/accessToken`` with the app key and secret, kept until shortly before it
  expires, fetched again at once when a call answers ``InvalidAuthentication`` (HTTP 400 at api.dingtalk.com)
  or 401, and the call made once more.
* **Limits.** Throttling (429, a ``Throttling``/``QpsLimit`` code, a user in ``flowControlledStaffIdList``)
  and 5xx are waited out in place (1 s doubling to 30 s) up to ``--max-retry-wait``; then the hub's
  own retries take over.
* **Refusals.** The app key or secret refused, the robot code not the app's, the app lacking the robot's
  send permission, or any other ``Forbidden.AccessDenied.*`` that is no throttle (this host not in the app's
  IP whitelist) raises ``ChannelRefused``: the plugin is disabled with the reason, not restarted. A
  user DingTalk names in ``invalidStaffIdList``, a group send answered ``invalidParameter.robotCode.notExsit``
  / ``.empty`` / ``.coolApp`` (the robot is not in that group), and any other 4xx of a send, fails that
  delivery permanently with DingTalk's reason.
* **Without app credentials** (no ``DINGTALK_APP_KEY``; the secret still verifies the sign): each answer goes
  to the ``sessionWebhook`` of its conversation's newest message (by ``createAt``, from a message recorded
  for the first time; kept in a JSON file beside the outbox)
  while it is valid (about 90 minutes, never trusted past two hours; ``DINGTALK_OAPI_BASE_URL``, default ``https://oapi.dingtalk.com``, is the only
  host the worker posts such a URL to); after that the delivery is dead-lettered with the reason. Files
  are not downloaded, nor sent (a note for each): the message says so in its text.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import mimetypes
import os
import re
import sys
import time
from urllib.parse import parse_qs, quote, urlsplit

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady)
from plugins_app.channel.sdk.audio import amr_seconds, wav_seconds
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.text import split_text, unsent_note
from plugins_app.channel.sdk.webhook import WebhookInbox

from .api import (DEFAULT_API_BASE_URL, DEFAULT_OAPI_BASE_URL, INVALID_TOKEN_CODE, MAX_DOWNLOAD_BYTES, OAPI_TOKEN_STALE,
                  AppRefused, DingTalkApi, DingTalkError, RateLimited, RobotNotInGroup, SessionRefused, Stopped,
                  Unavailable, UploadRefused, UserUnreachable)

KIND = "channel-dingtalk"
DESCRIPTION = "DingTalk (钉钉): an internal app robot's HTTP callback or Stream mode in, the robot OpenAPI out."
ENV_REFS = ("DINGTALK_APP_KEY", "DINGTALK_APP_SECRET")

APP_KEY_ENV, APP_SECRET_ENV = ENV_REFS
ROBOT_CODE_ENV = "DINGTALK_ROBOT_CODE"
BASE_URL_ENV = "DINGTALK_API_BASE_URL"
OAPI_BASE_URL_ENV = "DINGTALK_OAPI_BASE_URL"

#: The most one message's text may measure: bytes of UTF-8 once JSON-escaped, as it sits in ``msgParam``
#: (DingTalk allows 15,000 bytes for the whole ``msgParam``; a third, on the safe side).
TEXT_LIMIT_BYTES = 5000
#: The longest title of a markdown message (what a notification and the chat list show).
TITLE_CHARS = 20
USER_PREFIX, GROUP_PREFIX = "user:", "group:"
#: A message type's attachment kind and content type (a file's type is guessed from its name).
MEDIA = {"picture": ("image", "image/jpeg"), "audio": ("audio", "audio/amr"), "video": ("video", "video/mp4"),
         "file": ("document", "application/octet-stream")}
#: A session webhook this close to its expiry is taken as expired (a send must reach DingTalk before it).
SESSION_MARGIN_MS = 10_000
MB = 1024 * 1024
#: What the robot sends a file as, by its type: an image (``media/upload`` type ``image``, then ``sampleImageMsg``
#: with the media id as ``photoURL``), a voice (type ``voice``, then ``sampleAudio`` with its duration) or a file
#: (type ``file``, then ``sampleFile``). DingTalk's upload limits: an image 20 MB (JPG, PNG, GIF, BMP), a voice
#: 2 MB (AMR, MP3, WAV; the worker reads the duration of AMR and WAV only), a file 20 MB of the types below.
IMAGE_TYPES = {"image/jpeg": "jpg", "image/jpg": "jpg", "image/pjpeg": "jpg", "image/png": "png", "image/gif": "gif",
               "image/bmp": "bmp"}
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "gif", "bmp")
FILE_EXTENSIONS = ("doc", "docx", "xls", "xlsx", "ppt", "pptx", "zip", "pdf", "rar")
VOICE_TYPES = {"audio/amr": "amr", "audio/x-amr": "amr", "voice/amr": "amr", "audio/wav": "wav", "audio/x-wav": "wav",
               "audio/wave": "wav", "audio/vnd.wave": "wav", "audio/mpeg": "mp3", "audio/mp3": "mp3"}
VOICE_EXTENSIONS = ("amr", "wav", "mp3")
UPLOAD_LIMITS = {"image": 20 * MB, "voice": 2 * MB, "file": 20 * MB}
#: ``channel_ref`` of an uploaded file: ``dingtalk:`` and JSON ``[media type, media id, file name]``.
UPLOADED = "dingtalk:"
#: ``channel_ref`` of a file not sent: ``unsent:<why>``; a note is sent in its place.
UNSENT = "unsent:"
#: ``channel_ref`` of a file whose part went out before a crash: nothing to upload.
SENT_REF = "sent"
OAPI_STALE_CODES = {str(code) for code in OAPI_TOKEN_STALE}
_MENTION = re.compile(r"^\s*@\S*\s*")
_MARKUP = re.compile(r"^[\s#>*_`~\-+|]+")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-dingtalk", description=DESCRIPTION)
    p.add_argument("--mode", choices=("http", "stream"), default="http",
                   help="how messages come in: http (DingTalk POSTs them to --bind/--path) or stream (the worker "
                        "opens a WebSocket to DingTalk; no public address)")
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the webhook listens on (port 0: any)")
    p.add_argument("--path", default="/dingtalk/robot", help="the message receiving address's path")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a send waits out throttling and 5xx in place; then the hub's retries take over")
    return p.parse_args(argv)


def ms_to_rfc3339(ms) -> str:
    try:
        moment = _dt.datetime.fromtimestamp(int(ms) / 1000, _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        moment = _dt.datetime.now(_dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def download_ref(base_url: str, download_code: str) -> str:
    """The attachment's URL: where its download URL is asked for (the token is added then, never stored)."""
    return f"{base_url.rstrip('/')}/v1.0/robot/messageFiles/download?downloadCode={quote(download_code, safe='')}"


def url_for_log(url: str) -> str:
    """A URL as a log line may show it: scheme, host and path, never the query (a session webhook's token)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(not a URL)"
    host = parts.netloc.rpartition("@")[2]  # no user info either
    return f"{parts.scheme}://{host}{parts.path}" if parts.scheme else "(not a URL)"


def strip_mention(text: str) -> str:
    """A group message's text without the leading @mention (the robot's name) DingTalk may leave in it."""
    return _MENTION.sub("", text, count=1) if text.lstrip().startswith("@") else text.strip()


def _attachment(base_url: str, mtype: str, content: dict) -> Attachment | None:
    code = content.get("downloadCode") or content.get("pictureDownloadCode")
    if not code or mtype not in MEDIA:
        return None
    kind, ctype = MEDIA[mtype]
    name = str(content.get("fileName") or "") or None
    if name:
        ctype = mimetypes.guess_type(name)[0] or ctype
    return Attachment(kind=kind, content_type=ctype, url=download_ref(base_url, str(code)), filename=name,
                      channel_ref=str(code))


def normalise(message: dict, *, base_url: str = DEFAULT_API_BASE_URL) -> InboundMessage | None:
    """A robot callback's message as an InboundMessage; None for what names no chat or carries nothing."""
    msg_id = str(message.get("msgId") or "")
    mtype = str(message.get("msgtype") or "")
    ctype = str(message.get("conversationType") or "")
    staff = str(message.get("senderStaffId") or "")
    if not msg_id:
        return None
    if ctype == "1":
        if not staff:
            return None  # someone outside the organisation: the robot OpenAPI cannot write back to them
        conversation_id, source_type = USER_PREFIX + staff, "user"
    elif ctype == "2" and message.get("conversationId"):
        conversation_id, source_type = GROUP_PREFIX + str(message["conversationId"]), "group"
    else:
        return None
    content = message.get("content") if isinstance(message.get("content"), dict) else {}
    text, attachments = "", []
    if mtype == "text":
        text = str((message.get("text") or {}).get("content") or "")
    elif mtype == "richText":
        lines = []
        for item in content.get("richText") or []:
            if not isinstance(item, dict):
                continue
            if item.get("text"):
                lines.append(str(item["text"]))
            elif item.get("type") == "picture" or item.get("downloadCode") or item.get("pictureDownloadCode"):
                att = _attachment(base_url, "picture", item)
                if att:
                    attachments.append(att)
        text = "\n".join(lines)
    elif mtype in MEDIA:
        att = _attachment(base_url, mtype, content)
        if att:
            attachments.append(att)
        if mtype == "audio":
            text = str(content.get("recognition") or "")  # what DingTalk heard
    else:
        return None  # interactive cards, links, ...: nothing the agent reads
    text = strip_mention(text) if source_type == "group" else text.strip()
    if not text and not attachments:
        return None
    metadata = {"message_type": mtype, "dingtalk_msg_id": msg_id, "conversation_type": ctype,
                "dingtalk_conversation_id": str(message.get("conversationId") or "")}
    for key, name in (("robotCode", "robot_code"), ("conversationTitle", "conversation_title"),
                      ("sessionWebhook", "session_webhook"), ("sessionWebhookExpiredTime", "session_webhook_expires"),
                      ("senderId", "dingtalk_sender_id"), ("chatbotUserId", "chatbot_user_id")):
        if message.get(key) not in (None, ""):
            metadata[name] = message[key]
    if source_type == "group":
        metadata["is_in_at_list"] = bool(message.get("isInAtList"))
    return InboundMessage(channel="dingtalk", conversation_id=conversation_id, message_id=msg_id,
                          sender_id=staff or str(message.get("senderId") or conversation_id),
                          sender_name=str(message.get("senderNick") or "") or None, source_type=source_type,
                          text=text, attachments=attachments, metadata=metadata,
                          timestamp=ms_to_rfc3339(message.get("createAt")))


def param_len(text: str) -> int:
    """Bytes ``text`` takes inside ``msgParam``: UTF-8, JSON-escaped, as DingTalk counts the parameter."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def message_parts(text: str) -> list[str]:
    """An answer as the texts of the messages that carry it, each within ``TEXT_LIMIT_BYTES``."""
    return split_text(text, TEXT_LIMIT_BYTES, measure=param_len) if text.strip() else []


def title_of(text: str, n: int = 0, total: int = 1) -> str:
    """A markdown message's title: its first line without markup, cut short; numbered when split."""
    first = next((line for line in text.splitlines()
                  if _MARKUP.sub("", line).strip() and not line.lstrip().startswith("```")), "")
    title = _MARKUP.sub("", first).strip()
    title = title if len(title) <= TITLE_CHARS else title[:TITLE_CHARS - 1] + "…"
    title = title or "…"
    return f"{title} ({n + 1}/{total})" if total > 1 else title


def markdown_params(parts: list[str]) -> list[dict]:
    """Each part's ``sampleMarkdown`` parameters."""
    return [{"title": title_of(part, n, len(parts)), "text": part} for n, part in enumerate(parts)]


def extension_of(name: str | None) -> str:
    name = (name or "").rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[1].lower() if "." in name else ""


def upload_plan(content_type: str | None, filename: str | None) -> tuple[str | None, str]:
    """(media type, extension) a file is uploaded as: ``image`` for a JPG, PNG, GIF or BMP (by its type, or its
    name's extension when the type says nothing), ``voice`` for an AMR, WAV or MP3, ``file`` for a name DingTalk's
    file message takes; media type None for what the robot cannot send (a video needs its duration and a cover
    the worker does not have; other files DingTalk's ``sampleFile`` does not take)."""
    mime = (content_type or "").split(";")[0].strip().lower()
    ext = extension_of(filename)
    if mime in IMAGE_TYPES:
        return "image", ext if ext in IMAGE_EXTENSIONS else IMAGE_TYPES[mime]
    if ext in IMAGE_EXTENSIONS and mime in ("", "application/octet-stream", "binary/octet-stream"):
        return "image", ext
    if mime in VOICE_TYPES:
        return "voice", ext if ext in VOICE_EXTENSIONS else VOICE_TYPES[mime]
    if ext in VOICE_EXTENSIONS and mime in ("", "application/octet-stream", "binary/octet-stream"):
        return "voice", ext
    if ext in FILE_EXTENSIONS:
        return "file", ext
    guessed = (mimetypes.guess_extension(mime) or "").lstrip(".") if mime else ""
    if guessed in FILE_EXTENSIONS:
        return "file", guessed
    return None, ext


def note_param(note: str) -> dict:
    return {"title": title_of(note), "text": note}


def stream_refused(exc) -> str:
    """The operator's reason for a stream connection DingTalk refuses (``StreamRefused``), with what to fix."""
    return (f"{exc}: the app's Client ID ({APP_KEY_ENV}) or Client Secret ({APP_SECRET_ENV}) is wrong, the "
            "secret was reset in the developer console")


def refused(exc: DingTalkError) -> str:
    """The operator's reason for an app DingTalk refuses, with what to fix."""
    lowered = exc.code.lower()
    if ("accesstoken" in exc.where.lower() or exc.status == 401 or exc.code == INVALID_TOKEN_CODE
            or exc.code in OAPI_STALE_CODES):
        fix = (f"the app's Client ID ({APP_KEY_ENV}) or Client Secret ({APP_SECRET_ENV}) is wrong, or the secret "
               "was reset in the developer console")
    elif "robotcode" in lowered:
        fix = f"{ROBOT_CODE_ENV} is not this app's robot (the robot's code is on its page in the developer console)"
    elif (lowered.startswith("forbidden.accessdenied") and "permissiondenied" not in lowered) or exc.code == "60020":
        fix = ("DingTalk refuses calls from this host: add its public (outgoing) IP address to the app's IP "
               "whitelist (服务器出口IP, in the developer console under Development configuration > Security "
               "settings), or remove the whitelist")
    else:
        fix = "the app lacks the robot's permission to send messages (企业内机器人发送消息权限, qyapi_robot_sendmsg)"
    return f"{exc}: {fix}"


class DingTalkWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.app_key, self.app_secret = env.get(APP_KEY_ENV, ""), env.get(APP_SECRET_ENV, "")
        self.robot_code = env.get(ROBOT_CODE_ENV) or self.app_key
        self.base_url = (env.get(BASE_URL_ENV) or DEFAULT_API_BASE_URL).rstrip("/")
        self.oapi_base_url = (env.get(OAPI_BASE_URL_ENV) or DEFAULT_OAPI_BASE_URL).rstrip("/")
        #: No app key: no token, so answers go through each message's session webhook while it lasts.
        self.session_mode = not self.app_key
        self.sessions = None
        self.api = DingTalkApi(self.app_key, self.app_secret, self.robot_code, base_url=self.base_url,
                               oapi_base_url=self.oapi_base_url, stopping=self.stopping, max_wait_secs=self.opts.max_retry_wait)
        self.inbox_init()
        self._journal: SentJournal | None = None
        self.server = None
        self.link = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        if self.opts.mode == "stream":
            return self._connect_stream()
        if not self.app_secret:
            raise ChannelRefused(f"{APP_SECRET_ENV} not set (it signs every message DingTalk sends the robot)")
        if self.session_mode:
            from .session import SessionStore
            self.sessions = SessionStore(self.state_path("sessions", "json"))
            self.log.warning("dingtalk: %s is not set: answers go through each message's sessionWebhook while it "
                             "is valid (about 90 minutes), and files are not downloaded", APP_KEY_ENV)
        else:
            try:
                self.api.token()
            except AppRefused as exc:
                raise ChannelRefused(refused(exc)) from exc
            self.log.info("dingtalk: app %s, robot %s via %s", self.app_key, self.robot_code, self.base_url)
        self._journal = SentJournal(self.state_path("sent", "sqlite3"))
        from .webhook import WebhookServer
        self.server = WebhookServer(self.opts.bind, self.opts.path, self.app_secret, self.accept,
                                    seen_path=self.state_path("seen", "log"))
        self.server.start()
        self.log.info("dingtalk: webhook listening on %s", self.server.url)

    def _connect_stream(self) -> None:
        """Stream mode: the gateway's first ticket asked for (a refused Client ID or Secret is found here, before
        anything listens), then the token the robot OpenAPI sends answers with."""
        if not (self.app_key and self.app_secret):
            raise ChannelRefused(f"stream mode needs the app's Client ID ({APP_KEY_ENV}) and Client Secret "
                                 f"({APP_SECRET_ENV}): they open the stream")
        from .stream import StreamLink, StreamRefused
        self.link = StreamLink(self.app_key, self.app_secret, self.accept, self.stopping, base_url=self.base_url,
                               client=self.api.client)
        try:
            self.link.prepare()
            self.api.token()
        except StreamRefused as exc:
            raise ChannelRefused(stream_refused(exc)) from exc
        except AppRefused as exc:
            raise ChannelRefused(refused(exc)) from exc
        self._journal = SentJournal(self.state_path("sent", "sqlite3"))
        self.log.info("dingtalk: app %s, robot %s, stream mode via %s", self.app_key, self.robot_code, self.base_url)

    def listen(self, submit) -> None:
        """HTTP mode: the webhook's threads queue what they record. Stream mode: the stream is read on a thread
        of its own (it records each message, then acknowledges it). Either way this one hands the queue to
        ``WebhookInbox``'s lanes: each chat's messages submitted in order in a thread of that chat's."""
        if self.link is None:
            return super().listen(submit)
        self.listen_beside(submit, self.link, name="dingtalk-stream", refusal=stream_refused)

    # ------------------------------------------------------------------ inbound

    def accept(self, message: dict) -> None:
        """One verified callback message: recorded durably (the outbox), queued for the hub. Returns once the
        record is written, so the webhook may answer DingTalk 200 at once."""
        code = message.get("robotCode")
        if code and str(code) != self.robot_code and not self.session_mode:
            self.log.warning("dingtalk: message %s is for robot %s, but %s is %s: answers will be refused",
                             message.get("msgId"), code, ROBOT_CODE_ENV, self.robot_code)
        msg = normalise(message, base_url=self.base_url)
        if msg is None:
            self.log.info("dingtalk: %s message %s (conversation type %s) carries nothing to answer; skipped",
                          message.get("msgtype"), message.get("msgId"), message.get("conversationType"))
            return
        if self.session_mode:
            if msg.attachments:  # no token, no download: the agent is told what it does not see
                notes = [f"[{a.filename or a.kind} not downloaded: the DingTalk worker has no app credentials "
                         f"({APP_KEY_ENV})]" for a in msg.attachments]
                msg.attachments = []
                msg.text = "\n\n".join([t for t in [msg.text] if t] + notes)
        if not self.inbox_record(msg):
            self.log.info("dingtalk: message %s was taken before (DingTalk sent it again)", msg.message_id)
            return  # (its session webhook is not newer than the one kept)
        if self.session_mode:
            self._remember_session(msg.conversation_id, message)

    def _remember_session(self, conversation_id: str, message: dict) -> None:
        url = str(message.get("sessionWebhook") or "")
        try:
            expires = int(message.get("sessionWebhookExpiredTime") or 0)
        except (TypeError, ValueError):
            expires = 0
        if not url.startswith(f"{self.oapi_base_url}/robot/sendBySession?") or not expires:
            self.log.warning("dingtalk: message %s carries no usable sessionWebhook (%s): it cannot be answered "
                             "without %s", message.get("msgId"), url_for_log(url) if url else "none", APP_KEY_ENV)
            return
        try:
            created = int(message.get("createAt") or 0)
        except (TypeError, ValueError):
            created = 0
        if not self.sessions.remember(conversation_id, url, expires, created):
            self.log.info("dingtalk: message %s is older than the one whose sessionWebhook %s keeps: that one stays",
                          message.get("msgId"), conversation_id)

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        prefix = f"{self.base_url}/v1.0/robot/messageFiles/download?"
        if not (attachment.url or "").startswith(prefix):
            return None
        code = (parse_qs(urlsplit(attachment.url).query).get("downloadCode") or [""])[0]
        if not code:
            return None
        try:
            # never more than the host could take in one media.put, nor the worker's own bound
            data, _ = self.api.download(code, max_bytes=min(MAX_DOWNLOAD_BYTES, self._media_frame_room()))
        except AppRefused as exc:
            self._refusal = refused(exc)  # the listener stops the worker
            raise
        except (Stopped, httpx.TransportError) as exc:  # the network or a stop: the message waits, SDK tries again
            raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
        except (DingTalkError, httpx.HTTPError) as exc:
            self.log.error("dingtalk: gave up downloading a %s (%s: %s): the message goes to the host without the "
                           "file, a note saying so", attachment.kind, type(exc).__name__, exc)
            raise
        return data

    # ------------------------------------------------------------------ outbound

    def put_media(self, media, attachment, delivery) -> str | None:
        """Upload one file of an answer (``POST {oapi}/media/upload``); its part sends the media id next.

        What the upload gave (the media id, or why the file is not sent) is journaled under the file's part the
        moment DingTalk answers, so a delivery resumed after a crash sends the same media id without a second
        upload, and a part already sent is not uploaded at all. A file the robot cannot send (its type, its size,
        the upload refused, or no app key: session webhooks carry no files) becomes a note in its part's place."""
        index = next(i for i, a in enumerate(delivery.attachments) if a is attachment)
        part = len(message_parts(delivery.text)) + index
        if self.session_mode:
            return UNSENT + (f"the DingTalk worker has no app credentials ({APP_KEY_ENV}), and a session webhook "
                             "carries no files")
        if part in self._journal.done(delivery.delivery_id):
            return SENT_REF  # that part went out before a crash: no second upload
        kept = self._journal.ref_of(delivery.delivery_id, part)
        if kept:
            return kept
        ctype = (attachment.content_type or media.content_type or "application/octet-stream").split(";")[0].strip()
        name = attachment.filename or media.filename
        mtype, ext = upload_plan(ctype, name)
        size = len(media.data)
        seconds = (amr_seconds(media.data) or wav_seconds(media.data)) if mtype == "voice" else None
        if mtype is None:
            ref = UNSENT + (f"DingTalk's robot sends images (JPG, PNG, GIF, BMP), voice (AMR, WAV) and files of type "
                            f"{', '.join(FILE_EXTENSIONS)} only, not {ext or ctype}")
        elif mtype == "voice" and not seconds:
            ref = UNSENT + ("DingTalk's voice message needs its duration, which the worker reads from AMR-NB and WAV "
                            f"only, not {ext or ctype}")
        elif size > UPLOAD_LIMITS[mtype]:
            ref = UNSENT + f"it is {size / MB:.1f} MB, over DingTalk's {UPLOAD_LIMITS[mtype] // MB} MB for " + (
                {"image": "an image", "voice": "a voice"}.get(mtype, "a file"))
        else:
            name = name or f"{attachment.kind or mtype}.{ext}"
            if extension_of(name) != ext:
                name = f"{name}.{ext}"
            try:
                media_id = self.api.upload(media.data, mtype, name, ctype)
            except AppRefused as exc:
                self._refusal = refused(exc)
                raise self.refused_failure("DingTalk refused the app's credentials") from exc
            except UploadRefused as exc:
                ref = UNSENT + f"DingTalk refused it (errcode {exc.code}: {exc.message})"
            except (RateLimited, Unavailable, DingTalkError) as exc:
                raise DeliveryFailed(str(exc)) from exc
            except (Stopped, httpx.HTTPError) as exc:
                raise DeliveryFailed(f"media/upload: {type(exc).__name__}: {exc}") from exc
            else:
                ref = UPLOADED + json.dumps([mtype, media_id, name, round((seconds or 0) * 1000)], ensure_ascii=False)
        if ref.startswith(UNSENT):
            self.log.warning("dingtalk: delivery %s: %s", delivery.delivery_id,
                             unsent_note(attachment, ref[len(UNSENT):]))
        self._journal.record_ref(delivery.delivery_id, part, ref)  # before anything else can fail
        return ref

    def steps(self, delivery) -> list[tuple[str, dict, str | None]]:
        """What a delivery sends, in order, as (msgKey, msgParam, the note that stands for it if DingTalk refuses
        it): the answer's markdown parts, then one part per file: the uploaded file, or a note in its place.
        The same delivery gives as many parts whatever its files became, so the journal's numbers hold."""
        steps: list[tuple[str, dict, str | None]] = [("sampleMarkdown", p, None)
                                                     for p in markdown_params(message_parts(delivery.text))]
        for att in delivery.attachments:
            ref = att.channel_ref or ""
            if ref.startswith(UPLOADED):
                mtype, media_id, name, duration_ms = json.loads(ref[len(UPLOADED):])
                if mtype == "image":
                    steps.append(("sampleImageMsg", {"photoURL": media_id}, unsent_note(att, "DingTalk refused it")))
                elif mtype == "voice":
                    steps.append(("sampleAudio", {"mediaId": media_id, "duration": str(duration_ms)},
                                  unsent_note(att, "DingTalk refused it")))
                else:
                    steps.append(("sampleFile", {"mediaId": media_id, "fileName": name,
                                                 "fileType": extension_of(name)}, unsent_note(att, "DingTalk refused it")))
            elif ref.startswith(UNSENT):
                steps.append(("sampleMarkdown", note_param(unsent_note(att, ref[len(UNSENT):])), None))
            elif ref == SENT_REF:
                steps.append(("", {}, None))  # journaled as sent: skipped
            elif att.url:
                steps.append(("sampleMarkdown", note_param(f"[{att.filename or att.kind or 'file'}: {att.url}]"), None))
            else:
                steps.append(("sampleMarkdown", note_param(unsent_note(att, "the host gave no file")), None))
        return steps

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("DingTalk refused the app's credentials")
        if self.session_mode:
            return self._deliver_by_session(delivery)
        target = delivery.conversation_id
        if target.startswith(USER_PREFIX):
            send = self.api.send_to_user
            target = target[len(USER_PREFIX):]
        elif target.startswith(GROUP_PREFIX):
            send = self.api.send_to_group
            target = target[len(GROUP_PREFIX):]
        else:
            raise DeliveryFailed(f"conversation {delivery.conversation_id!r} is no DingTalk chat (user:<staffId> or "
                                 "group:<openConversationId>)", permanent=True)
        steps = self.steps(delivery)
        if not steps:
            raise DeliveryFailed("nothing DingTalk can show: the answer has no text and no file", permanent=True)
        # DingTalk has no idempotency key: a part it took is journaled, and a delivery resumed after a crash
        # (or retried by the hub) skips it. The one part in flight when the worker died is the window left.
        done = self._journal.done(delivery.delivery_id)
        first: str | None = done.get(0) or None
        for n, (msg_key, param, note) in enumerate(steps):
            if n in done or not msg_key:
                continue
            try:
                key = self._send(send, target, msg_key, param)
            except _FileRefused as exc:
                # the file's message refused for itself (its type...): the note goes in its place, as the same part
                self.log.warning("dingtalk: delivery %s: DingTalk refused the %s (%s); sending a note instead",
                                 delivery.delivery_id, msg_key, exc)
                key = self._send(send, target, "sampleMarkdown", note_param(f"{note[:-1]} ({exc.code}: {exc.message})]"))
            self._journal.record(delivery.delivery_id, n, key)  # before anything else can fail
            first = first or key or None
        return first

    def _send(self, send, target: str, msg_key: str, param: dict) -> str:
        try:
            return send(target, msg_key, param)
        except AppRefused as exc:
            self._refusal = refused(exc)
            raise self.refused_failure("DingTalk refused the app's credentials") from exc
        except UserUnreachable as exc:
            raise DeliveryFailed(f"{exc} (the user is not in the organisation, or not in the robot's visible "
                                 "range)", permanent=True) from exc
        except RobotNotInGroup as exc:
            # one group the robot was removed from (or never in): that group's answers fail, nothing else
            raise DeliveryFailed(f"{exc} (the robot is not in this group: removed from it, or the group "
                                 f"disbanded; or {ROBOT_CODE_ENV} is not the app's robot)", permanent=True) from exc
        except (RateLimited, Unavailable) as exc:
            raise DeliveryFailed(str(exc)) from exc
        except DingTalkError as exc:
            if msg_key != "sampleMarkdown" and exc.status == 400:
                raise _FileRefused(exc.where, exc.status, exc.code, exc.message) from exc
            # a 4xx for this message (a bad chat id, a robot not in the group...): sending again cannot help
            raise DeliveryFailed(str(exc), permanent=400 <= exc.status < 500) from exc
        except (Stopped, httpx.HTTPError) as exc:
            raise DeliveryFailed(f"send: {type(exc).__name__}: {exc}") from exc

    def _deliver_by_session(self, delivery) -> str | None:
        """Without app credentials: each part POSTed to the conversation's newest session webhook while it lasts
        (a file's part is the note that it was not sent: a session webhook carries no files)."""
        params = [param for msg_key, param, _ in self.steps(delivery) if msg_key == "sampleMarkdown"]
        if not params:
            raise DeliveryFailed("nothing DingTalk can show: the answer has no text and no file", permanent=True)
        session = self.sessions.get(delivery.conversation_id)
        if session is None:
            raise DeliveryFailed(f"no sessionWebhook is known for {delivery.conversation_id}, and without "
                                 f"{APP_KEY_ENV} the robot cannot write first", permanent=True)
        url, expires = session
        done = self._journal.done(delivery.delivery_id)
        for n, param in enumerate(params):
            if n in done:
                continue
            if time.time() * 1000 >= expires - SESSION_MARGIN_MS:
                raise DeliveryFailed(f"the sessionWebhook of {delivery.conversation_id} expired at "
                                     f"{ms_to_rfc3339(expires)}; set {APP_KEY_ENV} to answer after it", permanent=True)
            try:
                self.api.send_by_session(url, param)
            except SessionRefused as exc:
                raise DeliveryFailed(str(exc), permanent=True) from exc
            except (RateLimited, Unavailable) as exc:
                raise DeliveryFailed(str(exc)) from exc
            except DingTalkError as exc:
                raise DeliveryFailed(str(exc), permanent=400 <= exc.status < 500) from exc
            except (Stopped, httpx.HTTPError) as exc:
                raise DeliveryFailed(f"sessionWebhook: {type(exc).__name__}: {exc}") from exc
            self._journal.record(delivery.delivery_id, n, "")  # a session webhook names no message id
        return None

    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): every part of the answer (its text's, one per file) is in the journal."""
        count = len(message_parts(delivery.text)) + len(delivery.attachments)
        return bool(count) and len(self._journal.done(delivery.delivery_id)) >= count

    def disconnect(self) -> None:
        conn = self.link.conn if self.link is not None else None  # once: the link's thread may clear it
        if conn is not None:
            conn.close()
        if self.server is not None:
            self.server.stop()
        self.api.close()
        if self._journal is not None:
            self._journal.close()


class _FileRefused(DingTalkError):
    """A file's message (``sampleImageMsg``, ``sampleFile``) refused with a 400 of its own: a note goes instead."""


def main(argv: list[str] | None = None) -> None:
    DingTalkWorker.main(argv=argv)
