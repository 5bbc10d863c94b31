"""The HTTP address DingTalk POSTs a robot's messages to, with its ``timestamp`` and ``sign`` headers checked.

DingTalk signs each request: ``sign`` = base64(HMAC-SHA256(key = the app's AppSecret, message = the
``timestamp`` header (milliseconds) + "\\n" + AppSecret)), no URL encoding (that is the custom robot's
outbound form). A request is taken only when the sign matches (compared in constant time) and the
timestamp is within an hour of this host's clock, as DingTalk's robot docs ask; anything else is answered
401 and nothing is recorded. The sign covers the timestamp only, not the body: whoever saw one request's
headers could send any body under them for up to two hours (a new ``msgId``, any sender) — a forgery, not
a replay. So each sign is tied to the message it first came with (``message_identity``: its ``msgId``,
``msgtype``, conversation and sender; ``SeenLog``, kept for as long as the timestamp can be fresh in a file
of the worker's own, so a restart forgets none of it), not to its bytes: that message again, however
serialised, is DingTalk sending it again (taken, and the ``msgId`` keeps it from running a second turn; its
``sessionWebhook`` is not taken), another message under a sign already used is answered 401 and records
nothing. docs/channels/dingtalk.md (Security) says why, and what that leaves.

A request is answered 200 only once its message is in the worker's outbox; DingTalk may send a message
again, and the ``msgId`` keeps that from running a second turn.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from typing import Callable

from plugins_app.channel.sdk.seen import AGAIN, OTHER, SeenLog
from plugins_app.channel.sdk.webhook import WebhookServer as SdkWebhookServer, json_loads_bounded

log = logging.getLogger("ugent.worker.dingtalk.webhook")

MAX_BODY_BYTES = 1 << 20
#: How far the ``timestamp`` header may be from this host's clock (DingTalk: "more than 1 hour: illegal").
MAX_SKEW_MS = 3600 * 1000


def signature(app_secret: str, timestamp: str) -> str:
    """The ``sign`` header DingTalk sends with ``timestamp``: base64(HMAC-SHA256(AppSecret, ts + "\\n" + AppSecret))."""
    digest = hmac.new(app_secret.encode("utf-8"), f"{timestamp}\n{app_secret}".encode("utf-8"), hashlib.sha256)
    return base64.b64encode(digest.digest()).decode()


def signature_valid(app_secret: str, timestamp: str | None, given: str | None, *, now_ms: int | None = None) -> bool:
    """Whether ``given`` is the sign of ``timestamp`` (constant time) and the timestamp is within the hour."""
    if not app_secret or not timestamp or not given:
        return False
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if abs(now - ts) > MAX_SKEW_MS:
        return False
    return hmac.compare_digest(signature(app_secret, timestamp).encode(), given.encode())


def message_identity(message: dict) -> bytes:
    """What a sign is tied to: the SHA-256 of the message's ``msgId``, type, conversation and sender, not of its
    bytes (DingTalk sending it again may serialise it anew, with a fresh ``sessionWebhook``)."""
    fields = [str(message.get(k) or "") for k in ("msgId", "msgtype", "conversationType", "conversationId",
                                                   "senderStaffId", "senderId")]
    return hashlib.sha256(json.dumps(fields).encode()).digest()


class WebhookServer(SdkWebhookServer):
    """``POST <path>``: verify, then hand the message (a dict) to ``on_message``."""

    name = "dingtalk-webhook"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, app_secret: str, on_message: Callable[[dict], None], *,
                 seen_path: str | None = None, clock: Callable[[], float] = time.time):
        super().__init__(bind, path)
        self.app_secret = app_secret
        self.on_message = on_message
        # sign -> (when, the identity of the message it first came with), on disk at ``seen_path``: a timestamp is
        # fresh from an hour before this host's clock to an hour after, so a sign may be offered for two hours
        self._seen = SeenLog(seen_path, 2 * MAX_SKEW_MS / 1000 + 60, clock)

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, dict]:
        if method != "POST":
            return 404, {"message": "Not found"}
        return self.handle(target, headers, body)

    def handle(self, path: str, headers, body: bytes | None, *, now_ms: int | None = None) -> tuple[int, dict]:
        """One request: (status, answer). Nothing is recorded unless the sign and the timestamp hold."""
        if path.split("?", 1)[0] != self.path:
            return 404, {"message": "Not found"}
        if body is None:
            return 413, {"message": "Request body too large"}
        if not signature_valid(self.app_secret, headers.get("timestamp"), headers.get("sign"), now_ms=now_ms):
            log.warning("refused a request whose sign is missing or does not verify, or whose timestamp is more "
                        "than an hour away")
            return 401, {"message": "Invalid sign or timestamp"}
        try:
            message = json_loads_bounded(body)
        except ValueError:
            return 400, {"message": "Body is not JSON"}
        if not isinstance(message, dict):
            return 400, {"message": "Body is not a robot message"}
        use = self._seen.use(headers.get("sign"), message_identity(message))
        if use == OTHER:
            log.warning("refused message %s of conversation %s: its sign came before with another message (the "
                        "sign covers only the timestamp: someone who saw that request's headers sent a message of "
                        "theirs, or another chat's message was stamped in the same millisecond)",
                        message.get("msgId"), message.get("conversationId"))
            return 401, {"message": "Invalid sign or timestamp"}
        if use == AGAIN and ("sessionWebhook" in message or "sessionWebhookExpiredTime" in message):
            # DingTalk sending the message again; its session URL is not taken from a body the sign came with
            # before (the one recorded first, if any, stands)
            message = {k: v for k, v in message.items() if k not in ("sessionWebhook", "sessionWebhookExpiredTime")}
        try:
            self.on_message(message)
        except Exception:  # noqa: BLE001 - not recorded: no 200, so DingTalk may send it again
            log.exception("could not record message %s", message.get("msgId"))
            return 500, {"message": "Not recorded"}
        return 200, {}

    def stop(self) -> None:
        super().stop()
        self._seen.close()
