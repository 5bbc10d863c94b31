"""The channel-whatsapp worker: Meta's signed webhook in, ``POST /{phone-number-id}/messages`` out (see the package)."""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady, ReplyContext)
from plugins_app.channel.sdk.download import says_later
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.outbox import outbox_path_for
from plugins_app.channel.sdk.webhook import WebhookInbox

from . import KIND
from .api import ACCOUNT_CODES, DEFAULT_BASE_URL, REENGAGEMENT, UNDELIVERABLE, GraphApi, GraphError, RateLimited, Stopped, classify
from .formatting import message_parts
from .interactive import interactive_message, pressed

TOKEN_ENV = "WHATSAPP_ACCESS_TOKEN"
SECRET_ENV = "WHATSAPP_APP_SECRET"
VERIFY_ENV = "WHATSAPP_VERIFY_TOKEN"
PHONE_ENV = "WHATSAPP_PHONE_NUMBER_ID"
BASE_URL_ENV = "WHATSAPP_API_BASE_URL"
MEDIA_URL_PREFIX = "wa-media:"
MEDIA_TYPES = ("image", "audio", "video", "document", "sticker")
REVOKED = ("the access token (WHATSAPP_ACCESS_TOKEN) was refused: {err}; make a new system-user token "
           "with whatsapp_business_messaging")
REFUSED_ACCOUNT = "Meta refused to send for this WhatsApp account or number: {err}; {fix}"
#: What ``classify`` calls an error only the operator can fix: the plugin is disabled with the reason.
REFUSALS = ("auth", "account")


def refusal_reason(err: GraphError) -> str:
    """The plugin's disabled reason for an error ``classify`` calls ``auth`` or ``account``."""
    if classify(err) == "account":
        return REFUSED_ACCOUNT.format(err=err, fix=ACCOUNT_CODES[err.code])
    return REVOKED.format(err=err)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-whatsapp")
    p.add_argument("--bind", default="127.0.0.1:3000", help="host:port the webhook listens on (port 0: any)")
    p.add_argument("--path", default="/whatsapp/webhook", help="the callback URL's path")
    p.add_argument("--max-retry-wait", type=float, default=60.0,
                   help="the longest a rate-limited send waits in place; then the hub's own retries take over")
    return p.parse_args(argv)


def attachment_kind(wa_type: str) -> str:
    return {"image": "image", "sticker": "image", "audio": "audio", "video": "video"}.get(wa_type, "document")


