"""A user's file the platform cannot give *now* (a 5xx, a 429, no answer) is waited for, not lost.

Each worker runs in process against the SDK's MockBridge and its own fake platform on loopback. Its
``fetch_media`` raises ``MediaNotReady`` for such a download, so the SDK holds that chat and fetches again
at each replay (every heartbeat), for up to ``media_wait_secs`` (here: until a second try is seen
then over): a file that comes back arrives with its message, once, before the chat's later message; one that
does not comes as a note, never as the platform's link.
"""
from __future__ import annotations

import tempfile
import threading
import time

import pytest

from plugins_app.channel.sdk.mock import MockBridge
from tests.plugins_app.conftest import Running, wait_until

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

HEARTBEAT = 0.2          # the replay that fetches a held file again runs at each heartbeat
#: The "keeps failing" cases wait (media_wait_secs, 60 s in production) until a second try is seen, then the wait
#: is made over (``give_up_after_retries``): a fixed short wait was used up by one slow try on a loaded machine.
LONG_WAIT = 3600.0


def give_up_after_retries(worker, tries) -> None:
    """Once ``tries()`` counts two tries of the file (it was tried again while it waited), the wait is over: the
    next replay sends the message on with its note."""
    assert wait(lambda: tries() > 1), "the file was not tried again while it waited"
    worker.media_wait_secs = 0.0


def wait(pred, timeout=30.0):
    return wait_until(pred, timeout)


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
    worker.media_wait_secs = LONG_WAIT
    running = Running(worker)
    try:
        assert wait(fake.connected), "the worker did not connect to the gateway"
        photo = fake.attachment("cat.png", b"png", "image/png")
        fake.fail_downloads(502, times=10_000)
        first = fake.push_message("300000000000000001", "look", attachments=[photo])
        give_up_after_retries(worker, lambda: len(fake.downloads(photo)))
        assert_arrived_with_a_note(bridge, first["id"], "cat.png", host="127.0.0.1")
    finally:
        running.stop()


# -- Slack ------------------------------------------------------------------------------------------

def slack_id(event: dict) -> str:
    """The message id the Slack worker gives the message an event carries."""
    from plugins_app.channel.workers.slack import message_id_of
    return message_id_of(event["event"]["channel"], event["event"]["ts"])


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
        assert_arrived_with_file_then_later(bridge, slack_id(first), slack_id(later), data)
        assert [status for file_id, status in fake.downloads if file_id == report["id"]] == [503, 503, 503, 200]
    finally:
        running.stop()


def test_slack_a_file_slack_keeps_failing_comes_as_a_note_without_its_link(slack):
    fake, bridge, worker = slack
    worker.media_wait_secs = LONG_WAIT
    running = Running(worker)
    try:
        assert wait(fake.sockets), "the worker did not open a socket"
        report = fake.add_file(b"%PDF-1.4", name="report.pdf", mimetype="application/pdf")
        fake.fail_downloads(500, times=10_000)
        first = fake.say("the report", files=[report])
        give_up_after_retries(worker, lambda: len(fake.downloads))
        assert_arrived_with_a_note(bridge, slack_id(first), "report.pdf", host="files-pri")
        assert fake.bot_token not in bridge.submits[0].text
    finally:
        running.stop()


def test_slack_a_file_downloading_long_holds_back_its_conversation_only():
    """One user's large file: while it downloads, the other conversations' messages reach the hub (the listener
    submits each conversation in a thread of its own) and its own conversation's next message waits for it."""
    from tests.fakes.slack import FakeSlack
    release = threading.Event()
    # (heartbeats far apart: the heartbeat's replay of the outbox would send the other message too, a beat later)
    with FakeSlack(mode="socket") as fake, MockBridge("slack-test", heartbeat_secs=60) as bridge, \
            tempfile.TemporaryDirectory() as state:
        from plugins_app.channel.workers.slack import SlackWorker
        worker = SlackWorker(argv=["--mode", "socket"], environ=fake.env(), **bridge.worker_kwargs(state_dir=state))
        running = Running(worker)
        try:
            assert wait(fake.sockets), "the worker did not open a socket"
            data = b"\x00\x00\x00\x18ftypmp42" + b"v" * 64
            video = fake.add_file(data, name="video.mp4", mimetype="video/mp4")
            fake.hold_downloads(release)
            first = fake.say("my video", files=[video])
            assert wait(lambda: fake.downloads), "the file was not fetched"
            later = fake.say("did you get it?")
            other = fake.say("hello", channel="D0DM00002", user="U0USER002")
            assert wait(lambda: bridge.submit_log)
            assert [m.message_id for m in bridge.submit_log] == [slack_id(other)]  # while the download runs
            release.set()
            assert wait(lambda: len(bridge.submit_log) == 3)
            assert [m.message_id for m in bridge.submit_log][1:] == [slack_id(first), slack_id(later)]
            assert bridge.media(bridge.submits[1].attachments[0].media_id).data == data
        finally:
            release.set()
            running.stop()


