"""``ChannelWorker``: the lifecycle of a channel plugin worker, so a channel writes only its own parts.

A channel subclasses ``ChannelWorker`` and implements:

* ``connect()``: open the channel API (websocket, HTTP client, webhook server);
* ``listen(submit)``: receive channel messages until ``self.stopping`` is set and
  pass each, normalised as an ``InboundMessage``, to ``submit``;
* ``deliver(delivery)``: send one ``Delivery`` to the channel; return the
  channel's message id (or None), or raise ``DeliveryFailed(reason, permanent=...)``;
* optionally ``fetch_media``/``put_media`` (attachments), ``already_delivered``
  (to close the one crash window the outbox cannot) and ``disconnect``.

``run()`` does the rest: it connects to the bridge socket named in
``UGENT_BRIDGE_SOCKET``, says hello with ``UGENT_PLUGIN_ID`` and the token
(``plugin_token()``: read from the pipe ``UGENT_PLUGIN_TOKEN_FD`` names), replays the outbox, heartbeats every ``heartbeat_secs``
(from the hello result), runs ``listen`` in a thread, long-polls outbound
deliveries and acks each one, reconnects when the socket drops, and on
SIGTERM/SIGINT stops polling, finishes the deliveries in hand, flushes what it
owes the host and exits 0. Every message passes through the outbox
(``outbox.py``), so a crash at any point neither loses nor doubles one.

Inbound submits go one at a time per chat (``conversation_id``) and chats go side
by side: a message's files are fetched (``fetch_media``) and stored (media.put)
under its chat's lock, so a download that takes minutes holds back that chat's
later messages only. A lock per chat rather than a claim per message, because a
chat's order needs one anyway: a later message must wait while an earlier one's
file is fetched, and under the lock it simply waits its turn (then sends every
earlier row first, as it always did), where after a claimed row it would have to
leave itself to the next replay; and the chat's lock is a claim on each of its rows
too, so the listener and the replay never fetch one file twice. The outbox is one
SQLite connection behind its own lock, shared by the chats' threads. A lock lives
only while a submit of its chat does, so there are never more than the threads.
A listener that submits from one thread still waits for each of its submits: one
that would let other chats by submits from several (``webhook.InboxLanes``, which
``WebhookInbox``, Slack, Discord and Telegram's polling use).
"""
from __future__ import annotations

import base64
import ctypes
import ctypes.util
import logging
import os
import random
import re
import sqlite3
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ugent_common.loglevel import log_level_name

from .client import CallCancelled, CallTimeout, ConnectionLost, RpcClient, connect_with_retry
from .jsonrpc import (DEFAULT_MAX_FRAME_BYTES, HOST_UNAVAILABLE, INVALID_PARAMS, MEDIA_TOO_LARGE, RATE_LIMITED,
                      UNKNOWN_DELIVERY, RPCError)
from .messages import Attachment, InboundMessage, Media, MessageValidationError, Delivery
from .outbox import (ACK, ACKED, FAILED, PENDING, REJECTED, RESUME, SENT, Outbox, PendingAck, outbox_path_for,
                     refusal_path_for)

SOCKET_ENV = "UGENT_BRIDGE_SOCKET"
PLUGIN_ID_ENV = "UGENT_PLUGIN_ID"
TOKEN_ENV = "UGENT_PLUGIN_TOKEN"  # the token itself: MockBridge, a worker started by hand
TOKEN_FD_ENV = "UGENT_PLUGIN_TOKEN_FD"  # the supervisor's way: the fd of an inherited pipe holding it

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2

EXIT_OK = 0
EXIT_FAILURE = 1        # the bridge stayed unreachable, or the channel failed: the supervisor restarts it
EXIT_REFUSED = 2        # hello was refused (bad token, bad params): restarting alone will not help
EXIT_CHANNEL_REFUSED = 78  # EX_CONFIG: the platform refused the worker (ChannelRefused); not restarted until an edit


_token_lock = threading.Lock()
_token_read: str | None = None  # what the pipe held: it can be read only once


def plugin_token() -> str:
    """This start's bridge token.

    The supervisor never puts it in the environment, which any process of the same user can read
    (``/proc/<pid>/environ``): it writes it into a pipe this process inherits and names the pipe's
    fd in ``UGENT_PLUGIN_TOKEN_FD``. The first call reads the pipe to its end and closes it (and
    drops the variable, so a process this one starts does not look for it); later calls return what
    it held. Without that variable: ``UGENT_PLUGIN_TOKEN`` (MockBridge, a worker started by hand),
    or "" when neither is set. Raises ``ValueError`` when the variable names no pipe.
    """
    global _token_read
    with _token_lock:
        if _token_read is not None:
            return _token_read
        raw = os.environ.get(TOKEN_FD_ENV)
        if raw is None:
            return os.environ.get(TOKEN_ENV, "")
        if not (raw.isascii() and raw.isdigit()):
            raise ValueError(f"{TOKEN_FD_ENV}={raw!r} is not a file descriptor number")
        fd = int(raw)
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise ValueError(f"{TOKEN_FD_ENV}={raw}: fd {fd} is not a pipe")
            # Without blocking: a pipe whose writer someone keeps open (a worker started by hand) gives what
            # it holds, rather than a start that waits for ever.
            os.set_blocking(fd, False)
            chunks = []
            try:
                while chunk := os.read(fd, 4096):
                    chunks.append(chunk)
            except BlockingIOError:
                pass
            os.close(fd)
        except OSError as exc:
            raise ValueError(f"{TOKEN_FD_ENV}={raw}: fd {fd} cannot be read: {exc.strerror}") from None
        del os.environ[TOKEN_FD_ENV]
        _token_read = b"".join(chunks).decode("utf-8", "replace")
        return _token_read


