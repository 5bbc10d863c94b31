"""Headless Chromium with a real EventSource: the connection drops mid-stream, the browser reconnects by
itself with Last-Event-ID, and the page receives every event once.

The page and its event stream are served by a small front end on loopback that holds the API key (a
browser's EventSource cannot send headers) and hangs up on the browser after a few events, as a load
balancer or a restarting worker would.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.streams.live import has, post_chat, read_events
from tests.support.daemon import Daemon

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not CHROMIUM, reason="chromium is not installed (scripts/ensure-chromium.sh)")

PAGE = """<!doctype html><html><body><pre id="log"></pre><script>
const seen = []; let completed = 0;
const es = new EventSource("/events?conversation_id=c-browser&cursor=0");
function record(e) {
  seen.push({id: e.lastEventId, type: e.type});
  if (e.type === "turn.completed" && ++completed === 2) {
    es.close();
    const out = document.createElement("pre"); out.id = "result"; out.textContent = JSON.stringify(seen);
    document.body.appendChild(out);
  }
}
for (const t of ["ugent.user_message", "turn.delta", "turn.completed", "turn.failed", "ugent.gap"]) {
  es.addEventListener(t, record);
}
</script></body></html>"""


class FrontEnd(ThreadingHTTPServer):
    """Serves the page and relays /events to the daemon; the first relay hangs up after `drop_after` events."""

    daemon_threads = True

    def __init__(self, daemon: Daemon, drop_after: int):
        super().__init__(("127.0.0.1", 0), Relay)
        self.daemon, self.drop_after = daemon, drop_after
        self.connections: list[str | None] = []  # the Last-Event-ID of each /events request


class Relay(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        server: FrontEnd = self.server
        if self.path == "/":
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if not self.path.startswith("/events?"):
            self.send_error(404)
            return
        last = self.headers.get("Last-Event-ID")
        server.connections.append(last)
        first = len(server.connections) == 1
        headers = {"x-api-key": server.daemon.key}
        if last:
            headers["Last-Event-ID"] = last
        query = self.path.split("?", 1)[1] + "&user=alice"
        with httpx.stream("GET", f"{server.daemon.base}/v1/ugent/events?{query}", headers=headers,
                          timeout=30) as resp:
            self.send_response(resp.status_code)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            sent = 0
            for line in resp.iter_lines():
                self.wfile.write(line.encode() + b"\n")
                if line == "":
                    self.wfile.flush()
                if line.startswith("id: "):
                    sent += 1
                if line == "" and first and sent >= server.drop_after:
                    self.wfile.flush()
                    self.connection.shutdown(2)  # hang up mid-stream
                    return


class Chromium:
    """Headless Chromium driven over the DevTools protocol."""

    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="ugent-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        deadline = time.monotonic() + 10
        while True:
            try:
                targets = httpx.get(f"http://127.0.0.1:{port}/json", timeout=2).json()
                page = next(t for t in targets if t["type"] == "page")
                break
            except (httpx.HTTPError, StopIteration):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        import websocket
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.seq = 0

    def call(self, method: str, **params):
        self.seq += 1
        self.ws.send(json.dumps({"id": self.seq, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.seq:
                return msg.get("result", {})

    def evaluate(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True).get("result", {}).get("value")

    def close(self):
        try:
            self.ws.close()
        finally:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("browser")).start()
    yield d
    d.close()


def test_eventsource_reconnects_with_last_event_id_and_receives_every_event_once(daemon):
    front = FrontEnd(daemon, drop_after=6)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    browser = Chromium()
    try:
        post_chat(daemon.base, daemon.key, "first message", conversation_id="c-browser", user="alice")
        browser.call("Page.navigate", url=f"http://127.0.0.1:{front.server_address[1]}/")
        time.sleep(0.3)
        post_chat(daemon.base, daemon.key, "script:slow=0.05|answer=" + " ".join(f"w{i}" for i in range(20)),
                  conversation_id="c-browser", user="alice")
        deadline = time.monotonic() + 30
        result = None
        while result is None and time.monotonic() < deadline:
            result = browser.evaluate(
                "(() => { const r = document.getElementById('result'); return r ? r.textContent : null })()")
            time.sleep(0.2)
        assert result is not None, "the page never finished"
    finally:
        browser.close()
        front.shutdown()
    seen = json.loads(result)
    whole = read_events(daemon.base, daemon.key, until=has("turn.completed", 2), cursor="0",
                        conversation_id="c-browser", user="alice")
    assert [int(e["id"]) for e in seen] == [e["id"] for e in whole]  # every event once, in order
    assert len(front.connections) >= 2 and front.connections[0] is None
    assert front.connections[1] == seen[5]["id"]  # the browser sent Last-Event-ID by itself
