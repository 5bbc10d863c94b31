"""``BridgeServer``: the protocol's methods for one plugin's socket, delegated to a ``Hub``.

Pure Python (asyncio), no Django. It checks the worker's token on ``hello``,
keeps one session per plugin, validates each request's params and remembers the
claim each delivery was handed out under. The socket is ``transport``'s, the
delivery semantics are ``policy``'s. docs/plugin-protocol.md is the contract.
"""
from __future__ import annotations

import base64
import functools
import hmac
import inspect
import logging
import time
import uuid
from typing import Any, Callable, Mapping

from plugins_app.channel.bridge.errors import RateLimited
from plugins_app.channel.bridge.hub import Hub
from plugins_app.channel.bridge.params import (PROTOCOL_VERSION, AckParams, HeartbeatParams, HelloParams, MediaGetParams,
                                       MediaPutParams, PollParams, SubmitParams, parse)
from plugins_app.channel.bridge.ratelimit import TokenBucket
from plugins_app.channel.bridge.transport import Connection, HelloGate, JsonRpcSocketServer
from plugins_app.channel.sdk.jsonrpc import (
    AUTHENTICATION_FAILED,
    DEFAULT_MAX_FRAME_BYTES,
    NOT_AUTHENTICATED,
    Dispatcher,
    InvalidParams,
    RPCError,
)
from plugins_app.channel.sdk.messages import InboundMessage, Media, MessageValidationError, utc_now

logger = logging.getLogger(__name__)

MAX_POLL_SECS = 60.0
# A plugin over its submit rate is logged at its first refusal, then at most this often (with the count so far).
RATE_WARN_EVERY_SECS = 300.0


