"""Files against the real daemon (embedded, or uvicorn + a Celery worker with REDIS_URL set): a link keeps
working across a restart over the same var dir, and headless Chromium plays a WAV served by /v1/files through
Range requests in an <audio> element.

Chromium missing is a failure, not a skip: scripts/ensure-chromium.sh installs it (`make test` runs it).
"""
from __future__ import annotations

import io
import math
import re
import struct
import time
import wave

import httpx
import pytest

from tests.support.daemon import Daemon

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
SECONDS = 1.5


def wav_tone(seconds: float = SECONDS, rate: int = 16000) -> bytes:
    """16 kHz mono 16-bit PCM, as the seed's voice messages are: a quiet 440 Hz tone."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(3000 * math.sin(2 * math.pi * 440 * i / rate)))
                               for i in range(int(rate * seconds))))
    return out.getvalue()


def wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("files")).start()
    yield d
    d.close()


def upload(d: Daemon, data: bytes, name: str, conversation_id: str) -> dict:
    resp = httpx.post(d.base + "/v1/files", headers={"x-api-key": d.key}, timeout=30,
                      data={"conversation_id": conversation_id, "user": "alice"}, files={"file": (name, data)})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_link_keeps_working_across_a_restart(daemon):
    data = wav_tone(0.5)
    f = upload(daemon, data, "before-restart.wav", "c-restart")
    link = daemon.base + f["url"]
    headers = {"x-api-key": daemon.key}
    assert httpx.get(link, params={"user": "alice"}, headers=headers, timeout=30).content == data
    daemon.stop()
    daemon.spawn()  # a fresh process over the same var dir and database
    again = httpx.get(link, params={"user": "alice"}, headers={**headers, "Range": "bytes=44-"}, timeout=30)
    assert again.status_code == 206 and again.content == data[44:]
    assert again.headers["content-range"] == f"bytes 44-{len(data) - 1}/{len(data)}"
    assert again.headers["content-type"] == "audio/wav"
    # still its owner's only
    assert httpx.get(link, params={"user": "bob"}, headers=headers, timeout=30).status_code == 404


def test_chromium_plays_a_wav_from_v1_files_through_range_requests(daemon):
    from playwright.sync_api import sync_playwright
    data = wav_tone()
    f = upload(daemon, data, "tone.wav", "c-audio")
    src = f"{daemon.base}{f['url']}?user=alice"
    seen = []  # (status, request Range header, response Content-Range) of each request for the file
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # the key on every request the page makes, the <audio> element's included (it cannot send headers)
            context = browser.new_context(extra_http_headers={"x-api-key": daemon.key})
            page = context.new_page()

            def on_response(resp):
                if f["id"] in resp.url:
                    seen.append((resp.status, resp.request.headers.get("range"), resp.headers.get("content-range")))
            page.on("response", on_response)
            page.goto(daemon.base + "/v1/health")  # the daemon's own origin
            page.set_content(f'<audio id="a" preload="auto" src="{src}"></audio>')
            page.evaluate("() => { const a = document.getElementById('a'); a.muted = true; "
                          "window.playing = a.play().then(() => 'ok', e => String(e)); }")
            assert page.evaluate("() => window.playing") == "ok"
            wait_for(lambda: page.evaluate("() => document.getElementById('a').ended"), "the audio to play to its end")
            duration = page.evaluate("() => document.getElementById('a').duration")
            played = page.evaluate("() => { const p = document.getElementById('a').played; "
                                   "return p.length ? p.end(p.length - 1) : 0 }")
            error = page.evaluate("() => document.getElementById('a').error && document.getElementById('a').error.code")
        finally:
            browser.close()
    assert error is None
    assert duration == pytest.approx(SECONDS, abs=0.05)
    assert played == pytest.approx(SECONDS, abs=0.05)
    ranged = [s for s in seen if s[1]]
    assert ranged and all(status == 206 for status, _, _ in ranged), seen
    assert all(cr and cr.endswith(f"/{len(data)}") for _, _, cr in ranged), seen
    # and the daemon itself answered a request for the file with a 206 (its request log line)
    log = (daemon.tmp / "daemon.log").read_text(errors="replace")
    assert re.search(rf"path=/v1/files/{f['id']}, status=206", log), log[-2000:]
