"""The Salesforce channel: platform events in over the Streaming API (CometD), platform events out over REST.

    python -m plugins_app.channel.workers.salesforce [--api-version 62.0] [--inbound-event UGENT_Inbound__e]
        [--outbound-event UGENT_Outbound__e] [--replay-from new|all] [--text-limit 131072]
        [--max-retry-wait 120] [--conversation-field ConversationId__c] [--user-field UserId__c]
        [--text-field Text__c] [--message-id-field MessageId__c] [--delivery-id-field DeliveryId__c]
        [--part-field Part__c] [--parts-field Parts__c] [--in-reply-to-field InReplyTo__c]

Environment: ``SALESFORCE_CLIENT_ID`` and ``SALESFORCE_CLIENT_SECRET`` (an external client app's or connected
app's consumer key and secret, with the client credentials flow switched on and a run-as user),
``SALESFORCE_LOGIN_URL`` (the org's My Domain, ``https://<domain>.my.salesforce.com``; a test's fake). The API
version and the two event names may also come from ``SALESFORCE_API_VERSION``, ``SALESFORCE_INBOUND_EVENT``
and ``SALESFORCE_OUTBOUND_EVENT`` (an argument wins). Operators' page: docs/channels/salesforce.md.

* **Inbound.** A CometD subscription to ``/event/<inbound event>`` (``cometd.py``). Each event whose
  conversation and text fields are set becomes an ``InboundMessage``: the conversation is the conversation
  field, the sender the user field (else the event's ``CreatedById``), the message id the message id field
  when the publisher set one, else the event's ``EventUuid``, else its replay id. The event is written to the
  worker's outbox and only then its replay id recorded: after a crash the subscription resumes from the
  replay id recorded, an event given again is recognised by its message id and runs no second turn. The first
  start takes only new events (``--replay-from new``, replay -1) or every event Salesforce keeps (``all``, -2).
* **Outbound.** Each answer is published as ``<outbound event>`` events (``POST .../sobjects/<event>/``): the
  conversation, the text, the delivery id, the part's number (from 1) and the number of parts, and the
  message id answered. A text longer than ``--text-limit`` (a Long Text Area's 131,072, counted in UTF-16
  units, the safe side) is split into parts. Salesforce has no idempotency key: each part it took is written to
  a sent-parts journal (a SQLite file beside the outbox), so a delivery resumed after a crash publishes no
  journaled part again; a part in flight at the crash, or one whose publish timed out or got a 502/504 after
  Salesforce may have taken it, may be published twice, with the same delivery id and part number, which a
  Salesforce-side subscriber dedupes on.
* **Limits.** 503 and other 5xx are waited out in place (1 s doubling to 30 s) up to ``--max-retry-wait``;
  then the hub's own retries take over, as at once for ``LIMIT_EXCEEDED`` (the hourly publishing allocation)
  and ``REQUEST_LIMIT_EXCEEDED`` (the org's API requests over 24 hours). A field or validation error (400) fails the delivery permanently (dead letter) with
  Salesforce's message.
* **Refusals.** The token endpoint refusing the app (``invalid_client``, ``invalid_grant``, ...), at the start
  or later, an inbound event that does not exist, a handshake denied for a permission, an API version the
  Streaming API does not serve, or no My Domain login URL raises ``ChannelRefused``: the plugin is disabled
  with the reason, not restarted. An expired token (401 ``INVALID_SESSION_ID``) is fetched again.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import sys
import threading
from urllib.parse import urlsplit

import httpx

from plugins_app.channel.sdk import ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage
from plugins_app.channel.sdk.journal import SentJournal
from plugins_app.channel.sdk.messages import MessageValidationError
from plugins_app.channel.sdk.outbox import outbox_path_for
from plugins_app.channel.sdk.text import split_text, utf16_len
from plugins_app.channel.sdk.webhook import WebhookInbox

from .api import (DEFAULT_API_VERSION, LATER_CODES, ClientRefused, RateLimited, SalesforceApi,
                  SalesforceError, Stopped, TokenError)
from .cometd import REPLAY_ALL, REPLAY_NEW, ChannelMissing, ReplayStore, StreamRefused, Subscription, parse_time

KIND = "channel-salesforce"
DESCRIPTION = "Salesforce: platform events in over the Streaming API (CometD, durable replay), out over REST."
ENV_REFS = ("SALESFORCE_CLIENT_ID", "SALESFORCE_CLIENT_SECRET", "SALESFORCE_LOGIN_URL")

CLIENT_ID_ENV, CLIENT_SECRET_ENV, LOGIN_URL_ENV = ENV_REFS
API_VERSION_ENV = "SALESFORCE_API_VERSION"
INBOUND_EVENT_ENV = "SALESFORCE_INBOUND_EVENT"
OUTBOUND_EVENT_ENV = "SALESFORCE_OUTBOUND_EVENT"

DEFAULT_INBOUND_EVENT = "UGENT_Inbound__e"
DEFAULT_OUTBOUND_EVENT = "UGENT_Outbound__e"
#: A Long Text Area field's most characters (the largest text field a platform event may have).
TEXT_LIMIT = 131072
TOKEN_CALL = "POST /services/oauth2/token"
#: Login hosts the client credentials flow is refused on: it needs the org's My Domain.
GENERIC_LOGIN_HOSTS = ("login.salesforce.com", "test.salesforce.com")
EVENT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*__e$")
API_VERSION = re.compile(r"^[0-9]{2,3}\.0$")


def parse_args(argv: list[str] | None, env: dict | None = None) -> argparse.Namespace:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="channel-salesforce", description=DESCRIPTION)
    p.add_argument("--api-version", default=env.get(API_VERSION_ENV) or DEFAULT_API_VERSION,
                   help="the REST and Streaming API version, e.g. 62.0")
    p.add_argument("--inbound-event", default=env.get(INBOUND_EVENT_ENV) or DEFAULT_INBOUND_EVENT,
                   help="the platform event the worker subscribes to (API name, ends in __e)")
    p.add_argument("--outbound-event", default=env.get(OUTBOUND_EVENT_ENV) or DEFAULT_OUTBOUND_EVENT,
                   help="the platform event each answer is published as (API name, ends in __e)")
    p.add_argument("--replay-from", choices=("new", "all"), default="new",
                   help="on the first start only: new events (-1) or every event Salesforce keeps (-2)")
    p.add_argument("--text-limit", type=int, default=TEXT_LIMIT,
                   help="the outbound text field's length; longer answers are split into parts")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="the longest a publish waits out 5xx/PLATFORM_EVENT_PUBLISHING_UNAVAILABLE in place")
    p.add_argument("--conversation-field", default="ConversationId__c", help="both events: the conversation")
    p.add_argument("--user-field", default="UserId__c", help="inbound: who wrote (else CreatedById)")
    p.add_argument("--text-field", default="Text__c", help="both events: the text")
    p.add_argument("--message-id-field", default="MessageId__c",
                   help="inbound: the publisher's own id for the message (else EventUuid); '' for none")
    p.add_argument("--delivery-id-field", default="DeliveryId__c", help="outbound: the delivery id ('' for none)")
    p.add_argument("--part-field", default="Part__c", help="outbound: the part's number, from 1 ('' for none)")
    p.add_argument("--parts-field", default="Parts__c", help="outbound: how many parts ('' for none)")
    p.add_argument("--in-reply-to-field", default="InReplyTo__c",
                   help="outbound: the message id answered ('' for none)")
    opts = p.parse_args(argv)
    if opts.text_limit < 16:
        p.error("--text-limit must be at least 16 (a part must hold a code fence)")
    return opts


def channel_of(event: str) -> str:
    return f"/event/{event}"


def refused(where: str, exc: SalesforceError) -> str:
    return (f"{where}: {exc.status} {exc.code}: {exc.message}: the connected app's consumer key or secret "
            f"({CLIENT_ID_ENV}, {CLIENT_SECRET_ENV}) or its client credentials flow (enabled, with a run-as "
            "user) is refused (fix it in Setup, App Manager)")


def salesforce_time(value) -> str | None:
    """Salesforce's ``CreatedDate`` as an RFC 3339 UTC timestamp (milliseconds), or None."""
    moment = parse_time(value)
    if moment is None:
        return None
    return moment.astimezone(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def normalise(message: dict, opts: argparse.Namespace) -> InboundMessage | None:
    """A CometD event message (``data.event``, ``data.payload``) as an InboundMessage; None when it carries no
    conversation or no text, or breaks the protocol."""
    data = message.get("data") or {}
    payload, event = data.get("payload") or {}, data.get("event") or {}
    if not isinstance(payload, dict) or not isinstance(event, dict):
        return None
    conversation = payload.get(opts.conversation_field)
    text = payload.get(opts.text_field)
    if conversation in (None, "") or not isinstance(text, str) or not text.strip():
        return None
    replay_id = event.get("replayId")
    event_uuid = event.get("EventUuid") or payload.get("EventUuid")
    own_id = payload.get(opts.message_id_field) if opts.message_id_field else None
    message_id = own_id or event_uuid or (f"replay-{replay_id}" if replay_id is not None else None)
    if not message_id:
        return None
    sender = payload.get(opts.user_field) if opts.user_field else None
    metadata = {"event": message.get("channel"), "replay_id": replay_id, "event_uuid": event_uuid,
                "created_by_id": payload.get("CreatedById")}
    msg = InboundMessage(
        channel="salesforce", conversation_id=str(conversation), message_id=str(message_id),
        sender_id=str(sender or payload.get("CreatedById") or conversation), source_type="user", text=text,
        metadata={k: v for k, v in metadata.items() if v is not None},
        timestamp=salesforce_time(payload.get("CreatedDate")) or
        _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"))
    try:
        return msg.validate()
    except MessageValidationError:
        return None


def message_parts(text: str, limit: int = TEXT_LIMIT) -> list[str]:
    """An answer as the texts of the events that carry it, each within the field's length (UTF-16 units)."""
    return split_text(text, limit, measure=utf16_len) if text.strip() else []


def event_fields(opts: argparse.Namespace, delivery, n: int, parts: list[str]) -> dict:
    """The outbound event's fields for part ``n`` (from 0) of a delivery; a field named '' is left out."""
    fields = {opts.conversation_field: delivery.conversation_id, opts.text_field: parts[n],
              opts.delivery_id_field: delivery.delivery_id, opts.part_field: n + 1, opts.parts_field: len(parts),
              opts.in_reply_to_field: delivery.reply_to_message_id}
    return {k: v for k, v in fields.items() if k and v is not None}


class SalesforceWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text",)

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        self.opts = parse_args(sys.argv[1:] if argv is None else argv, env)
        self.client_id = env.get(CLIENT_ID_ENV, "")
        self.client_secret = env.get(CLIENT_SECRET_ENV, "")
        self.login_url = (env.get(LOGIN_URL_ENV) or "").strip().rstrip("/")
        self.api = SalesforceApi(self.client_id, self.client_secret, login_url=self.login_url,
                                 api_version=self.opts.api_version, stopping=self.stopping,
                                 max_wait_secs=self.opts.max_retry_wait)
        self.inbox_init()
        self._journal: SentJournal | None = None
        self._replays: ReplayStore | None = None
        self.subscription: Subscription | None = None
        self._stream: threading.Thread | None = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        missing = [name for name, value in ((CLIENT_ID_ENV, self.client_id), (CLIENT_SECRET_ENV, self.client_secret))
                   if not value]
        if missing:
            raise ChannelRefused(f"{', '.join(missing)} not set")
        host = urlsplit(self.login_url).hostname or ""
        if not self.login_url or host in GENERIC_LOGIN_HOSTS:
            raise ChannelRefused(f"{LOGIN_URL_ENV} {'is ' + host if host else 'not set'}: the client credentials "
                                 "flow needs the org's My Domain URL, https://<domain>.my.salesforce.com")
        for name in (self.opts.inbound_event, self.opts.outbound_event):
            if not EVENT_NAME.match(name):
                raise ChannelRefused(f"{name!r} is not a platform event's API name (it ends in __e)")
        if self.opts.inbound_event == self.opts.outbound_event:
            raise ChannelRefused(f"the inbound and outbound events are both {self.opts.inbound_event}: the worker "
                                 "would read its own answers back as messages")
        if not API_VERSION.match(self.opts.api_version):
            raise ChannelRefused(f"--api-version {self.opts.api_version!r} is not an API version such as 62.0")
        try:
            token = self.api.token()
        except ClientRefused as exc:
            raise ChannelRefused(refused(TOKEN_CALL, exc)) from exc
        base = str(outbox_path_for(self.plugin_id, self.state_dir))
        self._journal = SentJournal(base.replace(".outbox.", ".salesforce-sent."))
        self._replays = ReplayStore(base.replace(".outbox.", ".salesforce-replay."))
        self.log.info("salesforce: token for %s (instance %s, API %s)", self.login_url, token.instance_url,
                      self.opts.api_version)
        self.subscription = Subscription(
            self.api, channel_of(self.opts.inbound_event), self._replays, self.on_event,
            first_replay=REPLAY_ALL if self.opts.replay_from == "all" else REPLAY_NEW, stopping=self.stopping)
        self._stream = threading.Thread(target=self._stream_main, name="salesforce-stream", daemon=True)
        self._stream.start()

    def _stream_main(self) -> None:
        try:
            self.subscription.run()
        except ClientRefused as exc:
            self._refusal = refused(TOKEN_CALL, exc)  # the listener stops the worker
        except ChannelMissing as exc:
            self._refusal = (f"{exc}: define the platform event {self.opts.inbound_event} in Setup (Platform "
                             "Events) and let the run-as user read it")
        except StreamRefused as exc:
            self._refusal = (f"the Streaming API refused the worker: {exc}: check --api-version (or "
                             f"{API_VERSION_ENV}) and that the run-as user has API Enabled and the org the "
                             "Streaming API")

    # ------------------------------------------------------------------ inbound

    def on_event(self, message: dict) -> None:
        """One event from the subscription: recorded in the outbox (and queued for the hub) before it returns;
        an event that is no message is logged and passed over."""
        msg = normalise(message, self.opts)
        event = (message.get("data") or {}).get("event") or {}
        if msg is None:
            self.log.warning("salesforce: event %s (replay id %s) has no %s or no %s; skipped",
                             event.get("EventUuid"), event.get("replayId"), self.opts.conversation_field,
                             self.opts.text_field)
            return
        if not self.inbox_record(msg):
            self.log.info("salesforce: event %s (message %s) was taken before", event.get("replayId"), msg.message_id)

    # ------------------------------------------------------------------ outbound

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self.refused_failure("Salesforce refused the connected app")
        parts = message_parts(delivery.text, self.opts.text_limit)
        if not parts:
            raise DeliveryFailed("nothing to publish: the answer has no text (files are not sent to Salesforce)",
                                 permanent=True)
        done = self._journal.done(delivery.delivery_id)
        first: str | None = done.get(0) or None
        for n in range(len(parts)):
            if n in done:
                continue
            where = f"POST /services/data/v{self.opts.api_version}/sobjects/{self.opts.outbound_event}/"
            try:
                event_id = self.api.publish(self.opts.outbound_event, event_fields(self.opts, delivery, n, parts))
            except ClientRefused as exc:
                self._refusal = refused(TOKEN_CALL, exc)
                raise self.refused_failure("Salesforce refused the connected app") from exc
            except TokenError as exc:
                # a new token (after a 401) the token endpoint could not give now: nothing wrong with the answer
                raise DeliveryFailed(f"{TOKEN_CALL}: {exc}") from exc
            except RateLimited as exc:
                raise DeliveryFailed(f"{where}: {exc}") from exc
            except SalesforceError as exc:
                # a field or validation error (400), an event that is not there (404): sending again cannot help;
                # the hourly publishing allocation (LIMIT_EXCEEDED) or the API requests can, later
                permanent = 400 <= exc.status < 500 and exc.status != 401 and exc.code not in LATER_CODES
                raise DeliveryFailed(f"{where}: {exc}", permanent=permanent) from exc
            except (Stopped, httpx.HTTPError) as exc:
                raise DeliveryFailed(f"{where}: {type(exc).__name__}: {exc}") from exc
            self._journal.record(delivery.delivery_id, n, event_id)  # before anything else can fail
            first = first or event_id or None
        return first

    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): every part of the answer is in the sent journal."""
        parts = message_parts(delivery.text, self.opts.text_limit)
        return bool(parts) and len(self._journal.done(delivery.delivery_id)) >= len(parts)


    def disconnect(self) -> None:
        if self.subscription is not None:
            self.subscription.close()
        if self._stream is not None:
            self._stream.join(2.0)
        self.api.close()
        if self._replays is not None:
            self._replays.close()
        if self._journal is not None:
            self._journal.close()


def main(argv: list[str] | None = None) -> None:
    SalesforceWorker.main(argv=argv)