def test_slack_a_revoked_token_while_a_file_downloads_stops_the_worker_and_its_lanes(caplog):
    """Slack revokes the token while one conversation's file downloads and its next message waits on the lane:
    the worker stops within its drain time, and the lane, which outlives it, takes nothing more and touches no
    closed outbox (each message stays owed, for the start after the plugin is enabled again)."""
    import logging
    from tests.fakes.slack import FakeSlack
    caplog.set_level(logging.INFO)
    release = threading.Event()
    with FakeSlack(mode="socket") as fake, MockBridge("slack-test", heartbeat_secs=60) as bridge, \
            tempfile.TemporaryDirectory() as state:
        from plugins_app.channel.workers.slack import SlackWorker
        worker = SlackWorker(argv=["--mode", "socket"], environ=fake.env(), drain_timeout_secs=0.5,
                             **bridge.worker_kwargs(state_dir=state))
        running = Running(worker)
        try:
            assert wait(fake.sockets), "the worker did not open a socket"
            video = fake.add_file(b"\x00\x00\x00\x18ftypmp42" + b"v" * 64, name="video.mp4", mimetype="video/mp4")
            fake.hold_downloads(release)
            fake.say("my video", files=[video])
            assert wait(lambda: fake.downloads), "the file was not fetched"
            fake.say("did you get it?")
            time.sleep(0.3)  # (on the conversation's lane, behind the video)
            fake.revoke(bot=True)
            running.thread.join(10)
            assert not running.thread.is_alive(), "the worker did not stop"
            release.set()
            time.sleep(0.5)  # (the lane's download ends now)
            assert bridge.submit_log == [] and len(fake.downloads) == 1
            assert not [r.getMessage() for r in caplog.records
                        if r.threadName.endswith("-lane") and r.levelno >= logging.WARNING]
        finally:
            release.set()
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
        # parameters that are neither of the library's cases (a retry_after of 0, a key it does not know): a 5xx
        fake.fail_next("getFile", 502, "Bad Gateway", parameters={"retry_after": 0, "hint": "busy"})
        first = fake.push_message(42, "the report", document=doc)
        later = fake.push_message(42, "and this?")
        assert_arrived_with_file_then_later(bridge, telegram_key(first), telegram_key(later), data)
        assert [status for _, status in fake.downloads] == [502, 502, 200]
    finally:
        running.stop()


def test_telegram_a_file_telegram_keeps_failing_comes_as_a_note_without_its_link(telegram):
    fake, bridge, worker = telegram
    worker.media_wait_secs = LONG_WAIT
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        doc = {**fake.add_file(b"%PDF-1.4", "documents/report.pdf"), "file_name": "report.pdf",
               "mime_type": "application/pdf"}
        fake.fail_downloads(503, times=10_000)
        first = fake.push_message(42, "the report", document=doc)
        give_up_after_retries(worker, lambda: len(fake.downloads))
        assert_arrived_with_a_note(bridge, telegram_key(first), "report.pdf", host="/file/bot")
        assert fake.token not in bridge.submits[0].text
    finally:
        running.stop()


# -- what is not "not now" keeps its old path -------------------------------------------------------

