"""An outbound WebSocket a worker keeps open to its platform (Slack's Socket Mode, DingTalk's Stream mode).

One home for what every such link needs, whatever the platform: a fresh URL asked for before each connection
(``open_url``: the platform's "open a connection" call, whose ticket is good once), a handshake (``greet``),
frames read one at a time on the link's own thread and handed to ``handle`` (which records a message durably
and then acknowledges it on the same connection), and:

* a socket that drops (or a connection that cannot be opened) is replaced after a wait: the link's delay,
  0.2 s doubling to 30 s, each wait a random 50-100 % of it (so many workers do not come back in step). The
  delay is the link's, not one connection attempt's: it goes back to 0.2 s only once a frame arrived on a
  connection, so a gateway that takes the handshake and closes at once is not reconnected in a hot loop.
  Whether the platform sends again what it had sent on the dropped socket is the platform's business
  (Slack does, DingTalk's Stream gateway does not for robot messages);
* a frame ``handle`` says asks for a new connection (the platform's ``disconnect``) opens the next connection
  first, reads (and acknowledges) what the old one still carries for a short while, and only then closes it;
  when the connection carried nothing before asking, the next one waits the link's delay as after a drop;
* ``LinkRefused`` (raised by ``open_url`` or ``handle``: the platform refused the credentials that open the
  link) ends ``run``: only the operator can fix it, so it is not tried again in a loop. A link whose credentials
  go in the handshake itself (an ``Authorization`` header, ``open_headers``) is told of a handshake the server
  answered with an HTTP status instead of 101 (``handshake_refused``), and raises ``LinkRefused`` there for the
  statuses that mean the credentials were refused (a 401, a 403); any other status is tried again.

A worker subclasses ``WebSocketLink`` and runs it with ``start_link`` (``run()`` on a thread of its own) until
its ``stopping`` event is set.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

log = logging.getLogger("ugent.worker.wslink")


class LinkRefused(Exception):
    """The platform refused the credentials (or the setting) that open the link: the operator must fix it."""


class WebSocketLink:
    #: How the link is named in the worker's log.
    name = "websocket"
    #: Seconds the WebSocket handshake (and ``greet``) may take.
    open_timeout = 15.0
    #: After a hand-over: how long the old connection is read at most, and how quiet it must be to be closed.
    drain_secs = 5.0
    drain_quiet_secs = 0.3
    #: The largest frame read.
    max_size = 2 ** 24
    backoff_initial, backoff_max = 0.2, 30.0

    def __init__(self, stopping: threading.Event):
        self.stopping = stopping
        self.conn: ClientConnection | None = None
        self.connections_opened = 0
        self._next_url: str | None = None
        self._delay = self.backoff_initial  # the wait before the next connection attempt (see _connect)

    # ------------------------------------------------------------------ the platform's part

    def open_url(self) -> str:
        """A fresh ``ws(s)://`` URL for the next connection; raise ``LinkRefused`` when the platform says no."""
        raise NotImplementedError

    def open_headers(self) -> dict[str, str] | None:
        """Headers the opening handshake sends besides WebSocket's own (an ``Authorization``), or None."""
        return None

    def handshake_refused(self, status: int, body: bytes) -> None:
        """The server answered the opening handshake with HTTP ``status`` (and ``body``), not 101. Raise
        ``LinkRefused`` when it means the credentials were refused; returning tries again, with backoff."""

    def greet(self, conn: ClientConnection) -> None:
        """The platform's handshake on a new connection, if it has one (raise to give the connection up)."""

    def handle(self, conn: ClientConnection, raw: str | bytes) -> bool:
        """One frame; True when it asks the link to move to a new connection (the platform's ``disconnect``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop

    def prepare(self) -> None:
        """Ask for the first URL now (before the worker listens), so a refusal is found at once."""
        self._next_url = self.open_url()

    def run(self) -> None:
        """Until stopped: connect, read, hand each frame over; move on a disconnect, reconnect on a drop."""
        try:
            self.conn = self._connect(wait=False)
            frames = 0  # the frames the current connection carried, a request to move on aside
            while self.conn is not None and not self.stopping.is_set():
                try:
                    raw = self.conn.recv(timeout=0.5)
                except TimeoutError:
                    continue
                except ConnectionClosed as exc:
                    log.warning("%s: connection dropped (%s); reconnecting", self.name, exc)
                    self.conn, frames = self._connect(wait=True), 0
                    continue
                if self.handle(self.conn, raw):
                    # a connection asked to move on before it carried anything is no better than one that
                    # dropped: the move waits the link's delay (a gateway doing that every time is not
                    # reconnected in a loop)
                    self._hand_over(self.conn, wait=frames == 0)
                    frames = 0
                else:
                    frames += 1
                    self._delay = self.backoff_initial  # a frame came through: this connection worked
        finally:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def _open(self) -> ClientConnection:
        url, self._next_url = self._next_url or self.open_url(), None
        try:
            conn = connect(url, open_timeout=self.open_timeout, close_timeout=2, max_size=self.max_size,
                           additional_headers=self.open_headers())
        except InvalidStatus as exc:
            self.handshake_refused(exc.response.status_code, bytes(exc.response.body or b""))
            raise
        try:
            self.greet(conn)
        except BaseException:
            conn.close()
            raise
        self.connections_opened += 1
        return conn

    def _connect(self, *, wait: bool) -> ClientConnection | None:
        """A new connection, or None once stopping. Each attempt but one made with ``wait=False`` (the first,
        and a move the platform asked for while the old connection still works) waits the link's delay first,
        with jitter; the delay doubles with each wait up to ``backoff_max`` and is reset by ``run`` only when a
        frame arrived on a connection."""
        while not self.stopping.is_set():
            if wait:
                pause = self._delay * random.uniform(0.5, 1.0)
                self._delay = min(self._delay * 2, self.backoff_max)
                if self.stopping.wait(pause):
                    return None
            wait = True
            try:
                return self._open()
            except LinkRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - network trouble, the platform busy: try again, slower
                log.warning("%s: could not connect (%s: %s); again in %.1f s at most", self.name,
                            type(exc).__name__, exc, self._delay)
        return None

    def _hand_over(self, old: ClientConnection, *, wait: bool = False) -> None:
        log.info("%s: the platform asked for a new connection; opening it before the old one closes", self.name)
        new = self._connect(wait=wait)
        if new is None:
            return
        self.conn = new  # from here on, whatever happens, the old one is closed and the new one is the link's
        # What the old connection still carries is read (and acknowledged) before it is closed.
        deadline = time.monotonic() + self.drain_secs
        try:
            while time.monotonic() < deadline:
                try:
                    raw = old.recv(timeout=self.drain_quiet_secs)
                except (TimeoutError, ConnectionClosed):
                    break
                self.handle(old, raw)  # (a second request to move on, on the old connection, is already under way)
        finally:
            old.close()


def start_link(link: WebSocketLink, *, name: str, refused: Callable[[LinkRefused], None],
               failed: Callable[[Exception], None]) -> threading.Thread:
    """``link.run()`` on a daemon thread of its own, started; returns the thread. How it ends is handed to the
    worker: ``refused(exc)`` for ``LinkRefused`` (the worker's listener then raises ``ChannelRefused``: the plugin
    is disabled with the reason), ``failed(exc)`` for anything else (the listener raises it: the supervisor
    restarts the worker). A ``run`` that returns (the worker stopping) calls neither."""
    def main() -> None:
        try:
            link.run()
        except LinkRefused as exc:
            refused(exc)
        except Exception as exc:  # noqa: BLE001 - the worker's listener fails with it
            log.error("%s: the link failed: %s: %s", link.name, type(exc).__name__, exc)
            failed(exc)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    return thread