def ts_to_rfc3339(ts) -> str | None:
    try:
        moment = _dt.datetime.fromtimestamp(int(str(ts)), _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


#: What WhatsApp shows as an image, audio or video (the types Meta's /media takes for each).
MEDIA_MESSAGE_TYPES = {"image": ("image/jpeg", "image/png"),
                       "audio": ("audio/aac", "audio/amr", "audio/mpeg", "audio/mp4", "audio/ogg"),
                       "video": ("video/mp4", "video/3gpp")}
#: The types a document message takes (and /media accepts): plain text, PDF, MS Office and OpenOffice.
DOCUMENT_TYPES = frozenset({
    "text/plain", "application/pdf",
    "application/msword", "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "application/vnd.ms-excel", "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    "application/vnd.ms-powerpoint", "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    "application/vnd.oasis.opendocument.text", "application/vnd.oasis.opendocument.spreadsheet",
    "application/vnd.oasis.opendocument.presentation",
})
#: ``channel_ref`` of a file WhatsApp will not take: its step sends a note naming it instead.
UNSENDABLE = "unsendable"
#: Codes with which Meta refuses an interactive message for what it is (an invalid parameter, one missing, a
#: value not valid, a message type this number or app version does not take): the question then goes as its
#: numbered text, which a typed reply answers, instead of dead-lettering unseen.
INTERACTIVE_REFUSED = frozenset({100, 131008, 131009, 131051})


def mime_of(att: Attachment) -> str:
    return (att.content_type or "").split(";")[0].strip().lower()


def message_type(att: Attachment) -> str | None:
    """The message type a file goes as: its own kind's when WhatsApp takes its type, else a document when
    documents take it, else another kind that takes it; None when no WhatsApp message can carry it."""
    mime = mime_of(att)
    if mime in MEDIA_MESSAGE_TYPES.get(att.kind, ()):
        return att.kind
    if mime in DOCUMENT_TYPES:
        return "document"
    return next((kind for kind, types in MEDIA_MESSAGE_TYPES.items() if mime in types), None)


def unsent_note(att: Attachment, why: str | None = None) -> str:
    """The text sent in place of a file WhatsApp will not take, so the user knows it exists."""
    name = att.filename or f"a {att.kind or 'file'}"
    why = why or f"WhatsApp does not take {mime_of(att) or 'untyped'} files"
    return f"[{name} could not be sent: {why}]"


def media_message(att: Attachment) -> dict:
    """The type and media object of a message carrying one file: an uploaded media id, or a public link.

    Only for a file ``message_type`` finds a type for."""
    wa_type = message_type(att) or "document"
    media = {"id": att.channel_ref} if att.channel_ref else {"link": att.url}
    if wa_type == "document" and att.filename:
        media["filename"] = att.filename
    return {"type": wa_type, wa_type: media}


class WhatsAppWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "markdown", "attachments", "reply", "options")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.access_token = env.get(TOKEN_ENV, "")
        self.app_secret = env.get(SECRET_ENV, "")
        self.verify_token = env.get(VERIFY_ENV, "")
        self.phone_number_id = env.get(PHONE_ENV, "")
        self.base_url = env.get(BASE_URL_ENV) or DEFAULT_BASE_URL
        self.api: GraphApi | None = None
        self.server = None
        self._journal: SentJournal | None = None
        self.inbox_init()
        self._unsendable: dict[tuple[str, int], str] = {}  # (delivery, file) -> why Meta refused its upload

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        for name, value in ((TOKEN_ENV, self.access_token), (SECRET_ENV, self.app_secret),
                            (VERIFY_ENV, self.verify_token), (PHONE_ENV, self.phone_number_id)):
            if not value:
                raise ChannelRefused(f"{name} is not set (add it to the plugin's env_refs or secrets)")
        self.api = GraphApi(self.access_token, self.phone_number_id, base_url=self.base_url, stopping=self.stopping,
                            max_wait_secs=self.opts.max_retry_wait)
        try:
            number = self.api.phone_number()  # a dead token is known before the webhook listens
        except GraphError as err:
            if classify(err) in REFUSALS:
                raise ChannelRefused(refusal_reason(err)) from err
            raise RuntimeError(f"GET /{self.phone_number_id} failed: {err}") from err
        journal_path = str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.", ".whatsapp-sent.")
        self._journal = SentJournal(journal_path)
        from .webhook import WebhookServer
        self.server = WebhookServer(self.opts.bind, self.opts.path, app_secret=self.app_secret,
                                    verify_token=self.verify_token, on_payload=self.accept)
        self.server.start()
        self.log.info("whatsapp: number %s (%s, id %s); webhook listening on %s",
                      number.get("display_phone_number"), number.get("verified_name"), self.phone_number_id,
                      self.server.url)

    # ------------------------------------------------------------------ inbound

    def accept(self, payload: dict) -> None:
        """One webhook notification: record the messages it carries durably (the outbox) and queue them.

        Returns once they are written, so the webhook may answer Meta 200."""
        if payload.get("object") != "whatsapp_business_account":
            self.log.info("ignored a notification for object %r", payload.get("object"))
            return
        for msg in self.normalise(payload):
            if not self.inbox_record(msg):
                self.log.info("message %s was already taken; Meta sent it again", msg.message_id)

    def normalise(self, payload: dict) -> list[InboundMessage]:
        """The people's messages in a notification, for this phone number; statuses are logged, not messages."""
        out: list[InboundMessage] = []
        for entry in payload.get("entry") or []:
            for change in (entry or {}).get("changes") or []:
                value = (change or {}).get("value") or {}
                if change.get("field") != "messages" or not isinstance(value, dict):
                    continue
                metadata = value.get("metadata") or {}
                if str(metadata.get("phone_number_id") or "") != self.phone_number_id:
                    self.log.info("ignored a notification for phone number id %r (this worker's is %s)",
                                  metadata.get("phone_number_id"), self.phone_number_id)
                    continue
                for status in value.get("statuses") or []:
                    self._log_status(status)
                names = {c.get("wa_id"): (c.get("profile") or {}).get("name")
                         for c in value.get("contacts") or [] if isinstance(c, dict)}
                for message in value.get("messages") or []:
                    msg = self._message(message, names, entry.get("id"), metadata)
                    if msg is not None:
                        out.append(msg)
        return out

    def _log_status(self, status: dict) -> None:
        """A ``failed`` status: Meta took a send (200, a wamid) and only later says it did not reach the user.

        The delivery was acked delivered at the 200 and is not sent again; a closed 24-hour window
        (131047) or an undeliverable message (131026) reported this way is logged as an error naming the
        delivery (the sent journal maps the wamid to it), so the operator can see which answer was lost."""
        if status.get("status") != "failed":
            return
        errors = status.get("errors") or []
        reasons = "; ".join(f"{e.get('code')}: {e.get('title') or e.get('message')}"
                            + (f" ({e['error_data']['details']})" if isinstance(e.get("error_data"), dict)
                               and e["error_data"].get("details") else "")
                            for e in errors if isinstance(e, dict)) or "no reason given"
        wamid = str(status.get("id") or "")
        sent = self._journal.delivery_of(wamid) if self._journal is not None and wamid else None
        where = f" (delivery {sent[0]}, part {sent[1] + 1})" if sent else ""
        codes = {e.get("code") for e in errors if isinstance(e, dict)}
        if codes & {REENGAGEMENT, UNDELIVERABLE, str(REENGAGEMENT), str(UNDELIVERABLE)}:
            what = ("the 24-hour customer service window had closed; only a template message can reach them"
                    if codes & {REENGAGEMENT, str(REENGAGEMENT)} else "the message is undeliverable to them")
            self.log.error("WhatsApp reports message %s to %s failed%s: %s: %s. Meta had accepted the send, so "
                           "the delivery was recorded delivered; the user did not get it and it is not sent again",
                           wamid, status.get("recipient_id"), where, reasons, what)
        else:
            self.log.warning("WhatsApp reports message %s to %s failed%s: %s", wamid,
                             status.get("recipient_id"), where, reasons)

    def _message(self, message: dict, names: dict, account: str | None, metadata: dict) -> InboundMessage | None:
        wa_type, sender, wamid = message.get("type"), message.get("from"), message.get("id")
        if not (sender and wamid):
            return None
        text, attachments, option = "", [], None
        if wa_type == "text":
            text = (message.get("text") or {}).get("body") or ""
        elif wa_type in MEDIA_TYPES:
            media = message.get(wa_type) or {}
            if media.get("id"):
                mime = (media.get("mime_type") or "application/octet-stream").split(";")[0].strip()
                attachments.append(Attachment(kind=attachment_kind(wa_type), content_type=mime,
                                              url=MEDIA_URL_PREFIX + str(media["id"]),
                                              filename=media.get("filename"), channel_ref=str(media["id"])))
            text = media.get("caption") or ""
        elif wa_type == "button":
            text = (message.get("button") or {}).get("text") or (message.get("button") or {}).get("payload") or ""
        elif wa_type == "interactive":
            press = pressed(message)  # a reply button or a list row: its id is the option's value
            if press is not None:
                option, text = press
        elif wa_type == "location":
            loc = message.get("location") or {}
            text = " ".join(str(x) for x in (loc.get("name"), loc.get("address"),
                                             f"({loc.get('latitude')}, {loc.get('longitude')})") if x)
        else:
            self.log.info("message %s of type %r is not one this worker reads; skipped", wamid, wa_type)
            return None
        if not text.strip() and not attachments:
            return None
        context = message.get("context") or {}
        return InboundMessage(
            channel="whatsapp", conversation_id=str(sender), message_id=str(wamid), sender_id=str(sender),
            sender_name=names.get(sender) or None, source_type="user", text=text, attachments=attachments,
            timestamp=ts_to_rfc3339(message.get("timestamp")) or
            _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            reply_to=ReplyContext(message_id=str(context["id"])) if context.get("id") else None,
            metadata={k: v for k, v in {"type": wa_type, "option": option, "business_account": account,
                                        "phone_number_id": metadata.get("phone_number_id"),
                                        "display_phone_number": metadata.get("display_phone_number")}.items() if v})

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        if not (attachment.url or "").startswith(MEDIA_URL_PREFIX):
            return None
        media_id = attachment.url[len(MEDIA_URL_PREFIX):]
        try:
            data, _ = self.api.download(media_id)
        except GraphError as err:
            kind = classify(err)
            if kind in REFUSALS:
                self._refusal = refusal_reason(err)  # the listener stops the worker; the message waits
            elif kind == "rate" or (kind == "retry" and (err.status is None or says_later(err.status))):
                # (Meta's rate limits, codes 4, 80007, 130429, come with a 400: the code says "later", not the status)
                raise MediaNotReady(str(err)) from err  # Meta keeps media 30 days: the message waits a while
            raise
        except httpx.TransportError as exc:
            raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
        return data

    # ------------------------------------------------------------------ outbound

    def put_media(self, media, attachment, delivery) -> str | None:
        """Upload one file of an answer to Meta (``POST /{phone-number-id}/media``); its media id is sent next.

        A file no WhatsApp message takes, or that Meta's upload refuses for good, is not uploaded: its step
        sends a note naming it instead (``UNSENDABLE``), so the rest of the answer still reaches the user."""
        index = next(i for i, a in enumerate(delivery.attachments) if a is attachment)
        if len(message_parts(delivery.text)) + index in self._journal.done(delivery.delivery_id):
            return "sent"  # that step went out before a crash: no second upload
        if message_type(attachment) is None:
            self.log.warning("delivery %s: %s", delivery.delivery_id, unsent_note(attachment))
            return UNSENDABLE
        try:
            return self.api.upload(media.data, mime_of(attachment) or media.content_type.split(";")[0].strip(),
                                   attachment.filename or media.filename or "file", on_wait=self._waiting)
        except GraphError as err:
            if classify(err) == "permanent":
                self._unsendable[(delivery.delivery_id, index)] = f"Meta refused the upload ({err})"
                self.log.warning("delivery %s: %s", delivery.delivery_id,
                                 unsent_note(attachment, self._unsendable[(delivery.delivery_id, index)]))
                return UNSENDABLE
            raise self._failure(err, body={"to": delivery.conversation_id}) from err
        except (RateLimited, Stopped) as exc:
            raise DeliveryFailed(str(exc)) from exc

    def _steps(self, delivery) -> list[tuple[str, object]]:
        """What a delivery sends, in order: its text parts, then one message per file (a note for a file
        WhatsApp will not take, in the file's place so the steps' numbers do not move). A one-part text
        with options WhatsApp can show goes as one ``interactive`` message instead (the same one step)."""
        parts = message_parts(delivery.text)
        steps: list[tuple[str, object]] = [("text", part) for part in parts]
        if len(parts) == 1 and (shown := interactive_message(parts[0], delivery.metadata)) is not None:
            steps[0] = ("interactive", shown)
        for i, att in enumerate(delivery.attachments):  # each has a media_id or a url (the protocol)
            if att.channel_ref == UNSENDABLE or message_type(att) is None:
                why = self._unsendable.pop((delivery.delivery_id, i), None)
                steps.append(("text", unsent_note(att, why)))
            else:
                steps.append(("media", att))
        return steps

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("Meta refused the access token or the account")
        steps = self._steps(delivery)
        if not steps:
            raise DeliveryFailed("nothing to send: the answer is empty", permanent=True)
        done = self._journal.done(delivery.delivery_id)
        first = done.get(0)
        for index, (kind, payload) in enumerate(steps):
            if index in done:
                continue
            body = {"messaging_product": "whatsapp", "recipient_type": "individual", "to": delivery.conversation_id}
            if kind == "text":
                body.update(type="text", text={"body": payload, "preview_url": False})
            elif kind == "interactive":
                body.update(type="interactive", interactive=payload)
            else:
                body.update(media_message(payload))
            if index == 0 and delivery.reply_to_message_id:
                body["context"] = {"message_id": delivery.reply_to_message_id}
            try:
                wamid = self._send(body, interactive=kind == "interactive")
            except _InteractiveRefused as exc:
                # The same step as the text part it stands for: journaled under the same index, so a resend
                # after a crash skips it whichever of the two went out.
                self.log.warning("delivery %s: Meta refused the interactive message (%s); sending the numbered "
                                 "text instead", delivery.delivery_id, exc.err)
                body.pop("interactive")
                body.update(type="text", text={"body": message_parts(delivery.text)[index], "preview_url": False})
                wamid = self._send(body)
            # Meta took it: recorded before anything else can fail, so a resend after a crash skips it
            self._journal.record(delivery.delivery_id, index, wamid)
            first = first or wamid
        return first

    def _waiting(self, err: GraphError, secs: float) -> None:
        self.log.info("rate limited (%s): waiting %.1f s before sending again", err, secs)

    def _send(self, body: dict, *, interactive: bool = False) -> str:
        try:
            answer = self.api.send(body, on_wait=self._waiting)
        except GraphError as err:
            if interactive and err.code in INTERACTIVE_REFUSED and classify(err) == "permanent":
                raise _InteractiveRefused(err) from err
            raise self._failure(err, body=body) from err
        except (RateLimited, Stopped) as exc:
            raise DeliveryFailed(str(exc)) from exc
        messages = answer.get("messages") or [{}]
        return str(messages[0].get("id") or "")

    def _failure(self, err: GraphError, *, body: dict) -> DeliveryFailed:
        kind = classify(err)
        if kind in REFUSALS:
            # The listener turns this into ChannelRefused; the delivery waits, retryable, for the operator's fix
            # (a new token, a registered number, an unlocked account) instead of every answer dead-lettering.
            self._refusal = refusal_reason(err)
            return self.refused_failure("Meta refused the access token or the account")
        if err.code == REENGAGEMENT:
            self.log.error("not sent to %s: %s: the 24-hour customer service window has closed; only an "
                           "approved template message may open it again", body.get("to"), err)
            return DeliveryFailed(f"131047: the 24-hour customer service window has closed (only a template "
                                  f"message can be sent): {err.message}", permanent=True)
        return DeliveryFailed(str(err), permanent=kind == "permanent")


    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): every step (text parts, files) is in the sent journal."""
        return len(self._journal.done(delivery.delivery_id)) >= len(self._steps(delivery))

    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.api is not None:
            self.api.close()
        if self._journal is not None:
            self._journal.close()


class _InteractiveRefused(Exception):
    """Meta refused an interactive message for its content (``INTERACTIVE_REFUSED``)."""

    def __init__(self, err: GraphError):
        super().__init__(str(err))
        self.err = err


def main(argv: list[str] | None = None) -> None:
    WhatsAppWorker.main(argv=argv)
