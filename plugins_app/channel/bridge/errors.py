"""Errors a hub raises: each is an ``RPCError`` the worker receives as it is (docs/plugin-protocol.md, Errors)."""
from __future__ import annotations

from plugins_app.channel.sdk.jsonrpc import (HOST_UNAVAILABLE, MEDIA_NOT_FOUND, MEDIA_TOO_LARGE, RATE_LIMITED, UNKNOWN_DELIVERY,
                                             RPCError)


class UnknownDelivery(RPCError):
    """-32003: the ack names a delivery the host never handed to this plugin."""

    def __init__(self, delivery_id: str):
        super().__init__(UNKNOWN_DELIVERY, data={"delivery_id": delivery_id})


class MediaNotFound(RPCError):
    """-32004: no stored media by that id (or it expired)."""

    def __init__(self, media_id: str):
        super().__init__(MEDIA_NOT_FOUND, data={"media_id": media_id})


class MediaTooLarge(RPCError):
    """-32005: the upload is over the host's media limit, or over what is left of the plugin's media
    quota (``max_bytes`` is then that room, and ``quota_bytes``/``stored_bytes`` say why)."""

    def __init__(self, size: int, limit: int, *, quota: int | None = None, stored: int | None = None):
        data = {"size": size, "max_bytes": limit}
        if quota is not None:
            data.update(quota_bytes=quota, stored_bytes=stored)
        super().__init__(MEDIA_TOO_LARGE, data=data)


class HostUnavailable(RPCError):
    """The hub cannot serve the call now (e.g. its database is down); the worker retries later."""

    def __init__(self, reason: str = ""):
        super().__init__(HOST_UNAVAILABLE, data={"reason": reason} if reason else None)



class RateLimited(RPCError):
    """-32007: the plugin's ``inbound.submit`` calls are over its rate; nothing was taken. The worker sends the
    message again after ``retry_after_secs`` (the SDK does, however often it takes)."""

    def __init__(self, retry_after: float, rate: float, burst: int):
        super().__init__(RATE_LIMITED, data={"retry_after_secs": round(retry_after, 3), "rate_per_sec": rate,
                                             "burst": burst})
