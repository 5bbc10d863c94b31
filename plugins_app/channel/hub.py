"""The Django-backed Hub: the bridge's methods as rows on the one message path.

Each method runs its ORM work in a worker thread (``sync_to_async`` with
``thread_sensitive=False``, connections closed around it), so the bridge's
event loop never blocks on the database; each plugin has a fair share of that
thread pool (``Hub.in_share``), so one plugin's burst does not queue every other
plugin's calls behind it. This hub and ``InMemoryHub``
(``plugins_app.channel.bridge.memory``) keep one delivery policy, ``plugins_app.channel.bridge.policy``.
"""
from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections
from django.utils import timezone

from channels_app import notify
from plugins_app.channel import conf, services
from plugins_app.channel.bridge import HostUnavailable, Hub, MediaNotFound, MediaTooLarge, UnknownDelivery
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.sdk.jsonrpc import InvalidParams
from plugins_app.channel.sdk.messages import Attachment, Media
from plugins_app.channel.sdk.messages import Delivery as WireDelivery

log = logging.getLogger("ugent.plugins")


def _db(fn):
    """Run a blocking ORM function in a thread; a database that is away (down, restarting, a connection lost,
    SQLite locked past its timeout) is -32006, the host unavailable: the worker waits and tries again, however
    long, and counts no attempt. Any other database error (a value the database refuses, a constraint) is about
    the call's own data: -32603, which the worker counts toward giving the message up (HOLD_ATTEMPTS), so one
    message that always fails cannot hold its chat for ever."""
    def wrapped(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            log.warning("plugin hub: database unavailable (error=%s)", exc)
            raise HostUnavailable("database unavailable") from None
        finally:
            close_old_connections()
    return sync_to_async(wrapped, thread_sensitive=False)


def to_wire(row: OutboundDelivery) -> WireDelivery:
    payload = row.payload or {}
    attachments = []
    for a in payload.get("attachments", []):
        try:
            attachments.append(Attachment.from_dict(a))
        except Exception:  # a malformed stored attachment is dropped, the text still goes
            log.warning("delivery %s: dropped a malformed attachment", row.delivery_id)
    return WireDelivery(
        delivery_id=row.delivery_id, conversation_id=row.conversation.external_id,
        channel=row.plugin.channel, text=row.text, attachments=attachments,
        reply_to_message_id=payload.get("reply_to_message_id"), attempt=row.attempt,
        created_at=row.created_at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        metadata=dict(payload.get("metadata") or {}), claim=row.claim or None)


class DjangoHub(Hub):
    """One hub for every plugin the supervisor runs; heartbeats are kept in memory for the watchdog."""

    def __init__(self):
        self.beats: dict[str, float] = {}

    def _db(self, plugin_id: str, fn, lane: str = "work"):
        """``_db(fn)`` within the plugin's share of the shared thread pool (``Hub.in_share``)."""
        return self.in_share(plugin_id, _db(fn), lane)

    def last_heartbeat(self, plugin_id: str) -> float | None:
        """The supervisor's heartbeat lookup (epoch seconds)."""
        return self.beats.get(plugin_id)

    async def hello_ok(self, plugin_id: str, info: dict) -> dict:
        self.beats[plugin_id] = time.time()

        def work():
            plugin = Plugin.objects.get(plugin_id=plugin_id)
            requeued = services.deliveries_requeue(plugin_id=plugin_id)
            services.plugin_heartbeat_record(plugin_id=plugin_id)
            log.info("plugin %s: worker said hello (kind=%s version=%s pid=%s, requeued=%d)", plugin_id,
                     info.get("kind"), info.get("version"), info.get("pid"), requeued)
            return {"heartbeat_secs": plugin.heartbeat_secs, "max_in_flight": plugin.max_in_flight,
                    "max_retries": plugin.max_retries}
        return await self._db(plugin_id, work, "beat")()

    async def heartbeat(self, plugin_id: str, stats: dict) -> None:
        self.beats[plugin_id] = time.time()
        await self._db(plugin_id, services.plugin_heartbeat_record, "beat")(plugin_id=plugin_id)

    async def submit_inbound(self, plugin_id: str, message) -> dict:
        # A channel message's text is held to the web API's body limit (the frame alone allows 16 MiB).
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and len(message.text.encode("utf-8")) > limit:
            raise InvalidParams(f"is longer than the host takes: at most {limit} bytes (UGENT_MAX_REQUEST_BYTES)",
                                field="message.text")
        return await self._db(plugin_id, services.inbound_submit)(plugin_id=plugin_id, message=message)

    async def poll_outbound(self, plugin_id: str, max_items: int, timeout: float) -> list[WireDelivery]:
        claim = self._db(plugin_id, lambda: [to_wire(r) for r in services.deliveries_claim(
            plugin_id=plugin_id, max_items=max_items)])
        waiter = await notify.subscribe(services.outbound_topic(plugin_id))
        deadline = time.monotonic() + timeout
        try:
            while True:
                # The take runs in a thread the cancellation cannot stop: see it to its end and
                # give back what it took if nobody is left to receive it.
                task = asyncio.ensure_future(claim())
                try:
                    taken = await asyncio.shield(task)
                except asyncio.CancelledError:
                    taken = await task
                    if taken:
                        await self.requeue_outbound(plugin_id, [d.delivery_id for d in taken])
                    raise
                remaining = deadline - time.monotonic()
                if taken or remaining <= 0:
                    return taken
                await waiter.wait(min(remaining, conf.POLL_RECHECK_SECS))
        finally:
            waiter.close()

    async def ack_outbound(self, plugin_id: str, delivery_id: str, status: str, retryable: bool,
                           reason: str | None, channel_message_id: str | None = None,
                           claim: str | None = None) -> dict:
        def work():
            try:
                return services.delivery_ack(plugin_id=plugin_id, delivery_id=delivery_id, status=status,
                                             retryable=retryable, reason=reason,
                                             channel_message_id=channel_message_id, claim=claim)
            except services.UnknownDeliveryId:
                raise UnknownDelivery(delivery_id) from None
        return await self._db(plugin_id, work)()

    async def requeue_outbound(self, plugin_id: str, delivery_ids: list[str]) -> None:
        await self._db(plugin_id, services.deliveries_requeue)(plugin_id=plugin_id, delivery_ids=delivery_ids)

    async def media_get(self, plugin_id: str, media_id: str) -> Media:
        def work():
            row = PluginMedia.objects.filter(media_id=media_id, plugin__plugin_id=plugin_id,
                                             expires_at__gt=timezone.now()).first()
            if row is None:
                raise MediaNotFound(media_id)
            return Media(bytes(row.data), row.content_type, row.filename or None)
        return await self._db(plugin_id, work)()

    async def media_put(self, plugin_id: str, media: Media) -> str:
        def work():
            try:
                return services.media_store(plugin_id=plugin_id, data=media.data,
                                            content_type=media.content_type, filename=media.filename)
            except services.MediaTooLargeError as exc:
                raise MediaTooLarge(exc.size, exc.limit, quota=exc.quota, stored=exc.stored) from None
        return await self._db(plugin_id, work)()
