"""The hub interface: what the bridge needs from the host (the Django hub, or ``InMemoryHub`` in tests)."""
from __future__ import annotations

import abc
import asyncio
import weakref
from typing import Any, Awaitable, Callable

from plugins_app.channel.sdk.messages import InboundMessage, Media, Delivery


class Hub(abc.ABC):
    """What the bridge needs from the host; one hub may serve many plugins.

    Every method is a coroutine run on the bridge's event loop; a hub backed by
    blocking code (the ORM) wraps it (``asyncio.to_thread``/``sync_to_async``).
    A method may raise the ``RPCError`` subclasses of ``bridge.errors``; any other exception
    reaches the worker as -32603 Internal error.

    Every plugin's bridge shares one event loop and its default thread pool: a hub that hands
    blocking work to that pool wraps it in ``in_share`` so that one plugin never has more than
    ``EXECUTOR_SHARE`` jobs in it at once and another plugin's call queues behind a few of its
    jobs, not behind all of them. A plugin's liveness calls (hello, heartbeat) have a lane of their own
    (``lane="beat"``, one job): a worker asks a heartbeat to learn whether the host still answers while its
    submits hang (the SDK's host probe), so it must not queue behind them.
    """

    EXECUTOR_SHARE = 2
    LANES = {"work": EXECUTOR_SHARE, "beat": 1}

    def in_share(self, plugin_id: str, fn: Callable[..., Awaitable[Any]],
                 lane: str = "work") -> Callable[..., Awaitable[Any]]:
        """``fn`` (a coroutine function that hands work to the shared thread pool) run within the plugin's share
        of that lane."""
        async def shared(*args: Any, **kwargs: Any) -> Any:
            async with self._share(plugin_id, lane):
                return await fn(*args, **kwargs)
        return shared

    def _share(self, plugin_id: str, lane: str) -> asyncio.Semaphore:
        # One semaphore per plugin, lane and event loop (a semaphore belongs to the loop it first waits on).
        shares = self.__dict__.setdefault("_shares", weakref.WeakKeyDictionary())
        per_loop = shares.setdefault(asyncio.get_running_loop(), {})
        if (plugin_id, lane) not in per_loop:
            per_loop[(plugin_id, lane)] = asyncio.Semaphore(self.LANES[lane])
        return per_loop[(plugin_id, lane)]

    @abc.abstractmethod
    async def hello_ok(self, plugin_id: str, info: dict) -> dict:
        """A worker authenticated. ``info``: kind, version, capabilities, pid, peer_pid, peer_uid, session_id.

        This is a new session: every delivery still in flight to the plugin is
        returned to the queue (the outbox acks or redelivers them, never twice).
        Returns the plugin's limits: ``heartbeat_secs``, ``max_in_flight``, ``max_retries``.
        """

    @abc.abstractmethod
    async def heartbeat(self, plugin_id: str, stats: dict) -> None:
        """The worker is alive; ``stats`` is whatever it chose to report (may be empty)."""

    @abc.abstractmethod
    async def submit_inbound(self, plugin_id: str, message: InboundMessage) -> dict:
        """Accept one validated inbound message, at most once per (conversation_id, message_id).

        Returns ``{"accepted": bool, "duplicate": bool}`` plus anything useful
        (``reason`` for a refusal, a receipt id). A repeat returns the first
        outcome with ``duplicate: true`` and changes nothing.
        """

    @abc.abstractmethod
    async def poll_outbound(self, plugin_id: str, max_items: int, timeout: float) -> list[Delivery]:
        """Hand out up to ``max_items`` deliveries, waiting up to ``timeout`` seconds for one.

        Never lets the plugin hold more than ``max_in_flight`` unacknowledged
        deliveries; returns ``[]`` when the time is up. The call is cancelled
        when the worker's connection closes: it must then leave nothing taken
        (take in one step the cancellation cannot split; a take run in a thread
        is awaited to its end and its deliveries requeued).
        """

    @abc.abstractmethod
    async def ack_outbound(self, plugin_id: str, delivery_id: str, status: str, retryable: bool,
                           reason: str | None, channel_message_id: str | None = None,
                           claim: str | None = None) -> dict:
        """Settle a delivery: ``status`` is ``delivered`` or ``failed``.

        ``claim`` is the claim the ack answers (``DeliveryPolicy.ack``): the bridge always passes one
        (``""`` when the session holds none); ``None`` is a trusted direct call. A failure under a
        claim that is no longer the delivery's changes nothing.

        A retryable failure is retried with ``attempt + 1`` until ``max_retries``
        retries are used, then dead-lettered with the reason; a permanent one is
        dead-lettered at once. Returns ``{"state": "delivered"|"pending"|"dead_letter",
        "duplicate": bool}``; a repeated ack of a settled delivery is
        ``duplicate: true`` and changes nothing. Unknown ids raise ``UnknownDelivery``.
        """

    @abc.abstractmethod
    async def requeue_outbound(self, plugin_id: str, delivery_ids: list[str]) -> None:
        """Return deliveries a poll took to the queue, unchanged: its connection closed before the answer.

        Only deliveries still in flight are touched (same ``attempt``, same place in the queue).
        """

    @abc.abstractmethod
    async def media_get(self, plugin_id: str, media_id: str) -> Media:
        """The bytes of a stored attachment, or raise ``MediaNotFound``."""

    @abc.abstractmethod
    async def media_put(self, plugin_id: str, media: Media) -> str:
        """Store an attachment the worker uploads; returns its media id (``MediaTooLarge`` over the limit)."""

    async def session_closed(self, plugin_id: str) -> None:
        """The authenticated connection ended (the worker stopped or died). Optional."""

