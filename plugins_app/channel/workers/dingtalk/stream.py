"""Stream mode: the worker opens an outbound WebSocket to DingTalk's gateway; no public address is needed.

The protocol, as DingTalk's Stream protocol page describes it (open-dingtalk developerpedia, "Stream 模式
协议") and the official SDK (``dingtalk-stream``, open-dingtalk/dingtalk-stream-sdk-python) speaks it:

* ``POST {DINGTALK_API_BASE_URL}/v1.0/gateway/connections/open`` with ``{"clientId", "clientSecret",
  "subscriptions": [{"type": "CALLBACK", "topic": "/v1.0/im/bot/messages/get"}], "ua", "localIp"}``
  answers ``{"endpoint", "ticket"}``; the WebSocket is ``<endpoint>?ticket=<ticket>`` (a ticket is good once,
  so every connection asks for a new one). A 4xx that is no throttle (the Client ID or Secret refused) is
  ``LinkRefused``: only the operator can fix it. A throttle, a 5xx or the network is tried again with backoff.
* Frames are JSON ``{"specVersion", "type": "SYSTEM"|"EVENT"|"CALLBACK", "headers": {"messageId", "topic",
  "contentType", "time", ...}, "data": "<a JSON string>"}``.
* SYSTEM ``ping`` is answered with its ``data`` echoed; SYSTEM ``disconnect`` (DingTalk is about to close
  the connection: it sends nothing new on it; the frame carries no ``messageId`` and wants no answer) opens
  a new connection before the old one is closed; nothing is sent back for it.
* A CALLBACK of ``/v1.0/im/bot/messages/get`` carries the robot message (the JSON HTTP mode is POSTed). It
  is handed to ``on_message``, which returns once the message is in the worker's outbox, and then
  acknowledged ``{"code": 200, "headers": {"contentType": "application/json", "messageId": <the same>},
  "message": "OK", "data": "{\\"response\\": null}"}``. DingTalk pushes a robot message once ("fire and
  forget": it is never sent again, whether acknowledged or not; the acknowledgement only shows in DingTalk's
  diagnostics). So the worker keeps a message it could not record in hand and tries again in place
  (``record_tries`` times, 0.2 s doubling: a database locked for a moment); one it still could not record
  is lost, logged at ERROR with its ``msgId``, and the link reads on: ending the link would close the
  connection under every message DingTalk already pushed behind it, each lost as well. Unlike HTTP mode,
  where DingTalk retries a callback that got no 200, nothing here brings a message back; a message recorded
  but not yet answered when the worker dies is answered after the restart from the worker's outbox.
"""
from __future__ import annotations

import json
import logging
import socket
from typing import Callable

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

from plugins_app.channel.sdk.wslink import LinkRefused, WebSocketLink

from .api import error_of, throttled

log = logging.getLogger("ugent.worker.dingtalk.stream")

OPEN_PATH = "/v1.0/gateway/connections/open"
BOT_MESSAGE_TOPIC = "/v1.0/im/bot/messages/get"
SUBSCRIPTIONS = [{"type": "CALLBACK", "topic": BOT_MESSAGE_TOPIC}]
UA = "ugent-dingtalk-stream/1.0"


def ack(message_id: str, *, data: str = json.dumps({"response": None}), message: str = "OK",
        code: int = 200) -> str:
    """The answer to a frame, in the shape DingTalk's Stream protocol page gives (``code``, ``headers`` with
    the frame's ``messageId`` and ``contentType``, ``message``, ``data``: a JSON string)."""
    return json.dumps({"code": code, "headers": {"contentType": "application/json", "messageId": message_id},
                       "message": message, "data": data})