def test_a_refused_token_or_an_expired_link_is_not_waited_for():
    """A refusal (Slack's sign-in page for a revoked token, Telegram's 401) or a 403/404 is not a busy platform:
    fetch_media does not raise MediaNotReady for it, so the SDK does not hold the chat a minute for it (it goes
    the way it went before: ChannelRefused once the worker knows of the refusal, else a note)."""
    from plugins_app.channel.sdk import Attachment, MediaNotReady
    from plugins_app.channel.workers.discord import DiscordWorker
    from plugins_app.channel.workers.slack import SlackWorker
    from tests.fakes.discord import FakeDiscord
    from tests.fakes.slack import FakeSlack

    kwargs = dict(socket_path="/nowhere", plugin_id="p", token="t", install_signal_handlers=False)
    with FakeSlack() as fake:
        worker = SlackWorker(argv=["--mode", "socket"], environ=fake.env(), **kwargs)
        report = fake.add_file(b"%PDF-1.4", name="report.pdf", mimetype="application/pdf")
        att = Attachment("document", "application/pdf", url=report["url_private_download"], filename="report.pdf")
        fake.fail_downloads(403)
        with pytest.raises(Exception) as forbidden:
            worker.fetch_media(att)
        assert not isinstance(forbidden.value, MediaNotReady) and "403" in str(forbidden.value)
        gone = Attachment("document", "application/pdf", url=report["url_private_download"].replace(report["id"], "F0GONE"),
                          filename="report.pdf")
        with pytest.raises(ValueError, match="files:read"):  # Slack's sign-in page, the token good: a note
            worker.fetch_media(gone)
        assert worker._refusal is None
    with FakeDiscord() as fake:
        worker = DiscordWorker(api_base_url=fake.api_base_url, bot_token=fake.token, **kwargs)
        photo = fake.attachment("cat.png", b"png", "image/png")
        fake.fail_downloads(403)  # a signed CDN link past its expiry
        with pytest.raises(RuntimeError, match="answered 403"):
            worker.fetch_media(Attachment("image", "image/png", url=photo["url"], filename="cat.png"))


def telegram_doc(fake, data=b"%PDF-1.4"):
    return {**fake.add_file(data, "documents/report.pdf"), "file_name": "report.pdf", "mime_type": "application/pdf"}


def test_slack_a_revoked_token_at_a_download_stops_the_worker_and_keeps_the_message(slack):
    """Slack answers a download with a revoked token with its sign-in page: auth.test, refused too, says it is
    the token (not files:read): the refusal is recorded, the worker stops, the message stays owed."""
    from plugins_app.channel.sdk import Outbox
    fake, bridge, worker = slack
    running = Running(worker)
    try:
        assert wait(fake.sockets), "the worker did not open a socket"
        report = fake.add_file(b"%PDF-1.4", name="report.pdf", mimetype="application/pdf")
        fake.fail_downloads(503)
        first = fake.say("the report", files=[report])
        assert wait(lambda: fake.downloads), "the file was not fetched"
        fake.revoke(event=False)  # no event says so: only the download finds it
        running.thread.join(30)
        assert not running.thread.is_alive(), "the worker did not stop on the refusal"
        assert "token_revoked" in (worker._refusal or "") and bridge.submit_log == []
        with Outbox(plugin_id=bridge.plugin_id, state_dir=worker.state_dir) as box:
            assert [row.message["message_id"] for row in box.inbound_pending()] == [slack_id(first)]
    finally:
        running.stop()


def test_telegram_a_revoked_token_at_a_download_stops_the_worker_and_keeps_the_message(telegram):
    """A file download refused for the token (Telegram's 401, which getMe then confirms) is no "not now" and no
    lost file either: the refusal is recorded as a send records it, ChannelRefused stops the worker, and the
    message stays owed, file and all, for when the plugin is enabled again with a good token."""
    from plugins_app.channel.sdk import Attachment, ChannelRefused
    from plugins_app.channel.workers.telegram.worker import REVOKED
    fake, bridge, worker = telegram
    worker.connect()
    try:
        doc = fake.add_file(b"%PDF-1.4", "documents/report.pdf")
        fake.revoke()
        with pytest.raises(ChannelRefused, match="401"):
            worker.fetch_media(Attachment("document", "application/pdf", url=f"tg-file:{doc['file_id']}"))
        assert worker._refusal == REVOKED
    finally:
        worker.disconnect()


