"""The shipped proxy configuration (deploy/haproxy.cfg) streams each chunk as it comes.

HAProxy's default sends with MSG_MORE: a chunk smaller than a packet waits in the kernel for the next
one or for about 200 ms, so a chat stream's tokens and an event stream's events came through the
proxy in bursts, up to 200 ms late (bench/events_fanout.py --layout proxy: commit to client p50
153 ms against 19 ms with `option http-no-delay`). How late is a duration, measured in the bench, not
asserted here; this checks the setting the proxy reads, section by section, as HAProxy reads it."""
from __future__ import annotations

from pathlib import Path

import pytest

CFG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy.cfg"
SECTIONS = ("global", "defaults", "frontend", "backend", "listen")


def sections(text: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.split()[0] in SECTIONS and not raw[:1].isspace():
            out.append((line, []))
        elif out:
            out[-1][1].append(" ".join(line.split()))
    return out


def test_the_proxy_sends_each_chunk_at_once_in_every_http_section():
    parsed = sections(CFG.read_text())
    defaults = [body for head, body in parsed if head.startswith("defaults")]
    assert defaults and "option http-no-delay" in defaults[-1]
    proxies = [(head, body) for head, body in parsed if head.split()[0] in ("frontend", "backend", "listen")]
    assert proxies, "the frontend and backend sections"
    assert [head for head, body in proxies if "no option http-no-delay" in body] == []


def test_the_reader_finds_a_setting_turned_off_in_a_section():
    text = CFG.read_text().replace("    balance roundrobin", "    balance roundrobin\n    no option http-no-delay")
    proxies = [head for head, body in sections(text) if "no option http-no-delay" in body]
    assert proxies == ["backend ugent_web"]


# -- the proxy's own errors, live -------------------------------------------------------------------------


def _fake_web(mode: str):
    """A web process for the proxy: /v1/health answers 200; a chat request is read, then either never answered
    ("hang") or its connection closed ("close"), as a web process that is slow or dies mid-turn."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.server.posts += 1
            if mode == "hang":
                self.server.stop.wait(30)
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.posts = 0
    server.stop = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server



@pytest.mark.parametrize("mode, status, code", [("close", 502, "bad_gateway"), ("hang", 504, "gateway_timeout")])
def test_the_proxys_own_502_and_504_tell_the_openai_client_not_to_send_it_again(tmp_path, mode, status, code):
    """The request reached a web process, so its message may have been accepted: the proxy's 502 (the process
    ended mid-request) and 504 (its timeout) are API errors with x-should-retry: false, and the official client
    sends the request once (found in review: a turn over `timeout server` ran three times)."""
    import os
    import subprocess
    import time

    import httpx
    import openai

    from tests.support.daemon import free_port
    from tests.support.layout import ensure_haproxy
    haproxy = ensure_haproxy()
    web = _fake_web(mode)
    port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CFG.read_text().replace("timeout server 120s", "timeout server 1s"))
    env = dict(os.environ, UGENT_PROXY_BIND=f"127.0.0.1:{port}", UGENT_WEB_A=f"127.0.0.1:{web.server_port}",
               UGENT_WEB_B=f"127.0.0.1:{web.server_port}")
    proxy = subprocess.Popen([haproxy, "-f", str(cfg), "-db"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:  # up, and the web process passed its health check
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not come up"
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []}, timeout=20)
        assert r.status_code == status
        assert r.headers["x-should-retry"] == "false" and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == code and "GET /v1/ugent/receipt" in r.json()["error"]["message"]
        web.posts = 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=2, timeout=20)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == status
        assert web.posts == 1  # sent once: the client did not retry
    finally:
        proxy.terminate()
        proxy.wait(10)
        web.stop.set()
        web.shutdown()
