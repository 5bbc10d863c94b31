"""The host side of the plugin bridge: a JSON-RPC 2.0 server on one Unix socket per plugin.

Pure Python (asyncio), no Django. ``BridgeServer`` owns the socket, checks the
worker's token on ``hello`` and turns the protocol's methods into calls on a
``Hub``; the hub is where messages are stored (the Django-backed hub) or kept
in memory (``InMemoryHub``, which defines the delivery semantics the tests pin
down: max_in_flight, retries, dead letters, idempotent submits and acks).
docs/plugin-protocol.md is the contract this module implements.
"""
from __future__ import annotations

import abc
import asyncio
import base64
import binascii
import functools
import inspect
import hmac
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from plugins_app.sdk.jsonrpc import (
    AUTHENTICATION_FAILED,
    DEFAULT_MAX_FRAME_BYTES,
    HOST_UNAVAILABLE,
    MEDIA_NOT_FOUND,
    MEDIA_TOO_LARGE,
    NOT_AUTHENTICATED,
    UNKNOWN_DELIVERY,
    Dispatcher,
    InvalidParams,
    LineSplitter,
    RPCError,
)
from plugins_app.sdk.messages import (
    _CONTENT_TYPE,
    InboundMessage,
    Media,
    MessageValidationError,
    OutboundDelivery,
    utc_now,
)

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_POLL_SECS = 25.0
MAX_POLL_SECS = 60.0
DEFAULT_MEDIA_MAX_BYTES = 8 * 1024 * 1024


# ---------------------------------------------------------------------------
# Errors a hub raises (each is an RPCError the worker receives as it is)


class UnknownDelivery(RPCError):
    """-32003: the ack names a delivery the host never handed to this plugin."""

    def __init__(self, delivery_id: str):
        super().__init__(UNKNOWN_DELIVERY, data={"delivery_id": delivery_id})


class MediaNotFound(RPCError):
    """-32004: no stored media by that id (or it expired)."""

    def __init__(self, media_id: str):
        super().__init__(MEDIA_NOT_FOUND, data={"media_id": media_id})


class MediaTooLarge(RPCError):
    """-32005: the upload is over the host's media limit."""

    def __init__(self, size: int, limit: int):
        super().__init__(MEDIA_TOO_LARGE, data={"size": size, "max_bytes": limit})


class HostUnavailable(RPCError):
    """The hub cannot serve the call now (e.g. its database is down); the worker retries later."""

    def __init__(self, reason: str = ""):
        super().__init__(HOST_UNAVAILABLE, data={"reason": reason} if reason else None)


# ---------------------------------------------------------------------------
# The hub interface


class Hub(abc.ABC):
    """What the bridge needs from the host; one hub may serve many plugins.

    Every method is a coroutine run on the bridge's event loop; a hub backed by
    blocking code (the ORM) wraps it (``asyncio.to_thread``/``sync_to_async``).
    A method may raise the ``RPCError`` subclasses above; any other exception
    reaches the worker as -32603 Internal error.
    """

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
    async def poll_outbound(self, plugin_id: str, max_items: int, timeout: float) -> list[OutboundDelivery]:
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

        ``claim`` is the ``host_claim`` of the copy this session was handed (None when unknown):
        a failure under a claim that is no longer the delivery's changes nothing.

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


# ---------------------------------------------------------------------------
# The socket server (transport only)


class AddressInUse(OSError):
    """Another server is listening on the socket path."""


def remove_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on; refuse to touch a live socket or a non-socket file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        # Left behind by a server that died: nobody accepts on it.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    finally:
        probe.close()
    raise AddressInUse(f"a server is already listening on {path}")


def bind_private_socket(path: str, backlog: int = 16) -> socket.socket:
    """A listening Unix socket whose file is mode 0600, in a directory created 0700 if missing.

    The mode is set between bind() and listen(): until listen() every connect
    is refused, so no other user can slip in while the file is briefly wider.
    (A process-wide umask would race with other threads creating files.)
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _peer_credentials(sock: socket.socket | None) -> dict:
    """pid/uid/gid of the connecting process (Linux SO_PEERCRED); empty elsewhere."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return {}
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
    except OSError:
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}