def local_ip() -> str:
    """This host's address on its default route (what the SDK reports as ``localIp``); no packet is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
    except OSError:
        return ""


class StreamRefused(LinkRefused):
    """``connections/open`` refused the app: ``status``, DingTalk's ``code`` and ``message``."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"POST {OPEN_PATH}: HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class StreamLink(WebSocketLink):
    """DingTalk's Stream mode on ``WebSocketLink``: robot messages to ``on_message``, acknowledged after it."""

    name = "dingtalk stream"
    #: How often a robot message is tried before it is given up as lost (waits of 0.2 s doubling between).
    record_tries = 5

    def __init__(self, client_id: str, client_secret: str, on_message: Callable[[dict], None], stopping, *,
                 base_url: str, client: httpx.Client):
        super().__init__(stopping)
        self.client_id, self.client_secret = client_id, client_secret
        self.on_message = on_message
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.acked = 0

    def open_url(self) -> str:
        response = self.client.post(f"{self.base_url}{OPEN_PATH}", json={
            "clientId": self.client_id, "clientSecret": self.client_secret, "subscriptions": SUBSCRIPTIONS,
            "ua": UA, "localIp": local_ip()}, headers={"Accept": "application/json"})
        status = response.status_code
        if status != 200:
            code, message = error_of(response)
            if 400 <= status < 500 and not throttled(status, code):
                raise StreamRefused(status, code, message)
            raise ConnectionError(f"POST {OPEN_PATH}: HTTP {status} {code}: {message}")  # tried again, with backoff
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not body.get("endpoint") or not body.get("ticket"):
            raise ConnectionError(f"POST {OPEN_PATH}: the answer carries no endpoint and ticket")
        endpoint = str(body["endpoint"])
        sep = "&" if "?" in endpoint else "?"
        return f"{endpoint}{sep}{httpx.QueryParams({'ticket': str(body['ticket'])})}"

    def prepare(self) -> None:
        """The first ticket, asked for before the worker listens: a refused Client ID or Secret is found at the
        start. The gateway busy or out of reach is only logged: ``run`` tries again with backoff."""
        try:
            super().prepare()
        except LinkRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - an outage at the start is not a reason to exit
            log.warning("dingtalk stream: could not open a connection yet (%s: %s); trying again", type(exc).__name__,
                        exc)

    def greet(self, conn: ClientConnection) -> None:
        log.info("dingtalk: stream connected")

    def handle(self, conn: ClientConnection, raw: str | bytes) -> bool:
        try:
            frame = json.loads(raw)
        except ValueError:
            log.warning("dingtalk stream: a frame that is not JSON")
            return False
        if not isinstance(frame, dict):
            return False
        kind = frame.get("type")
        headers = frame.get("headers") if isinstance(frame.get("headers"), dict) else {}
        topic, message_id = str(headers.get("topic") or ""), str(headers.get("messageId") or "")
        data = frame.get("data") if isinstance(frame.get("data"), str) else ""
        if kind == "SYSTEM":
            if topic == "ping":
                self._send(conn, ack(message_id, data=data))
                return False
            if topic == "disconnect":  # it wants no answer
                log.info("dingtalk stream: DingTalk asks for a new connection (disconnect)")
                return True
            log.info("dingtalk stream: a SYSTEM frame of topic %r, ignored", topic)
            return False
        if kind == "CALLBACK" and topic == BOT_MESSAGE_TOPIC:
            try:
                message = json.loads(data)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                log.warning("dingtalk stream: robot message frame %s carries no message; acknowledged", message_id)
                self._send(conn, ack(message_id))  # nothing to record
                return False
            if not self._record(message, message_id):
                return False  # lost (logged); not acknowledged
            if self._send(conn, ack(message_id)):
                self.acked += 1
            return False
        # an EVENT or a CALLBACK of another topic was not subscribed to: acknowledged (taken) and dropped
        log.info("dingtalk stream: a %s frame of topic %r, not subscribed to; acknowledged", kind, topic)
        if message_id:
            self._send(conn, ack(message_id))
        return False

    def _record(self, message: dict, frame_id: str) -> bool:
        """Hand ``message`` to ``on_message`` (which returns once it is in the outbox), trying again in place
        while it fails; False once it is given up, logged as lost (DingTalk never pushes it again)."""
        delay = 0.2
        for attempt in range(1, self.record_tries + 1):
            try:
                self.on_message(message)
                return True
            except LinkRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - the message is only in this frame: try again, then log it
                if attempt == self.record_tries or self.stopping.wait(delay):
                    log.error("dingtalk stream: could not record robot message msgId=%s (frame %s) in %d tries: "
                              "%s: %s; DingTalk does not send it again: it is LOST", message.get("msgId"), frame_id,
                              attempt, type(exc).__name__, exc, exc_info=True)
                    return False
                log.warning("dingtalk stream: could not record robot message msgId=%s (%s: %s); trying again in "
                            "%.1f s", message.get("msgId"), type(exc).__name__, exc, delay)
                delay *= 2
        return False

    @staticmethod
    def _send(conn: ClientConnection, text: str) -> bool:
        try:
            conn.send(text)
        except ConnectionClosed:
            return False  # the message is recorded; a robot message's acknowledgement is only diagnostic
        return True
