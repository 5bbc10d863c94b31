"""Fakes of the chat platforms' APIs, speaking their wire formats on loopback."""
from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHTTPServer(ThreadingHTTPServer):
    """A fake's HTTP server: a client that leaves before its answer is written (a worker the test killed or
    stopped, a request that timed out) is the client's business, not a traceback on the test run's stderr."""

    def serve_forever(self, poll_interval: float = 0.05) -> None:
        """socketserver's loop looks for shutdown() every poll_interval: 0.5 s by default, which every test's
        teardown waited out (0.28 s on average; 7 s of test_channel_telegram.py's 90)."""
        super().serve_forever(poll_interval)

    def handle_error(self, request, client_address):
        import sys
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            return
        super().handle_error(request, client_address)


class FakeHandler(BaseHTTPRequestHandler):
    """A fake's request handler: GET and POST, their body read whole, go to ``route(method, raw)``; ``send``
    writes one answer. Quiet: the test run's stderr is not the fake's log."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.route("GET", self._raw())

    def do_POST(self):  # noqa: N802
        self.route("POST", self._raw())

    def _raw(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def route(self, method: str, raw: bytes) -> None:
        raise NotImplementedError

    def send(self, status: int, body: bytes, ctype: str, headers=None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
