"""The WhatsApp channel: the Business Cloud API (Meta's Graph API), a signed webhook in, messages out.

    python -m plugins_app.channel.workers.whatsapp [--bind 127.0.0.1:3000] [--path /whatsapp/webhook]
                                                   [--max-retry-wait 60]

Environment: ``WHATSAPP_ACCESS_TOKEN`` (a permanent system-user token), ``WHATSAPP_APP_SECRET`` (signs
the webhook), ``WHATSAPP_VERIFY_TOKEN`` (the handshake), ``WHATSAPP_PHONE_NUMBER_ID`` (the number this
worker answers for) and ``WHATSAPP_API_BASE_URL`` (default ``https://graph.facebook.com/v21.0``, or a
test's fake). Operators' page: docs/channels/whatsapp.md.

The package: ``api`` (a thin httpx client of the Graph API, its errors classified), ``webhook`` (the
handshake and the X-Hub-Signature-256 check), ``formatting`` (Markdown → WhatsApp, splitting at
4,096 characters), ``interactive`` (a question's options as reply buttons or a list, and a press
read back), ``worker`` (the ``ChannelWorker``).

* **Inbound.** Meta POSTs notifications to the worker's webhook; a signature that does not verify
  is answered 401 and records nothing; a good one is answered 200 once its messages are in the
  outbox. The message's ``wamid`` is the idempotency key (Meta's retries run nothing twice); the
  conversation is the sender's ``wa_id`` (1:1, ``source_type`` user); ``statuses`` are not
  messages (a ``failed`` one is logged, naming the delivery it was sent for); another phone number's notifications are ignored. Media
  are fetched (``GET /{media-id}``, then its URL with the token) and stored on the host. A press
  of a reply button or a list row (``interactive``) is a message whose text is the title shown and
  whose ``metadata.option`` is the button's id (a question's reply token).
* **Outbound.** ``POST /{phone-number-id}/messages``, text split at 4,096 characters, the first
  part replying (``context.message_id``) to the message answered; files uploaded
  (``POST /{phone-number-id}/media``) and sent by media id after the text; a file WhatsApp will
  not take is replaced by a note naming it. A delivery's ``metadata["options"]`` (a question's
  buttons) go as one ``interactive`` message instead of the text: reply buttons for up to 3, a
  list for 4 to 10; more than 10, or a text past 1,024 characters, stay plain text. Every part Meta took is journaled, so a restart after
  a crash sends only the parts still missing.
* **Errors.** 190 or HTTP 401, and the account's own (133010, 3, 368, 131031): ``ChannelRefused``
  (the plugin is disabled with the reason); 4, 80007, 130429, 131056 or HTTP 429: wait
  (``Retry-After``, else backoff) and send again; 131047 (the 24-hour window closed) in the send's
  answer: the delivery fails permanently with that reason. Meta often answers such a send 200
  instead and posts a ``failed`` status later: the delivery is then already acked delivered, and
  the worker logs an error naming it (the user did not get it; it is not sent again).
"""
from __future__ import annotations

KIND = "channel-whatsapp"
DESCRIPTION = "WhatsApp: the Business Cloud API (Graph API), a signed webhook in, messages out (httpx)."
ENV_REFS = ("WHATSAPP_ACCESS_TOKEN", "WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN", "WHATSAPP_PHONE_NUMBER_ID")

from .formatting import TEXT_LIMIT, message_parts, to_whatsapp  # noqa: E402
from .webhook import signature, signature_valid, verification_answer  # noqa: E402
from .worker import MEDIA_URL_PREFIX, SentJournal, WhatsAppWorker, main, parse_args  # noqa: E402

__all__ = ["DESCRIPTION", "ENV_REFS", "KIND", "MEDIA_URL_PREFIX", "SentJournal", "TEXT_LIMIT", "WhatsAppWorker",
           "main", "message_parts", "parse_args", "signature", "signature_valid", "to_whatsapp",
           "verification_answer"]