class BridgeServer:
    """The JSON-RPC bridge for one plugin: token check on hello, methods delegated to a ``Hub``.

    Methods: ``hello``, ``heartbeat``, ``inbound.submit``, ``outbound.poll``,
    ``outbound.ack``, ``media.get``, ``media.put`` (plus ``extra_methods``, which
    also require a hello first). Any method but hello before a successful hello
    is answered -32001 and the connection stays usable, within the ``gate``'s
    limits (a small frame limit, a deadline for the hello, a few such connections
    at once). A new successful hello replaces the previous session, whose
    connection is closed.

    ``submit_rate`` (a second, 0: no limit) and ``submit_burst`` bound the plugin's
    ``inbound.submit`` calls, whichever connection makes them: one over them is
    answered -32007 (``RateLimited``) and reaches nothing.
    """

    def __init__(self, *, socket_path: str, plugin_id: str, token: str, hub: Hub,
                 extra_methods: Mapping[str, Callable[..., Any]] | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_poll_secs: float = MAX_POLL_SECS,
                 max_concurrent_requests: int = 64, gate: HelloGate = HelloGate(),
                 submit_rate: float = 0.0, submit_burst: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if gate is None:
            raise ValueError("a bridge needs a HelloGate: without one a connection is authenticated at once")
        if submit_rate < 0:
            raise ValueError(f"submit_rate must be 0 (no limit) or above, not {submit_rate!r}")
        self.plugin_id = plugin_id
        self._token = token
        self.hub = hub
        self.extra_methods = dict(extra_methods or {})
        self.max_poll_secs = max_poll_secs
        self.max_frame_bytes = max_frame_bytes
        self.session: Connection | None = None
        self.submits = (TokenBucket(submit_rate, submit_burst or max(1, round(submit_rate)), clock=clock)
                        if submit_rate else None)
        self.rate_limited = 0  # inbound.submit calls refused over the rate
        self._rate_warned_at = float("-inf")
        self.transport = JsonRpcSocketServer(socket_path, self._dispatcher_for,
                                             max_frame_bytes=max_frame_bytes,
                                             max_concurrent_requests=max_concurrent_requests,
                                             on_close=self._closed, gate=gate, label=f"bridge {plugin_id}")

    @property
    def socket_path(self) -> str:
        return self.transport.socket_path

    def set_token(self, token: str) -> None:
        """Rotate the token (the supervisor issues a new one for each worker start)."""
        self._token = token

    async def start(self) -> None:
        await self.transport.start()

    async def close(self) -> None:
        await self.transport.close()

    def _dispatcher_for(self, conn: Connection) -> Dispatcher:
        methods: dict[str, Callable[..., Any]] = {"hello": lambda *a, **p: self._hello(conn, a, p)}
        own = {
            "heartbeat": self._heartbeat,
            "inbound.submit": self._submit,
            "outbound.poll": self._poll,
            "outbound.ack": self._ack,
            "media.get": self._media_get,
            "media.put": self._media_put,
        }
        for name, fn in own.items():
            methods[name] = self._authenticated(conn, fn, pass_conn=True)
        for name, fn in self.extra_methods.items():
            methods[name] = self._authenticated(conn, fn, pass_conn=False)
        return Dispatcher(methods)

    @staticmethod
    def _authenticated(conn: Connection, fn: Callable[..., Any], *, pass_conn: bool) -> Callable[..., Any]:
        async def guarded(*args: Any, **params: Any) -> Any:
            if not conn.authenticated:
                raise RPCError(NOT_AUTHENTICATED)
            result = fn(conn, args, params) if pass_conn else fn(*args, **params)
            return await result if inspect.isawaitable(result) else result
        if not pass_conn:
            # Keep the method's own signature, so params that do not fit it are -32602.
            guarded = functools.wraps(fn)(guarded)
        return guarded

    async def _closed(self, conn: Connection) -> None:
        if self.session is conn:
            self.session = None
            await self.hub.session_closed(self.plugin_id)

    # -- methods ------------------------------------------------------------------

    async def _hello(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(HelloParams, args, params)
        # Both checks in constant time and one answer for either, so a wrong id tells nothing.
        id_ok = hmac.compare_digest(p.plugin_id.encode(), self.plugin_id.encode())
        token_ok = hmac.compare_digest(p.token.encode(), self._token.encode())
        if not (id_ok and token_ok):
            logger.warning("bridge %s: hello refused (bad plugin id or token)", self.plugin_id)
            raise RPCError(AUTHENTICATION_FAILED)
        session_id = uuid.uuid4().hex
        pid = p.pid if isinstance(p.pid, int) and not isinstance(p.pid, bool) else None
        info = {"kind": p.kind, "version": p.version, "capabilities": list(p.capabilities), "pid": pid,
                "session_id": session_id, **conn.peer}
        previous, self.session = self.session, conn
        if previous is not None and previous is not conn:
            # One session per plugin: the newest hello wins. The old connection and its
            # calls end before the hub requeues what it held, so its long-poll cannot take it back.
            previous.close()
        limits = await self.hub.hello_ok(self.plugin_id, info)
        conn.state.update(session_id=session_id, limits=dict(limits))
        conn.authenticate()
        return {
            "plugin_id": self.plugin_id,
            "session_id": session_id,
            "protocol_version": PROTOCOL_VERSION,
            "heartbeat_secs": limits.get("heartbeat_secs", 30),
            "max_in_flight": limits.get("max_in_flight", 64),
            "max_retries": limits.get("max_retries", 5),
            "max_poll_secs": self.max_poll_secs,
            "max_frame_bytes": self.max_frame_bytes,
            "max_batch_calls": self.transport.max_concurrent_requests,
        }

    async def _heartbeat(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(HeartbeatParams, args, params)
        await self.hub.heartbeat(self.plugin_id, p.stats)
        return {"ok": True, "time": utc_now()}

    async def _submit(self, conn: Connection, args: tuple, params: dict) -> dict:
        if self.submits is not None:
            wait = self.submits.take()
            if wait:
                self.rate_limited += 1
                if time.monotonic() - self._rate_warned_at >= RATE_WARN_EVERY_SECS:
                    self._rate_warned_at = time.monotonic()
                    logger.warning("bridge %s: inbound.submit over the plugin's rate (%s a second, %s at once): "
                                   "refused, the worker sends it again (%d refused so far)", self.plugin_id,
                                   self.submits.rate, self.submits.burst, self.rate_limited)
                raise RateLimited(wait, self.submits.rate, self.submits.burst)
        p = parse(SubmitParams, args, params)
        try:
            message = InboundMessage.from_dict(p.message, "message")
        except MessageValidationError as exc:
            raise InvalidParams(exc.reason, field=exc.field) from None
        result = dict(await self.hub.submit_inbound(self.plugin_id, message))
        result.setdefault("accepted", True)
        result.setdefault("duplicate", False)
        result.setdefault("message_id", message.message_id)
        return result

    async def _poll(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(PollParams, args, params)
        max_items = p.max_items or conn.state["limits"].get("max_in_flight", 64)
        timeout = min(p.timeout_secs, self.max_poll_secs)  # longer waits are clamped, not refused
        deliveries = await self.hub.poll_outbound(self.plugin_id, max_items, timeout)
        if deliveries and (conn.closed or self.session is not conn):
            # Nobody will read this answer: give the deliveries back at once rather than
            # leave them in flight until the next hello.
            await self.hub.requeue_outbound(self.plugin_id, [d.delivery_id for d in deliveries])
            return {"deliveries": []}
        claims = conn.state.setdefault("claims", {})
        for d in deliveries:
            if d.claim is not None:
                claims[d.delivery_id] = d.claim
        return {"deliveries": [d.to_dict() for d in deliveries]}

    async def _ack(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(AckParams, args, params)
        claims = conn.state.get("claims", {})
        # The ack's own claim (a worker that keeps it), else the one this session was handed the
        # delivery under (a worker that does not), else "": this session holds no claim on it.
        claim = p.claim or claims.get(p.delivery_id) or ""
        result = dict(await self.hub.ack_outbound(self.plugin_id, p.delivery_id, p.status, bool(p.retryable),
                                                  p.reason, p.channel_message_id, claim=claim))
        claims.pop(p.delivery_id, None)  # settled (or pending again): a retried ack that failed keeps it
        result.setdefault("duplicate", False)
        result["delivery_id"] = p.delivery_id
        return result

    async def _media_get(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(MediaGetParams, args, params)
        media = await self.hub.media_get(self.plugin_id, p.media_id)
        return {"media_id": p.media_id, "content_type": media.content_type, "filename": media.filename,
                "size": media.size, "data_base64": base64.b64encode(media.data).decode("ascii")}

    async def _media_put(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = parse(MediaPutParams, args, params)
        data = p.data
        media_id = await self.hub.media_put(self.plugin_id, Media(data, p.content_type, p.filename))
        return {"media_id": media_id, "size": len(data)}
