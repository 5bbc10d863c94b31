"""A user's file the platform cannot give *now* (a 5xx, a 429, no answer) is waited for, not lost.

Each worker runs in process against the SDK's MockBridge and its own fake platform on loopback. Its
``fetch_media`` raises ``MediaNotReady`` for such a download, so the SDK holds that chat and fetches again
at each replay (every heartbeat), for up to ``media_wait_secs`` (shortened here, as the SDK's own tests
do): a file that comes back arrives with its message, once, before the chat's later message; one that
does not comes as a note, never as the platform's link.
"""
from __future__ import annotations

import tempfile
import threading
import time

import pytest

from plugins_app.channel.sdk.mock import MockBridge

HEARTBEAT = 0.2          # the replay that fetches a held file again runs at each heartbeat
SHORT_WAIT = 1.0         # media_wait_secs for the "keeps failing" cases (60 s in production)


def wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    return pred()


class Running:
    """One worker's run() in a thread, stopped at the end of the test."""

    def __init__(self, worker):
        self.worker = worker
        self.thread = threading.Thread(target=worker.run, name=f"{worker.kind}-worker", daemon=True)
        self.thread.start()

    def stop(self):
        self.worker.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the worker did not stop"


def assert_arrived_with_file_then_later(bridge, file_id, later_id, data):
    """The message with the file came once, file and all, and the chat's later message after it, once."""
    assert wait(lambda: len(bridge.submits) >= 2), [m.message_id for m in bridge.submits]
    assert [m.message_id for m in bridge.submit_log] == [file_id, later_id]  # in order; neither lost nor doubled
    [att] = bridge.submits[0].attachments
    assert att.media_id, f"submitted without its file: {bridge.submits[0]}"
    assert bridge.media(att.media_id).data == data


def assert_arrived_with_a_note(bridge, message_id, filename, *, host):
    assert wait(lambda: bridge.submits)
    [msg] = bridge.submits
    assert msg.message_id == message_id and msg.attachments == []
    assert f"[{filename} could not be fetched from the channel: " in msg.text, msg.text
    assert "://" not in msg.text and host not in msg.text  # the SDK strips the platform's links


# -- Discord ----------------------------------------------------------------------------------------

@pytest.fixture
def discord():
    from tests.fakes.discord import FakeDiscord
    with FakeDiscord() as fake, MockBridge("discord-test", heartbeat_secs=HEARTBEAT) as bridge, \
            tempfile.TemporaryDirectory() as state:
        from plugins_app.channel.workers.discord import DiscordWorker
        worker = DiscordWorker(api_base_url=fake.api_base_url, bot_token=fake.token,
                               **bridge.worker_kwargs(state_dir=state))
        yield fake, bridge, worker


def test_discord_a_file_the_cdn_fails_a_few_times_arrives_with_its_message_before_the_next(discord):
    fake, bridge, worker = discord
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        data = b"\x89PNG\r\n\x1a\n" + b"p" * 64
        photo = fake.attachment("cat.png", data, "image/png")
        fake.fail_downloads(503, times=3)
        first = fake.push_message("300000000000000001", "look", attachments=[photo])
        later = fake.push_message("300000000000000001", "and this?")
        assert_arrived_with_file_then_later(bridge, first["id"], later["id"], data)
        assert fake.downloads(photo) == [503, 503, 503, 200]
    finally:
        running.stop()


def test_discord_a_file_the_cdn_keeps_failing_comes_as_a_note_without_its_link(discord):
    fake, bridge, worker = discord
    worker.media_wait_secs = SHORT_WAIT
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        photo = fake.attachment("cat.png", b"png", "image/png")
        fake.fail_downloads(502, times=10_000)
        first = fake.push_message("300000000000000001", "look", attachments=[photo])
        assert_arrived_with_a_note(bridge, first["id"], "cat.png", host="127.0.0.1")
        assert len(fake.downloads(photo)) > 1  # tried again while it waited
    finally:
        running.stop()


# -- Slack ------------------------------------------------------------------------------------------