def test_telegram_a_token_revoked_while_a_file_waits_leaves_the_message_owed(telegram):
    fake, bridge, worker = telegram
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        fake.fail_downloads(503, times=1)
        first = fake.push_message(42, "the report", document=telegram_doc(fake))
        assert wait(lambda: fake.downloads), "the file was not fetched"
        fake.revoke()  # the replay's next try finds the token revoked
        running.thread.join(30)
        assert not running.thread.is_alive(), "the worker did not stop on the refusal"
        assert bridge.submit_log == []  # not sent on without its file
        from plugins_app.channel.sdk import Outbox
        with Outbox(plugin_id=bridge.plugin_id, state_dir=worker.state_dir) as box:
            assert [row.message["message_id"] for row in box.inbound_pending()] == [telegram_key(first)]
    finally:
        running.stop()


def test_telegram_a_file_path_telegram_answers_404_for_comes_as_a_note(telegram):
    """The library raises InvalidToken for a 404 too; getMe answering says the token is fine: the file is gone."""
    from plugins_app.channel.sdk import Attachment
    fake, bridge, worker = telegram
    worker.connect()
    try:
        doc = fake.add_file(b"%PDF-1.4", "documents/report.pdf")
        fake.fail_downloads(404)
        with pytest.raises(LookupError, match="no longer has the file"):
            worker.fetch_media(Attachment("document", "application/pdf", url=f"tg-file:{doc['file_id']}"))
        assert worker._refusal is None
    finally:
        worker.disconnect()


@pytest.mark.parametrize("status, description", [(400, "Bad Request: file is too big"),
                                                 (400, "Bad Request: invalid file_id"),
                                                 (413, "Request Entity Too Large")])
def test_telegram_a_file_telegram_will_never_give_comes_as_a_note_at_once(telegram, status, description):
    """A 400 (BadRequest, a NetworkError to python-telegram-bot) or a status the library has no case for (a 413,
    a bare NetworkError) is final: the message goes on with a note at once, not after media_wait_secs."""
    fake, bridge, worker = telegram
    worker.media_wait_secs = 3600.0  # a wait would outlast the test
    running = Running(worker)
    try:
        assert wait(lambda: fake.polls_begun >= 1), "the worker did not poll"
        fake.fail_next("getFile", status, description)
        first = fake.push_message(42, "the report", document=telegram_doc(fake))
        assert_arrived_with_a_note(bridge, telegram_key(first), "report.pdf", host="/file/bot")
        assert description.split(": ")[-1].lower() in bridge.submits[0].text.lower()
        assert fake.count("getFile") == 1 and fake.downloads == []
    finally:
        running.stop()


def test_telegram_no_answer_at_all_is_not_now(telegram, monkeypatch):
    """A getFile never answered: a short timeout of its own (not the sends' 30 s), then MediaNotReady."""
    from plugins_app.channel.sdk import Attachment, MediaNotReady
    from plugins_app.channel.workers.telegram import worker as telegram_worker
    monkeypatch.setattr(telegram_worker, "MEDIA_TIMEOUT_SECS", 0.5)
    fake, bridge, worker = telegram
    worker.connect()
    try:
        doc = fake.add_file(b"%PDF-1.4", "documents/report.pdf")
        fake.hold_next("getFile")
        with pytest.raises(MediaNotReady, match="TimedOut"):
            worker.fetch_media(Attachment("document", "application/pdf", url=f"tg-file:{doc['file_id']}"))
    finally:
        worker.disconnect()


# -- Email ------------------------------------------------------------------------------------------
# A mail's attachments come inside it: while its bytes are in memory nothing can be "not now". They are
# read again from the IMAP server only when they are not (the worker restarted, or the host was away when
# the mail came): then a server that hangs up or cannot be reached is "not now" too.

BOT = "bot@example.org"


@pytest.fixture
def mailbox(monkeypatch):
    from tests.fakes.email import MailServer
    with MailServer(user=BOT, password="app-password") as server, \
            MockBridge("mail-test", heartbeat_secs=HEARTBEAT) as bridge, tempfile.TemporaryDirectory() as state:
        for name, value in {"EMAIL_IMAP_HOST": "127.0.0.1", "EMAIL_IMAP_PORT": str(server.imap_port),
                            "EMAIL_IMAP_USER": BOT, "EMAIL_IMAP_PASSWORD": "app-password",
                            "EMAIL_SMTP_HOST": "127.0.0.1", "EMAIL_SMTP_PORT": str(server.smtp_port)}.items():
            monkeypatch.setenv(name, value)
        yield server, bridge, state


