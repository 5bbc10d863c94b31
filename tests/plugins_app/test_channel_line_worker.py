"""channel-line's worker in process against the SDK's MockBridge and a fake LINE on loopback: what a
resumed delivery sends (the sent-pushes journal), and how a media download that LINE is slow with or
that fails once still reaches the host with its bytes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from plugins_app.channel.sdk import MediaNotReady
from plugins_app.channel.sdk.mock import MockBridge
from plugins_app.channel.workers.line import LineWorker, normalise
from plugins_app.channel.workers.line.api import LineError
from tests.fakes.line import USER, FakeLine

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


@pytest.fixture
def line_log(caplog):
    caplog.set_level("ERROR")
    return caplog


def wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return pred()


def start_worker(bridge: MockBridge, fake: FakeLine, state_dir: str, env: dict | None = None):
    w = LineWorker(argv=["--bind", "127.0.0.1:0"], environ=env or fake.env(),
                   **bridge.worker_kwargs(state_dir=state_dir))
    t = threading.Thread(target=w.run, name="line-worker", daemon=True)
    t.start()
    assert wait(lambda: w.server is not None and bridge.hellos), "worker did not come up"
    fake.webhook_url = w.server.url
    return w, t


REPO = Path(__file__).resolve().parents[2]


def long_answer() -> str:
    return "\n\n".join(f"paragraph {i} " + "word " * 200 for i in range(28))  # 7 parts: pushes of 5 and 2


# -- the sent-pushes journal --------------------------------------------------------------------------

class RevokeAfterFirstPush(FakeLine):
    """The token is reissued (the old one revoked) right after the first push of an answer went out."""

    def _push(self, headers, body):
        result = super()._push(headers, body)
        if result[0] == 200 and not getattr(self, "_revoked_once", False):
            self.revoked = self._revoked_once = True
        return result

    def a_day_passes(self):
        """LINE: 'The retry key is valid for 24 hours after attempting the first request.'"""
        with self.lock:
            self.accepted_keys.clear()


def test_an_answer_resumed_after_lines_retry_keys_expired_sends_each_part_once():
    """The first push of two went out, the second was refused for the token; the operator puts in a new
    token the next day, when LINE no longer knows the first push's key: the journal skips that push."""
    with RevokeAfterFirstPush() as line, MockBridge("line-test") as bridge, tempfile.TemporaryDirectory() as state:
        w, t = start_worker(bridge, line, state)
        delivery_id = bridge.queue_delivery(USER, long_answer())
        assert wait(lambda: not t.is_alive(), 60), "worker did not stop on the refusal"
        assert len(line.texts()) == 5  # the first push went out, the second was refused
        line.a_day_passes()
        line.token, line.revoked = "reissued-token", False
        w2, t2 = start_worker(bridge, line, state, env=line.env())
        try:
            assert wait(lambda: (bridge.delivery(delivery_id) or {}).get("state") == "delivered", 30), (
                bridge.delivery(delivery_id), [(c.status, c.body) for c in line.pushes()])
            texts = line.texts()
            assert len(texts) == 7 and len(set(texts)) == 7, f"{len(texts)} messages for 7 parts"
            assert [len(c.body["messages"]) for c in line.pushes() if c.status == 200] == [5, 2]
        finally:
            w2.stop()
            t2.join(15)