@pytest.fixture
def slack():
    from tests.fakes.slack import FakeSlack
    with FakeSlack(mode="socket") as fake, MockBridge("slack-test", heartbeat_secs=HEARTBEAT) as bridge, \
            tempfile.TemporaryDirectory() as state:
        from plugins_app.channel.workers.slack import SlackWorker
        worker = SlackWorker(argv=["--mode", "socket"], environ=fake.env(), **bridge.worker_kwargs(state_dir=state))
        yield fake, bridge, worker


def test_slack_a_file_slack_fails_a_few_times_arrives_with_its_message_before_the_next(slack):
    fake, bridge, worker = slack
    running = Running(worker)
    try:
        assert wait(fake.sockets), "the worker did not open a socket"
        data = b"%PDF-1.4 " + b"r" * 64
        report = fake.add_file(data, name="report.pdf", mimetype="application/pdf")
        fake.fail_downloads(503, times=3)
        first = fake.say("the report", files=[report])
        later = fake.say("and this?")
        assert_arrived_with_file_then_later(bridge, first["event_id"], later["event_id"], data)
        assert [status for file_id, status in fake.downloads if file_id == report["id"]] == [503, 503, 503, 200]
    finally:
        running.stop()


def test_slack_a_file_slack_keeps_failing_comes_as_a_note_without_its_link(slack):
    fake, bridge, worker = slack
    worker.media_wait_secs = SHORT_WAIT
    running = Running(worker)
    try:
        assert wait(fake.sockets), "the worker did not open a socket"
        report = fake.add_file(b"%PDF-1.4", name="report.pdf", mimetype="application/pdf")
        fake.fail_downloads(500, times=10_000)
        first = fake.say("the report", files=[report])
        assert_arrived_with_a_note(bridge, first["event_id"], "report.pdf", host="files-pri")
        assert fake.bot_token not in bridge.submits[0].text
        assert len(fake.downloads) > 1  # tried again while it waited
    finally:
        running.stop()


# -- Telegram ---------------------------------------------------------------------------------------

@pytest.fixture
def telegram(monkeypatch):
    from tests.fakes.telegram import FakeTelegram
    with MockBridge("telegram-test", heartbeat_secs=HEARTBEAT) as bridge, tempfile.TemporaryDirectory() as state:
        fake = FakeTelegram().start()
        monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake.token)
        monkeypatch.setenv("TELEGRAM_API_BASE_URL", fake.base_url)
        from plugins_app.channel.workers.telegram import TelegramWorker, parse_args
        options = parse_args(["--mode", "polling", "--poll-timeout", "1", "--per-chat-secs", "0",
                              "--group-secs", "0"])
        worker = TelegramWorker(options=options, **bridge.worker_kwargs(state_dir=state))
        try:
            yield fake, bridge, worker
        finally:
            fake.stop()


def telegram_key(update: dict) -> str:
    return f"{update['update_id']}:{update['message']['message_id']}"


def test_telegram_a_file_telegram_fails_a_few_times_arrives_with_its_message_before_the_next(telegram):
    fake, bridge, worker = telegram
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        data = b"%PDF-1.4 " + b"t" * 64
        doc = {**fake.add_file(data, "documents/report.pdf"), "file_name": "report.pdf",
               "mime_type": "application/pdf"}
        fake.fail_downloads(502, times=2)
        fake.fail_next("getFile", 500, "Internal Server Error")
        first = fake.push_message(42, "the report", document=doc)
        later = fake.push_message(42, "and this?")
        assert_arrived_with_file_then_later(bridge, telegram_key(first), telegram_key(later), data)
        assert [status for _, status in fake.downloads] == [502, 502, 200]
    finally:
        running.stop()


def test_telegram_a_file_telegram_keeps_failing_comes_as_a_note_without_its_link(telegram):
    fake, bridge, worker = telegram
    worker.media_wait_secs = SHORT_WAIT
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        doc = {**fake.add_file(b"%PDF-1.4", "documents/report.pdf"), "file_name": "report.pdf",
               "mime_type": "application/pdf"}
        fake.fail_downloads(503, times=10_000)
        first = fake.push_message(42, "the report", document=doc)
        assert_arrived_with_a_note(bridge, telegram_key(first), "report.pdf", host="/file/bot")
        assert fake.token not in bridge.submits[0].text
        assert len(fake.downloads) > 1  # tried again while it waited
    finally:
        running.stop()
