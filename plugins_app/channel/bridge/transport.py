"""The bridge's transport: newline-delimited JSON-RPC 2.0 on a private Unix socket (no protocol methods)."""
from __future__ import annotations

import array
import asyncio
import fcntl
import itertools
import logging
import os
import socket
import stat
import struct
import termios
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from plugins_app.channel.sdk.jsonrpc import (DEFAULT_MAX_FRAME_BYTES, Dispatcher, LineSplitter, RPCError,
                                             batch_too_long, encode_frame, error_response, parse_large_frame)

logger = logging.getLogger(__name__)

# A frame longer than this is parsed in a thread (``parse_large_frame``), not on the event loop every plugin's
# bridge shares; the connection reads on once it is parsed, so its frames keep their order.
LARGE_FRAME_BYTES = 256 * 1024


@dataclass(frozen=True)
class HelloGate:
    """What a connection may do before it is authenticated (``Connection.authenticate``, the bridge's ``hello``).

    Its frames are cut at ``max_frame_bytes`` (the server's own limit, if lower), it is closed unless
    authenticated within ``deadline_secs`` of its connect, and at most ``max_connections`` such connections
    are open at once: one more closes the oldest that is idle, neither in the middle of a frame (a hello under
    way) nor with its first bytes sent and not read yet (a hello waiting its turn), or is itself refused when
    none is. The oldest rather than the newcomer: a client holding its places idle must not keep the worker,
    whose hello follows its connect at once, from getting in; nor must a client connecting again and again
    push the worker's connection out before its hello is read.
    """

    max_frame_bytes: int = 64 * 1024
    deadline_secs: float = 10.0
    max_connections: int = 8

    def __post_init__(self):
        if self.max_frame_bytes < 1 or not self.deadline_secs > 0 or self.max_connections < 1:
            raise ValueError(f"{self}: every limit must be above 0")


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

    def __init__(self, writer: asyncio.StreamWriter, *, authenticated: bool = True,
                 reader: asyncio.StreamReader | None = None):
        self.id = next(self._ids)
        self.writer = writer
        self.reader = reader
        self.read_from = False  # its handler has read bytes of it
        self.tasks: set[asyncio.Task] = set()
        self.closed = False
        # Until a connection is authenticated its frames are handled one at a time, in order (so a client
        # that pipelines hello and its first call sees them in that order), under the server's HelloGate.
        self.authenticated = authenticated
        self.state: dict[str, Any] = {}
        self.peer = _peer_credentials(writer.get_extra_info("socket"))
        self.kept_answers = 0  # answers of finished batch calls kept for their batch's, their slots given back
        self.busy = False  # a frame of an unauthenticated connection is being dispatched
        self.overdue = False  # its deadline passed while it was
        self._on_authenticated: Callable[[], None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._write_lock = asyncio.Lock()

    def first_bytes_waiting(self) -> bool:
        """Nothing read from the connection yet, and bytes of it wait to be: in its stream's buffer or in its
        socket's (a worker's hello, sent as it connected, while the loop served others)."""
        if self.read_from:
            return False
        if self.reader is not None and len(getattr(self.reader, "_buffer", b"")):  # (asyncio.StreamReader's)
            return True
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        waiting = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting, True)
        except (OSError, ValueError):
            return False
        return waiting[0] > 0

    def authenticate(self) -> None:
        """Lift the ``HelloGate``: the server's own frame limit, no deadline, calls run side by side."""
        if self.authenticated:
            return
        self.authenticated = True
        if self._on_authenticated is not None:
            self._on_authenticated()

    async def send(self, data: bytes) -> None:
        if self.closed:
            return
        async with self._write_lock:
            try:
                self.writer.write(data)
                await self.writer.drain()
            except (ConnectionError, RuntimeError):
                self.closed = True

    def close(self, *, abort: bool = False) -> None:
        """Close the socket and cancel the calls still running on it. ``abort``: at once, dropping what is not
        sent yet (a peer that reads nothing cannot keep it open)."""
        self.closed = True
        if abort:
            self.writer.transport.abort()
        else:
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
    connection carries on. A frame over ``LARGE_FRAME_BYTES`` is parsed in a
    thread while the loop serves everyone else; the connection's next frame
    waits for it, so frames run in the order they came.

    ``max_concurrent_requests`` bounds the calls a connection has running, batched
    or not: a batch takes one slot per call, and a batch longer than the limit is
    refused whole (-32600, none of its calls run). A call of a batch that has
    finished gives its slot back while the rest of its batch runs, its answer kept
    for the batch's: at most ``max_concurrent_requests`` such answers are kept per
    connection (past them a finished call keeps its slot until its batch is
    answered). When every slot is taken the connection is not read until one frees.

    With a ``gate`` (``HelloGate``) a connection starts unauthenticated, under the
    gate's limits, until ``Connection.authenticate``; without one every connection is
    authenticated from the start. ``label`` names the server in its log lines.
    """

    def __init__(self, socket_path: str, dispatcher_factory: Callable[[Connection], Dispatcher], *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_concurrent_requests: int = 64,
                 on_close: Callable[[Connection], Awaitable[None]] | None = None, gate: HelloGate | None = None,
                 label: str = "json-rpc server", large_frame_bytes: int = LARGE_FRAME_BYTES):
        self.socket_path = socket_path
        self.dispatcher_factory = dispatcher_factory
        self.max_frame_bytes = max_frame_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.on_close = on_close
        self.gate = gate
        self.label = label
        self.large_frame_bytes = large_frame_bytes
        self.connections: set[Connection] = set()
        self.unauthenticated: dict[Connection, None] = {}  # in the order they connected
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

    # -- the gate -----------------------------------------------------------------------

    def _admit(self, conn: Connection, splitter: LineSplitter) -> bool:
        """Put a new connection under the gate; False when it is refused (every place taken by a hello under way or
        waiting to be read)."""
        gate = self.gate
        assert gate is not None
        if len(self.unauthenticated) >= gate.max_connections:
            oldest = next((c for c in self.unauthenticated if not c.busy and not c.first_bytes_waiting()), None)
            if oldest is None:
                logger.warning("%s: %d connections have not said hello yet, each with a hello under way: "
                               "refused one more", self.label, gate.max_connections)
                return False
            logger.warning("%s: %d connections have not said hello yet: closed the oldest", self.label,
                           gate.max_connections)
            self._drop(oldest)
        self.unauthenticated[conn] = None
        conn._deadline = asyncio.get_running_loop().call_later(gate.deadline_secs, self._hello_overdue, conn)

        def lift() -> None:
            if conn._deadline is not None:
                conn._deadline.cancel()
            self.unauthenticated.pop(conn, None)
            splitter.max_frame_bytes = self.max_frame_bytes

        conn._on_authenticated = lift
        return True

    def _hello_overdue(self, conn: Connection) -> None:
        if conn.authenticated or conn.closed:
            return
        if conn.busy:
            conn.overdue = True  # (closed once that frame is answered, unless it authenticated the connection)
            return
        self._close_overdue(conn)

    def _close_overdue(self, conn: Connection) -> None:
        logger.warning("%s: a connection said no hello within %s s: closed", self.label,
                       self.gate.deadline_secs if self.gate else None)
        self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        self.unauthenticated.pop(conn, None)
        conn.close(abort=True)

    # -- a connection -------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(writer, authenticated=self.gate is None, reader=reader)
        self.connections.add(conn)
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
        splitter = LineSplitter(self.max_frame_bytes if self.gate is None
                                else min(self.gate.max_frame_bytes, self.max_frame_bytes))
        slots = asyncio.Semaphore(self.max_concurrent_requests)  # backpressure: stop reading when full
        try:
            if self.gate is not None and not self._admit(conn, splitter):
                conn.close(abort=True)
                return
            dispatcher = self.dispatcher_factory(conn)
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                conn.read_from = True
                for frame in splitter.frames(data):
                    if conn.closed:
                        break
                    try:
                        if isinstance(frame, bytes) and len(frame) > self.large_frame_bytes:
                            obj = await asyncio.to_thread(parse_large_frame, frame)
                        else:
                            obj = dispatcher.frame_obj(frame)
                    except RPCError as exc:
                        await conn.send(encode_frame(error_response(None, exc)))
                        continue
                    calls = len(obj) if isinstance(obj, list) else 1
                    if calls > self.max_concurrent_requests:
                        refusal = batch_too_long(calls, self.max_concurrent_requests)
                        await conn.send(encode_frame(error_response(None, refusal)))
                        continue
                    if not conn.authenticated:
                        # Under way (not closed at the deadline, not the oldest to close) while it runs, not while
                        # its answer is written: a client that sends and never reads is closed all the same.
                        conn.busy = True
                        try:
                            response = await dispatcher.handle_obj_async(obj)
                        finally:
                            conn.busy = False
                        if conn.overdue and not conn.authenticated:
                            self._close_overdue(conn)
                        elif response is not None:
                            await conn.send(encode_frame(response))
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
            self.unauthenticated.pop(conn, None)
            if conn._deadline is not None:
                conn._deadline.cancel()
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

    async def _one(self, conn: Connection, dispatcher: Dispatcher, obj: Any, slots: asyncio.Semaphore | None,
                   calls: int) -> None:
        """Run one frame's calls and send its answer; give back its ``calls`` slots, a finished batch call's at once
        while fewer than ``max_concurrent_requests`` answers are kept on the connection."""
        given_back = 0
        keeping = 0

        def call_done() -> None:
            nonlocal given_back, keeping
            if (slots is not None and calls > 1 and given_back < calls
                    and conn.kept_answers < self.max_concurrent_requests):
                conn.kept_answers += 1
                keeping += 1
                given_back += 1
                slots.release()

        try:
            response = await dispatcher.handle_obj_async(obj, call_done if isinstance(obj, list) else None)
            if response is not None:
                await conn.send(encode_frame(response))
        finally:
            conn.kept_answers -= keeping
            if slots is not None:
                for _ in range(calls - given_back):
                    slots.release()
