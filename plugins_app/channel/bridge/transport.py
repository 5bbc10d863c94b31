"""The bridge's transport: newline-delimited JSON-RPC 2.0 on a private Unix socket (no protocol methods)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import stat
import struct
from typing import Any, Awaitable, Callable

from plugins_app.channel.sdk.jsonrpc import (DEFAULT_MAX_FRAME_BYTES, Dispatcher, LineSplitter, RPCError,
                                             batch_too_long, encode_frame, error_response)

logger = logging.getLogger(__name__)


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

    ``max_concurrent_requests`` bounds the calls a connection has in flight, batched
    or not: a batch takes one slot per call until it is answered, and a batch
    longer than the limit is refused whole (-32600, none of its calls run). When
    every slot is taken the connection is not read until one frees.
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
                    try:
                        obj = dispatcher.frame_obj(frame)
                    except RPCError as exc:
                        await conn.send(encode_frame(error_response(None, exc)))
                        continue
                    calls = len(obj) if isinstance(obj, list) else 1
                    if calls > self.max_concurrent_requests:
                        refusal = batch_too_long(calls, self.max_concurrent_requests)
                        await conn.send(encode_frame(error_response(None, refusal)))
                        continue
                    if conn.sequential:
                        await self._one(conn, dispatcher, obj, None, 0)
                        continue
                    calls = max(calls, 1)  # an empty batch is one (invalid) request
                    for _ in range(calls):
                        # Only this loop acquires, so taking the slots one at a time cannot deadlock.
                        await slots.acquire()
                    task = asyncio.create_task(self._one(conn, dispatcher, obj, slots, calls))
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
    async def _one(conn: Connection, dispatcher: Dispatcher, obj: Any, slots: asyncio.Semaphore | None,
                   calls: int) -> None:
        try:
            response = await dispatcher.handle_obj_async(obj)
            if response is not None:
                await conn.send(encode_frame(response))
        finally:
            if slots is not None:
                for _ in range(calls):
                    slots.release()
