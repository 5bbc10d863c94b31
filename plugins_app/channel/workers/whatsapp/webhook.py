"""The Cloud API webhook: Meta's verification handshake (GET) and signed notifications (POST).

* ``GET <path>?hub.mode=subscribe&hub.verify_token=T&hub.challenge=C``: when ``T`` is
  ``WHATSAPP_VERIFY_TOKEN``, answered ``200 text/plain`` with ``C`` as it came; else 403 (Meta's
  own sample answers a wrong verify token 403: the caller is known, and refused).
* ``POST <path>``: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256(app secret, raw body)>`` is checked
  in constant time on the bytes as they arrived, before the body is parsed. A missing or wrong
  signature is answered **401** (the request failed authentication: it does not prove it comes
  from Meta; Slack's webhook answers the same) and nothing is recorded. A good one is answered 200
  only once ``on_payload`` returned, which is once the messages are safe in the worker's outbox;
  anything else is a 500, and Meta sends the notification again.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from plugins_app.channel.sdk.webhook import WebhookServer as SdkWebhookServer, json_loads_bounded

log = logging.getLogger("ugent.worker.whatsapp.webhook")

MAX_BODY_BYTES = 3 << 20
SIGNATURE_HEADER = "X-Hub-Signature-256"


def signature(app_secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value Meta sends for ``body``."""
    return "sha256=" + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()


def signature_valid(app_secret: str, body: bytes, header: str | None) -> bool:
    """Whether ``header`` is ``sha256=`` and the hex HMAC of ``body`` under the app secret (constant time)."""
    if not app_secret or not header:
        return False
    scheme, _, given = header.strip().partition("=")
    if scheme.lower() != "sha256" or not given:
        return False
    expected = hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(given.lower().encode(), expected.encode())


def verification_answer(query: str, verify_token: str) -> tuple[int, str]:
    """The answer to Meta's GET handshake: (200, the challenge) or (403, why not)."""
    params = {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}
    given = params.get("hub.verify_token", "")
    if params.get("hub.mode") != "subscribe" or not verify_token or \
            not hmac.compare_digest(given.encode(), verify_token.encode()):
        return 403, "verification failed"
    return 200, params.get("hub.challenge", "")


class WebhookServer(SdkWebhookServer):
    """The worker's HTTP endpoint for Meta; ``handle_get``/``handle_post`` are its whole logic."""

    name = "whatsapp-webhook"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, *, app_secret: str, verify_token: str,
                 on_payload: Callable[[dict], None]):
        super().__init__(bind, path)
        self.app_secret = app_secret
        self.verify_token = verify_token
        self.on_payload = on_payload

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, str]:
        return self.handle_get(target) if method == "GET" else self.handle_post(target, headers, body)

    def handle_get(self, target: str) -> tuple[int, str]:
        parts = urlsplit(target)
        if parts.path != self.path:
            return 404, "not found"
        status, answer = verification_answer(parts.query, self.verify_token)
        if status != 200:
            log.warning("refused a webhook verification: wrong hub.verify_token or hub.mode")
        return status, answer

    def handle_post(self, target: str, headers, body: bytes | None) -> tuple[int, str]:
        """One notification: (status, answer). Nothing is recorded unless the signature holds."""
        if urlsplit(target).path != self.path:
            return 404, "not found"
        if body is None:
            return 413, "request body too large"
        if not signature_valid(self.app_secret, body, headers.get(SIGNATURE_HEADER)):
            log.warning("refused a notification whose %s is missing or does not verify", SIGNATURE_HEADER)
            return 401, "invalid signature"
        try:
            payload = json_loads_bounded(body)
        except ValueError:
            return 400, "body is not JSON"
        if not isinstance(payload, dict):
            return 400, "body is not a JSON object"
        try:
            self.on_payload(payload)
        except Exception:  # noqa: BLE001 - not recorded: anything but a 200 makes Meta send it again
            log.exception("could not record a notification")
            return 500, "not recorded"
        return 200, "ok"