def mail_left_owed(server, bridge, state, data):
    """A mail with an attachment that a worker recorded and was then killed before submitting: the outbox
    holds the message, its bytes went with the old process. Returns (its UID, its Message-ID)."""
    from plugins_app.channel.sdk import Outbox
    from plugins_app.channel.workers.email.parse import normalise
    from tests.fakes.email import make_mail
    raw = make_mail(text="the report", attachments=[(data, "application/pdf", "report.pdf")]).as_bytes()
    uid = server.deliver(raw)
    inbound, _, _ = normalise(raw, uidvalidity=uidvalidity_of(server), uid=uid, own_addresses={BOT}, known={}, user=BOT,
                              host="127.0.0.1", mailbox="INBOX")
    with Outbox(plugin_id=bridge.plugin_id, state_dir=state) as box:
        box.inbound_record(inbound)
    return uid, inbound.message_id


def uidvalidity_of(server) -> int:
    conn = server.imap()
    try:
        conn.select("INBOX", readonly=True)
        return int(conn.untagged_responses["UIDVALIDITY"][0])
    finally:
        conn.logout()


def email_worker(bridge, state):
    from plugins_app.channel.workers.email.worker import EmailWorker
    return EmailWorker(argv=["--imap-security", "none", "--smtp-security", "none", "--timeout-secs", "5"],
                       **bridge.worker_kwargs(state_dir=state))


def owed(bridge, state) -> int:
    from plugins_app.channel.sdk import Outbox
    with Outbox(plugin_id=bridge.plugin_id, state_dir=state) as box:
        return len(box.inbound_pending())


def test_email_an_attachment_the_server_cannot_give_now_arrives_with_its_message_before_the_next(mailbox):
    from tests.fakes.email import make_mail
    server, bridge, state = mailbox
    data = b"%PDF-1.4 " + b"m" * 64
    uid, first_id = mail_left_owed(server, bridge, state, data)
    server.fail_fetch(uid, times=10_000)  # the server hangs up on it until the test says otherwise
    running = Running(email_worker(bridge, state))
    try:
        assert wait(lambda: any(u == uid and not ok for u, ok in server.fetches)), "the replay did not try it"
        # the listener waits in IDLE (a mail that came between its first search and its IDLE would be read only
        # at the next IDLE cycle, 25 minutes on)
        assert wait(lambda: server.idle_count >= 1), "the listener did not IDLE"
        reply = make_mail(text="and this?", in_reply_to=first_id, references=first_id)
        server.deliver(reply)  # the same thread, read by the listener while the first still waits
        assert wait(lambda: owed(bridge, state) == 2, 60), "the later mail was not recorded"
        assert bridge.submit_log == []  # the later mail waits behind the first, whose file is awaited
        server.fail_fetch(uid, times=0)  # the server answers again
        assert_arrived_with_file_then_later(bridge, first_id, reply["Message-ID"], data)
        assert bridge.submits[1].conversation_id == bridge.submits[0].conversation_id
        assert server.fetches[-1] == (uid, True) and [ok for u, ok in server.fetches if u == uid].count(True) == 1
    finally:
        running.stop()


def test_email_an_attachment_the_server_keeps_refusing_comes_as_a_note_without_its_link(mailbox):
    server, bridge, state = mailbox
    uid, first_id = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    server.fail_fetch(uid, times=10_000)
    worker = email_worker(bridge, state)
    worker.media_wait_secs = LONG_WAIT
    running = Running(worker)
    try:
        give_up_after_retries(worker, lambda: len([u for u, _ in server.fetches if u == uid]))
        assert_arrived_with_a_note(bridge, first_id, "report.pdf", host=f"UID={uid}")
    finally:
        running.stop()


def test_email_an_attachment_whose_mail_was_deleted_comes_as_a_note_at_once_without_the_account(mailbox):
    """Expunged (or moved away) since it came: UID FETCH answers OK and nothing. Final: a note at once, never the
    imap://user@host URL, which names the account."""
    server, bridge, state = mailbox
    uid, first_id = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    server.expunge(uid)
    worker = email_worker(bridge, state)
    worker.media_wait_secs = 3600.0  # a wait would outlast the test
    running = Running(worker)
    try:
        assert_arrived_with_a_note(bridge, first_id, "report.pdf", host=BOT)
        assert "no longer on the server" in bridge.submits[0].text
        assert "imap" not in bridge.submits[0].text.lower()
    finally:
        running.stop()


