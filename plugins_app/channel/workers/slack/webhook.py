"""The Events API webhook: an HTTP endpoint Slack POSTs events to, with v0 signatures checked.

A request is answered only after its event is safe in the worker's outbox, and within
Slack's 3 seconds (the hub is asked afterwards), so a retry (``X-Slack-Retry-Num``) is rare and,
when it comes, is recognised by its ``event_id`` and runs nothing.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from slack_sdk.signature import SignatureVerifier

log = logging.getLogger("ugent.worker.slack.webhook")

MAX_BODY_BYTES = 1 << 20


class EventsServer:
    """``POST <path>``: verify, answer ``url_verification``, hand event callbacks to ``on_payload``."""

    def __init__(self, bind: str, path: str, signing_secret: str, on_payload: Callable[[dict], None],
                 *, verifier: SignatureVerifier | None = None):
        host, _, port = bind.rpartition(":")
        self.path = path
        self.verifier = verifier or SignatureVerifier(signing_secret)
        self.on_payload = on_payload
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10  # seconds a connection may keep the server waiting (a stalled client holds no thread)

            def log_message(self, fmt, *args):  # noqa: N802 - the stdlib's name
                log.debug("%s " + fmt, self.address_string(), *args)

            def do_POST(self):  # noqa: N802
                status, body = server.handle(self.path, self.headers, self._body())
                self._answer(status, body)

            def do_GET(self):  # noqa: N802
                self._answer(404, {"ok": False, "error": "not_found"})

            def _body(self) -> bytes | None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    self.close_connection = True
                    return None
                if length < 0 or length > MAX_BODY_BYTES:
                    self.close_connection = True  # its body is never read: it must not be taken for the next request
                    return None
                return self.rfile.read(length)

            def _answer(self, status: int, body: dict | str | None):
                data = (json.dumps(body) if isinstance(body, dict) else (body or "")).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer((host or "127.0.0.1", int(port or 0)), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}{self.path}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="slack-webhook", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, path: str, headers, body: bytes | None) -> tuple[int, dict | str]:
        """One request: (status, answer). Nothing is recorded unless the signature holds."""
        if path.split("?", 1)[0] != self.path:
            return 404, {"ok": False, "error": "not_found"}
        if body is None:
            return 413, {"ok": False, "error": "request body too large"}
        timestamp = headers.get("X-Slack-Request-Timestamp") or ""
        signature = headers.get("X-Slack-Signature") or ""
        if not self.verifier.is_valid(body=body, timestamp=timestamp, signature=signature):
            log.warning("refused a request whose Slack signature does not verify (or is older than 5 minutes)")
            return 401, {"ok": False, "error": "invalid signature"}
        try:
            payload = json.loads(body)
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
