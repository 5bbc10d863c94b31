"""``InMemoryHub``: a complete hub kept in memory, the SDK's test host (``MockBridge``) and the reference hub.

Its delivery state machine is ``plugins_app.channel.bridge.policy``'s, the same the Django hub keeps.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from plugins_app.channel.bridge.errors import MediaNotFound, MediaTooLarge, UnknownDelivery
from plugins_app.channel.bridge.hub import Hub
from plugins_app.channel.bridge.policy import DEAD_LETTER, DELIVERED, IN_FLIGHT, PENDING, DeliveryPolicy, new_claim
from plugins_app.channel.sdk.messages import InboundMessage, Media, Delivery, utc_now

DEFAULT_MEDIA_MAX_BYTES = 8 * 1024 * 1024


@dataclass
class DeliveryRecord:
    """One outbound delivery as the hub tracks it."""

    delivery: Delivery
    seq: int
    state: str = PENDING
    not_before: float = 0.0
    handed_out: int = 0
    failures: list[str] = field(default_factory=list)
    reason: str | None = None
    permanent: bool = False
    channel_message_id: str | None = None
    claim: str = ""

    @property
    def attempt(self) -> int:
        return self.delivery.attempt

    def snapshot(self) -> dict:
        return {"delivery_id": self.delivery.delivery_id, "state": self.state, "attempt": self.attempt,
                "handed_out": self.handed_out, "failures": list(self.failures), "reason": self.reason,
                "permanent": self.permanent, "channel_message_id": self.channel_message_id,
                "claim": self.claim}


class InMemoryHub(Hub):
    """A complete hub kept in memory: the tests' host, with the Django hub's delivery semantics.

    * ``submit_inbound`` accepts each (conversation_id, message_id) once; a
      repeat answers ``duplicate: true`` with the first outcome.
    * ``poll_outbound`` takes what ``DeliveryPolicy.room`` allows, marks it with
      a claim, and waits (long-poll) for a delivery or a free slot.
    * ``ack_outbound`` does what ``DeliveryPolicy.ack`` decides (retries, backoff,
      dead letters, stale claims).
    * a new hello returns every in-flight delivery to the queue.

    State is guarded by a lock, so a test thread may enqueue and inspect while
    the bridge runs on its own loop.
    """

    def __init__(self, *, max_in_flight: int = 64, max_retries: int = 5, heartbeat_secs: float = 30.0,
                 retry_backoff_secs: float = 0.0, retry_backoff_max_secs: float = 300.0,
                 media_max_bytes: int = DEFAULT_MEDIA_MAX_BYTES, allowed_senders: set[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.max_in_flight = max_in_flight
        self.max_retries = max_retries
        self.heartbeat_secs = heartbeat_secs
        self.retry_backoff_secs = retry_backoff_secs
        self.retry_backoff_max_secs = retry_backoff_max_secs
        self.media_max_bytes = media_max_bytes
        self.allowed_senders = allowed_senders
        self.clock = clock
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._deliveries: dict[str, DeliveryRecord] = {}
        self._inbound: dict[tuple[str, str], dict] = {}
        self._media: dict[str, Media] = {}
        self.inbound: list[InboundMessage] = []        # accepted, once each
        self.submit_log: list[InboundMessage] = []     # every submit, repeats included
        self.ack_log: list[dict] = []                   # every ack as received
        self.hellos: list[dict] = []
        self.heartbeats = 0
        self.sessions_closed = 0
        self.max_in_flight_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()

    @property
    def policy(self) -> DeliveryPolicy:
        """The delivery policy of these limits (read each time: a test may change a limit)."""
        return DeliveryPolicy(max_in_flight=self.max_in_flight, max_retries=self.max_retries,
                              backoff_secs=self.retry_backoff_secs, backoff_max_secs=self.retry_backoff_max_secs)

    # -- wakeups (pollers wait on an event of the bridge's loop) ---------------------

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def _wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def _notify(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
        else:
            loop.call_soon_threadsafe(self._wake)

    # -- test helpers -------------------------------------------------------------

    def enqueue(self, conversation_id: str = "conv-1", text: str = "hello", *, delivery_id: str | None = None,
                channel: str = "", attachments: list | None = None, reply_to_message_id: str | None = None,
                metadata: dict | None = None) -> str:
        """Queue an outbound delivery (from any thread); returns its id."""
        delivery = Delivery(
            delivery_id=delivery_id or f"d_{uuid.uuid4().hex[:12]}", conversation_id=conversation_id,
            text=text, channel=channel, attachments=list(attachments or []),
            reply_to_message_id=reply_to_message_id, attempt=1, created_at=utc_now(), metadata=dict(metadata or {}))
        delivery.validate()
        with self._lock:
            if delivery.delivery_id in self._deliveries:
                raise ValueError(f"delivery {delivery.delivery_id} exists")
            self._deliveries[delivery.delivery_id] = DeliveryRecord(delivery, next(self._seq))
        self._notify()
        return delivery.delivery_id

    def delivery(self, delivery_id: str) -> dict | None:
        with self._lock:
            record = self._deliveries.get(delivery_id)
            return None if record is None else record.snapshot()

    def deliveries(self, state: str | None = None) -> list[dict]:
        with self._lock:
            return [r.snapshot() for r in sorted(self._deliveries.values(), key=lambda r: r.seq)
                    if state is None or r.state == state]

    def dead_letters(self) -> list[dict]:
        return self.deliveries(DEAD_LETTER)

    def in_flight_count(self) -> int:
        with self._lock:
            return sum(1 for r in self._deliveries.values() if r.state == IN_FLIGHT)

    def stored_media(self, media_id: str) -> Media | None:
        with self._lock:
            return self._media.get(media_id)

    def store_media(self, data: bytes, content_type: str, filename: str | None = None) -> str:
        """Put media on the host side (as the conversation hub would), for a delivery's attachment."""
        with self._lock:
            media_id = f"m_{uuid.uuid4().hex}"
            self._media[media_id] = Media(bytes(data), content_type, filename)
        return media_id

    # -- the Hub ------------------------------------------------------------------

    async def hello_ok(self, plugin_id: str, info: dict) -> dict:
        self._bind_loop()
        with self._lock:
            self.hellos.append(dict(info, plugin_id=plugin_id))
            for record in self._deliveries.values():
                if record.state == IN_FLIGHT:
                    record.state, record.claim = PENDING, ""  # the previous session's worker may be gone
        self._notify()
        return {"heartbeat_secs": self.heartbeat_secs, "max_in_flight": self.max_in_flight,
                "max_retries": self.max_retries}

    async def heartbeat(self, plugin_id: str, stats: dict) -> None:
        with self._lock:
            self.heartbeats += 1

    async def submit_inbound(self, plugin_id: str, message: InboundMessage) -> dict:
        key = (message.conversation_id, message.message_id)
        with self._lock:
            self.submit_log.append(message)
            first = self._inbound.get(key)
            if first is not None:
                return dict(first, duplicate=True)
            if self.allowed_senders is not None and f"{message.channel}:{message.sender_id}" not in self.allowed_senders:
                outcome = {"accepted": False, "reason": "sender not allowed"}
            else:
                outcome = {"accepted": True}
                self.inbound.append(message)
            self._inbound[key] = outcome
            return dict(outcome, duplicate=False)

    def _take(self, max_items: int) -> list[Delivery]:
        now = self.clock()
        in_flight = sum(1 for r in self._deliveries.values() if r.state == IN_FLIGHT)
        room = self.policy.room(in_flight=in_flight, max_items=max_items)
        taken: list[Delivery] = []
        if room <= 0:
            return taken
        claim = new_claim()
        for record in sorted(self._deliveries.values(), key=lambda r: r.seq):
            if len(taken) >= room:
                break
            if record.state == PENDING and record.not_before <= now:
                record.state, record.claim = IN_FLIGHT, claim
                record.handed_out += 1
                record.delivery.claim = claim
                taken.append(record.delivery)
        self.max_in_flight_seen = max(self.max_in_flight_seen, in_flight + len(taken))
        return taken

    def _next_due(self) -> float | None:
        due = [r.not_before for r in self._deliveries.values() if r.state == PENDING]
        return min(due) if due else None

    async def poll_outbound(self, plugin_id: str, max_items: int, timeout: float) -> list[Delivery]:
        self._bind_loop()
        deadline = self.clock() + timeout
        while True:
            # Capture the event in the same step as the check: a wakeup can only come after it.
            event = self._event
            with self._lock:
                taken = self._take(max_items)
                next_due = self._next_due()
            now = self.clock()
            if taken or now >= deadline:
                return [Delivery.from_dict(d.to_dict()) for d in taken]  # copies: the wire's view
            wait = deadline - now
            if next_due is not None and next_due > now:
                wait = min(wait, next_due - now)  # a retry becomes due before the deadline
            try:
                await asyncio.wait_for(event.wait(), timeout=max(wait, 0.001))
            except asyncio.TimeoutError:
                pass

    async def ack_outbound(self, plugin_id: str, delivery_id: str, status: str, retryable: bool,
                           reason: str | None, channel_message_id: str | None = None,
                           claim: str | None = None) -> dict:
        with self._lock:
            self.ack_log.append({"delivery_id": delivery_id, "status": status, "retryable": retryable,
                                 "reason": reason, "channel_message_id": channel_message_id})
            record = self._deliveries.get(delivery_id)
            if record is None:
                raise UnknownDelivery(delivery_id)
            decision = self.policy.ack(state=record.state, attempt=record.attempt, held_claim=record.claim,
                                       status=status, retryable=retryable, reason=reason, claim=claim)
            if not decision.changed:
                return decision.result()
            record.state, record.claim = decision.state, ""
            record.delivery.attempt = decision.attempt
            if decision.state == DELIVERED:
                record.channel_message_id = channel_message_id
            if decision.failure is not None:
                record.failures.append(decision.failure)
            if decision.state == DEAD_LETTER:
                record.reason, record.permanent = decision.dead_letter_reason, decision.permanent
            if decision.backoff_secs is not None:
                record.not_before = self.clock() + decision.backoff_secs
            outcome = decision.result()
        self._notify()  # a slot is free, or a retry is queued
        return outcome

    async def requeue_outbound(self, plugin_id: str, delivery_ids: list[str]) -> None:
        with self._lock:
            for delivery_id in delivery_ids:
                record = self._deliveries.get(delivery_id)
                if record is not None and record.state == IN_FLIGHT:
                    record.state, record.claim = PENDING, ""
        self._notify()

    async def media_get(self, plugin_id: str, media_id: str) -> Media:
        with self._lock:
            media = self._media.get(media_id)
        if media is None:
            raise MediaNotFound(media_id)
        return media

    async def media_put(self, plugin_id: str, media: Media) -> str:
        if media.size > self.media_max_bytes:
            raise MediaTooLarge(media.size, self.media_max_bytes)
        return self.store_media(media.data, media.content_type, media.filename)

    async def session_closed(self, plugin_id: str) -> None:
        with self._lock:
            self.sessions_closed += 1

