"""A blocking, thread-safe JSON-RPC 2.0 client over a Unix socket.

Several threads share one connection (the heartbeat, the inbound listener and
the outbound long-poll run side by side): each call gets its own request id, a
reader thread matches responses to waiting callers by id, and writes are
serialised so frames never interleave. It notes when it last read a response
(any call's), so a caller whose call timed out can tell a host that is away from
one that answers other calls but not this one.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any

from .jsonrpc import (
    DEFAULT_MAX_FRAME_BYTES,
    HOST_UNAVAILABLE,
    FrameTooLarge,
    LineSplitter,
    RPCError,
    encode_frame,
    notification,
    parse_frame,
    request,
)

logger = logging.getLogger(__name__)


class ConnectionLost(ConnectionError):
    """The socket closed (or never opened); calls in flight fail with this."""


class CallTimeout(TimeoutError):
    """No response arrived in time. The call may still have been carried out."""


class CallCancelled(Exception):
    """The caller's cancel event fired while waiting; a late response is dropped."""


class _Waiter:
    __slots__ = ("done", "response", "sent_at")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: Any = None
        self.sent_at = time.monotonic()  # (just before the request goes out)


class RpcClient:
    """One connection to a JSON-RPC server on a Unix socket.

    ``call`` blocks until the matching response and returns its result or
    raises ``RPCError``; ``ConnectionLost`` once the socket is gone (the client
    does not reconnect by itself: see ``connect_with_retry``).
    """

    def __init__(self, path: str, *, connect_timeout: float = 5.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost(f"cannot connect to {path}: {exc}") from exc
        sock.settimeout(None)
        self._sock = sock
        self._splitter = LineSplitter(max_frame_bytes)
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[Any, _Waiter] = {}
        self._closed = threading.Event()
        self._last_response_at = float("-inf")
        self._reader = threading.Thread(target=self._read_loop, name="jsonrpc-reader", daemon=True)
        self._reader.start()

    # -- public -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def last_response_at(self) -> float:
        """When the newest call the host served was sent (``time.monotonic()``): of the calls answered while their
        callers still waited, with a result or an error other than -32006 (the host unavailable), the latest sent.
        Later than a call's own sending: the host served a call made after it, so it was there meanwhile. A late
        answer (its caller gone), a -32006 and a call merely sent never move it; -inf before the first."""
        return self._last_response_at

    def call(self, method: str, params: Any = None, *, timeout: float | None = 30.0,
             cancel: threading.Event | None = None) -> Any:
        """Send a request and wait for its response; returns ``result`` or raises ``RPCError``."""
        rid = next(self._ids)
        waiter = _Waiter()
        with self._pending_lock:
            if self.closed:
                raise ConnectionLost("connection closed")
            self._pending[rid] = waiter
        try:
            self._send(encode_frame(request(method, params, rid)))
            self._wait(waiter, timeout, cancel, method)
        finally:
            with self._pending_lock:
                self._pending.pop(rid, None)
        response = waiter.response
        if response is None:
            raise ConnectionLost("connection closed while waiting for a response")
        if "error" in response:
            raise RPCError.from_dict(response["error"])
        return response.get("result")

    def notify(self, method: str, params: Any = None) -> None:
        """Send a notification (no response will come)."""
        self._send(encode_frame(notification(method, params)))

    def send_raw(self, frame: bytes) -> None:
        """Send bytes as they are (tests use it for malformed frames)."""
        self._send(frame)

    def close(self) -> None:
        if self._closed.is_set():
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._fail_all()

    def __enter__(self) -> "RpcClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionLost("connection closed")
        try:
            with self._write_lock:
                self._sock.sendall(data)
        except OSError as exc:
            self._fail_all()
            raise ConnectionLost(f"send failed: {exc}") from exc

    def _wait(self, waiter: _Waiter, timeout: float | None, cancel: threading.Event | None, method: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CallTimeout(f"{method}: no response within {timeout} s")
            # With a cancel event, wake often enough to notice it; otherwise sleep to the deadline.
            step = remaining if cancel is None else min(0.05, remaining if remaining is not None else 0.05)
            if waiter.done.wait(step):
                return
            if cancel is not None and cancel.is_set():
                raise CallCancelled(method)

    def _read_loop(self) -> None:
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                for frame in self._splitter.feed(data):
                    if isinstance(frame, FrameTooLarge):
                        logger.warning("dropped a %d-byte frame from the server", frame.size)
                        continue
                    self._deliver(frame)
        except OSError:
            pass
        finally:
            self._fail_all()

    def _deliver(self, frame: bytes) -> None:
        try:
            obj = parse_frame(frame)
        except RPCError:
            logger.warning("unparseable frame from the server")
            return
        for response in obj if isinstance(obj, list) else [obj]:
            if not isinstance(response, dict) or ("result" not in response and "error" not in response):
                # The worker is the client; the host sends no requests to it.
                logger.debug("ignoring a frame that is not a response: %r", response)
                continue
            with self._pending_lock:
                waiter = self._pending.get(response.get("id"))
            if waiter is None:
                if response.get("id") is None and "error" in response:
                    logger.warning("server error for an unidentifiable frame: %s", response["error"])
                continue
            error = response.get("error")
            if not (isinstance(error, dict) and error.get("code") == HOST_UNAVAILABLE):
                # the host served a call sent then: it was there from then on
                self._last_response_at = max(self._last_response_at, waiter.sent_at)
            waiter.response = response
            waiter.done.set()

    def _fail_all(self) -> None:
        with self._pending_lock:
            self._closed.set()
            waiters = list(self._pending.values())
        for waiter in waiters:
            waiter.done.set()  # response stays None: the caller raises ConnectionLost


def connect_with_retry(path: str, *, timeout: float = 10.0, initial_backoff: float = 0.05,
                       max_backoff: float = 1.0, stop: threading.Event | None = None,
                       max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> RpcClient:
    """Connect, retrying with exponential backoff until ``timeout`` (the host may be restarting).

    Raises ``ConnectionLost`` when time runs out or ``stop`` is set.
    """
    deadline = time.monotonic() + timeout
    backoff = initial_backoff
    while True:
        try:
            return RpcClient(path, max_frame_bytes=max_frame_bytes)
        except ConnectionLost:
            now = time.monotonic()
            if now >= deadline or (stop is not None and stop.is_set()):
                raise
            wait = min(backoff, deadline - now)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            backoff = min(backoff * 2, max_backoff)
