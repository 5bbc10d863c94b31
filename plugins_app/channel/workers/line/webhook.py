"""The webhook LINE POSTs events to, with ``X-Line-Signature`` checked.

A request is answered 200 only once every event it carries is safe in the worker's outbox (the
hub is asked afterwards), so LINE's redelivery (when switched on) resends only what was not
taken, and a redelivered event (``deliveryContext.isRedelivery``) is recognised by its
``webhookEventId`` and runs nothing. A bad or missing signature is answered 401 and nothing is
recorded (LINE's own SDK samples answer 400; LINE treats any non-2xx alike).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from typing import Callable

from plugins_app.channel.sdk.webhook import WebhookServer as SdkWebhookServer, json_loads_bounded

log = logging.getLogger("ugent.worker.line.webhook")

MAX_BODY_BYTES = 1 << 20


def signature(channel_secret: str, body: bytes) -> str:
    """``X-Line-Signature``: base64(HMAC-SHA256(channel secret, raw body))."""
    return base64.b64encode(hmac.new(channel_secret.encode(), body, hashlib.sha256).digest()).decode()


def signature_valid(channel_secret: str, body: bytes, given: str | None) -> bool:
    """Whether ``given`` is the body's signature, compared in constant time."""
    if not given or not channel_secret:
        return False
    return hmac.compare_digest(signature(channel_secret, body).encode(), given.encode())


class WebhookServer(SdkWebhookServer):
    """``POST <path>``: verify, then hand the payload (``destination``, ``events``) to ``on_payload``."""

    name = "line-webhook"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, channel_secret: str, on_payload: Callable[[dict], None]):
        super().__init__(bind, path)
        self.channel_secret = channel_secret
        self.on_payload = on_payload

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, dict]:
        if method != "POST":
            return 404, {"message": "Not found"}
        return self.handle(target, headers, body)

    def handle(self, path: str, headers, body: bytes | None) -> tuple[int, dict]:
        """One request: (status, answer). Nothing is recorded unless the signature holds."""
        if path.split("?", 1)[0] != self.path:
            return 404, {"message": "Not found"}
        if body is None:
            return 413, {"message": "Request body too large"}
        if not signature_valid(self.channel_secret, body, headers.get("X-Line-Signature")):
            log.warning("refused a request whose X-Line-Signature is missing or does not verify")
            return 401, {"message": "Invalid signature"}
        try:
            payload = json_loads_bounded(body)
        except ValueError:
            return 400, {"message": "Body is not JSON"}
        if not isinstance(payload, dict) or not isinstance(payload.get("events", []), list):
            return 400, {"message": "Body is not a webhook payload"}
        try:
            self.on_payload(payload)
        except Exception:  # noqa: BLE001 - not recorded: a 500 makes LINE redeliver (when switched on)
            log.exception("could not record the events for %s", payload.get("destination"))
            return 500, {"message": "Not recorded"}
        return 200, {}
