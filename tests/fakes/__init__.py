"""Fakes of the chat platforms' APIs, speaking their wire formats on loopback."""
from __future__ import annotations

from http.server import ThreadingHTTPServer


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
