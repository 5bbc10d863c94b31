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
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

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


class WebhookServer:
    """``POST <path>``: verify, then hand the payload (``destination``, ``events``) to ``on_payload``."""

    def __init__(self, bind: str, path: str, channel_secret: str, on_payload: Callable[[dict], None]):
        host, _, port = bind.rpartition(":")
        self.path = path
        self.channel_secret = channel_secret
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
                self._answer(404, {"message": "Not found"})

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

            def _answer(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
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
                                        name="line-webhook", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

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
            payload = json.loads(body)
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