def test_email_a_no_unavailable_answer_waits_and_the_attachment_then_arrives(mailbox):
    """A tagged ``NO [UNAVAILABLE]`` to UID FETCH (RFC 5530: a subsystem down) is "not now", as a BYE is."""
    server, bridge, state = mailbox
    data = b"%PDF-1.4 " + b"n" * 64
    uid, first_id = mail_left_owed(server, bridge, state, data)
    server.fail_fetch(uid, times=2, no="UNAVAILABLE")
    running = Running(email_worker(bridge, state))
    try:
        assert wait(lambda: bridge.submits)
        [msg] = bridge.submits
        assert msg.message_id == first_id
        [att] = msg.attachments
        assert att.media_id and bridge.media(att.media_id).data == data
        assert [ok for u, ok in server.fetches if u == uid] == [False, False, True]
    finally:
        running.stop()


def test_email_another_no_answer_is_final(mailbox):
    server, bridge, state = mailbox
    uid, first_id = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    server.fail_fetch(uid, times=10_000, no="CANNOT")
    worker = email_worker(bridge, state)
    worker.media_wait_secs = 3600.0
    running = Running(worker)
    try:
        assert_arrived_with_a_note(bridge, first_id, "report.pdf", host=BOT)
        assert "NO [CANNOT]" in bridge.submits[0].text
        assert len([u for u, _ in server.fetches if u == uid]) == 1
    finally:
        running.stop()


def test_email_a_renumbered_mailbox_is_final_and_a_login_refused_at_a_reread_stops_the_worker(mailbox):
    from plugins_app.channel.sdk import Attachment, ChannelRefused
    server, bridge, state = mailbox
    uid, first_id = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    worker = email_worker(bridge, state)
    uidvalidity = uidvalidity_of(server)
    with pytest.raises(LookupError, match="UIDVALIDITY"):
        worker._fetch_attachment_sync(uidvalidity + 1, uid, 1)
    with pytest.raises(LookupError):  # a Gmail part, --gmail-push since turned off: never None (the URL passed on)
        worker.fetch_media(Attachment("document", "application/pdf", url="gmail:18c0ffee/1", filename="report.pdf"))
    assert worker._fetch_attachment_sync(uidvalidity, uid, 1) == b"%PDF-1.4"
    server.set_password("a-new-app-password")
    with pytest.raises(ChannelRefused, match="IMAP login refused"):
        worker._fetch_attachment_sync(uidvalidity, uid, 1)
    assert "IMAP login refused" in worker._refusal


@pytest.mark.parametrize("answer", ["[ALERT] Too many simultaneous connections. (Failure)",
                                    "[UNAVAILABLE] Temporary authentication failure."])
def test_email_a_login_the_server_answers_later_at_a_reread_waits_and_refuses_nothing(mailbox, answer):
    """The listener's rule (``login_says_later``): Gmail's full account or an RFC 5530 "later" code to the
    re-read's LOGIN is "not now" for the file, never the plugin's refusal."""
    from plugins_app.channel.sdk import ChannelRefused, MediaNotReady
    server, bridge, state = mailbox
    uid, _ = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    worker = email_worker(bridge, state)
    uidvalidity = uidvalidity_of(server)
    server.refuse_login(answer)
    with pytest.raises(MediaNotReady) as info:
        worker._fetch_attachment_sync(uidvalidity, uid, 1)
    assert str(info.value) == f"the IMAP server answered LOGIN: NO {answer}"
    assert worker._refusal is None
    assert worker._fetch_attachment_sync(uidvalidity, uid, 1) == b"%PDF-1.4"
    server.refuse_login("[ALERT] Application-specific password required: "
                        "https://support.google.com/accounts/answer/185833 (Failure)")
    with pytest.raises(ChannelRefused, match="Application-specific password required"):
        worker._fetch_attachment_sync(uidvalidity, uid, 1)


