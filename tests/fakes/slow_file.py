"""A platform's file over a slow but steady link, on loopback: the headers at once, then the body a byte at a time.

No read waits long enough to time out (the SDK's ``download`` allows 15 s between two), so the download simply
goes on until the test says ``finish()`` (or ``give_up_secs`` passed): one user's large video, downloading for
minutes, while the test looks at what the worker does meanwhile."""
from __future__ import annotations

import threading
import time

from tests.fakes import FakeHandler, FakeHTTPServer


class SlowFile:
    """``url`` serves ``data`` slowly; ``gets`` counts the downloads begun, ``sending``/``sent`` say where one is."""

    def __init__(self, data: bytes, *, byte_every: float = 0.05, give_up_secs: float = 10.0,
                 content_type: str = "video/mp4"):
        self.data = data
        self.gets = 0
        self.sending = threading.Event()   # a download is under way
        self.sent = threading.Event()      # ... and has ended, the body sent whole
        self._finish = threading.Event()
        file = self

        class Handler(FakeHandler):
            def route(self, method, raw):
                file.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(file.data)))
                self.end_headers()
                file.sending.set()
                deadline, at = time.monotonic() + give_up_secs, 0
                while at < len(file.data) - 1 and time.monotonic() < deadline and not file._finish.wait(byte_every):
                    self.wfile.write(file.data[at:at + 1])
                    self.wfile.flush()
                    at += 1
                self.wfile.write(file.data[at:])
                self.wfile.flush()
                file.sent.set()

        self.httpd = FakeHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/video.mp4"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def finish(self) -> None:
        """Send the rest of the body at once."""
        self._finish.set()

    def __enter__(self) -> "SlowFile":
        return self

    def __exit__(self, *exc) -> None:
        self._finish.set()
        self.httpd.shutdown()
        self.httpd.server_close()
