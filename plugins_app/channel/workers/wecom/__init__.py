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
  Events (``MsgType`` event: entering the app, menu clicks, ...) are not messages.
* **Outbound.** ``POST /cgi-bin/message/send`` with WeCom's duplicate check on
  (``enable_duplicate_check``, 1,800 s): a send repeated after a crash, with the same content to
  the same user, is not shown twice. Text is split at WeCom's 2,048 bytes of UTF-8.
* **Token.** ``gettoken`` with the corp id and the app's secret, kept until shortly before it
  expires, fetched again at once when a call says it is stale (40014, 42001, 40001), and the call
  made once more.
* **Limits.** 45009/45033 are waited out in place (1 s doubling to 30 s) up to ``--max-retry-wait``;
  then the hub's own retries take over.
* **Refusals.** The corp id, the secret or the server's IP refused (gettoken's 40001, 40013, 40091,
  41004; 60020 anywhere) raises ``ChannelRefused``: the plugin is disabled with the reason, not
  restarted. A user not found or not in the app's visible range (81013, 60111) fails that
  delivery permanently with WeCom's reason.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import mimetypes
import os
import sys
from urllib.parse import quote, unquote

import httpx

from plugins_app.channel.sdk import Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage
from plugins_app.channel.sdk.webhook import WebhookInbox
from plugins_app.channel.sdk.text import split_text

from .api import (DEFAULT_API_BASE_URL, TEXT_LIMIT_BYTES, AppRefused, RateLimited, Stopped, UserUnreachable,
                  WeComApi, WeComError)
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt

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
#: How long a send refused for the app's settings waits for the worker to stop (the listener stops it at once).
REFUSAL_HOLD_SECS = 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-wecom", description=DESCRIPTION)
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the callback listens on (port 0: any)")
    p.add_argument("--path", default="/wecom/callback", help="the callback URL's path")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a send waits out 45009/45033 in place; then the hub's retries take over")
    return p.parse_args(argv)


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


def to_rfc3339(seconds) -> str:
    try:
        moment = _dt.datetime.fromtimestamp(int(seconds), _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        moment = _dt.datetime.now(_dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def media_url(base_url: str, media_id: str) -> str:
    """Where a media file is downloaded from (the access token is added at download, never stored)."""
    return f"{base_url.rstrip('/')}/cgi-bin/media/get?media_id={quote(media_id, safe='')}"


def normalise(message: dict, *, agent_id: str | None = None,
              base_url: str = DEFAULT_API_BASE_URL) -> InboundMessage | None:
    """A decrypted callback message as an InboundMessage; None for events and what the agent cannot read."""
    mtype = str(message.get("MsgType") or "")
    user = str(message.get("FromUserName") or "")
    msg_id = str(message.get("MsgId") or "")
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
                          timestamp=to_rfc3339(message.get("CreateTime")))


class WeComWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments")

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

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        missing = [name for name, value in self.settings.items() if not value]
        if missing:
            raise ChannelRefused(f"{', '.join(missing)} not set")
        if not str(self.agent_id).isdigit():
            raise ChannelRefused(f"{AGENT_ID_ENV} must be the app's AgentId, a number (it is {self.agent_id!r})")
        try:
            crypto = MsgCrypt(self.settings[TOKEN_ENV], self.settings[AES_KEY_ENV], self.corp_id)
        except CryptoError as exc:
            raise ChannelRefused(f"{AES_KEY_ENV}: {exc}") from exc
        try:
            self.api.token()
        except AppRefused as exc:
            raise ChannelRefused(refused(exc)) from exc
        self.log.info("wecom: corp %s, agent %s via %s", self.corp_id, self.agent_id, self.base_url)
        from .callback import CallbackServer
        self.server = CallbackServer(self.opts.bind, self.opts.path, crypto, self.accept)
        self.server.start()
        self.log.info("wecom: callback listening on %s", self.server.url)

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
        msg = normalise(message, agent_id=self.agent_id, base_url=self.base_url)
        if msg is None:
            self.log.debug("wecom: %s %s is not a message; skipped", message.get("MsgType"), message.get("Event"))
            return
        if not self.inbox_record(msg):
            self.log.info("wecom: message %s was taken before (WeCom called again)", msg.message_id)

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        prefix = f"{self.base_url}/cgi-bin/media/get?media_id="
        if not (attachment.url or "").startswith(prefix):
            return None
        try:
            data, _, _ = self.api.media(unquote(attachment.url[len(prefix):]))
        except AppRefused as exc:
            self._refusal = refused(exc)  # the listener stops the worker
            raise
        return data

    # ------------------------------------------------------------------ outbound

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self._refused_failure()
        parts = message_parts(delivery.text)
        if not parts:
            raise DeliveryFailed("nothing WeCom can show: the answer has no text (files are not sent to WeCom)",
                                 permanent=True)
        first: str | None = None
        for part in parts:
            try:
                answer = self.api.send_text(delivery.conversation_id, part)
            except AppRefused as exc:
                self._refusal = refused(exc)
                raise self._refused_failure() from exc
            except UserUnreachable as exc:
                raise DeliveryFailed(f"{exc} (the user does not exist or is not in the app's visible range)",
                                     permanent=True) from exc
            except RateLimited as exc:
                raise DeliveryFailed(str(exc)) from exc
            except WeComError as exc:
                # -1 (system busy) and the rest: worth the hub's retries; a content WeCom refuses is not
                raise DeliveryFailed(str(exc), permanent=exc.errcode in CONTENT_REFUSED) from exc
            except (Stopped, httpx.HTTPError) as exc:
                raise DeliveryFailed(f"message/send: {type(exc).__name__}: {exc}") from exc
            if first is None:
                first = str(answer.get("msgid") or "") or None
        return first

    def _refused_failure(self) -> DeliveryFailed:
        """A send WeCom refused for the app's settings: held until the listener has stopped the worker, so
        the host does not spend the delivery's retries meanwhile; the delivery stays retryable."""
        self.stopping.wait(REFUSAL_HOLD_SECS)
        return DeliveryFailed(self._refusal or "WeCom refused the app's credentials")

    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.api.close()


def main(argv: list[str] | None = None) -> None:
    # httpx logs each request at INFO, the access token in its URL among them: keep it out of the log
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    WeComWorker.main(argv=argv)