def test_email_a_login_refused_while_an_attachment_waits_leaves_the_message_owed(mailbox):
    server, bridge, state = mailbox
    uid, first_id = mail_left_owed(server, bridge, state, b"%PDF-1.4")
    server.fail_fetch(uid, times=10_000)
    running = Running(email_worker(bridge, state))
    try:
        assert wait(lambda: any(u == uid for u, _ in server.fetches)), "the replay did not try it"
        server.set_password("a-new-app-password")  # the next re-read's login is refused
        running.thread.join(30)
        assert not running.thread.is_alive(), "the worker did not stop on the refusal"
        assert bridge.submit_log == [] and owed(bridge, state) == 1
    finally:
        running.stop()


def test_email_gmail_push_an_attachment_gmail_cannot_give_now_is_not_now_and_a_refusal_stays_a_refusal(monkeypatch):
    """With --gmail-push the part is read again through messages.get: a 5xx raises MediaNotReady at once (the SDK
    waits and tries again, as above); a mail deleted meanwhile is final; a revoked grant stays ChannelRefused."""
    from plugins_app.channel.sdk import Attachment, ChannelRefused, MediaNotReady
    from plugins_app.channel.workers.email.gmail import GmailPush
    from plugins_app.channel.workers.email.worker import EmailWorker
    from tests.fakes.email import make_mail
    from tests.fakes.gmail import AUDIENCE, FakeGmail
    with FakeGmail(address=BOT) as fake:
        for name, value in (("GMAIL_CLIENT_ID", "client-1.apps.googleusercontent.com"), ("GMAIL_CLIENT_SECRET", "s"),
                            ("GMAIL_REFRESH_TOKEN", "1//refresh"), ("GMAIL_API_BASE_URL", fake.api_url),
                            ("GMAIL_TOKEN_URL", fake.token_url), ("EMAIL_ADDRESS", BOT)):
            monkeypatch.setenv(name, value)
        worker = EmailWorker(argv=["--gmail-push", "--gmail-topic", "projects/p/topics/t", "--push-audience",
                                   AUDIENCE, "--timeout-secs", "5"],
                             socket_path="/nowhere", plugin_id="gmail-test", token="t", install_signal_handlers=False)
        worker.gmail = GmailPush(worker, worker.args)
        try:
            gid = fake.add_mail(make_mail(text="the report", attachments=[(b"%PDF-1.4 g", "application/pdf",
                                                                           "report.pdf")]))
            att = Attachment("document", "application/pdf", url=f"gmail:{gid}/1", filename="report.pdf")
            fake.fail_reads(503, times=1)
            reads = lambda: [p for m, p in fake.requests if m == "GET" and p.endswith(f"/messages/{gid}")]  # noqa: E731
            with pytest.raises(MediaNotReady, match="503"):
                worker.fetch_media(att)
            assert len(reads()) == 1  # one try: no retries of gmail.py's own while every chat waits
            assert worker.fetch_media(att) == b"%PDF-1.4 g"  # the next replay's try
            token_url, worker.gmail.token_url = worker.gmail.token_url, closed_port_url()
            worker.gmail._access = None  # the access token expired: a refresh first, and the endpoint is down
            with pytest.raises(MediaNotReady, match="token endpoint is unreachable"):
                worker.fetch_media(att)
            worker.gmail.token_url = token_url
            assert worker.fetch_media(att) == b"%PDF-1.4 g"
            fake.access_token = "ya29.rotated"  # the access token the worker holds is no longer good: a 401
            assert worker.fetch_media(att) == b"%PDF-1.4 g"  # one refresh and the part, though no retries are asked
            del fake.messages[gid]  # deleted meanwhile: Gmail answers 404
            with pytest.raises(LookupError, match="no longer on the server"):  # final: a note, never "gmail:..."
                worker.fetch_media(att)
            fake.revoke()
            with pytest.raises(ChannelRefused):
                worker.fetch_media(att)
        finally:
            worker.gmail.close()