class HoldSecondPush(FakeLine):
    """LINE takes an answer's second push only once ``hold_second`` is set: the worker dies waiting."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hold_second = threading.Event()
        self.second_arrived = threading.Event()
        self._n = 0

    def _push(self, headers, body):
        with self.lock:
            self._n += 1
            n = self._n
        if n == 2:
            self.second_arrived.set()
            self.hold_second.wait(60)
        return super()._push(headers, body)


def spawn(bridge: MockBridge, line: FakeLine, state: str) -> subprocess.Popen:
    env = dict(os.environ, **bridge.env(), **line.env(), UGENT_WORKER_STATE_DIR=state)
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    return subprocess.Popen([sys.executable, "-m", "plugins_app.channel.workers.line", "--bind", "127.0.0.1:0"],
                            env=env, cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_kill_9_between_two_pushes_of_one_answer_sends_each_part_once():
    """The worker is killed while LINE holds the answer's second push, which LINE then takes. The restarted
    worker skips the first push (journaled) and sends the second again with its key: 409, delivered."""
    with HoldSecondPush() as line, MockBridge("line-test") as bridge, tempfile.TemporaryDirectory() as state:
        delivery_id = bridge.queue_delivery(USER, long_answer())
        first = spawn(bridge, line, state)
        try:
            assert line.second_arrived.wait(30), "the second push never came"
            assert len(line.texts()) == 5
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            line.hold_second.set()  # LINE takes the held push only now: the worker never heard of it
            assert wait(lambda: len(line.texts()) == 7, 10)
            second = spawn(bridge, line, state)
            try:
                assert wait(lambda: (bridge.delivery(delivery_id) or {}).get("state") == "delivered", 30), \
                    bridge.acks
                texts = line.texts()
                assert len(texts) == 7 and len(set(texts)) == 7, texts
                pushes = line.pushes()
                # push 0 was journaled: not sent again; push 1 (in flight at the kill) is LINE's 409
                assert [c.status for c in pushes] == [200, 200, 409], [c.status for c in pushes]
                assert pushes[1].headers["x-line-retry-key"] == pushes[2].headers["x-line-retry-key"]
            finally:
                second.send_signal(signal.SIGTERM)
                second.wait(15)
        finally:
            if first.poll() is None:
                first.kill()


# -- media downloads ----------------------------------------------------------------------------------

def test_a_video_line_is_still_preparing_reaches_the_host_with_its_bytes():
    """LINE answers 202 for a large video it is still preparing: the worker waits on the transcoding
    endpoint and submits the message once the bytes are stored on the host, not with the bare URL."""
    with FakeLine() as line, MockBridge("line-test") as bridge, tempfile.TemporaryDirectory() as state:
        w, t = start_worker(bridge, line, state)
        try:
            video = line.media_message(b"\x00\x00\x00\x18ftypmp42" + b"v" * 64, mtype="video",
                                       content_type="video/mp4")
            line.prepare(video["id"], polls=2)
            assert line.post(line.payload([line.event(video)])).status_code == 200
            [msg] = bridge.wait_for(lambda: bridge.submits, timeout=30)
            [att] = msg.attachments
            assert att.media_id, f"submitted without its bytes: url={att.url!r}"
            assert [c.status for c in line.calls_to(f"/v2/bot/message/{video['id']}/content")] == [202, 200]
        finally:
            w.stop()
            t.join(15)


def test_an_image_is_not_lost_to_one_passing_500_from_the_data_api():
    with FakeLine() as line, MockBridge("line-test") as bridge, tempfile.TemporaryDirectory() as state:
        w, t = start_worker(bridge, line, state)
        try:
            image = line.media_message(b"\xff\xd8\xff\xe0" + b"j" * 64)
            line.fail_content(times=1)
            assert line.post(line.payload([line.event(image)])).status_code == 200
            [msg] = bridge.wait_for(lambda: bridge.submits, timeout=20)
            assert msg.attachments[0].media_id, "submitted without its image after one 500"
            assert [c.status for c in line.calls_to(f"/v2/bot/message/{image['id']}/content")] == [500, 200]
        finally:
            w.stop()
            t.join(15)


def test_a_file_given_up_is_logged_as_such(line_log):
    line_log.set_level("WARNING")
    with FakeLine() as line:
        w = LineWorker(argv=[], environ=line.env(), socket_path="/nowhere", plugin_id="line-test", token="t",
                       install_signal_handlers=False)
        w.api.content_tries, w.api._sleep = 2, lambda secs: False
        [att] = normalise(line.event(line.media_message(b"jpeg")), data_base_url=line.base_url).attachments
        line.fail_content(times=5)
        with pytest.raises(MediaNotReady) as later:  # a 5xx past the retries: the SDK keeps the message owed
            w.fetch_media(att)
        assert isinstance(later.value.__cause__, LineError) and later.value.__cause__.status == 500
        w.api.close()
    assert any(f"the image of message {att.channel_ref} cannot be downloaded now" in r.getMessage()
               for r in line_log.records), line_log.text
