"""The WeChat worker: a OneBot 12 bridge's forward WebSocket in, its ``send_message`` action out.

docs/channels/wechat.md is the operator's page; ``onebot`` is the wire, ``events`` the reading of a message.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import mimetypes
import os
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady, MessageValidationError)
from plugins_app.channel.sdk.download import download
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.text import split_text
from plugins_app.channel.sdk.webhook import WebhookInbox

from .events import GROUP_POLICIES, file_id_of, normalise, self_id_of, target_of
from .onebot import ActionFailed, AnswerLost, BridgeAway, OneBotLink

KIND = "channel-wechat"
DESCRIPTION = "WeChat (a personal account): a OneBot 12 bridge's forward WebSocket (WECHAT_ONEBOT_URL)."
URL_ENV, TOKEN_ENV = "WECHAT_ONEBOT_URL", "WECHAT_ONEBOT_ACCESS_TOKEN"
ENV_REFS = (URL_ENV, TOKEN_ENV)
#: Characters a text message holds at most. WeChat documents no limit for a personal account's message; 2,000
#: keeps an answer readable on a phone and well inside what the PC client takes.
TEXT_LIMIT = 2000
#: Bridges known to send the other segments of a message and answer ``failed`` for a ``reply`` segment they
#: cannot send (ComWeChatBotClient: each segment is its own WeChat message, and a quote cannot be sent): a
#: failure there would send the answer again on the retry. ``--reply-segment auto`` sends none to them.
NO_REPLY_IMPLS = frozenset({"comwechat"})
GET_FILE_TIMEOUT_SECS = 15.0
#: ``get_file`` parameters a bridge may not support (10003 bad, 10004 unsupported): then the bytes are asked for
#: in the answer itself (``type: data``).
UNSUPPORTED_PARAM = (10003, 10004)
#: The largest file sent: ``upload_file`` carries it base64 in one frame, and a bridge's WebSocket server takes
#: a frame of some 16 MiB at most (uvicorn's default, ComWeChatBotClient's): a larger frame closes the connection.
UPLOAD_MAX_BYTES = 11 * 2 ** 20
#: Hosts a bridge may put in the file URLs it hands out when it listens on every address (or on loopback): the
#: worker reaches them at the host of WECHAT_ONEBOT_URL instead.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "127.0.0.1", "localhost", "::1"})
RECORD_TRIES = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=KIND, description=DESCRIPTION)
    p.add_argument("--url", default=None, help=f"the bridge's ws:// or wss:// URL (default: ${URL_ENV})")
    p.add_argument("--groups", choices=GROUP_POLICIES, default="mention",
                   help="group messages answered: those mentioning the account (default), all, or none")
    p.add_argument("--reply-segment", choices=("auto", "on", "off"), default="auto",
                   help="quote the message answered (a reply segment); auto: not to bridges that cannot send one")
    p.add_argument("--max-chars", type=int, default=TEXT_LIMIT, help="characters in one message at most")
    p.add_argument("--action-timeout", type=float, default=30.0, help="seconds an action's answer is waited for")
    p.add_argument("--max-retry-wait", type=float, default=60.0,
                   help="seconds a send waits for the bridge to be connected before it goes back to the hub")
    return p.parse_args(argv)


class WeChatWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("media",)

    def __init__(self, *, options: argparse.Namespace | None = None, url: str | None = None,
                 access_token: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.opts = options or parse_args([])
        self.url = url or self.opts.url or os.environ.get(URL_ENV, "")
        self.access_token = access_token if access_token is not None else os.environ.get(TOKEN_ENV, "")
        self.link: OneBotLink | None = None
        self.self_id: str | None = None  # the account the bridge is logged in as (its events' ``self``)
        self._journal: SentJournal | None = None
        self.inbox_init()

    # ------------------------------------------------------------------ connect / listen

    def connect(self) -> None:
        if not self.url:
            raise ChannelRefused(f"{URL_ENV} is not set (the OneBot 12 bridge's ws:// address)")
        if not self.url.startswith(("ws://", "wss://")):
            raise ChannelRefused(f"{URL_ENV} must be a ws:// or wss:// URL (the bridge's forward WebSocket), "
                                 f"not {self.url[:60]!r}")
        if self.opts.max_chars < 16:
            raise ChannelRefused(f"--max-chars {self.opts.max_chars}: at least 16")
        self.link = OneBotLink(self.url, self.access_token, self.on_event, self.stopping)
        self._journal = SentJournal(self.state_path("sent", "sqlite3"))
        self.log.info("wechat: OneBot 12 bridge at %s, group messages: %s", self.url, self.opts.groups)

    def disconnect(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def listen(self, submit) -> None:
        """The link is read on a thread of its own (each message recorded in the outbox there); here each chat's
        messages go to the hub on a lane of that chat's (``WebhookInbox``)."""
        self.listen_beside(submit, self.link, name="wechat-onebot")

    def stats(self) -> dict:
        link = self.link
        return {**super().stats(), "onebot": {"connections": link.connections_opened if link else 0,
                                              "impl": link.impl if link else None, "self_id": self.self_id}}

    # ------------------------------------------------------------------ inbound

    def on_event(self, event: dict) -> None:
        """One event from the bridge, on the link's thread: a message is recorded (the outbox) and queued for
        the lanes before the next frame is read."""
        kind, detail = event.get("type"), event.get("detail_type")
        if kind == "meta":
            if detail == "status_update":
                self._status(event.get("status"))
            return
        me = self_id_of(event)
        if me and me != self.self_id:
            self.self_id = me
        if kind != "message":
            self.log.debug("wechat: %s.%s event, not a message", kind, detail)
            return
        try:
            message = normalise(event, groups=self.opts.groups, self_id=self.self_id)
            if message is not None:
                message.validate()
        except MessageValidationError as exc:
            self.log.error("wechat: message %s skipped: %s", event.get("message_id"), exc)
            return
        except Exception:  # noqa: BLE001 - one malformed event must not end the link
            self.log.exception("wechat: could not read event %s; skipped", event.get("id"))
            return
        if message is None:
            self.log.debug("wechat: %s message %s not for the agent", detail, event.get("message_id"))
            return
        self._record(message)

    def _record(self, message: InboundMessage) -> None:
        """Write ``message`` in the outbox and queue it; tried again in place a few times (a database locked for a
        moment): OneBot never pushes an event again, so one that cannot be written is lost, and logged so."""
        delay = 0.2
        for attempt in range(1, RECORD_TRIES + 1):
            try:
                if not self.inbox_record(message):
                    self.log.info("wechat: message %s: duplicate (taken before)", message.message_id)
                return
            except Exception as exc:  # noqa: BLE001
                if attempt == RECORD_TRIES or self.stopping.wait(delay):
                    self.log.error("wechat: could not record message %s (%s) in %d tries: %s: %s; the bridge does "
                                   "not send it again: it is LOST", message.message_id, message.conversation_id,
                                   attempt, type(exc).__name__, exc)
                    return
                delay *= 2

    def _status(self, status) -> None:
        bots = status.get("bots") if isinstance(status, dict) and isinstance(status.get("bots"), list) else []
        for bot in bots:
            me = bot.get("self") if isinstance(bot, dict) and isinstance(bot.get("self"), dict) else {}
            if me.get("user_id"):
                self.self_id = str(me["user_id"])
                if bot.get("online") is False:
                    self.log.warning("wechat: the bridge says account %s is offline (logged out of WeChat?)",
                                     self.self_id)
                else:
                    self.log.info("wechat: account %s online on the bridge", self.self_id)
        if len(bots) > 1:
            self.log.warning("wechat: the bridge serves %d accounts; this worker answers as whichever the bridge "
                             "picks (run one account per bridge)", len(bots))

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        """The bytes of a file the message named: ``get_file`` with ``type: url`` and a download of that URL (the
        bridge's own file server: ComWeChatBotClient cannot put a binary file in a JSON answer), or, from a bridge
        that has no URLs to give, ``type: data`` (base64 in the answer). The bridge away, slow, or failing for
        now: ``MediaNotReady`` (the message waits, its chat only); an answer that will not change: an error (the
        message goes on with a note). The content type follows the file's name where the bridge gives one."""
        file_id = file_id_of(attachment.url)
        if file_id is None:
            return None
        try:
            data = self._get_file(file_id, "url")
        except ActionFailed as exc:
            if exc.retcode not in UNSUPPORTED_PARAM:
                raise self._file_failure(exc) from None
            try:
                data = self._get_file(file_id, "data")
            except ActionFailed as again:
                raise self._file_failure(again) from None
        if not isinstance(data, dict):
            raise RuntimeError("the bridge's get_file answer carries no file")
        name = str(data.get("name") or "")
        named = (mimetypes.guess_type(name)[0] or "").lower()
        if named:  # (a bridge's segment type is no sure guide: ComWeChatBotClient sends a voice note as "image")
            attachment.content_type = named
        if name and not attachment.filename:
            attachment.filename = name
        if isinstance(data.get("url"), str) and data["url"]:
            headers = data.get("headers") if isinstance(data.get("headers"), dict) else None
            response = download(self.reachable(data["url"]),
                                headers={str(k): str(v) for k, v in (headers or {}).items()})
            if response.status_code != 200:
                raise RuntimeError(f"the bridge's file URL answered HTTP {response.status_code}")
            return response.content
        raw = data.get("data")
        if isinstance(raw, str):
            try:
                return base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise RuntimeError("the bridge's get_file data is not base64") from None
        if isinstance(raw, (bytes, bytearray)):
            return bytes(raw)
        raise RuntimeError("the bridge's get_file answer carries no url and no data")

    def _get_file(self, file_id: str, kind: str):
        try:
            return self.link.actions.call("get_file", {"file_id": file_id, "type": kind},
                                          timeout=GET_FILE_TIMEOUT_SECS)
        except (BridgeAway, AnswerLost, TimeoutError) as exc:
            raise MediaNotReady(str(exc)) from None

    @staticmethod
    def _file_failure(exc: ActionFailed) -> Exception:
        if exc.refuses_account:
            return ChannelRefused(account_refused(exc))
        said = f"the bridge answered get_file: retcode {exc.retcode}: {exc.message}"
        return RuntimeError(said) if exc.file_gone else MediaNotReady(said)

    def reachable(self, url: str) -> str:
        """A file URL the bridge gave, with its host replaced by WECHAT_ONEBOT_URL's when it names every address
        or loopback (a bridge builds its URLs from the address it listens on)."""
        parts = urlsplit(url)
        bridge = urlsplit(self.url).hostname
        if parts.hostname in WILDCARD_HOSTS and bridge and parts.hostname != bridge:
            host = f"[{bridge}]" if ":" in bridge else bridge
            netloc = host + (f":{parts.port}" if parts.port else "")
            return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
        return url

    # ------------------------------------------------------------------ outbound

    def deliver(self, delivery) -> str | None:
        """Each part its own ``send_message``: the text split at ``--max-chars``, then each file (``upload_file``,
        then an ``image`` or ``file`` segment). The bridge has no idempotency key: each part it took is journaled,
        and a resend of the delivery (a crash, the hub's retry) sends only the parts not in the journal."""
        target = target_of(delivery.conversation_id)
        text = delivery.text or ""
        parts: list[dict] = [{"text": t} for t in (split_text(text, self.opts.max_chars) if text.strip() else [])]
        parts += [{"file": att} for att in delivery.attachments if att.media_id]
        if not parts:
            raise DeliveryFailed("wechat: nothing to send (no text, no files)", permanent=True)
        done = self._journal.done(delivery.delivery_id)
        first_id = None
        for number, part in enumerate(parts):
            if number in done:
                first_id = first_id or done[number] or None
                continue
            if "text" in part:
                segments = [{"type": "text", "data": {"text": part["text"]}}]
            else:
                segments = [self._file_segment(delivery, number, part["file"])]
            if number == 0 and delivery.reply_to_message_id and self._quotes():
                segments.insert(0, {"type": "reply", "data": {"message_id": delivery.reply_to_message_id}})
            sent_id = self._send(target, segments)
            self._journal.record(delivery.delivery_id, number, sent_id)
            first_id = first_id or sent_id or None
        return first_id

    def _quotes(self) -> bool:
        choice = self.opts.reply_segment
        impl = (self.link.impl or "").lower() if self.link else ""
        # (auto: only once the bridge said what it is, in meta.connect: a send racing the first connection's
        # greeting goes without the quote rather than with one the bridge may fail after sending the text)
        return choice == "on" or (choice == "auto" and bool(impl) and impl not in NO_REPLY_IMPLS)

    def _file_segment(self, delivery, number: int, att: Attachment) -> dict:
        """The segment of one file: uploaded once (the bridge's ``file_id`` journaled under its part)."""
        file_id = self._journal.ref_of(delivery.delivery_id, number)
        if file_id is None:
            media = self.media_get(att.media_id)
            name = att.filename or media.filename or "file"
            if len(media.data) > UPLOAD_MAX_BYTES:
                return {"type": "text", "data": {"text": f"[{name}: not sent, {len(media.data) // 2 ** 20} MiB is "
                                                         f"more than the {UPLOAD_MAX_BYTES // 2 ** 20} MiB a file "
                                                         "may have here]"}}
            answer = self._act("upload_file", {"type": "data", "name": name,
                                                "data": base64.b64encode(media.data).decode()})
            file_id = str(answer.get("file_id") or "") if isinstance(answer, dict) else ""
            if not file_id:
                raise DeliveryFailed("wechat: the bridge's upload_file answer named no file_id")
            self._journal.record_ref(delivery.delivery_id, number, file_id)
        kind = "image" if (att.content_type or "").startswith("image/") else "file"
        return {"type": kind, "data": {"file_id": file_id}}

    def _send(self, target: dict, segments: list[dict]) -> str:
        data = self._act("send_message", {**target, "message": segments})
        # the standard answers {"message_id", "time"}; ComWeChatBotClient answers true or null
        return str(data.get("message_id") or "") if isinstance(data, dict) else ""

    def _act(self, action: str, params: dict):
        """One action for a delivery, its failures as the hub's: the bridge away before the action went out (after
        waiting for it up to ``--max-retry-wait``), no answer or the connection lost before it, or a passing
        failure is retryable; a request error, the platform's
        refusal or an impossible action is dead-lettered; an account the bridge cannot name stops the worker."""
        link = self.link
        deadline = time.monotonic() + max(0.0, self.opts.max_retry_wait)
        while True:
            try:
                return link.actions.call(action, params, timeout=self.opts.action_timeout)
            except BridgeAway as exc:
                if self.stopping.is_set() or self._refusal or time.monotonic() >= deadline:
                    raise DeliveryFailed(f"wechat: {exc}") from None
                self.stopping.wait(0.5)  # the link reconnects meanwhile
            except (TimeoutError, AnswerLost) as exc:
                # the one part whose fate is unknown: the hub's retry sends it again (the journal's window)
                raise DeliveryFailed(f"wechat: {exc} (it may have been sent)") from None
            except ActionFailed as exc:
                if exc.refuses_account:
                    self._refusal = account_refused(exc)
                    raise self.refused_failure(f"wechat: {exc}") from None
                raise DeliveryFailed(f"wechat: {exc}", permanent=exc.final) from None


def account_refused(exc: ActionFailed) -> str:
    return (f"the OneBot bridge cannot tell which account to act as ({exc.action}: retcode {exc.retcode}: "
            f"{exc.message or 'no message'}): point the worker at a bridge of one logged-in WeChat account")


def main() -> None:
    WeChatWorker.main(options=parse_args(sys.argv[1:]))