def closed_port_url() -> str:
    """A loopback URL nothing listens at (bound, never listening): the connection is refused."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/token"


def test_a_429_or_no_answer_at_all_is_not_now_too():
    """The SDK's download(), which the Slack and Discord workers fetch with: a 429 and a refused connection are
    MediaNotReady as a 5xx is; a 404 is handed back for the worker to judge."""
    import socket

    from plugins_app.channel.sdk import MediaNotReady
    from plugins_app.channel.sdk.download import download
    from tests.fakes.discord import FakeDiscord
    with FakeDiscord() as fake:
        photo = fake.attachment("cat.png", b"png", "image/png")
        fake.fail_downloads(429)
        with pytest.raises(MediaNotReady, match="429"):
            download(photo["url"])
        assert download(photo["url"]).content == b"png"
        assert download(photo["url"] + "-gone").status_code == 404
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: the connection is refused
        with pytest.raises(MediaNotReady, match="ConnectError"):
            download(f"http://127.0.0.1:{port}/attachments/1/cat.png", timeout=5)


def bare_imap_worker(monkeypatch, tmp_path, server):
    from plugins_app.channel.workers.email.worker import EmailWorker
    for name, value in (("EMAIL_IMAP_HOST", "127.0.0.1"), ("EMAIL_IMAP_PORT", str(server.port)),
                        ("EMAIL_IMAP_USER", BOT), ("EMAIL_IMAP_PASSWORD", "pw"), ("EMAIL_ADDRESS", BOT)):
        monkeypatch.setenv(name, value)
    return EmailWorker(argv=["--imap-security", "none", "--smtp-security", "none", "--timeout-secs", "5"],
                       socket_path="/nowhere", plugin_id="email-test", token="t", install_signal_handlers=False,
                       state_dir=str(tmp_path))


def test_email_a_login_the_server_answers_bad_at_a_re_read_is_a_refusal_with_the_servers_words(monkeypatch,
                                                                                                tmp_path):
    """A BAD to LOGIN is an error in the command itself (RFC 3501 7.1.3): sent again it is answered the same, so
    the re-read refuses as the listener does (imaplib raises one error for a NO and a BAD; its BAD is unpacked)."""
    from plugins_app.channel.sdk import ChannelRefused
    from tests.fakes.email import BareImap
    with BareImap(login=b"BAD [CLIENTBUG] try that again") as server:
        worker = bare_imap_worker(monkeypatch, tmp_path, server)
        with pytest.raises(ChannelRefused) as info:
            worker._fetch_attachment_sync(1, 101, 1)
        assert len(server.logins) == 1
    assert str(info.value) == worker._refusal == (f"IMAP login refused for {BOT}: the server rejected the LOGIN "
                                                  "command itself (BAD): [CLIENTBUG] try that again")


def test_email_a_server_with_logindisabled_is_refused_at_a_re_read_without_sending_the_password(monkeypatch,
                                                                                                 tmp_path):
    from plugins_app.channel.sdk import ChannelRefused
    from tests.fakes.email import BareImap
    with BareImap(capabilities="IMAP4rev1 STARTTLS LOGINDISABLED", login=b"OK welcome") as server:
        worker = bare_imap_worker(monkeypatch, tmp_path, server)
        with pytest.raises(ChannelRefused, match="refuses plaintext LOGIN .*LOGINDISABLED.*--imap-security ssl"):
            worker._fetch_attachment_sync(1, 101, 1)
        assert server.logins == [] and "LOGINDISABLED" in worker._refusal


def test_email_a_user_name_with_a_backslash_logs_in_at_a_re_read(monkeypatch):
    """Exchange's DOMAIN\\user and a shared mailbox's user@domain\\shared@domain are sent as RFC 3501 quoted
    strings; sent bare, a server answers BAD."""
    from tests.fakes.email import MailServer
    user = "bot@example.org\\shared@example.org"
    with MailServer(user=user, password="app-password") as server, \
            MockBridge("mail-test", heartbeat_secs=HEARTBEAT) as bridge, tempfile.TemporaryDirectory() as state:
        for name, value in {"EMAIL_IMAP_HOST": "127.0.0.1", "EMAIL_IMAP_PORT": str(server.imap_port),
                            "EMAIL_IMAP_USER": user, "EMAIL_IMAP_PASSWORD": "app-password", "EMAIL_ADDRESS": BOT,
                            "EMAIL_SMTP_HOST": "127.0.0.1", "EMAIL_SMTP_PORT": str(server.smtp_port)}.items():
            monkeypatch.setenv(name, value)
        uid, _ = mail_left_owed(server, bridge, state, b"%PDF-1.4 shared")
        worker = email_worker(bridge, state)
        assert worker._fetch_attachment_sync(uidvalidity_of(server), uid, 1) == b"%PDF-1.4 shared"
        assert worker._refusal is None