class DeliveryFailed(Exception):
    """Raised by ``deliver()``: the channel did not take the message.

    ``permanent=True`` when trying again cannot help (the chat is gone, the
    message is refused); the host then dead-letters the delivery at once.
    Otherwise the host retries it up to the plugin's ``max_retries``.
    """

    def __init__(self, reason: str = "delivery failed", *, permanent: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


class ChannelRefused(Exception):
    """Raised by ``connect()`` or ``listen()`` when the platform refuses this worker and only the
    operator can fix it: a bad or revoked token, a missing permission or intent, a second poller.

    The worker records ``reason`` beside its outbox and exits with ``EXIT_CHANNEL_REFUSED``; the
    supervisor then disables the plugin with the reason (the admin shows it) instead of restarting
    it in a loop. Enabling the plugin again, or editing it, starts it afresh.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class MediaNotReady(Exception):
    """Raised by ``fetch_media()`` when the platform cannot give the file now (busy, a 5xx, a network error):
    the message stays owed and the download is tried again at the next replay, for up to the worker's
    ``media_wait_secs`` from the start of the first try; then it goes on without the file, a note in its text
    saying so. Fetch with short timeouts and no retries of your own (``sdk.download`` does): the SDK's hold
    is the retry, and while a fetch runs the later messages of its chat wait for it (other chats do not).
    (Any other error is final at once: the message goes on without that file, saying so. Never with the
    platform's link, which the host cannot fetch.)"""


#: A message the host failed this many times (an error of the host's about it, not a refusal) stops holding back
#: its chat's later messages: a message that breaks the hub must not silence a chat. It is still retried. A submit
#: that got no answer in time while the host answered other calls (it hangs on this one message) is such a failure
#: too. A host that cannot answer at all (unreachable, no answer to anything in time, or -32006: its database down)
#: fails no message: its chats' messages wait, in order, however long it lasts.
HOLD_ATTEMPTS = 10
#: How long the heartbeat that follows a timed-out submit (``_host_probe``) waits: a host that is there answers a beat
#: in milliseconds; one slower than this is taken as away, which keeps the message holding its chat (the safe side).
PROBE_TIMEOUT_SECS = 2.0
#: The longest one wait after a -32007 (the plugin's submit rate; the host names the wait): then the submit is sent
#: again, and waits again if the host says so, for as long as it does.
RATE_WAIT_MAX_SECS = 5.0

_NO_LINKS = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


class _ChatLocks:
    """One lock per conversation: a chat's submits go one at a time, in order, and other chats go beside them.

    A lock exists only while a thread holds or waits for it (then it is dropped), so the table is as big as
    the submits under way, not as the chats ever seen."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, list] = {}  # conversation -> [its lock, threads holding or waiting for it]

    def acquire(self, conversation: str, *, wait: bool = True) -> bool:
        with self._guard:
            entry = self._locks.setdefault(conversation, [threading.Lock(), 0])
            entry[1] += 1
        if entry[0].acquire(blocking=wait):
            return True
        self._leave(conversation, entry)
        return False

    def release(self, conversation: str) -> None:
        with self._guard:
            entry = self._locks[conversation]
        entry[0].release()
        self._leave(conversation, entry)

    def _leave(self, conversation: str, entry: list) -> None:
        with self._guard:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[conversation]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


class _MediaWait(Exception):
    """A message held for a file ``MediaNotReady`` said to wait for; ``_send_inbound_locked`` answers queued."""


@dataclass
class SubmitResult:
    """What became of a submitted inbound message.

    ``queued`` means it is safe in the outbox but the host has not answered yet;
    it will be submitted again once the bridge is reachable. Either way the
    channel may now acknowledge the message on its side.
    """

    accepted: bool
    duplicate: bool = False
    queued: bool = False
    reason: str | None = None


class ChannelWorker:
    """Base class of a channel plugin worker (see the module docstring for what to implement)."""

    #: How long a message waits for a file ``fetch_media`` raised ``MediaNotReady`` for (seconds).
    media_wait_secs = 60.0

    kind: str = "channel-custom"
    version: str = "0.1.0"
    capabilities: tuple[str, ...] = ()

    def __init__(self, *, socket_path: str | None = None, plugin_id: str | None = None,
                 token: str | None = None, state_dir: str | None = None, outbox_path: str | None = None,
                 poll_timeout_secs: float = 25.0, call_timeout_secs: float = 10.0,
                 drain_timeout_secs: float = 10.0, reconnect_timeout_secs: float = 60.0,
                 install_signal_handlers: bool = True):
        self.socket_path = socket_path or os.environ.get(SOCKET_ENV) or ""
        self.plugin_id = plugin_id or os.environ.get(PLUGIN_ID_ENV) or ""
        self.token = token if token is not None else plugin_token()
        missing = [name for name, value in ((SOCKET_ENV, self.socket_path), (PLUGIN_ID_ENV, self.plugin_id),
                                            (f"{TOKEN_FD_ENV} (or {TOKEN_ENV})", self.token)) if not value]
        if missing:
            raise ValueError(f"worker is missing {', '.join(missing)} (set by the supervisor)")
        self.state_dir = state_dir
        self.outbox_path = outbox_path
        self.poll_timeout_secs = poll_timeout_secs
        self.call_timeout_secs = call_timeout_secs
        self.drain_timeout_secs = drain_timeout_secs
        self.reconnect_timeout_secs = reconnect_timeout_secs
        self.install_signal_handlers = install_signal_handlers
        self.log = logging.getLogger(f"ugent.worker.{self.plugin_id}")
        self.stopping = threading.Event()
        self.session: dict | None = None          # the hello result of the current session
        self.outbox: Outbox | None = None
        self._client: RpcClient | None = None
        self._drain_deadline: float | None = None
        self._chat_locks = _ChatLocks()            # one submit at a time per chat keeps its order
        # outbox key -> when its file first could not be fetched (a key is written only under its chat's lock)
        self._media_waits: dict[str, float] = {}
        self._replay_lock = threading.Lock()
        self._acks_lock = threading.Lock()
        self._acks_under_way: set[str] = set()
        self._listener: threading.Thread | None = None
        self._heartbeat: threading.Thread | None = None
        self._replayer: threading.Thread | None = None  # the background replay, woken by each beat
        self._replay_due = threading.Event()
        self._failed = False
        self._refused: str | None = None
        self._stopped = False
        self._parent_pid: int | None = None         # set by main(): a worker whose parent is gone stops

    # ---------------------------------------------------------------- the channel's part

    def connect(self) -> None:
        """Open the channel API. Raising here ends the worker with exit code 1."""

    def listen(self, submit: Callable[[InboundMessage | dict], SubmitResult]) -> None:
        """Receive channel messages and ``submit`` each until ``self.stopping`` is set.

        Runs in its own thread. Acknowledge a message to the channel only after
        ``submit`` returns: by then it is in the outbox. The default receives
        nothing (an outbound-only channel).
        """
        self.stopping.wait()

    def deliver(self, delivery: Delivery) -> str | None:
        """Send one delivery to the channel; return its channel message id, or raise ``DeliveryFailed``.

        Any other exception counts as a retryable failure.
        """
        raise NotImplementedError("a channel worker implements deliver()")

    def already_delivered(self, delivery: Delivery) -> bool:
        """Whether a delivery interrupted by a crash inside ``deliver()`` reached the channel.

        Only asked in that one case. A channel that can look (search the chat
        for the delivery id it put in the message metadata, use an idempotency
        key of the channel's API) returns True to avoid a second send; the
        default False sends again (at least once).
        """
        return False

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        """Download an inbound attachment that has a channel ``url`` but no ``media_id``.

        The bytes are stored on the host with media.put before the message is
        submitted, so the host never needs the channel's credentials. Return
        None to pass the url through as it is. Raise ``ChannelRefused`` when the
        platform refused the worker's credentials: the message stays owed (not
        submitted without its file) and the worker stops; once the plugin is
        enabled again, its replay downloads the file and submits the message.
        Raise ``MediaNotReady`` when the platform cannot give it now: the message
        waits (its chat only) for up to ``media_wait_secs``. Any other error: the
        message goes on without the file, a note in its text saying why. A
        platform that says what the file is only with its bytes may set the
        attachment's ``content_type`` and ``filename``: they are stored so.
        """
        return None

    def put_media(self, media: Media, attachment: Attachment, delivery: Delivery) -> str | None:
        """Upload one outbound attachment to the channel; return the channel's reference for it.

        Called for each attachment before ``deliver()`` when a subclass defines
        it; the reference is set as ``attachment.channel_ref``.
        """
        return None

    def disconnect(self) -> None:
        """Close the channel API; called once while shutting down."""

    def stats(self) -> dict:
        """What the heartbeat reports to the host."""
        return {"outbox": self.outbox.counts() if self.outbox else {}}

    # ---------------------------------------------------------------- helpers for the channel

    def submit(self, message: InboundMessage | dict) -> SubmitResult:
        """Record an inbound message in the outbox and submit it to the host.

        Raises ``MessageValidationError`` for a message that breaks the protocol
        (nothing is recorded). A message the host already acknowledged is not
        sent again: the channel redelivering it gets ``duplicate=True``.
        """
        msg = InboundMessage.from_dict(message) if isinstance(message, dict) else message.validate()
        row = self._outbox().inbound_record(msg)
        if row.state != PENDING:
            return self._result_from_row(row.state, row.result, duplicate=True)
        return self._send_inbound_in_order(row.key, msg.conversation_id)

    def media_get(self, media_id: str) -> Media:
        """Fetch an attachment's bytes from the host (media.get)."""
        result = self._call("media.get", {"media_id": media_id})
        return Media(base64.b64decode(result["data_base64"]), result["content_type"], result.get("filename"))

    def media_put(self, data: bytes, content_type: str, filename: str | None = None) -> str:
        """Store bytes on the host (media.put); returns the media id to put in an attachment."""
        params: dict[str, Any] = {"content_type": content_type, "data_base64": base64.b64encode(data).decode()}
        if filename:
            params["filename"] = filename
        return self._call("media.put", params)["media_id"]

    def stop(self) -> None:
        """Ask the worker to stop: no new polls, finish what is in hand, flush, exit."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout_secs
        self.stopping.set()

    # ---------------------------------------------------------------- steps (each callable alone)

    def open_session(self, *, replay: bool = True) -> dict:
        """Connect to the bridge, say hello, replay the outbox (unless told not to); returns the hello result."""
        client = connect_with_retry(self.socket_path, timeout=self.reconnect_timeout_secs, stop=self.stopping)
        try:
            result = client.call("hello", {
                "plugin_id": self.plugin_id, "token": self.token, "kind": self.kind, "version": self.version,
                "capabilities": list(self.capabilities), "protocol_version": 1, "pid": os.getpid(),
            }, timeout=self.call_timeout_secs)
        except BaseException:
            client.close()
            raise
        old, self._client = self._client, client
        if old is not None:
            old.close()
        self.session = result
        self.log.info("session %s open (heartbeat %ss, max_in_flight %s)", result.get("session_id"),
                      result.get("heartbeat_secs"), result.get("max_in_flight"))
        if replay:
            self.replay()
        return result

    def replay_acks(self) -> None:
        """Send the acks the outbox still owes (deliveries sent, their ack not answered): a start sends them
        before it polls, so the host does not hand those deliveries out again."""
        with self._replay_lock:
            self._send_owed_acks()

    def _send_owed_acks(self) -> None:
        for ack in self._outbox().outbound_pending_acks():
            self._send_ack(ack, owed_only=True)

    def replay(self) -> None:
        """Send what the outbox says is still owed: acks first, then pending inbound submits."""
        with self._replay_lock:
            self._replay()

    def _replay(self, *, background: bool = False, flush: bool = False) -> None:
        self._send_owed_acks()
        outbox = self._outbox()
        # a listener's bounded inbox (sdk.webhook.InboxQueue) is told when a replay has sent what it left
        inbox = getattr(self, "_inbox", None)
        begun = inbox.replay_begins() if hasattr(inbox, "replay_begins") else None
        held: set[str] = set()  # conversations whose earlier message the host could not take yet
        for row in outbox.inbound_pending():
            # A stop ends a replay between two rows (a row's file may take minutes): what is left stays owed. The
            # flush at the stop itself goes on until the drain time is out.
            if self.stopping.is_set() and not (flush and time.monotonic() < (self._drain_deadline or 0.0)):
                return
            conversation = row.message.get("conversation_id", "")
            if conversation in held:
                continue  # never ahead of an earlier message of its chat
            try:
                result = self._send_inbound(row.key, conversation, wait=not background)
            except ChannelRefused as exc:  # a file's download refused: the message stays owed, the worker stops
                self._refuse(exc.reason)
                self.stop()
                return
            if result is None:
                held.add(conversation)  # a submit of this chat is under way in another thread: the others go on
                continue
            if result.queued:
                if result.reason is None:
                    break  # the host is not answering; the rest waits for the next replay
                if row.attempts + 1 >= HOLD_ATTEMPTS and row.key not in self._media_waits:
                    if row.attempts + 1 == HOLD_ATTEMPTS:
                        self.log.error("inbound message %s (%s): the host failed it %d times (%s); its chat's later "
                                       "messages no longer wait for it", row.key, conversation, HOLD_ATTEMPTS,
                                       result.reason)
                    continue
                held.add(conversation)  # the host refused this one for now: other chats go on
        else:
            if begun is not None and not held:
                inbox.replay_caught_up(begun)

    def heartbeat_once(self) -> None:
        """One heartbeat, and nothing else: a beat that waited for a file's download would be missed, and the
        supervisor kills a worker whose beats stop. A beat the host answered wakes the replay thread
        (``replay_owed``), which retries what the outbox still owes."""
        client = self._client
        if client is None or client.closed:
            return
        try:
            client.call("heartbeat", {"stats": self.stats()}, timeout=self.call_timeout_secs)
        except (RPCError, ConnectionLost, CallTimeout, OSError) as exc:
            self.log.warning("heartbeat failed: %s", exc)
            return
        self._replay_due.set()

    def replay_owed(self) -> None:
        """The background replay: retries what the outbox still owes (after a transient host error), passing
        over a chat whose submit is under way in another thread; nothing if a replay is under way already."""
        counts = self._outbox().counts()
        if counts.get("inbound.pending") or counts.get("outbound.sent") or counts.get("outbound.failed"):
            if self._replay_lock.acquire(blocking=False):
                try:
                    self._replay(background=True)
                except (ConnectionLost, OSError):
                    pass
                finally:
                    self._replay_lock.release()

    def poll_once(self) -> int:
        """One outbound.poll long-poll and the handling of every delivery it returns; returns how many."""
        client = self._require_client()
        batch = int((self.session or {}).get("max_in_flight") or 1)
        try:
            result = client.call("outbound.poll", {"max_items": batch, "timeout_secs": self.poll_timeout_secs},
                                 timeout=self.poll_timeout_secs + self.call_timeout_secs, cancel=self.stopping)
        except CallCancelled:
            return 0  # stopping; what the host handed out meanwhile is requeued on the next hello
        except CallTimeout:
            self.log.warning("outbound.poll got no answer")
            return 0
        except RPCError as exc:
            self.log.warning("outbound.poll failed: %s", exc)
            self.stopping.wait(1.0)
            return 0
        handled = 0
        for raw in result.get("deliveries", []):
            if self.stopping.is_set() and self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                break  # out of drain time: the host requeues the rest for the next worker
            try:
                delivery = Delivery.from_dict(raw)
            except MessageValidationError as exc:
                self._reject_malformed(raw, exc)
                continue
            self.process_delivery(delivery)
            handled += 1
        return handled

    def process_delivery(self, delivery: Delivery) -> None:
        """Deliver once (per the outbox) and ack: the core of the outbound side."""
        outbox = self._outbox()
        decision = outbox.outbound_begin(delivery)
        if decision.action == ACK:
            self.log.info("delivery %s was already handled; acking it again without sending",
                          delivery.delivery_id)
            self._send_ack(decision.ack)
            return
        if decision.action == RESUME:
            try:
                reached = self.already_delivered(delivery)
            except Exception:  # noqa: BLE001 - an unsure answer means send again
                self.log.exception("already_delivered failed for %s", delivery.delivery_id)
                reached = False
            if reached:
                self._send_ack(outbox.outbound_sent(delivery.delivery_id))
                return
        try:
            self._put_outbound_media(delivery)
            channel_message_id = self.deliver(delivery)
        except DeliveryFailed as exc:
            ack = outbox.outbound_failed(delivery.delivery_id, retryable=not exc.permanent, reason=exc.reason)
        except Exception as exc:  # noqa: BLE001 - any other failure is worth a retry
            self.log.exception("deliver failed for %s", delivery.delivery_id)
            ack = outbox.outbound_failed(delivery.delivery_id, retryable=True,
                                         reason=f"{type(exc).__name__}: {exc}")
        else:
            ack = outbox.outbound_sent(delivery.delivery_id,
                                       channel_message_id if isinstance(channel_message_id, str) else None)
        self._send_ack(ack)

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        """Run until stopped; returns the process exit code (0 after a graceful stop)."""
        if self.install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        self._outbox()
        code = EXIT_OK
        refusal = refusal_path_for(self.plugin_id, self.state_dir)
        refusal.unlink(missing_ok=True)
        try:
            self.connect()
        except ChannelRefused as exc:
            self._refuse(exc.reason)
            self._close_outbox()
            return EXIT_CHANNEL_REFUSED
        except Exception:  # noqa: BLE001
            self.log.exception("connect() failed")
            self._close_outbox()
            return EXIT_FAILURE
        unreachable_since: float | None = None
        try:
            while not self.stopping.is_set():
                try:
                    self.open_session(replay=False)
                    self._start_beating()
                    # the acks the outbox owes, before the first poll: the host hands out nothing already sent
                    self.replay_acks()
                except RPCError as exc:
                    self.log.error("hello refused: %s", exc)
                    code = EXIT_REFUSED
                    break
                except (ConnectionLost, CallTimeout, OSError) as exc:
                    self._drop_client()
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    if self.stopping.is_set():
                        break
                    if now - unreachable_since >= self.reconnect_timeout_secs:
                        self.log.error("bridge unreachable for %.0f s: %s", now - unreachable_since, exc)
                        code = EXIT_FAILURE
                        break
                    self.stopping.wait(0.2)
                    continue
                unreachable_since = None
                self._start_threads()
                # The opening replay runs on the replay thread, beside polling and the listener: a backlog owed
                # since before a restart (its files to download, the bridge's submit rate to wait out) must not
                # hold up every outbound delivery and new message until it is all in. A chat's order holds: a
                # new message of a chat goes after its owed ones (_send_inbound_in_order).
                self._replay_due.set()
                try:
                    while not self.stopping.is_set():
                        self.poll_once()
                except (ConnectionLost, OSError) as exc:
                    self._drop_client()
                    if self.orphaned():
                        # the supervisor (or the wrapper it started us through) is gone: nobody will
                        # restart or stop this worker, so it must not linger reconnecting
                        self.log.error("bridge connection lost and the parent process is gone; stopping")
                        code = EXIT_FAILURE
                        break
                    self.log.warning("bridge connection lost (%s); reconnecting", exc)
            if self._failed:
                code = EXIT_FAILURE
        finally:
            self._shutdown()
        return EXIT_CHANNEL_REFUSED if self._refused is not None else code

    def _refuse(self, reason: str) -> None:
        """Record why the platform refused this worker, where the supervisor reads it after the exit."""
        self._refused = reason
        self.log.error("the channel refused this worker: %s", reason)
        path = refusal_path_for(self.plugin_id, self.state_dir)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(reason[:500])
            tmp.replace(path)
        except OSError:
            self.log.exception("could not record the refusal at %s", path)

    @classmethod
    def main(cls, **kwargs: Any) -> None:
        """Entry point for a worker executable: log to stderr, die with the parent, run, exit with run()'s code."""
        try:  # the daemon's rule (ugent_common/logs.py): any level name logging knows, any case, empty = INFO
            level = log_level_name(os.environ.get("UGENT_LOG_LEVEL"))
        except ValueError as exc:
            sys.exit(f"{cls.__name__}: {exc}")
        logging.basicConfig(level=level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # httpx logs each request's URL at INFO, and platforms put tokens in URLs (Telegram's Bot API, WeCom's
        # access_token, signed download links): keep them out of the log, and the log about the worker
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        worker = cls(**kwargs)
        worker.die_with_parent()
        sys.exit(worker.run())

    def die_with_parent(self) -> None:
        """Stop when the process that started this worker dies, even by ``kill -9``.

        The supervisor gives its direct child a parent-death signal, but a worker
        started through a wrapper (``sh -c "python -m worker ; true"``) is the
        wrapper's child and inherits none: on Linux it asks for SIGTERM (a graceful
        stop) when its own parent dies. Elsewhere ``orphaned()`` stops it once the
        bridge connection drops.
        """
        self._parent_pid = os.getppid()
        prctl = _prctl()
        if prctl is None:
            return
        current = ctypes.c_int(0)
        if prctl(PR_GET_PDEATHSIG, ctypes.addressof(current), 0, 0, 0) == 0 and current.value == 0:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != self._parent_pid:
            self.stop()  # the parent died before the request took effect: no signal will come

    def orphaned(self) -> bool:
        """The parent recorded by ``die_with_parent`` is gone (this process was re-parented)."""
        return self._parent_pid is not None and os.getppid() != self._parent_pid

    def state_path(self, what: str, ext: str) -> str:
        """A file of the worker's own beside its outbox, ``<plugin id>.<kind>-<what>.<ext>`` (the kind without
        ``channel-``): its sent-parts journal (``sent``), the signatures its webhook saw (``seen``)."""
        name = self.kind.removeprefix("channel-")
        return str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.sqlite3", f".{name}-{what}.{ext}")

    # ---------------------------------------------------------------- internals

    def _outbox(self) -> Outbox:
        if self._stopped:
            raise ConnectionLost("worker stopped")
        if self.outbox is None:
            self.outbox = Outbox(self.outbox_path, plugin_id=self.plugin_id, state_dir=self.state_dir)
        return self.outbox

    def _require_client(self) -> RpcClient:
        client = self._client
        if client is None or client.closed:
            raise ConnectionLost("not connected to the bridge")
        return client

    def _call(self, method: str, params: dict) -> Any:
        return self._require_client().call(method, params, timeout=self.call_timeout_secs)

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _start_beating(self) -> None:
        """The heartbeat thread (it only beats) and the replay thread its beats wake; once, at the first hello."""
        # each kept only once it runs: a thread that could not start (a worker at its memory cap, which counts
        # each thread's stack) must not be joined by the stop, which would fail over it before its flush
        if self._heartbeat is None:
            self._heartbeat = _started(threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True))
        if self._replayer is None:
            self._replayer = _started(threading.Thread(target=self._replay_loop, name="outbox-replay", daemon=True))

    def _start_threads(self) -> None:
        self._start_beating()
        if self._listener is None:
            self._listener = _started(threading.Thread(target=self._listen_main, name="listener", daemon=True))

    def _heartbeat_loop(self) -> None:
        while True:
            interval = float((self.session or {}).get("heartbeat_secs") or 30)
            if self.stopping.wait(max(interval, 0.01)):
                return
            try:
                self.heartbeat_once()
            except Exception:  # noqa: BLE001 - the heartbeat thread must outlive one bad beat
                self.log.exception("heartbeat step failed")

    def _replay_loop(self) -> None:
        while not self.stopping.is_set():
            if not self._replay_due.wait(0.5):
                continue
            self._replay_due.clear()
            if self.stopping.is_set():
                return
            try:
                self.replay_owed()
            except Exception:  # noqa: BLE001 - the replay thread must outlive one bad replay
                self.log.exception("background replay failed")

    def _listen_main(self) -> None:
        try:
            self.listen(self.submit)
        except ChannelRefused as exc:
            self._refuse(exc.reason)
            self.stop()
            return
        except Exception:  # noqa: BLE001
            self.log.exception("listen() failed")
            self._failed = True
        if not self.stopping.is_set():
            # A listener that returns on its own leaves the channel deaf: stop and let the supervisor restart.
            self.log.error("listen() returned before stop; stopping the worker")
            self._failed = True
            self.stop()

    def _result_from_row(self, state: str, result: dict | None, *, duplicate: bool) -> SubmitResult:
        result = result or {}
        if state == REJECTED:
            return SubmitResult(False, duplicate=duplicate, reason=result.get("reason"))
        return SubmitResult(bool(result.get("accepted", True)), duplicate=duplicate or bool(result.get("duplicate")),
                            reason=result.get("reason"))

    def _send_inbound(self, key: str, conversation: str, *, wait: bool = True) -> SubmitResult | None:
        """Submit one pending row of ``conversation``; with ``wait=False`` return None at once if a submit of
        that chat is under way in another thread."""
        if not self._chat_locks.acquire(conversation, wait=wait):
            return None
        try:
            return self._send_inbound_locked(key)
        finally:
            self._chat_locks.release(conversation)

    def _send_inbound_in_order(self, key: str, conversation_id: str) -> SubmitResult:
        """Submit one new row, after every earlier row of its conversation the host has not taken yet.

        A message queued while the host was away (or refused for now) is sent before a later one of its
        chat, so the agent reads a chat's messages in the order they were written; a later one waits
        (queued) while an earlier one still cannot go. Other chats are not held back: the lock is the chat's,
        so another chat's submit goes on while this one's file is fetched."""
        self._chat_locks.acquire(conversation_id)
        try:
            pending = self._outbox().inbound_pending()
            keys = [row.key for row in pending]
            # Only the rows before this one. Sent meanwhile by another thread (the replay took it while this one
            # waited for the lock), it is no longer pending, and every pending row of its chat is a later message,
            # not this call's to send: it would download their files (a lane closed at a stop too, past its one
            # message in hand) and answer for this message what became of them.
            for earlier in pending[:keys.index(key)] if key in keys else []:
                if earlier.message.get("conversation_id") != conversation_id:
                    continue
                if earlier.attempts >= HOLD_ATTEMPTS:
                    continue  # the host failed it again and again: it no longer holds its chat (the replay still tries)
                if earlier.key in self._media_waits:  # its file is awaited: only the replay tries it again
                    return SubmitResult(False, queued=True, reason="waiting for a file of an earlier message")
                result = self._send_inbound_locked(earlier.key)
                if result.queued:
                    return SubmitResult(False, queued=True, reason=result.reason)
            return self._send_inbound_locked(key)
        finally:
            self._chat_locks.release(conversation_id)

    def _send_inbound_locked(self, key: str) -> SubmitResult:
        """Submit one row, its files fetched and stored first; the caller holds the lock of the row's chat, so
        no other thread fetches, stores or submits this row meanwhile."""
        outbox = self._outbox()
        row = outbox.inbound_get(key)
        if row is None or row.state != PENDING:
            return self._result_from_row(row.state if row else ACKED, row.result if row else None,
                                         duplicate=False)
        client = self._client
        if client is None or client.closed:
            return SubmitResult(False, queued=True)
        counted = False
        sent_at: float | None = None
        try:
            message = self._store_inbound_media(key, row.message)
            outbox = self._outbox()  # (not if the worker closed it while the file downloaded: it stays owed)
            # Counted before the call, so a message that kills the worker while it is under way (its file, the
            # host's answer) counts too, and stops holding its chat after HOLD_ATTEMPTS restarts; taken back
            # below when the host turns out to have been away.
            outbox.inbound_attempted(key)
            counted = True
            sent_at = time.monotonic()
            result = self._submit_within_rate(client, key, message)
        except _MediaWait as exc:
            return SubmitResult(False, queued=True, reason=str(exc))  # this chat waits; the others go on
        except RPCError as exc:
            if exc.code == INVALID_PARAMS:
                # The host will refuse this message however often it is sent.
                self.log.error("inbound message %s refused: %s", key, exc.message)
                outbox.inbound_rejected(key, exc.message)
                return SubmitResult(False, reason=exc.message)
            if exc.code == HOST_UNAVAILABLE:
                # The host cannot serve anything now (its database is down): as when it is unreachable, the message
                # waits, its chat's later messages behind it, however long that lasts; not a failure of its own.
                self.log.warning("inbound.submit: the host is unavailable (%s), will retry", _data_reason(exc))
                if counted:
                    self._attempt_undone(key)
                return SubmitResult(False, queued=True)
            if not counted:  # (its file's media.put, before the call)
                outbox.inbound_attempted(key)
            # the host failed this message: HOLD_ATTEMPTS of these and it holds no more
            self.log.warning("inbound.submit failed, will retry: %s", exc)
            return SubmitResult(False, queued=True, reason=exc.message)
        except CallTimeout as exc:
            if sent_at is not None and not client.last_response_at > sent_at:
                self._host_probe(client)  # nothing else was answered meanwhile: ask the host whether it is there
            if sent_at is not None and client.last_response_at > sent_at:
                # The host answered other calls (a heartbeat, another chat's submit, the probe) while this one got
                # no answer: it is there and hangs on this message, which must not hold its chat for ever: the try
                # counts.
                self.log.warning("inbound.submit of %s timed out while the host answered other calls: counted as "
                                 "a failed try", key)
                return SubmitResult(False, queued=True, reason=f"{exc} while the host answered other calls")
            if counted:  # no answer to anything since the call went out: the host is away
                self._attempt_undone(key)
            return SubmitResult(False, queued=True)
        except (ConnectionLost, OSError):
            if counted:
                self._attempt_undone(key)
            return SubmitResult(False, queued=True)
        self._outbox().inbound_acked(key, result)  # (closed meanwhile: owed, and the host answers a repeat duplicate)
        return SubmitResult(bool(result.get("accepted")), duplicate=bool(result.get("duplicate")),
                            reason=result.get("reason"))

    def _submit_within_rate(self, client: RpcClient, key: str, message: dict) -> dict:
        """``inbound.submit``, sent again after each -32007 once the wait the host names (``retry_after_secs``, with a
        little jitter, at most ``RATE_WAIT_MAX_SECS``) is over, until the host takes it. The host took nothing, so the
        message keeps its place (its chat's later messages wait behind it) and counts no try; its lock is the chat's,
        so the other chats go on. A stop ends the wait (within the drain time, during the flush): the message stays
        owed in the outbox, ``ConnectionLost`` says so to the caller."""
        while True:
            try:
                return client.call("inbound.submit", {"message": message}, timeout=self.call_timeout_secs)
            except RPCError as exc:
                if exc.code != RATE_LIMITED:
                    raise
                data = exc.data if isinstance(exc.data, dict) else {}
                after = data.get("retry_after_secs")
                after = float(after) if isinstance(after, (int, float)) and not isinstance(after, bool) else 1.0
                wait = min(max(after, 0.01) * (1.0 + random.random() / 4), RATE_WAIT_MAX_SECS)
            self.log.debug("inbound.submit of %s: over the plugin's submit rate, again in %.2f s", key, wait)
            if not self.stopping.is_set():
                if not self.stopping.wait(wait):
                    continue
            deadline = self._drain_deadline
            if deadline is None or time.monotonic() + wait > deadline:
                raise ConnectionLost("stopping while the host limits the submit rate: the message stays owed")
            time.sleep(wait)  # the flush at the stop, within its drain time

    def _host_probe(self, client: RpcClient) -> None:
        """One heartbeat after a submit timed out with no other call answered meanwhile: a host that answers it (not
        with -32006) is there and hangs on that message alone, which ``client.last_response_at`` then says; one that
        answers nothing within ``PROBE_TIMEOUT_SECS`` (or the call timeout, if shorter) is away. Without it, whether
        a hung submit counted depended on whether a beat, a poll or another chat's submit happened to be answered
        inside its window, and with the default timings such a message held its chat for minutes."""
        try:
            client.call("heartbeat", {"stats": self.stats()}, timeout=min(self.call_timeout_secs, PROBE_TIMEOUT_SECS))
        except (RPCError, ConnectionLost, CallTimeout, OSError):
            pass

    def _attempt_undone(self, key: str) -> None:
        """Take back the try counted for a call the host never served; if the worker closed its outbox meanwhile
        (a stop), the try stays counted: one of HOLD_ATTEMPTS, harmless."""
        try:
            self._outbox().inbound_attempt_undone(key)
        except (ConnectionLost, sqlite3.Error):
            pass

    def _store_inbound_media(self, key: str, message: dict) -> dict:
        if type(self).fetch_media is ChannelWorker.fetch_media:
            return message
        changed = False
        notes: list[str] = []
        for att in message.get("attachments", []):
            att.pop("_drop", None)  # (a mark left by an earlier try that then waited: this try decides anew)
            if att.get("media_id") or not att.get("url"):
                continue
            # the wait is counted from the start of the first try, so a fetch that hangs until its timeout counts
            started = time.monotonic()
            fetched = Attachment.from_dict(att)
            try:
                data = self.fetch_media(fetched)
            except ChannelRefused:
                raise  # the platform refused the worker: the message waits, file and all, for its return
            except Exception as exc:  # noqa: BLE001 - the message goes on, or waits (MediaNotReady)
                refusal = getattr(self, "_refusal", None)  # a webhook worker's way to say so (WebhookInbox)
                if refusal:
                    raise ChannelRefused(refusal) from None
                # what the error says, without its links: an HTTP error names its URL, and platforms put tokens
                # in URLs (Telegram's in the path, WeChat's in the query); the note goes to the model
                why = _NO_LINKS.sub("<link>", str(exc) or type(exc).__name__)[:200]
                if isinstance(exc, MediaNotReady):
                    first = self._media_waits.setdefault(key, started)
                    if time.monotonic() - first < self.media_wait_secs:
                        self.log.warning("inbound message %s waits for its file, which the channel cannot give "
                                         "now: %s", key, why)
                        if changed:  # the files fetched so far are kept: the next try does not fetch them again
                            self._outbox().inbound_update_message(key, message)
                        raise _MediaWait(f"waiting for a file: {why}") from None
                else:  # (not exc_info: a traceback would print the links stripped above)
                    self.log.warning("fetch_media failed for inbound message %s (%s): %s", key,
                                     type(exc).__name__, why)
                kind = att.get("kind") or "file"
                name = att.get("filename") or "the " + kind
                notes.append(f"[{name} could not be fetched from the channel: {why}]")
                att["_drop"] = True
                changed = True
                continue
            if data is None:
                continue
            # what the download said the file is (a platform that names the type only with the bytes)
            att["content_type"] = fetched.content_type or att.get("content_type")
            att["filename"] = fetched.filename or att.get("filename")
            # The host will never take a file over its media limit (media.put answers -32005), nor one whose
            # base64 does not fit in a frame (never answered at all: the call times out). Such a message goes
            # on without the file, saying so: kept pending, it would be fetched again at every replay and
            # hold back every message recorded after it.
            limit = None
            if len(data) > self._media_frame_room():
                limit = 0  # (the frame's bound, not the host's configured limit: no number said)
            else:
                try:
                    att["media_id"] = self.media_put(data, att["content_type"], att.get("filename"))
                except RPCError as exc:
                    if exc.code != MEDIA_TOO_LARGE:
                        raise
                    limit = (exc.data or {}).get("max_bytes") if isinstance(exc.data, dict) else 0
            if limit is not None:
                kind = att.get("kind") or "file"
                name = att.get("filename") or ("an " if kind[:1] in "aeiou" else "a ") + kind
                notes.append(f"[{name} ({len(data)} bytes) was not kept: over the host's media limit"
                             + (f" of {limit} bytes" if limit else "") + "]")
                att["_drop"] = True
                self.log.warning("inbound message %s: %s", key, notes[-1])
                changed = True
                continue
            att["size"] = len(data)
            changed = True
        self._media_waits.pop(key, None)
        if notes:
            message["attachments"] = [a for a in message.get("attachments", []) if not a.get("_drop")]
            message["text"] = "\n\n".join([t for t in [message.get("text") or ""] if t.strip()] + notes)
        if changed:
            self._outbox().inbound_update_message(key, message)  # a replay reuses the stored media
        return message

    def _media_frame_room(self) -> int:
        """The largest file one media.put frame can carry: its base64 (4 bytes for 3) and the call around it
        within the session's max_frame_bytes."""
        frame = int((self.session or {}).get("max_frame_bytes") or DEFAULT_MAX_FRAME_BYTES)
        return max(0, (frame - 1024) * 3 // 4)

    def _put_outbound_media(self, delivery: Delivery) -> None:
        if type(self).put_media is ChannelWorker.put_media:
            return
        for att in delivery.attachments:
            if att.media_id and not att.channel_ref:
                try:
                    media = self.media_get(att.media_id)
                except RPCError as exc:
                    raise DeliveryFailed(f"media {att.media_id}: {exc.message}", permanent=True) from exc
                att.channel_ref = self.put_media(media, att, delivery)

    def _send_ack(self, ack: PendingAck, *, owed_only: bool = False) -> None:
        with self._acks_lock:
            if ack.delivery_id in self._acks_under_way:
                return  # another thread is sending this very ack; a second copy would only be a duplicate
            self._acks_under_way.add(ack.delivery_id)
        try:
            if owed_only and self._outbox().outbound_state(ack.delivery_id) not in (SENT, FAILED):
                return  # settled since the replay listed it
            self._send_ack_once(ack)
        finally:
            with self._acks_lock:
                self._acks_under_way.discard(ack.delivery_id)

    def _send_ack_once(self, ack: PendingAck) -> None:
        outbox = self._outbox()
        try:
            self._call("outbound.ack", ack.params())
        except RPCError as exc:
            if exc.code in (UNKNOWN_DELIVERY, INVALID_PARAMS):
                # Nothing the host will ever accept: settle it here rather than retry forever.
                self.log.error("ack for %s refused: %s", ack.delivery_id, exc)
                outbox.outbound_acked(ack.delivery_id)
            else:
                self.log.warning("ack for %s failed, will retry: %s", ack.delivery_id, exc)
            return
        except CallTimeout:
            self.log.warning("ack for %s got no answer, will retry", ack.delivery_id)
            return
        outbox.outbound_acked(ack.delivery_id)

    def _reject_malformed(self, raw: Any, exc: MessageValidationError) -> None:
        delivery_id = raw.get("delivery_id") if isinstance(raw, dict) else None
        self.log.error("malformed delivery %r: %s", delivery_id, exc)
        if isinstance(delivery_id, str) and delivery_id:
            claim = raw.get("claim") if isinstance(raw.get("claim"), str) else None
            self._send_ack(PendingAck(delivery_id, "failed", retryable=False, reason=f"malformed delivery: {exc}",
                                      claim=claim))

    def _shutdown(self) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout_secs
        self.stopping.set()
        if self._listener is not None:
            self._listener.join(max(0.0, self._drain_deadline - time.monotonic()))
        client = self._client
        if client is not None and not client.closed:
            try:
                with self._replay_lock:  # flush what the host is still owed before leaving (not a chat still
                    self._replay(background=True, flush=True)  # under way in a thread that outlived the drain)
            except (ConnectionLost, OSError):
                pass
        for thread in (self._heartbeat, self._replayer):
            if thread is not None:
                thread.join(1.0)
        self._drop_client()
        try:
            self.disconnect()
        except Exception:  # noqa: BLE001
            self.log.exception("disconnect() failed")
        self._close_outbox()
        self.log.info("worker stopped")

    def _close_outbox(self) -> None:
        self._stopped = True
        if self.outbox is not None:
            self.outbox.close()
            self.outbox = None


def _started(thread: threading.Thread) -> threading.Thread:
    thread.start()
    return thread


def _data_reason(exc: RPCError) -> str:
    """The ``reason`` a hub put in an error's data, else the error's message."""
    data = exc.data if isinstance(exc.data, dict) else {}
    return str(data.get("reason") or exc.message)


def _prctl():
    """libc's prctl on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn
