"""The Slack channel: Socket Mode or the Events API webhook in, ``chat.postMessage`` out.

    python -m plugins_app.channel.workers.slack [--mode socket|webhook] [--threads on|off]
                                                [--bind 127.0.0.1:3000] [--path /slack/events]

Environment: ``SLACK_BOT_TOKEN`` (xoxb-, always), ``SLACK_APP_TOKEN`` (xapp-, Socket Mode),
``SLACK_SIGNING_SECRET`` (webhook mode), ``SLACK_API_BASE_URL`` (default ``https://slack.com/api/``;
GovSlack's ``https://slack-gov.com/api/``, or a test's fake). Operators' page: docs/channels/slack.md.

* **Inbound.** ``message`` and ``app_mention`` events become ``InboundMessage``s whose
  ``message_id`` is the message's own identity, ``<channel>:<ts>`` (``message_id_of``): a retry, and the
  same message arriving as both events (whose ``event_id``s differ), are one message to the outbox and the
  hub, across restarts too, so it runs once;
  ``im`` → ``user``, ``mpim`` → ``group``, channels → ``room``. With ``--threads on`` (the default)
  each thread is a conversation (``C123/1700000000.000100``) and a top-level channel message
  starts one; a direct message's top level is one conversation. Files are fetched with the bot
  token (only from Slack's own hosts) and stored on the host; a download Slack answers with a 5xx
  or a 429, or not at all, raises ``MediaNotReady`` (the message waits, its chat only, and the
  SDK fetches again); Slack's sign-in page instead of the file is checked with ``auth.test``: a
  refused token stops the worker with the message owed, else the note names ``files:read``.
* **Outbound.** Markdown → mrkdwn, split at 4,000 characters, each part posted with message
  metadata naming the delivery, so after a crash inside a send ``already_delivered`` finds
  what reached Slack and only the missing parts go out. Files go up through
  ``files.getUploadURLExternal`` + ``files.completeUploadExternal``.
* **Options.** In Socket Mode a delivery's ``metadata["options"]`` become buttons under its last
  part; a press (an ``interactive`` envelope, ``block_actions``) comes back as a message whose
  ``metadata.option`` is the button's value (how a question is answered: docs/questions.md).
* **Slash commands.** A slash command the operator registered for the app (``/model``, or the umbrella
  ``--slash-command``, default ``/ugent``: ``/ugent model gpt-x``) comes as a ``slash_commands`` envelope
  (Socket Mode) or a form POST to the Request URL (webhook mode) and is submitted as the text the hub reads
  as that command (``/model gpt-x``), once per ``trigger_id``, in the channel's conversation
  (docs/commands.md, "From a chat channel"). Slack's client keeps an unregistered ``/word`` from being sent.
* **Refusals.** A bad or revoked token (``auth.test``, ``apps.connections.open``, a
  ``tokens_revoked``/``app_uninstalled`` event, an auth error while sending) or Socket Mode
  switched off raises ``ChannelRefused``: the plugin is disabled with the reason, not restarted.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import threading
from collections import OrderedDict
from urllib.parse import urlsplit

from slack_sdk.errors import SlackApiError

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MediaNotReady, ReplyContext)
from plugins_app.channel.sdk.download import MEDIA_TIMEOUT_SECS, download, says_later
from plugins_app.channel.sdk.outbox import PENDING
from plugins_app.channel.sdk.text import split_text
from plugins_app.channel.sdk.webhook import InboxQueue

from .api import AUTH_ERRORS, DEFAULT_BASE_URL, PERMANENT_ERRORS, RateLimited, SlackApi, Stopped, error_code
from .mrkdwn import to_mrkdwn, to_plain

KIND = "channel-slack"
DESCRIPTION = "Slack: Socket Mode or the Events API webhook in, chat.postMessage out (slack-sdk)."
ENV_REFS = ("SLACK_BOT_TOKEN", "SLACK_APP_TOKEN")

#: Slack truncates a message's text past 40,000 characters and advises staying under 4,000.
TEXT_LIMIT = 4000
#: Markdown is split before it is converted; conversion may lengthen it (escapes), so leave room.
MARKDOWN_LIMIT = 3500
METADATA_EVENT = "ugent_delivery"
#: Message subtypes that carry a person's message; every other subtype (edits, joins, bots) is not one.
HUMAN_SUBTYPES = frozenset({None, "", "file_share", "thread_broadcast", "me_message"})
#: Hosts the bot token may be sent to when fetching a file, besides the API base URL's own.
SLACK_FILE_HOSTS = ("slack.com", "slack-edge.com", "slack-gov.com", "slack-files.com")
SEEN_TS_MAX = 2048
#: The action_id prefix of a delivery's option buttons: a press of any other button is not ours.
OPTION_ACTION = "ugent_option_"
#: How long a send refused for the token waits for the worker to stop (the listener stops it at once).
REFUSAL_HOLD_SECS = 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-slack")
    p.add_argument("--mode", choices=("socket", "webhook"), default="socket")
    p.add_argument("--threads", choices=("on", "off"), default="on",
                   help="on: each thread is a conversation and answers go in the thread; off: one per channel")
    p.add_argument("--bind", default="127.0.0.1:3000", help="webhook mode: host:port to listen on (port 0: any)")
    p.add_argument("--path", default="/slack/events", help="webhook mode: the Request URL's path")
    p.add_argument("--slash-command", default="/ugent",
                   help="the umbrella slash command: '/ugent model gpt-x' is the hub's '/model gpt-x'")
    return p.parse_args(argv)


def source_type(channel_type: str | None, channel_id: str) -> str:
    """Slack's channel_type as the rule engine's source_type."""
    if not channel_type:  # app_mention events carry none: the id's prefix tells a DM
        channel_type = "im" if channel_id.startswith("D") else "channel"
    return {"im": "user", "mpim": "group", "channel": "room", "group": "room"}.get(channel_type, "unknown")


def message_id_of(channel: str, ts: str) -> str:
    """A person's message's ``message_id``: its channel and ``ts``, which Slack keeps unique per channel and
    which both of its events (``message``, ``app_mention``) carry, as does every retry of either."""
    return f"{channel}:{ts}"


def conversation_of(channel: str, ts: str, thread_ts: str | None, channel_type: str | None, *,
                    threads: bool) -> str:
    """The conversation id: ``C1/<thread ts>`` for a thread (when threads are conversations), else ``C1``."""
    if not threads:
        return channel
    if thread_ts:
        return f"{channel}/{thread_ts}"
    if source_type(channel_type, channel) == "user":
        return channel
    return f"{channel}/{ts}"


def split_conversation(conversation_id: str) -> tuple[str, str | None]:
    channel, _, thread_ts = conversation_id.partition("/")
    return channel, thread_ts or None


def option_blocks(text: str, metadata: dict) -> list[dict] | None:
    """A delivery's ``options`` (strings, or ``{"label", "value"}``) as Block Kit: the text, then one
    actions block of buttons (Slack's limits: 25 buttons, 75-character labels, 2,000-character values).
    Only in Socket Mode, where presses reach the worker as ``interactive`` envelopes."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not options:
        return None
    buttons = []
    for n, opt in enumerate(options[:25]):
        if isinstance(opt, dict):
            label, value = str(opt.get("label") or opt.get("value") or ""), str(opt.get("value") or opt.get("label"))
        else:
            label = value = str(opt)
        if label:
            buttons.append({"type": "button", "action_id": f"{OPTION_ACTION}{n}", "value": value[:2000],
                            "text": {"type": "plain_text", "text": label[:75]}})
    if not buttons:
        return None
    return [{"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}},
            {"type": "actions", "block_id": "ugent_options", "elements": buttons}]


def attachment_kind(mimetype: str) -> str:
    major = mimetype.split("/", 1)[0]
    return {"image": "image", "audio": "audio", "video": "video"}.get(major, "document")


def ts_to_rfc3339(ts: str | None) -> str | None:
    try:
        moment = _dt.datetime.fromtimestamp(float(ts or ""), _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return None
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message_parts(markdown: str) -> list[str]:
    """An answer as the mrkdwn texts of the messages that carry it, each within Slack's limit."""
    parts = []
    for piece in split_text(markdown, MARKDOWN_LIMIT) if markdown.strip() else []:
        converted = to_mrkdwn(piece)
        parts.extend(split_text(converted, TEXT_LIMIT) if len(converted) > TEXT_LIMIT else [converted])
    return parts


class SlackWorker(ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "attachments", "threads")

    def __init__(self, *, argv: list[str] | None = None, environ: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        env = os.environ if environ is None else environ
        opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.mode, self.threads, self.bind, self.path = opts.mode, opts.threads == "on", opts.bind, opts.path
        self.slash_command = "/" + opts.slash_command.strip().lstrip("/").lower()
        self.bot_token = env.get("SLACK_BOT_TOKEN", "")
        self.app_token = env.get("SLACK_APP_TOKEN", "")
        self.signing_secret = env.get("SLACK_SIGNING_SECRET", "")
        self.base_url = env.get("SLACK_API_BASE_URL") or DEFAULT_BASE_URL
        self.api = SlackApi(self.bot_token, base_url=self.base_url, stopping=self.stopping)
        self.app_api = SlackApi(self.app_token, base_url=self.base_url, stopping=self.stopping)
        self.bot_user_id: str | None = None
        self.bot_id: str | None = None
        self.team_id: str | None = None
        self._first_url: str | None = None
        self._inbox = InboxQueue.of(self)
        self._refusal: str | None = None
        self._link_error: Exception | None = None
        self._seen_ts: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._found_parts: dict[str, set[int]] = {}
        self.link = None
        self.server = None

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        if not self.bot_token:
            raise ChannelRefused("SLACK_BOT_TOKEN is not set")
        if self.mode == "socket" and not self.app_token:
            raise ChannelRefused("SLACK_APP_TOKEN (an app-level token with connections:write) is not set; "
                                 "Socket Mode needs it")
        if self.mode == "webhook" and not self.signing_secret:
            raise ChannelRefused("SLACK_SIGNING_SECRET is not set; the Events API webhook needs it")
        try:
            who = self.api.call("auth.test")
        except SlackApiError as exc:
            code = error_code(exc)
            if code in AUTH_ERRORS:
                raise ChannelRefused(f"auth.test: {code}: the bot token (SLACK_BOT_TOKEN) was refused") from exc
            raise
        self.bot_user_id, self.bot_id, self.team_id = who.get("user_id"), who.get("bot_id"), who.get("team_id")
        self.log.info("slack: signed in as %s (bot %s) in team %s; mode %s, threads %s", self.bot_user_id,
                      self.bot_id, self.team_id, self.mode, "on" if self.threads else "off")
        if self.mode == "socket":
            from .socket import LinkRefused, SocketModeLink
            self.link = SocketModeLink(self.app_api, self._on_envelope, self.stopping)
            try:
                self.link.prepare()  # a refused app token is found before listening
            except LinkRefused as exc:
                raise ChannelRefused(str(exc)) from exc
        else:
            from .webhook import EventsServer
            self.server = EventsServer(self.bind, self.path, self.signing_secret, self.accept)
            self.server.start()
            self.log.info("slack: events webhook listening on %s", self.server.url)

    # ------------------------------------------------------------------ inbound

    def listen(self, submit) -> None:
        from plugins_app.channel.sdk.webhook import InboxLanes
        receiver = None
        if self.link is not None:
            from plugins_app.channel.sdk.wslink import start_link
            receiver = start_link(self.link, name="slack-socket", refused=self._link_refused, failed=self._link_failed)
        # a thread per channel with messages under way: one channel's file downloading holds back no other
        InboxLanes(self, submit, name="slack-inbox").run(self._inbox, lambda: self._link_error,
                                                         what="socket mode failed: ")
        if receiver is not None:
            receiver.join(5)

    def _link_refused(self, exc) -> None:
        self._refusal = str(exc)  # listen() raises ChannelRefused with it: the plugin is disabled

    def _link_failed(self, exc: Exception) -> None:
        self._link_error = exc  # listen() fails with it: the supervisor restarts the worker

    def _on_envelope(self, frame: dict) -> None:
        if frame.get("type") == "events_api":
            if frame.get("retry_attempt"):
                self.log.info("Slack redelivered envelope (attempt %s, %s)", frame.get("retry_attempt"),
                              frame.get("retry_reason"))
            self.accept(frame.get("payload") or {})
        elif frame.get("type") == "interactive":
            self.accept_press(frame.get("payload") or {})
        elif frame.get("type") == "slash_commands":
            self.accept_slash(frame.get("payload") or {})

    def accept_slash(self, payload: dict) -> None:
        """A slash command, recorded and queued as a message; returns once recorded (Slack waits 3 s)."""
        msg = self.normalise_slash(payload)
        if msg is None:
            return
        self._record(msg)

    def normalise_slash(self, payload: dict) -> InboundMessage | None:
        """A slash command's payload as the text the hub reads as a command: ``/model gpt-x`` as it is, the
        umbrella ``/ugent model gpt-x`` as ``/model gpt-x``. Its message id is the invocation's
        ``trigger_id`` (a redelivered envelope runs once); its conversation the channel's own (a command has
        no thread). None when it names no user or channel."""
        command = str(payload.get("command") or "").strip().lower()
        user, channel = payload.get("user_id"), payload.get("channel_id")
        trigger = payload.get("trigger_id")
        if not (command.startswith("/") and user and channel and trigger):
            return None
        args = str(payload.get("text") or "").strip()
        if command == self.slash_command:
            text = "/" + args.lstrip("/") if args else "/"
        else:
            text = f"{command} {args}".strip()
        return InboundMessage(
            channel="slack", conversation_id=conversation_of(channel, "", None, None, threads=False),
            message_id=f"slash:{trigger}", sender_id=str(user), sender_name=payload.get("user_name") or None,
            source_type=source_type(None, str(channel)), text=text,
            metadata={"channel": channel, "event_type": "slash_commands", "command": command})

    def accept_press(self, payload: dict) -> None:
        """A press of one of our option buttons (``block_actions``), recorded and queued as a message."""
        msg = self.normalise_press(payload)
        if msg is None:
            return
        self._record(msg)

    def normalise_press(self, payload: dict) -> InboundMessage | None:
        """A ``block_actions`` payload on one of a delivery's option buttons as an InboundMessage whose
        ``metadata.option`` is the button's value; its message id is the press's own (action_ts and the
        user), so a redelivered envelope runs once. None for anything else."""
        if payload.get("type") != "block_actions":
            return None
        action = next((a for a in payload.get("actions") or []
                       if str(a.get("action_id", "")).startswith(OPTION_ACTION)), None)
        user = (payload.get("user") or {}).get("id")
        container = payload.get("container") or {}
        message = payload.get("message") or {}
        channel = (payload.get("channel") or {}).get("id") or container.get("channel_id")
        ts = container.get("message_ts") or message.get("ts")
        if action is None or not (user and channel and ts and action.get("value")):
            return None
        thread_ts = container.get("thread_ts") or message.get("thread_ts")
        return InboundMessage(
            channel="slack", conversation_id=conversation_of(channel, ts, thread_ts, None, threads=self.threads),
            message_id=f"press:{action.get('action_ts') or ts}:{user}", sender_id=user,
            sender_name=(payload.get("user") or {}).get("name") or None,
            source_type=source_type(None, channel), text=action["value"],
            reply_to=ReplyContext(message_id=message_id_of(channel, ts)),
            metadata={"option": action["value"], "channel": channel, "ts": ts, "event_type": "block_actions"})

    def accept(self, payload: dict) -> None:
        """One Events API payload: record what it carries durably (the outbox) and queue it for the hub.

        Returns once the record is written, so the caller may ack Slack at once.
        """
        kind = payload.get("type")
        if kind == "slash_commands":  # (the webhook's form POST, wrapped)
            self.accept_slash(payload.get("payload") or {})
            return
        if kind == "app_rate_limited":
            self.log.warning("Slack dropped events: app_rate_limited for minute %s",
                             payload.get("minute_rate_limited"))
            return
        if kind != "event_callback":
            return
        event = payload.get("event") or {}
        etype = event.get("type")
        if etype == "tokens_revoked":
            revoked = (event.get("tokens") or {}).get("bot") or []
            if not self.bot_user_id or self.bot_user_id in revoked:
                self._refusal = "tokens_revoked: the bot token was revoked"
            return
        if etype == "app_uninstalled":
            self._refusal = "app_uninstalled: the app was removed from the workspace"
            return
        msg = self.normalise(payload)
        if msg is None:
            return
        self._record(msg)

    def _record(self, msg: InboundMessage) -> None:
        """Record ``msg`` in the outbox and queue it for the lanes, unless it was taken before; the queue full
        (the hub away), it waits in the outbox for the replay. Returns once it is written (Slack may be
        answered then)."""
        if self.outbox.inbound_record(msg).state == PENDING:
            self._inbox.offer(msg)

    def normalise(self, payload: dict) -> InboundMessage | None:
        """A message or app_mention event as an InboundMessage; None for what is not a person's message."""
        event = payload.get("event") or {}
        if event.get("type") not in ("message", "app_mention"):
            return None
        if event.get("subtype") not in HUMAN_SUBTYPES or event.get("bot_id") or event.get("hidden"):
            return None
        user, channel, ts = event.get("user"), event.get("channel"), event.get("ts")
        event_id = payload.get("event_id")
        if not (user and channel and ts and event_id) or user == self.bot_user_id:
            return None
        # subscribed to both, one message arrives as a message and an app_mention: both carry its id (below), so
        # the outbox and the hub take it once whatever comes between; this only keeps a run from queuing it twice
        with self._seen_lock:
            first = self._seen_ts.setdefault((channel, ts), event_id)
            self._seen_ts.move_to_end((channel, ts))
            while len(self._seen_ts) > SEEN_TS_MAX:
                self._seen_ts.popitem(last=False)
        if first != event_id:
            return None
        thread_ts = event.get("thread_ts")
        channel_type = event.get("channel_type")
        attachments = [Attachment(kind=attachment_kind(f.get("mimetype") or ""),
                                  content_type=f.get("mimetype") or "application/octet-stream",
                                  url=f.get("url_private_download") or f.get("url_private"),
                                  filename=f.get("name"), size=f.get("size"), channel_ref=f.get("id"))
                       for f in event.get("files") or [] if f.get("url_private_download") or f.get("url_private")]
        text = to_plain(event.get("text") or "", bot_user_id=self.bot_user_id)
        if not text.strip() and not attachments:
            return None
        profile = event.get("user_profile") or {}
        return InboundMessage(
            channel="slack", conversation_id=conversation_of(channel, ts, thread_ts, channel_type,
                                                             threads=self.threads),
            message_id=message_id_of(channel, ts), sender_id=user,
            sender_name=profile.get("display_name") or profile.get("real_name") or None,
            source_type=source_type(channel_type, channel), text=text, attachments=attachments,
            timestamp=ts_to_rfc3339(ts) or ts_to_rfc3339(str(payload.get("event_time") or "")) or
            _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
            reply_to=ReplyContext(message_id=message_id_of(channel, thread_ts)) if thread_ts and thread_ts != ts else None,
            metadata={k: v for k, v in {"ts": ts, "thread_ts": thread_ts, "channel": channel,
                                        "team": payload.get("team_id") or event.get("team"),
                                        "event_type": event.get("type")}.items() if v})

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        if not attachment.url or not self._slack_host(attachment.url):
            return None  # never hand the bot token to a host that is not Slack's
        # a 5xx, a 429 or no answer: MediaNotReady (Slack keeps the file; the message waits and is fetched again)
        response = download(attachment.url, headers={"Authorization": f"Bearer {self.bot_token}"})
        response.raise_for_status()  # any other error status is final: the message goes on with a note
        if "text/html" in response.headers.get("content-type", "") and "html" not in attachment.content_type:
            # Slack's sign-in page: a token without files:read, or one no longer valid at all. auth.test tells.
            self._confirm_token()
            raise ValueError("Slack answered the file download with a page (the token lacks files:read)")
        return response.content

    def _confirm_token(self) -> None:
        """``ChannelRefused`` (the refusal recorded, as a send records it) if auth.test refuses the bot token,
        ``MediaNotReady`` if Slack does not answer it now; returns if the token is fine. One short call, no
        waiting out a rate limit: the SDK's hold tries again."""
        from slack_sdk import WebClient
        client = WebClient(token=self.bot_token, base_url=self.api.base_url, timeout=int(MEDIA_TIMEOUT_SECS),
                           retry_handlers=[])
        try:
            client.api_call("auth.test")
        except SlackApiError as exc:
            code = error_code(exc)
            if code in AUTH_ERRORS:
                self._refusal = f"auth.test: {code}: the bot token (SLACK_BOT_TOKEN) was refused"
                raise ChannelRefused(self._refusal) from exc
            if says_later(getattr(exc.response, "status_code", 0) or 0) or code == "ratelimited":
                raise MediaNotReady(f"auth.test: {code}") from exc
        except OSError as exc:  # refused, reset, timed out (urllib's errors are OSErrors)
            raise MediaNotReady(f"auth.test: {type(exc).__name__}: {exc}") from exc

    def _slack_host(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        api_host = (urlsplit(self.base_url).hostname or "").lower()
        return host == api_host or any(host == h or host.endswith("." + h) for h in SLACK_FILE_HOSTS)

    # ------------------------------------------------------------------ outbound

    def put_media(self, media, attachment, delivery) -> str | None:
        filename = attachment.filename or media.filename or "file"
        try:
            ticket = self.api.call("files.getUploadURLExternal",
                                   params={"filename": filename, "length": str(media.size)})
        except SlackApiError as exc:
            raise self._failure("files.getUploadURLExternal", exc) from exc
        import httpx
        response = httpx.post(ticket["upload_url"], content=media.data,
                              headers={"Content-Type": media.content_type}, timeout=120)
        if response.status_code != 200:
            raise DeliveryFailed(f"file upload answered HTTP {response.status_code}")
        return ticket["file_id"]

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            raise self._refused_failure()
        channel, thread_ts = split_conversation(delivery.conversation_id)
        parts = message_parts(delivery.text)
        done = self._found_parts.pop(delivery.delivery_id, set())
        first_ts = None
        try:
            files = [{"id": a.channel_ref, "title": a.filename or a.channel_ref}
                     for a in delivery.attachments if a.channel_ref]
            if files and "files" not in done:
                params = {"files": files, "channel_id": channel}
                if thread_ts:
                    params["thread_ts"] = thread_ts
                self.api.call("files.completeUploadExternal", json=params, key=channel, post=True)
            for i, part in enumerate(parts):
                if i in done:
                    continue
                body = {"channel": channel, "text": part, "unfurl_links": False,
                        "metadata": {"event_type": METADATA_EVENT,
                                     "event_payload": {"delivery_id": delivery.delivery_id, "part": i,
                                                       "parts": len(parts)}}}
                if i == len(parts) - 1 and self.mode == "socket":
                    buttons = option_blocks(part, delivery.metadata)
                    if buttons:
                        body["blocks"] = buttons
                if thread_ts:
                    body["thread_ts"] = thread_ts
                sent = self.api.call("chat.postMessage", json=body, key=channel, post=True)
                first_ts = first_ts or sent.get("ts")
        except SlackApiError as exc:
            raise self._failure("chat.postMessage", exc) from exc
        except (RateLimited, Stopped) as exc:
            raise DeliveryFailed(str(exc)) from exc
        return first_ts

    def _failure(self, method: str, exc: SlackApiError) -> DeliveryFailed:
        code = error_code(exc)
        if code in AUTH_ERRORS:
            # The listener turns this into ChannelRefused; the delivery waits for a fixed token.
            self._refusal = f"{method}: {code}: the bot token (SLACK_BOT_TOKEN) was refused"
            return self._refused_failure()
        return DeliveryFailed(f"{method}: {code}", permanent=code in PERMANENT_ERRORS)

    def _refused_failure(self) -> DeliveryFailed:
        """A send Slack refused for the token: hold it until the listener has stopped the worker, so the
        host does not spend the delivery's retries against a dead token in the meantime; its one
        failed attempt is retryable, and the delivery goes out once the operator fixed the token."""
        self.stopping.wait(REFUSAL_HOLD_SECS)
        return DeliveryFailed(self._refusal or "the token was refused")

    def already_delivered(self, delivery) -> bool:
        """After a crash inside deliver(): look in the chat for the parts this delivery's metadata names."""
        channel, thread_ts = split_conversation(delivery.conversation_id)
        parts = message_parts(delivery.text)
        params = {"channel": channel, "include_all_metadata": "true", "limit": "200"}
        if thread_ts:
            method, params["ts"] = "conversations.replies", thread_ts
        else:
            method = "conversations.history"
        try:
            data = self.api.call(method, params=params, http_verb="GET")
        except (SlackApiError, RateLimited, Stopped) as exc:
            self.log.warning("could not look for delivery %s in %s: %s", delivery.delivery_id, channel, exc)
            return False
        found: set[int] = set()
        for message in data.get("messages") or []:
            meta = message.get("metadata") or {}
            payload = meta.get("event_payload") or {}
            if meta.get("event_type") == METADATA_EVENT and payload.get("delivery_id") == delivery.delivery_id:
                found.add(int(payload.get("part", 0)))
        if found and delivery.attachments:
            found.add("files")  # type: ignore[arg-type] - the files went first, before any part
        if parts and all(i in found for i in range(len(parts))):
            return True
        self._found_parts[delivery.delivery_id] = found
        return False

    def disconnect(self) -> None:
        if self.server is not None:
            self.server.stop()


def main(argv: list[str] | None = None) -> None:
    SlackWorker.main(argv=argv)
