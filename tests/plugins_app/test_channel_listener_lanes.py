"""Telegram's polling and webhook, and Discord's gateway: one user's large file holds back that chat only.

Each worker records every message in its outbox before it confirms it to the platform (Telegram: the
getUpdates offset, or the webhook's 200; Discord: the committed ``seq``) and submits each chat's messages on a
lane of that chat's (``InboxLanes``). Run in process against the SDK's MockBridge and the platform's fake on
loopback; the crash tests run the worker as its own process (as the supervisor starts it) and kill it with
SIGKILL while a file downloads: the recorded message is submitted once after the restart, by the replay.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from plugins_app.channel.bridge import HostUnavailable
from plugins_app.channel.sdk.mock import MockBridge
from tests.fakes.slow_file import SlowFile
from tests.plugins_app.conftest import Running, wait_until

pytestmark = [pytest.mark.mode_free,  # no database, Redis, Django or run mode: the channel worker SDK and workers
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl, as the supervisor's workers")]

REPO_ROOT = Path(__file__).resolve().parents[2]
BIG = b"\x00\x00\x00\x18ftypmp42" + b"v" * 4096  # dribbled a byte every 50 ms: under way until released


def wait(pred, timeout=20.0):
    return wait_until(pred, timeout)


def ids(bridge) -> list[str]:
    return [m.message_id for m in bridge.submit_log]


def spawn(bridge: MockBridge, state: str, log: Path, module: str, *args: str, **env: str) -> subprocess.Popen:
    """The worker as its own process, as the supervisor starts it."""
    full = dict(os.environ)
    full.update(bridge.env(UGENT_WORKER_STATE_DIR=state, UGENT_LOG_LEVEL="INFO"), **env)
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=full,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(5)


def terminate(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(20)


# -- Telegram (polling) -----------------------------------------------------------------------------

TELEGRAM_ARGS = ("--mode", "polling", "--poll-timeout", "1", "--per-chat-secs", "0", "--group-secs", "0")


@pytest.fixture
def telegram(monkeypatch):
    from tests.fakes.telegram import FakeTelegram
    release = threading.Event()
    # (heartbeats far apart: the heartbeat's replay of the outbox would send a recorded message too, a beat later)
    with MockBridge("telegram-test", heartbeat_secs=60) as bridge, tempfile.TemporaryDirectory() as state:
        fake = FakeTelegram().start()
        monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake.token)
        monkeypatch.setenv("TELEGRAM_API_BASE_URL", fake.base_url)
        try:
            yield fake, bridge, state, release
        finally:
            release.set()
            fake.stop()


def telegram_worker(bridge, state, args=TELEGRAM_ARGS):
    from plugins_app.channel.workers.telegram import TelegramWorker, parse_args
    return TelegramWorker(options=parse_args(list(args)), **bridge.worker_kwargs(state_dir=state))


def telegram_key(update: dict) -> str:
    return f"{update['update_id']}:{update['message']['message_id']}"


def video(fake, data=BIG):
    return {**fake.add_file(data, "videos/file_1.mp4"), "duration": 9, "width": 640, "height": 360,
            "mime_type": "video/mp4"}


def confirmed(fake, update: dict) -> bool:
    """Telegram was told the update is taken (a getUpdates with an offset past it): it will not send it again."""
    with fake._cond:
        return all(u["update_id"] != update["update_id"] for u in fake.updates)


def test_telegram_polling_another_chats_message_reaches_the_host_while_a_file_downloads(telegram):
    fake, bridge, state, release = telegram
    worker = telegram_worker(bridge, state)
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        fake.hold_downloads(release)
        first = fake.push_message(42, "my video", video=video(fake))
        assert wait(lambda: fake.downloads), "the file was not fetched"
        later = fake.push_message(42, "did you get it?")
        other = fake.push_message(43, "hello")
        assert wait(lambda: bridge.submit_log)
        assert ids(bridge) == [telegram_key(other)]  # while the download runs
        # the offset moved past all three: each was in the outbox first
        assert wait(lambda: all(confirmed(fake, u) for u in (first, later, other)), 10)
        time.sleep(0.3)
        assert ids(bridge) == [telegram_key(other)]  # chat 42's later message waits for its video
        release.set()
        assert wait(lambda: len(bridge.submit_log) == 3)
        assert ids(bridge)[1:] == [telegram_key(first), telegram_key(later)]
        assert bridge.media(bridge.submits[1].attachments[0].media_id).data == BIG
    finally:
        release.set()
        running.stop()


def test_telegram_polling_a_press_is_answered_once_after_the_host_took_it(telegram):
    """The host cannot take the press at first (a database restarting): its lane waits and tries again, and the
    callback query is answered once, after the host took it; a later message of the chat comes after it."""
    fake, bridge, state, release = telegram
    real_submit = bridge.hub.submit_inbound
    refused = []

    async def unavailable_once(plugin_id, msg):
        if not refused:
            refused.append(msg.message_id)
            raise HostUnavailable("database is restarting")
        return await real_submit(plugin_id, msg)

    bridge.hub.submit_inbound = unavailable_once
    worker = telegram_worker(bridge, state)
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        press = fake.push_callback(42, "yes", message=fake.message(42, "Deploy now?"))
        after = fake.push_message(42, "and then?")
        assert wait(lambda: len(bridge.submits) == 2), ids(bridge)
        assert refused == [f"{press['update_id']}:cb"]
        assert [m.message_id for m in bridge.submits] == [f"{press['update_id']}:cb", telegram_key(after)]
        assert wait(lambda: fake.count("answerCallbackQuery") == 1)
        fake.redeliver(press)  # (confirmed already: Telegram would not; were it read, it is a duplicate)
        time.sleep(1.0)
        assert fake.count("answerCallbackQuery") == 1
        assert [c.params["callback_query_id"] for c in fake.calls if c.method == "answerCallbackQuery"] == \
            [press["callback_query"]["id"]]
    finally:
        running.stop()


class HubDown:
    """The hub's database down (every inbound.submit answered -32006, as hub.py does) until ``up()``; counts
    the submits it refused, per message id."""

    def __init__(self, bridge):
        self.real = bridge.hub.submit_inbound
        self.down = threading.Event()
        self.down.set()
        self.refused: list[str] = []
        bridge.hub.submit_inbound = self._submit

    async def _submit(self, plugin_id, msg):
        if self.down.is_set():
            self.refused.append(msg.message_id)
            raise HostUnavailable("database unavailable")
        return await self.real(plugin_id, msg)

    def up(self) -> None:
        self.down.clear()


def test_telegram_polling_a_hub_whose_database_is_down_long_keeps_a_chats_order_and_is_tried_less_often(
        telegram, monkeypatch):
    """The hub's database down for longer than HOLD_ATTEMPTS tries (5 here): the host is away, not failing the
    message, so the chat's first message keeps its place and the second comes after it once the hub is back
    (it went first, the first left to the replay, when the -32006 answers counted as failures); meanwhile the
    lane tries again less and less often (each try reads the whole outbox), not each second."""
    from plugins_app.channel.sdk import worker as sdk_worker
    from plugins_app.channel.workers.telegram import worker as telegram_module
    monkeypatch.setattr(sdk_worker, "HOLD_ATTEMPTS", 5)
    monkeypatch.setattr(telegram_module, "HOLD_ATTEMPTS", 5)
    fake, bridge, state, release = telegram
    hub = HubDown(bridge)
    worker = telegram_worker(bridge, state)
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        first = fake.push_message(42, "first")
        assert wait(lambda: hub.refused), "the lane did not try"
        second = fake.push_message(42, "second")
        assert wait(lambda: confirmed(fake, second), 10)
        time.sleep(6.0)  # the database down for 6 s: 6 tries at one a second, 3 backing off (at 0, 1 and 3 s)
        tries = len(hub.refused)
        hub.up()
        assert wait(lambda: bridge.submit_log, 30)
        assert ids(bridge)[0] == telegram_key(first)
        assert wait(lambda: len(bridge.submits) == 2), ids(bridge)
        assert ids(bridge) == [telegram_key(first), telegram_key(second)]
        assert set(hub.refused) == {telegram_key(first)}  # the second was never tried ahead of the first
        assert tries <= 4, hub.refused
    finally:
        running.stop()


@pytest.mark.parametrize("chats,each", [(10, 3), (2, 15)])
def test_telegram_polling_the_hub_away_keeps_the_inbox_bounded_and_loses_or_doubles_nothing(
        telegram, monkeypatch, chats, each):
    """The hub's database down while thirty messages come, of ten chats or of two (one busy group): two lanes hold
    two chats' first messages, trying again; what the lanes hold, in hand, waiting on a chat's lane or queued
    for one, stays at four (the limit, here), and the rest wait in the outbox alone, so a long outage does not
    grow the worker's memory. Once the hub is back the replay is woken as the lanes finish (heartbeats are a
    minute apart here): every message reaches the hub once, each chat's in the order they were written."""
    from plugins_app.channel.sdk.webhook import ChatLanes
    from plugins_app.channel.workers.telegram import worker as telegram_module
    monkeypatch.setattr(telegram_module, "INBOX_LANES", 2)
    lanes: list[ChatLanes] = []
    real_init = ChatLanes.__init__

    def kept(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        lanes.append(self)
    monkeypatch.setattr(ChatLanes, "__init__", kept)
    fake, bridge, state, release = telegram
    hub = HubDown(bridge)
    worker = telegram_worker(bridge, state)
    worker._inbox.limit = 4
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        sent = {chat: [] for chat in range(100, 100 + chats)}
        for n in range(each):
            for chat in sent:
                sent[chat].append(telegram_key(fake.push_message(chat, f"message {n} of chat {chat}")))
        assert wait(lambda: worker.outbox.counts().get("inbound.pending") == 30, 20), worker.outbox.counts()
        assert wait(lambda: all(confirmed(fake, u) for u in list(fake.updates)), 10)
        waiting = sum(len(lane) for lane in lanes[0]._lanes.values())  # on a lane, not yet in hand
        in_hand = len(lanes[0])  # (at most one a lane)
        assert worker._inbox.held == 4 and worker._inbox.qsize() + waiting + in_hand <= 4, (
            worker._inbox.qsize(), waiting, in_hand)
        assert worker._inbox.left == 26
        hub.up()
        assert wait(lambda: len(bridge.submits) == 30, 20), [m.message_id for m in bridge.submits]
        got = [m.message_id for m in bridge.submits]
        assert sorted(got) == sorted(k for keys in sent.values() for k in keys)  # each once
        for chat, keys in sent.items():
            assert [k for k in got if k in keys] == keys, chat
        assert wait(lambda: not worker.outbox.counts().get("inbound.pending"), 10), worker.outbox.counts()
        # (a lane lets a message go once its submit has returned: after the outbox says it was taken)
        assert wait(lambda: worker._inbox.held == 0, 10), worker._inbox.held
        assert worker._inbox.left == 0 and worker._inbox.qsize() == 0
    finally:
        running.stop()


def test_telegram_polling_a_press_the_replay_sent_while_its_lane_waited_is_answered(telegram):
    """The hub cannot take the press at first; while its lane waits to try again, the heartbeat's replay sends it
    (the hub back). The lane's next try finds it taken (a duplicate): the press is still answered, once."""
    fake, bridge, state, release = telegram
    hub = HubDown(bridge)
    worker = telegram_worker(bridge, state)
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        press = fake.push_callback(42, "yes", message=fake.message(42, "Deploy now?"))
        assert wait(lambda: len(hub.refused) >= 3), "the lane did not try"  # it now waits 4 s before a 4th
        hub.up()
        worker.replay_owed()  # (what a heartbeat the hub answers sets off)
        assert [m.message_id for m in bridge.submits] == [f"{press['update_id']}:cb"]
        assert len(hub.refused) == 3, "the lane took it, not the replay"
        assert wait(lambda: fake.count("answerCallbackQuery") == 1, 20)
        time.sleep(1.0)
        assert fake.count("answerCallbackQuery") == 1
        assert ids(bridge) == [f"{press['update_id']}:cb"]
    finally:
        running.stop()


def test_telegram_polling_an_update_whose_outbox_write_fails_is_not_confirmed_and_comes_after_the_restart_once(
        telegram):
    """The outbox write fails (a disk error): the offset stays before the update, the getUpdates thread ends and
    the worker with it (the supervisor restarts it); the next start gets the update again from Telegram and
    submits it once, after the message before it."""
    import sqlite3

    from plugins_app.channel.workers.telegram import TelegramWorker, parse_args

    fake, bridge, state, release = telegram
    failed: list[int] = []

    class FailingOnce(TelegramWorker):
        def _record(self, raw):
            if (raw.get("message") or {}).get("text") == "unlucky" and not failed:
                failed.append(raw["update_id"])
                raise sqlite3.OperationalError("disk I/O error")
            return super()._record(raw)

    worker = FailingOnce(options=parse_args(list(TELEGRAM_ARGS)), **bridge.worker_kwargs(state_dir=state))
    running = Running(worker)
    before = fake.push_message(42, "before")
    try:
        assert wait(lambda: ids(bridge) == [telegram_key(before)]), ids(bridge)
        unlucky = fake.push_message(43, "unlucky")
        running.thread.join(30)
        assert not running.thread.is_alive() and running.code == 1  # failed: the supervisor restarts it
    finally:
        running.stop()
    assert failed == [unlucky["update_id"]]
    assert not confirmed(fake, unlucky)  # Telegram still has it
    again = Running(telegram_worker(bridge, state))
    try:
        assert wait(lambda: len(bridge.submit_log) == 2), ids(bridge)
        time.sleep(1.0)  # (a second submit would show now)
        assert ids(bridge) == [telegram_key(before), telegram_key(unlucky)]
        assert wait(lambda: confirmed(fake, unlucky), 10)
    finally:
        again.stop()


# -- Telegram (webhook) -----------------------------------------------------------------------------
# The fake posts each update to the webhook as Telegram does: one at a time, the next only once one was answered
# 2xx, the same again after anything else. A request that waits for a download or for the hub holds them all.

WEBHOOK_ARGS = ("--mode", "webhook", "--webhook-port", "0", "--webhook-check-secs", "0.3", "--per-chat-secs", "0",
                "--group-secs", "0")


def answers(fake, update: dict) -> list[int]:
    """The statuses the webhook answered for ``update``'s posts, in order."""
    with fake._cond:
        return [status for update_id, status in fake.webhook_posts if update_id == update["update_id"]]


def test_telegram_webhook_answers_at_once_while_a_file_downloads_and_another_chats_message_reaches_the_host(
        telegram):
    fake, bridge, state, release = telegram
    running = Running(telegram_worker(bridge, state, WEBHOOK_ARGS))
    try:
        assert wait(lambda: fake.webhook["url"]), "the webhook was not set"
        fake.hold_downloads(release)
        first = fake.push_message(42, "my video", video=video(fake))
        assert wait(lambda: fake.downloads), "the file was not fetched"
        later = fake.push_message(42, "did you get it?")
        other = fake.push_message(43, "hello")
        # each answered 200 once recorded, the video still downloading
        assert wait(lambda: all(answers(fake, u) == [200] for u in (first, later, other)), 10), fake.webhook_posts
        assert wait(lambda: bridge.submit_log)
        assert ids(bridge) == [telegram_key(other)]  # while the download runs
        time.sleep(0.3)
        assert ids(bridge) == [telegram_key(other)]  # chat 42's later message waits for its video
        release.set()
        assert wait(lambda: len(bridge.submit_log) == 3)
        assert ids(bridge)[1:] == [telegram_key(first), telegram_key(later)]
        assert bridge.media(bridge.submits[1].attachments[0].media_id).data == BIG
        assert fake.count("getFile") == 1
    finally:
        release.set()
        running.stop()


def test_telegram_webhook_an_update_sent_again_is_recorded_once_and_submitted_once(telegram):
    """Telegram sends an update again (an answer it did not get): while its message still waits for its file on
    the chat's lane, and again once the hub took it. Each post is answered 200; the message reaches the hub once
    and its file is downloaded once."""
    fake, bridge, state, release = telegram
    running = Running(telegram_worker(bridge, state, WEBHOOK_ARGS))
    try:
        assert wait(lambda: fake.webhook["url"]), "the webhook was not set"
        fake.hold_downloads(release)
        first = fake.push_message(42, "my video", video=video(fake))
        assert wait(lambda: fake.downloads), "the file was not fetched"
        fake.redeliver(first)
        assert wait(lambda: answers(fake, first) == [200, 200], 10), fake.webhook_posts
        release.set()
        assert wait(lambda: bridge.submit_log)
        fake.redeliver(first)
        after = fake.push_message(42, "and then?")  # (answered after the resend: the resend was read)
        assert wait(lambda: len(bridge.submit_log) == 2), ids(bridge)
        time.sleep(1.0)  # (a second submit would show now)
        assert answers(fake, first) == [200, 200, 200]
        assert ids(bridge) == [telegram_key(first), telegram_key(after)]
        assert fake.count("getFile") == 1
    finally:
        release.set()
        running.stop()


@pytest.mark.parametrize("framing, status", [
    ("Content-Length: abc\r\n\r\n{}", b"400"),  # (no answer at all: the handler failed on the header)
    # (its body was read as 0 bytes, answered 400, and the chunk-size line then parsed as a next request)
    ("Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", b"411"),
], ids=["length-not-a-number", "chunked"])
def test_telegram_webhook_a_body_it_cannot_read_is_answered_once_unread_and_records_nothing(telegram, framing,
                                                                                             status):
    import re
    import socket
    import urllib.parse
    fake, bridge, state, release = telegram
    running = Running(telegram_worker(bridge, state, WEBHOOK_ARGS))
    try:
        assert wait(lambda: fake.webhook["url"]), "the webhook was not set"
        url = urllib.parse.urlsplit(fake.webhook["url"])
        request = (f"POST {url.path} HTTP/1.1\r\nHost: {url.hostname}\r\n"
                   f"X-Telegram-Bot-Api-Secret-Token: {fake.webhook['secret_token']}\r\n"
                   f"Content-Type: application/json\r\n{framing}")
        answer = b""
        with socket.create_connection((url.hostname, url.port), 5) as sock:
            sock.sendall(request.encode())
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [status], answer
        time.sleep(0.5)  # (a submit would show now)
        assert bridge.submit_log == []
    finally:
        running.stop()


def test_telegram_webhook_the_hub_away_does_not_hold_the_request_and_a_press_is_answered_once_it_is_back(
        telegram):
    fake, bridge, state, release = telegram
    hub = HubDown(bridge)
    running = Running(telegram_worker(bridge, state, WEBHOOK_ARGS))
    try:
        assert wait(lambda: fake.webhook["url"]), "the webhook was not set"
        press = fake.push_callback(42, "yes", message=fake.message(42, "Deploy now?"))
        after = fake.push_message(42, "and then?")
        other = fake.push_message(43, "hello")
        assert wait(lambda: all(answers(fake, u) == [200] for u in (press, after, other)), 10), fake.webhook_posts
        assert wait(lambda: hub.refused), "the lanes did not try"
        assert bridge.submit_log == [] and fake.count("answerCallbackQuery") == 0
        hub.up()
        assert wait(lambda: len(bridge.submits) == 3, 30), ids(bridge)
        mine = [i for i in ids(bridge) if i != telegram_key(other)]
        assert mine == [f"{press['update_id']}:cb", telegram_key(after)]  # the chat's order kept
        assert wait(lambda: fake.count("answerCallbackQuery") == 1)
        time.sleep(1.0)
        assert fake.count("answerCallbackQuery") == 1
        assert len(bridge.submit_log) == 3
    finally:
        running.stop()


def test_telegram_webhook_an_update_whose_outbox_write_fails_is_answered_500_and_taken_when_sent_again(telegram):
    import sqlite3

    from plugins_app.channel.workers.telegram import TelegramWorker, parse_args

    fake, bridge, state, release = telegram
    failed: list[int] = []

    class FailingOnce(TelegramWorker):
        def _record(self, raw):
            if (raw.get("message") or {}).get("text") == "unlucky" and not failed:
                failed.append(raw["update_id"])
                raise sqlite3.OperationalError("disk I/O error")
            return super()._record(raw)

    running = Running(FailingOnce(options=parse_args(list(WEBHOOK_ARGS)), **bridge.worker_kwargs(state_dir=state)))
    try:
        assert wait(lambda: fake.webhook["url"]), "the webhook was not set"
        unlucky = fake.push_message(42, "unlucky")
        assert wait(lambda: len(bridge.submit_log) == 1), ids(bridge)
        time.sleep(1.0)  # (a second submit would show now)
        assert answers(fake, unlucky) == [500, 200]  # Telegram sends again what was not answered 2xx
        assert ids(bridge) == [telegram_key(unlucky)]
        assert failed == [unlucky["update_id"]]
    finally:
        running.stop()


@pytest.mark.parametrize("mode", ["polling", "webhook"])
def test_telegram_a_message_confirmed_when_the_worker_is_killed_is_submitted_once_after_the_restart(
        telegram, tmp_path, mode):
    """Polling: the offset moved past the recorded update; webhook: the update was answered 200. Either way
    Telegram sends it no more, so only the outbox can bring it back."""
    fake, bridge, state, release = telegram
    args = TELEGRAM_ARGS if mode == "polling" else WEBHOOK_ARGS
    log = tmp_path / "worker.log"
    env = {"TELEGRAM_BOT_TOKEN": fake.token, "TELEGRAM_API_BASE_URL": fake.base_url}
    first_proc = spawn(bridge, state, log, "plugins_app.channel.workers.telegram", *args, **env)
    try:
        if mode == "polling":
            assert wait(lambda: fake.polls_begun >= 1, 30), log.read_text()
        else:
            assert wait(lambda: fake.webhook["url"], 30), log.read_text()
        fake.hold_downloads(release)
        update = fake.push_message(42, "my video", video=video(fake))
        assert wait(lambda: fake.downloads), log.read_text()
        if mode == "polling":
            assert wait(lambda: confirmed(fake, update), 10), "the offset did not move past the recorded update"
        else:
            assert wait(lambda: answers(fake, update) == [200], 10), "the webhook did not answer the recorded update"
        kill9(first_proc)  # the download under way, nothing submitted yet
        assert bridge.submit_log == []
        fake.hold_downloads(None)
        release.set()
        second = spawn(bridge, state, log, "plugins_app.channel.workers.telegram", *args, **env)
        try:
            assert wait(lambda: bridge.submits, 30), log.read_text()
            time.sleep(1.0)  # (a second submit would show now)
            assert ids(bridge) == [telegram_key(update)]  # once, by the restart's replay: Telegram sent it no more
            if mode == "webhook":
                assert answers(fake, update) == [200]
            assert bridge.media(bridge.submits[0].attachments[0].media_id).data == BIG
            assert terminate(second) == 0
        finally:
            if second.poll() is None:
                kill9(second)
    finally:
        if first_proc.poll() is None:
            kill9(first_proc)


# -- Discord ----------------------------------------------------------------------------------------

CHANNEL_A, CHANNEL_B = "300000000000000001", "300000000000000002"


@pytest.fixture
def discord():
    from tests.fakes.discord import FakeDiscord
    with FakeDiscord() as fake, MockBridge("discord-test", heartbeat_secs=60) as bridge, \
            tempfile.TemporaryDirectory() as state, SlowFile(BIG, give_up_secs=20) as file:
        yield fake, bridge, state, file


def slow_attachment(file: SlowFile) -> dict:
    return {"id": "1400000000000000001", "filename": "video.mp4", "size": len(file.data), "url": file.url,
            "proxy_url": file.url, "content_type": "video/mp4"}


def committed_seq(state: str, plugin_id: str = "discord-test") -> int | None:
    try:
        return json.loads((Path(state) / f"{plugin_id}.discord-session.json").read_text()).get("seq")
    except (OSError, ValueError):
        return None


def test_discord_another_channels_message_reaches_the_host_while_a_file_downloads(discord):
    fake, bridge, state, file = discord
    from plugins_app.channel.workers.discord import DiscordWorker
    worker = DiscordWorker(api_base_url=fake.api_base_url, bot_token=fake.token,
                           **bridge.worker_kwargs(state_dir=state))
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        first = fake.push_message(CHANNEL_A, "my video", attachments=[slow_attachment(file)])
        assert file.sending.wait(10), "the file was not fetched"
        later = fake.push_message(CHANNEL_A, "did you get it?")
        other = fake.push_message(CHANNEL_B, "hello")
        assert wait(lambda: bridge.submit_log)
        assert ids(bridge) == [other["id"]] and not file.sent.is_set()  # while the download runs
        # every seq committed: each message was in the outbox first
        assert wait(lambda: committed_seq(state) == fake.current.seq)
        time.sleep(0.3)
        assert ids(bridge) == [other["id"]]  # channel A's later message waits for its video
        file.finish()
        assert wait(lambda: len(bridge.submit_log) == 3)
        assert ids(bridge)[1:] == [first["id"], later["id"]]
        assert bridge.media(bridge.submits[1].attachments[0].media_id).data == BIG
    finally:
        file.finish()
        running.stop()


def test_discord_a_message_recorded_when_the_worker_is_killed_is_submitted_once_after_the_restart(
        discord, tmp_path):
    fake, bridge, state, file = discord
    log = tmp_path / "worker.log"
    args = ("--api-base-url", fake.api_base_url)
    env = {"DISCORD_BOT_TOKEN": fake.token}
    first_proc = spawn(bridge, state, log, "plugins_app.channel.workers.discord", *args, **env)
    try:
        assert wait(fake.connected, 30), log.read_text()
        d = fake.push_message(CHANNEL_A, "my video", attachments=[slow_attachment(file)])
        assert file.sending.wait(10), log.read_text()
        assert wait(lambda: committed_seq(state) == fake.current.seq), "the seq was not committed once recorded"
        kill9(first_proc)  # the download under way, nothing submitted yet
        fake.drop()
        assert bridge.submit_log == []
        file.finish()
        second = spawn(bridge, state, log, "plugins_app.channel.workers.discord", *args, **env)
        try:
            assert wait(lambda: bridge.submits, 30), log.read_text()
            time.sleep(1.0)  # (a second submit would show now)
            assert ids(bridge) == [d["id"]]  # once, by the restart's replay
            assert fake.connections[-1]["op"] == "resume"  # from the committed seq: Discord sent it no more
            assert bridge.media(bridge.submits[0].attachments[0].media_id).data == BIG
            assert terminate(second) == 0
        finally:
            if second.poll() is None:
                kill9(second)
    finally:
        if first_proc.poll() is None:
            kill9(first_proc)


def test_discord_a_message_that_cannot_be_recorded_is_not_confirmed_and_comes_again_on_the_resume(discord):
    """The outbox write fails (a disk error): its seq is not committed, the connection closes (4000, the session
    kept) and the resume from the last seq recorded brings the message again, which is then recorded and sent."""
    import sqlite3

    from plugins_app.channel.workers.discord import DiscordWorker

    class FailingOnce(DiscordWorker):
        failed: list[str] = []

        def _record(self, message):
            if message.text == "unlucky" and not self.failed:
                self.failed.append(message.message_id)
                raise sqlite3.OperationalError("disk I/O error")
            super()._record(message)

    fake, bridge, state, file = discord
    worker = FailingOnce(api_base_url=fake.api_base_url, bot_token=fake.token, **bridge.worker_kwargs(state_dir=state))
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        before = fake.push_message(CHANNEL_A, "before")
        assert wait(lambda: ids(bridge) == [before["id"]])
        recorded = committed_seq(state)
        unlucky = fake.push_message(CHANNEL_B, "unlucky")
        assert wait(lambda: len(fake.connections) >= 2 and fake.connections[-1].get("op")), "no reconnect"
        assert (fake.connections[-1]["op"], fake.connections[-1]["seq"]) == ("resume", recorded)
        assert wait(lambda: ids(bridge) == [before["id"], unlucky["id"]])
        assert worker.failed == [unlucky["id"]]
        after = fake.push_message(CHANNEL_A, "after")
        assert wait(lambda: ids(bridge) == [before["id"], unlucky["id"], after["id"]])
    finally:
        running.stop()


def test_discord_a_message_that_can_never_be_recorded_resumes_backing_off_not_in_a_loop(discord, caplog):
    """The outbox write keeps failing (a disk full): each connection resumes from the last seq recorded, so the
    message comes again, but after a pause that grows, not at once (a connection a second at most here, where
    it reconnected some thirty times a second); the session is kept (a resume, never an identify afresh), and
    asyncio logs no task exception left unretrieved."""
    import sqlite3

    from plugins_app.channel.workers.discord import DiscordWorker

    class DiskFull(DiscordWorker):
        def _record(self, message):
            if message.text == "poison":
                raise sqlite3.OperationalError("database or disk is full")
            super()._record(message)

    fake, bridge, state, file = discord
    worker = DiskFull(api_base_url=fake.api_base_url, bot_token=fake.token, **bridge.worker_kwargs(state_dir=state))
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        before = fake.push_message(CHANNEL_A, "before")
        assert wait(lambda: ids(bridge) == [before["id"]])
        recorded = committed_seq(state)
        fake.push_message(CHANNEL_B, "poison")
        assert wait(lambda: len(fake.connections) >= 2), "no reconnect"
        time.sleep(4.0)
        connections = list(fake.connections)
        assert 2 <= len(connections) <= 5, [c.get("op") for c in connections]
        assert [(c.get("op"), c.get("seq")) for c in connections[1:] if c.get("op")] == \
            [("resume", recorded)] * len([c for c in connections[1:] if c.get("op")])
        assert committed_seq(state) == recorded
    finally:
        running.stop()
    gc.collect()  # (a task left with its exception unretrieved says so when it is collected)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_discord_the_reader_seeing_the_close_first_still_raises_the_recording_failure():
    """The consumer that could not record a message closes the socket and raises; the reader may see the close
    first (ConnectionClosed). Waiting for what was queued then raises the consumer's failure (so the connection
    ends as a recording failure, backing off), and the task's exception is retrieved (asyncio logs none)."""
    import asyncio

    from plugins_app.channel.workers.discord import RecordFailed, _recorded

    async def scene():
        queue: asyncio.Queue = asyncio.Queue()

        async def consume():
            await queue.get()
            try:
                raise RecordFailed("message 1 could not be recorded")
            finally:
                queue.task_done()

        consumer = asyncio.ensure_future(consume())
        await queue.put(("MESSAGE_CREATE", {}, 2))
        await queue.put(("MESSAGE_CREATE", {}, 3))  # (never handled: the consumer ended)
        with pytest.raises(RecordFailed):
            await _recorded(queue, consumer)
        with pytest.raises(RecordFailed):
            await _recorded(queue, consumer)  # (the consumer done already)

    asyncio.run(scene())
