"""channel-slack end to end: the real supervisor runs the worker against a fake Slack on loopback.

Every test runs in both of the worker's modes (Socket Mode, Events API webhook) unless what it
shows belongs to one of them; the fake speaks Slack's wire formats (tests/fakes/slack.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import httpx
import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.workers.slack import message_id_of
from tests.fakes.slack import BOT_USER, FakeSlack, sign
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

ENV_REFS = ["SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_API_BASE_URL"]
CHANNEL = "C0CHAN001"
LISTENING = re.compile(r"events webhook listening on (http://\S+)")


@pytest.fixture(params=["socket", "webhook"])
def slack(request, monkeypatch):
    fake = FakeSlack(mode=request.param).start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


@pytest.fixture
def socket_slack(monkeypatch):
    fake = FakeSlack(mode="socket").start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def slack_plugin(fake: FakeSlack, plugin_id: str = "slack-main", args: tuple = ()) -> Plugin:
    argv = ["--mode", fake.mode, *(["--bind", "127.0.0.1:0"] if fake.mode == "webhook" else []), *args]
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second connection
    return make_plugin(plugin_id, kind="channel-slack", command="", args=argv, env_refs=ENV_REFS,
                       heartbeat_secs=1.0)


def listening(rt, fake: FakeSlack, plugin_id: str = "slack-main", *, after: str | None = None) -> None:
    """Wait until the worker takes events: a socket open, or its Request URL known to the fake."""
    if fake.mode == "socket":
        assert wait_until(lambda: fake.sockets(), 30), rt.log(plugin_id)
        return

    def url():
        found = LISTENING.findall(rt.log(plugin_id))
        return found[-1] if found and found[-1] != after else None
    fake.request_url = wait_until(url, 30) or pytest.fail(rt.log(plugin_id))


def answered(fake: FakeSlack, n: int = 1, timeout: float = 30) -> list[dict]:
    assert wait_until(lambda: len(fake.posts()) >= n, timeout), fake.posts()
    return fake.posts()


def test_a_channel_message_is_answered_in_its_thread_with_slack_markup(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    event = slack.say("script:answer=hello **there**, see [the docs](https://example.org/a?b=1&c=2)",
                      channel=CHANNEL, channel_type="channel")
    ts = event["event"]["ts"]
    [post] = answered(slack)
    assert (post["channel"], post["thread_ts"]) == (CHANNEL, ts)
    assert post["text"] == "hello *there*, see <https://example.org/a?b=1&amp;c=2|the docs>"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 15), rt.log("slack-main")
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    # the platform's dedupe key is the idempotency key; the thread is the conversation
    assert delivery.turn.receipt.client_message_id == f"{CHANNEL}:{ts}"  # the message's own id
    assert delivery.conversation.external_id == f"{CHANNEL}/{ts}"
    assert delivery.conversation.channel == "slack"
    assert delivery.channel_message_id == post["ts"]
    assert post["metadata"] == {"event_type": "ugent_delivery",
                                "event_payload": {"delivery_id": delivery.delivery_id, "part": 0, "parts": 1}}
    assert Plugin.objects.get().state == "running"


def test_a_direct_message_is_one_conversation_and_the_answer_goes_to_its_top_level(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.say("script:answer=first", channel="D0DM00001")
    answered(slack, 1)
    slack.say("script:answer=second", channel="D0DM00001")
    posts = answered(slack, 2)
    assert [(p["channel"], p.get("thread_ts"), p["text"]) for p in posts] == \
        [("D0DM00001", None, "first"), ("D0DM00001", None, "second")]
    assert Receipt.objects.filter(conversation__external_id="D0DM00001").count() == 2


def test_a_long_answer_is_split_within_slacks_limit(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    paragraphs = [f"paragraph {i} " + "word " * 150 for i in range(12)]  # about 9,000 characters
    slack.say("script:answer=" + "\n\n".join(paragraphs), channel="D0DM00001")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 30), rt.log("slack-main")
    posts = slack.posts()
    assert len(posts) >= 3 and all(len(p["text"]) <= 4000 for p in posts)
    assert " ".join(p["text"] for p in posts).split() == "\n\n".join(paragraphs).split()
    assert [p["metadata"]["event_payload"]["part"] for p in posts] == list(range(len(posts)))


def test_the_platform_redelivering_an_event_runs_one_turn(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    event = slack.say("script:answer=only once", channel=CHANNEL, channel_type="channel")
    answered(slack, 1)
    slack.redeliver(event)  # Slack's retry: the same event_id (socket: retry_attempt; webhook: X-Slack-Retry-Num)
    assert wait_until(slack.settled, 20)
    slack.say("script:answer=after", channel="D0DM00001")  # handled after the redelivery (one queue, in order)
    posts = answered(slack, 2)
    wait_until(lambda: False, 0.5)
    assert [p["text"] for p in slack.posts()] == ["only once", "after"], posts
    assert Turn.objects.filter(receipt__client_message_id=message_id_of(CHANNEL, event["event"]["ts"])).count() == 1
    assert Receipt.objects.count() == 2


def test_a_429_with_retry_after_makes_the_send_wait_and_then_succeed(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.rate_limit("chat.postMessage", retry_after=1)
    slack.say("script:answer=patience", channel="D0DM00001")
    [post] = answered(slack)
    assert post["text"] == "patience"
    limited, sent = slack.calls_of("chat.postMessage")
    assert (limited.status, limited.answer) == (429, {"ok": False, "error": "ratelimited"})
    assert sent.status == 200
    assert slack.early_calls == 0  # nothing was tried again inside the Retry-After (the fake would refuse it)
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 15)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host


def test_a_worker_killed_in_the_middle_of_a_send_answers_exactly_once_after_the_restart(
        tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.hold_post_secs = 30  # Slack has the message, the worker has no answer yet: the crash window
    slack.say("script:answer=exactly once", channel=CHANNEL, channel_type="channel")
    answered(slack, 1)
    first = rt.worker_pid("slack-main")
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    slack.hold_post_secs = 0
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 30), rt.log("slack-main")
    assert rt.worker_pid("slack-main") not in (None, first)
    assert [p["text"] for p in slack.posts()] == ["exactly once"]
    assert slack.calls_of("conversations.replies")  # it looked in the thread before sending again


def test_a_lost_connection_loses_no_message(tcast, slack, start_runtime):
    """Socket Mode: the socket drops without a word. Webhook: the worker is down (kill -9) when Slack
    posts; Slack retries and the restarted worker takes it."""
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.say("script:answer=before", channel="D0DM00001")
    answered(slack, 1)
    if slack.mode == "socket":
        slack.drop_sockets()
    else:
        before = slack.request_url
        pid = rt.worker_pid("slack-main")
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: rt.worker_pid("slack-main") != pid, 15)
    slack.say("script:answer=after", channel="D0DM00001")
    if slack.mode == "webhook":
        listening(rt, slack, after=before)
    posts = answered(slack, 2, timeout=45)
    assert [p["text"] for p in posts] == ["before", "after"]


def test_a_disconnect_frame_opens_the_next_socket_before_the_old_one_closes(tcast, socket_slack, start_runtime):
    slack_plugin(socket_slack)
    rt = start_runtime()
    listening(rt, socket_slack)
    socket_slack.say("script:answer=one", channel="D0DM00001")
    answered(socket_slack, 1)
    opened = socket_slack.sockets_opened
    assert socket_slack.disconnect("refresh_requested") == 1
    socket_slack.say("script:answer=two", channel="D0DM00001")  # may go out on either socket
    posts = answered(socket_slack, 2)
    assert socket_slack.sockets_opened == opened + 1
    assert max(socket_slack.open_counts) == 2  # both open at once: the new one came first
    assert wait_until(lambda: len(socket_slack.sockets()) == 1, 10)
    socket_slack.disconnect("warning")
    socket_slack.say("script:answer=three", channel="D0DM00001")
    posts = answered(socket_slack, 3)
    assert [p["text"] for p in posts] == ["one", "two", "three"]


def test_a_revoked_token_is_the_plugins_state_and_it_stops_retrying(tcast, slack, start_runtime, admin_client):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.revoke(bot=True)  # tokens_revoked arrives as an event
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("slack-main")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == "the channel refused the worker: tokens_revoked: the bot token was revoked"
    wait_until(lambda: False, 1.0)
    assert rt.worker_pid("slack-main") is None
    assert len(slack.calls_of("auth.test")) == 1  # one start: no loop against a platform that said no
    page = admin_client.get("/admin/plugins_app/plugin/").content.decode()
    assert "tokens_revoked: the bot token was revoked" in page


def test_a_token_slack_refuses_at_start_disables_the_plugin_with_the_reason(tcast, slack, start_runtime):
    slack.revoked_bot = True
    slack_plugin(slack)
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("slack-main")
    assert Plugin.objects.get().disabled_reason == (
        "the channel refused the worker: auth.test: token_revoked: the bot token (SLACK_BOT_TOKEN) was refused")
    wait_until(lambda: False, 1.0)
    assert len(slack.calls_of("auth.test")) == 1


def test_socket_mode_switched_off_for_the_app_is_reported_not_retried(tcast, socket_slack, start_runtime):
    slack_plugin(socket_slack)
    rt = start_runtime()
    listening(rt, socket_slack)
    socket_slack.disconnect("link_disabled")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("slack-main")
    assert Plugin.objects.get().disabled_reason == (
        "the channel refused the worker: socket mode: link_disabled: Socket Mode was turned off for this app")
    assert len(socket_slack.calls_of("auth.test")) == 1


def test_files_travel_both_ways_through_host_storage(tcast, slack, start_runtime):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    plugin = slack_plugin(slack, args=("--threads", "off"))
    rt = start_runtime()
    listening(rt, slack)
    photo = b"\x89PNG\r\n\x1a\n" + os.urandom(64)
    slack.say("script:answer=nice picture", channel=CHANNEL, channel_type="channel",
              files=[slack.add_file(photo, name="cat.png")])
    [post] = answered(slack)
    assert post.get("thread_ts") is None  # --threads off: the channel is the conversation
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type, media.filename) == (photo, "image/png", "cat.png")
    # out: a file the agent attaches goes up through getUploadURLExternal + completeUploadExternal
    report = services.media_store(plugin_id=plugin.plugin_id, data=b"%PDF-1.4 report", content_type="application/pdf",
                                  filename="report.pdf")
    actor = channel_actor_resolve(channel="slack", user_id="U0USER001")
    conv, _ = conversation_resolve(channel="slack", client_id=plugin.plugin_id, external_id=CHANNEL, actor=actor,
                                   caller=None)
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="the report", attachments=[
        {"kind": "document", "content_type": "application/pdf", "media_id": report, "filename": "report.pdf"}])
    assert wait_until(lambda: slack.shares, 30), rt.log("slack-main")
    [share] = slack.shares
    file_id = share["files"][0]["id"]
    assert share["channel_id"] == CHANNEL and slack.uploads[file_id]["data"] == b"%PDF-1.4 report"
    assert slack.uploads[file_id]["filename"] == "report.pdf"
    assert answered(slack, 2)[-1]["text"] == "the report"


def test_the_webhook_answers_the_url_challenge_and_refuses_a_bad_signature(tcast, start_runtime, monkeypatch):
    fake = FakeSlack(mode="webhook").start()
    try:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        slack_plugin(fake)
        rt = start_runtime()
        listening(rt, fake)
        url = fake.request_url
        fake.request_url = None  # this test posts by hand
        challenge = json.dumps({"token": "t", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
                                "type": "url_verification"}).encode()
        ts = str(int(time.time()))
        ok = httpx.post(url, content=challenge, headers={"X-Slack-Request-Timestamp": ts, "Content-Type":
                        "application/json", "X-Slack-Signature": sign(fake.signing_secret, ts, challenge)})
        assert (ok.status_code, ok.json()) == (200, {"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"})
        event = json.dumps(fake.event_payload({"type": "message", "text": "script:answer=no", "user": "U0USER001",
                                               "ts": fake.next_ts(), "channel": "D0DM00001",
                                               "channel_type": "im"})).encode()
        bad = httpx.post(url, content=event, headers={"X-Slack-Request-Timestamp": ts, "Content-Type":
                         "application/json", "X-Slack-Signature": sign("another-secret", ts, event)})
        stale_ts = str(int(ts) - 301)
        stale = httpx.post(url, content=event, headers={"X-Slack-Request-Timestamp": stale_ts, "Content-Type":
                           "application/json", "X-Slack-Signature": sign(fake.signing_secret, stale_ts, event)})
        assert (bad.status_code, bad.json()) == (401, {"ok": False, "error": "invalid signature"})
        assert (stale.status_code, stale.json()) == (401, {"ok": False, "error": "invalid signature"})
        wait_until(lambda: False, 1.0)
        assert not Receipt.objects.exists() and not fake.posts()
    finally:
        fake.stop()


def test_the_bots_own_messages_and_edits_are_not_answered(tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    own = {"type": "message", "text": "script:answer=loop", "user": BOT_USER, "bot_id": "B0BOT0001",
           "ts": slack.next_ts(), "channel": "D0DM00001", "channel_type": "im"}
    edit = {"type": "message", "subtype": "message_changed", "channel": "D0DM00001", "channel_type": "im",
            "ts": slack.next_ts(), "message": {"text": "script:answer=edited", "user": "U0USER001"}}
    slack.push(slack.event_payload(own))
    slack.push(slack.event_payload(edit))
    slack.say("script:answer=real", channel="D0DM00001")
    answered(slack, 1)
    assert wait_until(slack.settled, 15)
    wait_until(lambda: False, 0.5)
    assert slack.texts() == ["real"] and Receipt.objects.count() == 1


def test_a_token_revoked_without_a_word_is_found_at_the_first_send_and_stops_the_worker(
        tcast, slack, start_runtime):
    slack_plugin(slack)
    rt = start_runtime()
    listening(rt, slack)
    slack.revoke(bot=True, event=False)
    slack.say("script:answer=unsent", channel="D0DM00001")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("slack-main")
    assert Plugin.objects.get().disabled_reason == (
        "the channel refused the worker: chat.postMessage: token_revoked: the bot token (SLACK_BOT_TOKEN) "
        "was refused")
    assert not slack.posts()
    # the answer is not lost: it waits, retryable, for the operator's new token
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)


def test_an_app_level_token_revoked_while_connected_is_reported_not_retried(tcast, socket_slack, start_runtime):
    slack_plugin(socket_slack)
    rt = start_runtime()
    listening(rt, socket_slack)
    socket_slack.revoke(bot=False, app=True)  # the socket drops; apps.connections.open now refuses
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("slack-main")
    assert Plugin.objects.get().disabled_reason == (
        "the channel refused the worker: apps.connections.open: token_revoked: the app-level token "
        "(SLACK_APP_TOKEN) was refused")
    assert len(socket_slack.calls_of("auth.test")) == 1


def test_a_slash_command_is_run_and_answered_once_in_the_channel(tcast, slack, start_runtime):
    """docs/commands.md, "From a chat channel": Slack's client sends a /word only when it is a slash command
    the app registered; it comes as a slash_commands envelope (socket) or a form POST (webhook)."""
    from channels_app.models import Actor
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="other", provider="scripted", config={"prefix": "other"})
    plugin = slack_plugin(slack)
    plugin.allow_remote_control = ["slack:U0USER001"]
    plugin.save()
    rt = start_runtime()
    listening(rt, slack)
    invoked = slack.slash("/ugent", "model other", channel="D0DM00001")  # the umbrella command
    answered(slack, 1)
    slack.slash("/models", channel="D0DM00001")  # a command registered under its own name
    posts = answered(slack, 2)
    assert posts[0]["channel"] == "D0DM00001" and posts[0]["text"].startswith("Your model is now other")
    assert "other" in posts[1]["text"] and posts[1]["text"].startswith("The models you may name")
    assert Actor.objects.get(key="slack:U0USER001").model_choice == "other"
    if slack.mode == "socket":
        slack.reslash(invoked)  # an envelope Slack thinks unacked comes again: it runs nothing
    slack.say("script:answer=after", channel="D0DM00001")
    answered(slack, 3)
    wait_until(lambda: False, 0.5)
    assert [p["text"] for p in slack.posts()][2:] == ["after"] and Turn.objects.count() == 1