class Connection:
    """One accepted client connection: its writer, its running requests and per-session state."""

    _ids = itertools.count(1)

    def __init__(self, writer: asyncio.StreamWriter):
        self.id = next(self._ids)
        self.writer = writer
        self.tasks: set[asyncio.Task] = set()
        self.closed = False
        # Until a session is authenticated its frames are handled one at a time, in order,
        # so a client that pipelines hello and its first call sees them in that order.
        self.sequential = False
        self.state: dict[str, Any] = {}
        self.peer = _peer_credentials(writer.get_extra_info("socket"))
        self._write_lock = asyncio.Lock()

    async def send(self, data: bytes) -> None:
        if self.closed:
            return
        async with self._write_lock:
            try:
                self.writer.write(data)
                await self.writer.drain()
            except (ConnectionError, RuntimeError):
                self.closed = True

    def close(self) -> None:
        """Close the socket and cancel the calls still running on it."""
        self.closed = True
        self.writer.close()
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()


class JsonRpcSocketServer:
    """Newline-delimited JSON-RPC 2.0 on a private Unix socket; one dispatcher per connection.

    Each frame runs as its own task, so a long-poll does not hold up a
    heartbeat; responses go out as they finish (JSON-RPC matches them by id).
    A malformed or oversized frame is answered with its error and the
    connection carries on.
    """

    def __init__(self, socket_path: str, dispatcher_factory: Callable[[Connection], Dispatcher], *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_concurrent_requests: int = 64,
                 on_close: Callable[[Connection], Awaitable[None]] | None = None):
        self.socket_path = socket_path
        self.dispatcher_factory = dispatcher_factory
        self.max_frame_bytes = max_frame_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.on_close = on_close
        self.connections: set[Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None

    async def start(self) -> None:
        sock = bind_private_socket(self.socket_path)
        self._inode = os.stat(self.socket_path).st_ino
        self._server = await asyncio.start_unix_server(self._handle, sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._handlers:
            # Let each connection's handler finish its cleanup (and the hub's close hook).
            await asyncio.wait(list(self._handlers), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        try:
            # Remove the file only if it is still ours (a successor may have bound the path).
            if self._inode is not None and os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(writer)
        self.connections.add(conn)
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
        dispatcher = self.dispatcher_factory(conn)
        splitter = LineSplitter(self.max_frame_bytes)
        slots = asyncio.Semaphore(self.max_concurrent_requests)  # backpressure: stop reading when full
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                for frame in splitter.feed(data):
                    if conn.sequential:
                        await self._one(conn, dispatcher, frame, None)
                        continue
                    await slots.acquire()
                    task = asyncio.create_task(self._one(conn, dispatcher, frame, slots))
                    conn.tasks.add(task)
                    task.add_done_callback(conn.tasks.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            conn.closed = True
            for task in list(conn.tasks):
                task.cancel()
            if conn.tasks:
                await asyncio.gather(*conn.tasks, return_exceptions=True)
            self.connections.discard(conn)
            if me is not None:
                self._handlers.discard(me)
            try:
                writer.close()
            except RuntimeError:
                pass
            if self.on_close is not None:
                try:
                    await self.on_close(conn)
                except Exception:  # noqa: BLE001 - a failing hook must not break the server
                    logger.exception("connection close hook failed")

    @staticmethod
    async def _one(conn: Connection, dispatcher: Dispatcher, frame: Any, slots: asyncio.Semaphore | None) -> None:
        try:
            out = await dispatcher.handle_frame_async(frame)
            if out is not None:
                await conn.send(out)
        finally:
            if slots is not None:
                slots.release()


# ---------------------------------------------------------------------------
# The bridge


def _params(args: tuple, params: dict) -> dict:
    if args:
        raise InvalidParams("params must be an object (named parameters)")
    return params


def _req_str(params: dict, name: str, *, allow_empty: bool = False) -> str:
    value = params.get(name)
    if value is None:
        raise InvalidParams("is required", field=name)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise InvalidParams("must be a non-empty string", field=name)
    return value


def _opt_str(params: dict, name: str) -> str | None:
    value = params.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidParams("must be a string", field=name)
    return value


class BridgeServer:
    """The JSON-RPC bridge for one plugin: token check on hello, methods delegated to a ``Hub``.

    Methods: ``hello``, ``heartbeat``, ``inbound.submit``, ``outbound.poll``,
    ``outbound.ack``, ``media.get``, ``media.put`` (plus ``extra_methods``, which
    also require a hello first). Any method but hello before a successful hello
    is answered -32001 and the connection stays usable. A new successful hello
    replaces the previous session, whose connection is closed.
    """

    def __init__(self, *, socket_path: str, plugin_id: str, token: str, hub: Hub,
                 extra_methods: Mapping[str, Callable[..., Any]] | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_poll_secs: float = MAX_POLL_SECS,
                 max_concurrent_requests: int = 64):
        self.plugin_id = plugin_id
        self._token = token
        self.hub = hub
        self.extra_methods = dict(extra_methods or {})
        self.max_poll_secs = max_poll_secs
        self.max_frame_bytes = max_frame_bytes
        self.session: Connection | None = None
        self.transport = JsonRpcSocketServer(socket_path, self._dispatcher_for,
                                             max_frame_bytes=max_frame_bytes,
                                             max_concurrent_requests=max_concurrent_requests,
                                             on_close=self._closed)

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
        conn.sequential = True
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
            if not conn.state.get("authenticated"):
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
        p = _params(args, params)
        plugin_id = _req_str(p, "plugin_id")
        token = _req_str(p, "token")
        kind = _req_str(p, "kind")
        version = _req_str(p, "version")
        capabilities = p.get("capabilities", [])
        if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
            raise InvalidParams("must be an array of strings", field="capabilities")
        protocol = p.get("protocol_version", PROTOCOL_VERSION)
        if protocol != PROTOCOL_VERSION:
            raise InvalidParams(f"unsupported; this host speaks {PROTOCOL_VERSION}", field="protocol_version")
        pid = p.get("pid")
        # Both checks in constant time and one answer for either, so a wrong id tells nothing.
        id_ok = hmac.compare_digest(plugin_id.encode(), self.plugin_id.encode())
        token_ok = hmac.compare_digest(token.encode(), self._token.encode())
        if not (id_ok and token_ok):
            logger.warning("bridge %s: hello refused (bad plugin id or token)", self.plugin_id)
            raise RPCError(AUTHENTICATION_FAILED)
        session_id = uuid.uuid4().hex
        info = {"kind": kind, "version": version, "capabilities": capabilities,
                "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                "session_id": session_id, **conn.peer}
        previous, self.session = self.session, conn
        if previous is not None and previous is not conn:
            # One session per plugin: the newest hello wins. The old connection and its
            # calls end before the hub requeues what it held, so its long-poll cannot take it back.
            previous.close()
        limits = await self.hub.hello_ok(self.plugin_id, info)
        conn.state.update(authenticated=True, session_id=session_id, limits=dict(limits))
        conn.sequential = False
        return {
            "plugin_id": self.plugin_id,
            "session_id": session_id,
            "protocol_version": PROTOCOL_VERSION,
            "heartbeat_secs": limits.get("heartbeat_secs", 30),
            "max_in_flight": limits.get("max_in_flight", 64),
            "max_retries": limits.get("max_retries", 5),
            "max_poll_secs": self.max_poll_secs,
            "max_frame_bytes": self.max_frame_bytes,
        }

    async def _heartbeat(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        stats = p.get("stats", {})
        if not isinstance(stats, dict):
            raise InvalidParams("must be an object", field="stats")
        await self.hub.heartbeat(self.plugin_id, stats)
        return {"ok": True, "time": utc_now()}

    async def _submit(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        if "message" not in p:
            raise InvalidParams("is required", field="message")
        try:
            message = InboundMessage.from_dict(p["message"], "message")
        except MessageValidationError as exc:
            raise InvalidParams(exc.reason, field=exc.field) from None
        result = dict(await self.hub.submit_inbound(self.plugin_id, message))
        result.setdefault("accepted", True)
        result.setdefault("duplicate", False)
        result.setdefault("message_id", message.message_id)
        return result

    async def _poll(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        max_items = p.get("max_items", conn.state["limits"].get("max_in_flight", 64))
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise InvalidParams("must be a positive integer", field="max_items")
        timeout = p.get("timeout_secs", DEFAULT_POLL_SECS)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise InvalidParams("must be a non-negative number", field="timeout_secs")
        timeout = min(float(timeout), self.max_poll_secs)  # longer waits are clamped, not refused
        deliveries = await self.hub.poll_outbound(self.plugin_id, max_items, timeout)
        if deliveries and (conn.closed or self.session is not conn):
            # Nobody will read this answer: give the deliveries back at once rather than
            # leave them in flight until the next hello.
            await self.hub.requeue_outbound(self.plugin_id, [d.delivery_id for d in deliveries])
            return {"deliveries": []}
        claims = conn.state.setdefault("claims", {})
        for d in deliveries:
            if d.host_claim is not None:
                claims[d.delivery_id] = d.host_claim
        return {"deliveries": [d.to_dict() for d in deliveries]}

    async def _ack(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        delivery_id = _req_str(p, "delivery_id")
        status = p.get("status")
        if status not in ("delivered", "failed"):
            raise InvalidParams("must be delivered or failed", field="status")
        retryable = p.get("retryable", False)
        reason = _opt_str(p, "reason")
        if status == "failed":
            if "retryable" not in p:
                raise InvalidParams("is required when status is failed", field="retryable")
            if not reason:
                raise InvalidParams("is required when status is failed", field="reason")
        if not isinstance(retryable, bool):
            raise InvalidParams("must be a boolean", field="retryable")
        channel_message_id = _opt_str(p, "channel_message_id")
        claims = conn.state.get("claims", {})
        result = dict(await self.hub.ack_outbound(self.plugin_id, delivery_id, status, retryable, reason,
                                                  channel_message_id, claim=claims.get(delivery_id)))
        claims.pop(delivery_id, None)  # settled (or pending again): a retried ack that failed keeps it
        result.setdefault("duplicate", False)
        result["delivery_id"] = delivery_id
        return result

    async def _media_get(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        media_id = _req_str(p, "media_id")
        media = await self.hub.media_get(self.plugin_id, media_id)
        return {"media_id": media_id, "content_type": media.content_type, "filename": media.filename,
                "size": media.size, "data_base64": base64.b64encode(media.data).decode("ascii")}

    async def _media_put(self, conn: Connection, args: tuple, params: dict) -> dict:
        p = _params(args, params)
        content_type = _req_str(p, "content_type")
        if not _CONTENT_TYPE.match(content_type):
            raise InvalidParams("must be a MIME type such as image/png", field="content_type")
        filename = _opt_str(p, "filename")
        encoded = _req_str(p, "data_base64", allow_empty=True)
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParams("must be standard base64", field="data_base64") from None
        media_id = await self.hub.media_put(self.plugin_id, Media(data, content_type, filename))
        return {"media_id": media_id, "size": len(data)}


# ---------------------------------------------------------------------------
# The in-memory hub


PENDING = "pending"
IN_FLIGHT = "in_flight"
DELIVERED = "delivered"
DEAD_LETTER = "dead_letter"


@dataclass
class DeliveryRecord:
    """One outbound delivery as the hub tracks it."""

    delivery: OutboundDelivery
    seq: int
    state: str = PENDING
    not_before: float = 0.0
    handed_out: int = 0
    failures: list[str] = field(default_factory=list)
    reason: str | None = None
    permanent: bool = False
    channel_message_id: str | None = None

    @property
    def attempt(self) -> int:
        return self.delivery.attempt

    def snapshot(self) -> dict:
        return {"delivery_id": self.delivery.delivery_id, "state": self.state, "attempt": self.attempt,
                "handed_out": self.handed_out, "failures": list(self.failures), "reason": self.reason,
                "permanent": self.permanent, "channel_message_id": self.channel_message_id}


class InMemoryHub(Hub):
    """A complete hub kept in memory: the reference semantics of delivery, and the tests' host.

    * ``submit_inbound`` accepts each (conversation_id, message_id) once; a
      repeat answers ``duplicate: true`` with the first outcome.
    * ``poll_outbound`` never lets more than ``max_in_flight`` deliveries be
      unacknowledged; it waits (long-poll) for a delivery or a free slot.
    * ``ack_outbound``: delivered is final; a retryable failure comes back with
      ``attempt + 1`` after ``retry_backoff_secs * 2**(attempt-1)`` (capped), until
      the attempt that used the last of ``max_retries`` retries fails: then it is
      dead-lettered with the reason, as a permanent failure is at once.
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
        delivery = OutboundDelivery(
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
                    record.state = PENDING  # the previous session's worker may be gone
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

    def _take(self, max_items: int) -> list[OutboundDelivery]:
        now = self.clock()
        in_flight = sum(1 for r in self._deliveries.values() if r.state == IN_FLIGHT)
        room = min(max_items, self.max_in_flight - in_flight)
        taken: list[OutboundDelivery] = []
        if room <= 0:
            return taken
        for record in sorted(self._deliveries.values(), key=lambda r: r.seq):
            if len(taken) >= room:
                break
            if record.state == PENDING and record.not_before <= now:
                record.state = IN_FLIGHT
                record.handed_out += 1
                taken.append(record.delivery)
        self.max_in_flight_seen = max(self.max_in_flight_seen, in_flight + len(taken))
        return taken

    def _next_due(self) -> float | None:
        due = [r.not_before for r in self._deliveries.values() if r.state == PENDING]
        return min(due) if due else None

    async def poll_outbound(self, plugin_id: str, max_items: int, timeout: float) -> list[OutboundDelivery]:
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
                return [OutboundDelivery.from_dict(d.to_dict()) for d in taken]
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
            if record.state in (DELIVERED, DEAD_LETTER):
                return {"state": record.state, "attempt": record.attempt, "duplicate": True}
            if status == "delivered":
                record.state = DELIVERED
                record.channel_message_id = channel_message_id
            else:
                record.failures.append(reason or "")
                if not retryable:
                    record.state, record.permanent, record.reason = DEAD_LETTER, True, reason
                elif record.attempt > self.max_retries:
                    record.state = DEAD_LETTER
                    record.reason = f"max_retries ({self.max_retries}) exceeded: {reason}"
                else:
                    record.delivery.attempt += 1
                    record.state = PENDING
                    backoff = self.retry_backoff_secs * (2 ** (record.attempt - 2))
                    record.not_before = self.clock() + min(backoff, self.retry_backoff_max_secs)
            outcome = {"state": record.state, "attempt": record.attempt, "duplicate": False}
        self._notify()  # a slot is free, or a retry is queued
        return outcome

    async def requeue_outbound(self, plugin_id: str, delivery_ids: list[str]) -> None:
        with self._lock:
            for delivery_id in delivery_ids:
                record = self._deliveries.get(delivery_id)
                if record is not None and record.state == IN_FLIGHT:
                    record.state = PENDING
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


# ---------------------------------------------------------------------------
# Running a server on a background loop


class ServerThread:
    """Runs a server (``start()``/``close()`` coroutines) on its own event loop in a daemon thread.

    For tests and for a synchronous caller (a supervisor loop that is not asyncio).
    """

    def __init__(self, server: Any):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="bridge-loop", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self._thread.start()
        self.run(self.server.start(), timeout)
        return self

    def run(self, coro: Awaitable[Any], timeout: float | None = 10.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = 10.0) -> Any:
        """Run a plain function on the server's loop (to touch loop-bound state safely)."""
        async def wrapper() -> Any:
            return fn()
        return self.run(wrapper(), timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.server.close(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
