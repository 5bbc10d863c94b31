"""Socket Mode: a thin client on ``websockets`` (sync) and ``apps.connections.open``.

Why not slack-sdk's ``SocketModeClient``: its listeners run in a thread pool after the frame
is read and ack on their own schedule, its reconnect swallows ``invalid_auth`` into a retry loop,
and it closes the old socket before the new URL is fetched. Here (the loop is the SDK's
``WebSocketLink``, plugins_app/channel/sdk/wslink.py):

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
from typing import Callable

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

from plugins_app.channel.sdk.wslink import LinkRefused, WebSocketLink
from slack_sdk.errors import SlackApiError

from .api import AUTH_ERRORS, SlackApi, error_code

log = logging.getLogger("ugent.worker.slack.socket")

__all__ = ["LinkRefused", "SocketModeLink"]


class SocketModeLink(WebSocketLink):
    """Reads Socket Mode envelopes until ``stopping``; hands each to ``on_envelope`` then acks it."""

    name = "socket mode"

    def __init__(self, api: SlackApi, on_envelope: Callable[[dict], None], stopping: threading.Event, *,
                 first_url: str | None = None):
        super().__init__(stopping)
        self.api = api
        self.on_envelope = on_envelope
        self._next_url = first_url

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

    def greet(self, conn: ClientConnection) -> None:
        hello = json.loads(conn.recv(timeout=self.open_timeout))
        if hello.get("type") != "hello":
            raise ConnectionError(f"socket mode: expected hello, got {hello.get('type')!r}")
        log.info("socket mode connected (%s connection(s) of this app)", hello.get("num_connections"))

    def handle(self, conn: ClientConnection, raw: str | bytes) -> bool:
        try:
            frame = json.loads(raw)
        except ValueError:
            log.warning("socket mode: a frame that is not JSON")
            return False
        kind = frame.get("type")
        if kind == "disconnect":
            reason = str(frame.get("reason") or "")
            if reason == "link_disabled":
                raise LinkRefused("socket mode: link_disabled: Socket Mode was turned off for this app")
            log.info("socket mode: disconnect (%s)", reason)
            return True
        if kind == "hello":
            return False
        envelope_id = frame.get("envelope_id")
        if envelope_id:
            self.on_envelope(frame)  # durable before the ack
            try:
                conn.send(json.dumps({"envelope_id": envelope_id}))
            except ConnectionClosed:
                pass  # not acked: Slack sends it again, and the outbox knows it
        return False
