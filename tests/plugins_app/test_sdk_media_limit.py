"""A user's file over the host's media limit (media.put answers -32005) costs the file, never the message.

Before, the SDK left such a message pending: every replay downloaded the file from the platform again, was
refused again, and stopped there, so the message and every one recorded after it waited for ever (the
platform had its 200 for all of them). Now the message goes on without the file, its text saying so.
Driven through channel-line's worker and its fake, with the SDK's MockBridge as the host."""
from __future__ import annotations

import tempfile
import threading

import pytest

from plugins_app.channel.sdk.mock import MockBridge
from plugins_app.channel.workers.line import LineWorker
from tests.fakes.line import FakeLine

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


def test_a_file_over_the_hosts_media_limit_is_dropped_with_a_note_and_nothing_waits_behind_it():
    with FakeLine() as line, MockBridge("line-test", heartbeat_secs=0.2) as bridge, \
            tempfile.TemporaryDirectory() as state:
        bridge.hub.media_max_bytes = 1024  # stands in for UGENT_PLUGIN_MEDIA_MAX_BYTES against a large video
        worker = LineWorker(argv=["--bind", "127.0.0.1:0"], environ=line.env(),
                            **bridge.worker_kwargs(state_dir=state))
        thread = threading.Thread(target=worker.run, name="line-worker", daemon=True)
        thread.start()
        try:
            bridge.wait_for(lambda: worker.server is not None and bridge.hellos, timeout=20)
            line.webhook_url = worker.server.url
            video = line.media_message(b"v" * 4096, mtype="video", content_type="video/mp4")
            assert line.post(line.payload([line.event(video)])).status_code == 200
            line.say("hello after the video")
            got = bridge.wait_for(lambda: len(bridge.submits) >= 2 and bridge.submits, timeout=20)
            first, second = got[:2]
            assert first.attachments == []
            assert first.text == "[a video (4096 bytes) was not kept: over the host's media limit of 1024 bytes]"
            assert second.text == "hello after the video"
            assert len(line.calls_to(f"/v2/bot/message/{video['id']}/content")) == 1  # downloaded once, not per replay
        finally:
            worker.stop()
            thread.join(15)


def test_a_file_too_large_for_a_frame_is_dropped_with_a_note_too():
    """A file whose base64 does not fit in one JSON-RPC frame never reaches the host's media limit: the bridge
    drops the frame unanswered and the call times out. The worker checks the session's max_frame_bytes
    first. (Scaled down: media limit 1 KiB, frames 2 KiB; on a host, 8 MiB and 16 MiB.)"""
    with FakeLine() as line, MockBridge("line-test", heartbeat_secs=0.2, max_frame_bytes=2048) as bridge, \
            tempfile.TemporaryDirectory() as state:
        bridge.hub.media_max_bytes = 1024
        worker = LineWorker(argv=["--bind", "127.0.0.1:0"], environ=line.env(),
                            **bridge.worker_kwargs(state_dir=state, call_timeout_secs=1.0))
        thread = threading.Thread(target=worker.run, name="line-worker", daemon=True)
        thread.start()
        try:
            bridge.wait_for(lambda: worker.server is not None and bridge.hellos, timeout=20)
            line.webhook_url = worker.server.url
            video = line.media_message(b"v" * 4096, mtype="video", content_type="video/mp4")
            assert line.post(line.payload([line.event(video)])).status_code == 200
            line.say("hello after the video")
            got = bridge.wait_for(lambda: len(bridge.submits) >= 2 and bridge.submits, timeout=20)
            assert got[0].attachments == [] and got[0].text.startswith("[a video (4096 bytes) was not kept")
            assert got[1].text == "hello after the video"
        finally:
            worker.stop()
            thread.join(15)
