"""Socket Mode: a thin client on ``websockets`` (sync) and ``apps.connections.open``.

Why not slack-sdk's ``SocketModeClient``: its listeners run in a thread pool after the frame
is read and ack on their own schedule, its reconnect swallows ``invalid_auth`` into a retry loop,
and it closes the old socket before the new URL is fetched. Here:

* each envelope is recorded durably (the worker's outbox) and **acked at once**, before the
  hub is asked, so Slack never redelivers it for being slow;
* a ``disconnect`` frame (``warning``, ``refresh_requested``) opens the next connection first,
  reads what the old one still carries, and only then closes it; ``link_disabled`` (Socket Mode
  turned off for the app) is the operator's to fix and ends the worker as refused;
* a socket that drops without a word is replaced with backoff; Slack redelivers what was not
  acked, and the outbox answers a redelivery as a duplicate.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from slack_sdk.errors import SlackApiError

from .api import AUTH_ERRORS, SlackApi, Stopped, error_code

log = logging.getLogger("ugent.worker.slack.socket")

HELLO_TIMEOUT_SECS = 15.0
DRAIN_QUIET_SECS = 0.3


class LinkRefused(Exception):
    """Slack refused the app-level token or Socket Mode itself."""


class SocketModeLink:
    """Reads Socket Mode envelopes until ``stopping``; hands each to ``on_envelope`` then acks it."""

    def __init__(self, api: SlackApi, on_envelope: Callable[[dict], None], stopping: threading.Event, *,
                 first_url: str | None = None):
        self.api = api
        self.on_envelope = on_envelope
        self.stopping = stopping
        self._next_url = first_url
        self.conn: ClientConnection | None = None
        self.connections_opened = 0

    def open_url(self) -> str:
        """A fresh wss URL from apps.connections.open (the app-level token)."""
        try:
            data = self.api.call("apps.connections.open")
        except SlackApiError as exc:
            code = error_code(exc)
            if code in AUTH_ERRORS:
                raise LinkRefused(f"apps.connections.open: {code}: the app-level token (SLACK_APP_TOKEN) "
                                  "was refused") from exc
            raise
        return data["url"]

    def _open(self) -> ClientConnection:
        url, self._next_url = self._next_url or self.open_url(), None
        conn = connect(url, open_timeout=HELLO_TIMEOUT_SECS, close_timeout=2, max_size=2 ** 24)
        try:
            hello = json.loads(conn.recv(timeout=HELLO_TIMEOUT_SECS))
        except BaseException:
            conn.close()
            raise
        if hello.get("type") != "hello":
            conn.close()
            raise ConnectionError(f"socket mode: expected hello, got {hello.get('type')!r}")
        self.connections_opened += 1
        log.info("socket mode connected (%s connection(s) of this app)", hello.get("num_connections"))
        return conn

    def _connect_with_backoff(self) -> ClientConnection | None:
        delay = 0.2
        while not self.stopping.is_set():
            try:
                return self._open()
            except (LinkRefused, Stopped):
                raise
            except Exception as exc:  # noqa: BLE001 - network trouble: try again, slower
                log.warning("socket mode: could not connect (%s); again in %.1f s", exc, delay)
                if self.stopping.wait(delay):
                    return None
                delay = min(delay * 2, 30.0)
        return None

    def run(self) -> None:
        """Until stopped: connect, read, ack, hand over on disconnect, reconnect on a drop."""
        try:
            self.conn = self._connect_with_backoff()
            while self.conn is not None and not self.stopping.is_set():
                try:
                    raw = self.conn.recv(timeout=0.5)
                except TimeoutError:
                    continue
                except ConnectionClosed as exc:
                    log.warning("socket mode connection dropped (%s); reconnecting", exc)
                    self.conn = self._connect_with_backoff()
                    continue
                self._frame(self.conn, raw)
        finally:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def _frame(self, conn: ClientConnection, raw: str | bytes) -> None:
        try:
            frame = json.loads(raw)
        except ValueError:
            log.warning("socket mode: a frame that is not JSON")
            return
        kind = frame.get("type")
        if kind == "disconnect":
            self._disconnect(conn, str(frame.get("reason") or ""))
            return
        if kind == "hello":
            return
        envelope_id = frame.get("envelope_id")
        if envelope_id:
            self.on_envelope(frame)  # durable before the ack
            try:
                conn.send(json.dumps({"envelope_id": envelope_id}))
            except ConnectionClosed:
                pass  # not acked: Slack sends it again, and the outbox knows it

    def _disconnect(self, old: ClientConnection, reason: str) -> None:
        if reason == "link_disabled":
            raise LinkRefused("socket mode: link_disabled: Socket Mode was turned off for this app")
        log.info("socket mode: disconnect (%s); opening the next connection before the old one closes", reason)
        new = self._connect_with_backoff()
        if new is None:
            return
        # What the old connection still carries is read (and acked) before it is closed.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                raw = old.recv(timeout=DRAIN_QUIET_SECS)
            except (TimeoutError, ConnectionClosed):
                break
            try:
                frame = json.loads(raw)
            except ValueError:
                continue
            if frame.get("type") not in ("disconnect", "hello"):
                self._frame(old, raw)
        old.close()
        self.conn = new
