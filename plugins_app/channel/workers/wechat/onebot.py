"""OneBot 12's forward WebSocket, as the application end speaks it: events in, actions out, on one connection.

What this relies on (https://12.onebot.dev, "OneBot Connect"):

* Forward WebSocket: the bridge (the OneBot implementation) listens, the application connects to ``/`` of its
  ``ws://host:port``. With an access token configured, the bridge checks ``Authorization: Bearer <token>``
  before the upgrade and refuses with HTTP 401 (the standard; ComWeChatBotClient closes before accepting, which
  its server answers 403). Either is ``LinkRefused``: only the operator can fix the token.
* Events are JSON text frames ``{"id", "time", "type": message|notice|request|meta, "detail_type", "sub_type",
  "self": {"platform", "user_id"}, ...}`` (meta events carry no ``self``). The first event on a connection is
  ``meta.connect`` with ``version: {"impl", "version", "onebot_version"}``; ``meta.status_update`` carries
  ``status: {"good", "bots": [{"self", "online"}]}``; ``meta.heartbeat`` carries ``interval`` (ms).
* Actions are JSON text frames ``{"action", "params", "echo"}``, answered on the same connection by
  ``{"status": "ok"|"failed", "retcode", "data", "message", "echo"}``, matched here by ``echo`` (answers may come
  in any order, and between events).
* Return codes: 0 ok; 1xxxx the request (10001 bad request, 10002 unsupported action, 10003 bad param, 10004
  unsupported param, 10005 unsupported segment, 10006 bad segment data, 10007 unsupported segment data, 10101
  "who am I": the bridge serves several accounts and the action named none, 10102 unknown self); 2xxxx the
  bridge's handler failed; 3xxxx execution (31 database, 32 file system, 33 network, 34 the chat platform, 35
  logic: no such user or group, 36 "I am tired"); 4xxxx and 5xxxx reserved; 6xxxx-9xxxx an implementation's own.

Nothing in OneBot 12 replays an event: what the bridge pushed while no connection was open is gone.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from typing import Callable

from websockets.exceptions import ConnectionClosed
from websockets.protocol import State
from websockets.sync.client import ClientConnection

from plugins_app.channel.sdk.wslink import LinkRefused, WebSocketLink

log = logging.getLogger("ugent.worker.wechat.onebot")

#: Request errors (1xxxx) that name no fault of the moment: what was asked is wrong or unsupported, and sending
#: it again gets the same answer.
REQUEST_ERRORS = range(10000, 20000)
WHO_AM_I, UNKNOWN_SELF = 10101, 10102
#: Execution errors that will not pass by themselves: the chat platform refused (a muted group, a blocked user)
#: or the action is impossible (no such user or group).
PLATFORM_ERRORS = range(34000, 35000)
LOGIC_ERRORS = range(35000, 36000)
#: The bridge's file system: for ``get_file``, a file it does not have (ComWeChatBotClient: 32000 "未找到该文件").
FILESYSTEM_ERRORS = range(32000, 33000)


class BridgeAway(Exception):
    """No connection to the bridge now, or the one an action went out on closed before its answer came."""


class AnswerLost(Exception):
    """The action went out and its connection closed before the bridge answered: it may have been carried out."""


class ActionFailed(Exception):
    """The bridge answered ``status: failed``: its ``retcode`` and ``message``."""

    def __init__(self, action: str, retcode: int, message: str):
        super().__init__(f"{action} failed: retcode {retcode}: {message or 'no message'}")
        self.action, self.retcode, self.message = action, retcode, message

    @property
    def refuses_account(self) -> bool:
        """The bridge cannot tell which account the action is for (10101), or knows none such (10102): the
        operator must point the worker at a bridge of one logged-in account."""
        return self.retcode in (WHO_AM_I, UNKNOWN_SELF)

    @property
    def final(self) -> bool:
        """Sending the same action again would get the same answer: a request error, the platform's refusal, an
        impossible action. Everything else (the bridge's handler, its database, file system, network, "tired",
        an implementation's own code) may pass."""
        return self.retcode in REQUEST_ERRORS or self.retcode in PLATFORM_ERRORS or self.retcode in LOGIC_ERRORS

    @property
    def file_gone(self) -> bool:
        """For ``get_file``: the file will not come (the answer is final, or the bridge's file system has no such
        file); a network or database failure of the bridge's may pass."""
        return self.final or self.retcode in FILESYSTEM_ERRORS


def action_frame(action: str, params: dict, echo: str) -> str:
    return json.dumps({"action": action, "params": params, "echo": echo}, ensure_ascii=False)


def is_response(frame: dict) -> bool:
    """An action's answer rather than an event: it carries an ``echo`` and a ``status`` or ``retcode``."""
    return "echo" in frame and ("status" in frame or "retcode" in frame) and "type" not in frame


class Actions:
    """Actions sent on the link's current connection from any thread, each answer handed back by ``echo``."""

    def __init__(self, link: "OneBotLink"):
        self.link = link
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[str, list] = {}  # echo -> [threading.Event, the answer or None]

    def call(self, action: str, params: dict, *, timeout: float) -> object:
        """The ``data`` of the bridge's answer; ``ActionFailed`` for ``status: failed``, ``BridgeAway`` when there
        is no connection (nothing went out), ``AnswerLost`` when the connection it went out on closed before the
        answer, ``TimeoutError`` when no answer came in time (in these two the action may have been carried out)."""
        conn = self.link.conn
        if conn is None or conn.state is not State.OPEN:
            raise BridgeAway("not connected to the bridge")
        echo = f"ugent-{next(self._ids)}"
        slot: list = [threading.Event(), None]
        with self._lock:
            self._waiting[echo] = slot
        try:
            try:
                conn.send(action_frame(action, params, echo))
            except (ConnectionClosed, OSError) as exc:
                raise BridgeAway(f"the connection closed as {action} was sent: {exc}") from None
            deadline = time.monotonic() + timeout
            while not slot[0].wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                if conn.state is not State.OPEN:
                    raise AnswerLost(f"the connection closed before the bridge answered {action}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the bridge did not answer {action} within {timeout:.0f} s")
        finally:
            with self._lock:
                self._waiting.pop(echo, None)
        answer = slot[1]
        if answer.get("status") == "ok" or (answer.get("status") is None and answer.get("retcode") == 0):
            return answer.get("data")
        retcode = answer.get("retcode")
        raise ActionFailed(action, retcode if isinstance(retcode, int) else -1, str(answer.get("message") or ""))

    def resolve(self, frame: dict) -> None:
        with self._lock:
            slot = self._waiting.get(str(frame.get("echo")))
        if slot is None:
            log.debug("an answer for echo %r nobody waits for", frame.get("echo"))
            return
        slot[1] = frame
        slot[0].set()


class OneBotLink(WebSocketLink):
    """The forward WebSocket to a OneBot 12 bridge on the SDK's link: the token in the handshake, a 401 or 403
    there ``LinkRefused``, each event to ``on_event`` and each action's answer to ``actions``."""

    name = "onebot"
    #: A file fetched with ``get_file`` comes as base64 in one frame: room for a file of some 48 MiB.
    max_size = 64 * 2 ** 20

    def __init__(self, url: str, access_token: str, on_event: Callable[[dict], None], stopping: threading.Event):
        super().__init__(stopping)
        self.url = url
        self.access_token = access_token
        self.on_event = on_event
        self.actions = Actions(self)
        self.impl: str | None = None  # the bridge's name, from meta.connect (``version.impl``)

    def open_url(self) -> str:
        return self.url

    def open_headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.access_token}"} if self.access_token else None

    def handshake_refused(self, status: int, body: bytes) -> None:
        if status in (401, 403):
            said = body.decode("utf-8", "replace").strip()[:200]
            raise LinkRefused(f"the OneBot bridge refused the access token (WECHAT_ONEBOT_ACCESS_TOKEN): HTTP {status}"
                              + (f" {said}" if said else ""))
        log.warning("onebot: the bridge answered the handshake with HTTP %s; trying again", status)

    def greet(self, conn: ClientConnection) -> None:
        log.info("onebot: connected to %s", self.url)

    def handle(self, conn: ClientConnection, raw: str | bytes) -> bool:
        if isinstance(raw, bytes):  # MessagePack: this end sends JSON text, so a bridge answers in kind
            log.warning("onebot: a binary frame (MessagePack), not read")
            return False
        try:
            frame = json.loads(raw)
        except ValueError:
            log.warning("onebot: a frame that is not JSON")
            return False
        if not isinstance(frame, dict):
            return False
        if is_response(frame):
            self.actions.resolve(frame)
            return False
        if frame.get("type") == "meta" and frame.get("detail_type") == "connect":
            version = frame.get("version") if isinstance(frame.get("version"), dict) else {}
            self.impl = str(version.get("impl") or "") or None
            log.info("onebot: bridge %s %s (OneBot %s)", version.get("impl"), version.get("version"),
                     version.get("onebot_version"))
        self.on_event(frame)
        return False
