"""The Events API webhook: an HTTP endpoint Slack POSTs events to, with v0 signatures checked.

A slash command comes here too, as a form POST (``command``, ``text``, ``trigger_id``...), signed the same
way. A request is answered only after its event is safe in the worker's outbox, and within
Slack's 3 seconds (the hub is asked afterwards), so a retry (``X-Slack-Retry-Num``) is rare and,
when it comes, is recognised by its message's channel and ``ts`` (its ``message_id``) and runs nothing.
"""
from __future__ import annotations

import logging
from typing import Callable
from urllib.parse import parse_qs

from slack_sdk.signature import SignatureVerifier

from plugins_app.channel.sdk.webhook import WebhookServer, json_loads_bounded

log = logging.getLogger("ugent.worker.slack.webhook")

MAX_BODY_BYTES = 1 << 20


class EventsServer(WebhookServer):
    """``POST <path>``: verify, answer ``url_verification``, hand event callbacks to ``on_payload``."""

    name = "slack-webhook"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, signing_secret: str, on_payload: Callable[[dict], None],
                 *, verifier: SignatureVerifier | None = None):
        super().__init__(bind, path)
        self.verifier = verifier or SignatureVerifier(signing_secret)
        self.on_payload = on_payload

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, dict | str]:
        if method != "POST":
            return 404, {"ok": False, "error": "not_found"}
        return self.handle(target, headers, body)

    def handle(self, path: str, headers, body: bytes | None) -> tuple[int, dict | str]:
        """One request: (status, answer). Nothing is recorded unless the signature holds."""
        if path.split("?", 1)[0] != self.path:
            return 404, {"ok": False, "error": "not_found"}
        if body is None:
            return 413, {"ok": False, "error": "request body too large"}
        timestamp = (headers.get("X-Slack-Request-Timestamp") or "").strip()
        signature = headers.get("X-Slack-Signature") or ""
        if not (signature and timestamp.isascii() and timestamp.isdigit()):
            # (slack_sdk's verifier does int(timestamp) and raises on anything else)
            log.warning("refused a request without a Slack signature or an integer X-Slack-Request-Timestamp")
            return 401, {"ok": False, "error": "invalid signature"}
        try:
            valid = self.verifier.is_valid(body=body, timestamp=timestamp, signature=signature)
        except (ValueError, TypeError):
            # slack_sdk decodes the body as UTF-8, compares str digests and reads the timestamp with int(): a body
            # that is not UTF-8 (UnicodeDecodeError), a signature with a non-ASCII character (TypeError) or a
            # timestamp past int()'s digit limit (ValueError) raised, a 500 with a traceback for anyone who asked;
            # such a request is no signed request of Slack's
            valid = False
        if not valid:
            log.warning("refused a request whose Slack signature does not verify (or is older than 5 minutes)")
            return 401, {"ok": False, "error": "invalid signature"}
        if (headers.get("Content-Type") or "").startswith("application/x-www-form-urlencoded"):
            form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True).items()}
            if not form.get("command"):
                return 400, {"ok": False, "error": "a form body that is no slash command"}
            try:  # a slash command: the same answer within 3 s once recorded; an empty 200 shows nothing
                self.on_payload({"type": "slash_commands", "payload": form})
            except Exception:  # noqa: BLE001 - not recorded: Slack tells the user it failed
                log.exception("could not record slash command %s", form.get("trigger_id"))
                return 500, {"ok": False, "error": "not recorded"}
            return 200, ""
        try:
            payload = json_loads_bounded(body)
        except ValueError:
            return 400, {"ok": False, "error": "body is not JSON"}
        if not isinstance(payload, dict):
            return 400, {"ok": False, "error": "body is not a JSON object"}
        if payload.get("type") == "url_verification":
            return 200, {"challenge": str(payload.get("challenge", ""))}
        retry = headers.get("X-Slack-Retry-Num")
        if retry:
            log.info("Slack retry %s (%s) of event %s", retry, headers.get("X-Slack-Retry-Reason"),
                     payload.get("event_id"))
        try:
            self.on_payload(payload)
        except Exception:  # noqa: BLE001 - not recorded: a 500 makes Slack send it again
            log.exception("could not record event %s", payload.get("event_id"))
            return 500, {"ok": False, "error": "not recorded"}
        return 200, ""
