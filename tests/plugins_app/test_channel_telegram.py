"""channel-telegram end to end: the real supervisor starts the worker against a fake Bot API on loopback.

The fake (tests/fakes/telegram.py) speaks the Bot API's wire format; the worker is the built-in
kind with no command, configured by env_refs and args, in both of its modes.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest

from channels_app.models import Conversation, Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.sdk.text import split_text, utf16_len
from plugins_app.channel.workers.telegram import webhook_secret
from tests.fakes.telegram import CONFLICT_OTHER_POLLER, FakeTelegram
from tests.plugins_app.conftest import make_plugin, wait_until

DATA = Path(__file__).resolve().parents[1] / "data"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

MODES = ("polling", "webhook")
PID = "telegram-main"
# python-telegram-bot takes a while to import on a loaded machine: a grace the start fits in
SLOW_START = {"startup_grace_secs": 15.0}


@pytest.fixture
def fake(monkeypatch):
    fake = FakeTelegram().start()
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake.token)
    monkeypatch.setenv("TELEGRAM_API_BASE_URL", fake.base_url)
    yield fake
    fake.stop()


def telegram_plugin(mode: str, *extra: str, **over):
    args = ["--mode", mode, "--poll-timeout", "2", "--per-chat-secs", "0", "--group-secs", "0"]
    if mode == "webhook":
        args += ["--webhook-port", "0", "--webhook-check-secs", "0.3"]
    fields = dict(kind="channel-telegram", command="", args=args + list(extra),
                  env_refs=["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL"], heartbeat_secs=1.0)
    fields.update(over)
    return make_plugin(PID, **fields)


def ready(fake: FakeTelegram, mode: str, rt, timeout=20.0):
    """The worker is up: its first long poll waiting (not ended: it holds for --poll-timeout), or its webhook set."""
    if mode == "webhook":
        ok = wait_until(lambda: fake.webhook["url"], timeout)
    else:
        ok = wait_until(lambda: fake.polls_begun >= 1, timeout)
    assert ok, rt.log(PID)


@pytest.mark.parametrize("mode", MODES)
def test_a_message_in_gets_the_agents_answer_out_as_a_reply_in_markdown_v2(tcast, fake, start_runtime, mode):
    telegram_plugin(mode)
    rt = start_runtime(limits=SLOW_START)
    ready(fake, mode, rt)
    update = fake.push_message(42, "script:answer=**Done**: it costs 1.50 (see docs)!")
    sent = fake.wait_sent(1)
    assert len(sent) == 1, rt.log(PID)
    call = sent[0]
    assert int(call.params["chat_id"]) == 42
    assert call.params["parse_mode"] == "MarkdownV2"
    assert call.params["text"] == r"*Done*: it costs 1\.50 \(see docs\)\!"
    assert call.params["reply_parameters"]["message_id"] == update["message"]["message_id"]
    receipt = Receipt.objects.select_related("conversation", "actor").get()
    assert receipt.client_message_id == f"{update['update_id']}:{update['message']['message_id']}"
    assert (receipt.conversation.channel, receipt.conversation.client_id, receipt.conversation.external_id) == \
        ("telegram", PID, "42")
    assert receipt.actor.key == "telegram:42" and receipt.actor.display_name == "Ada"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 10), rt.log(PID)
    assert OutboundDelivery.objects.get().channel_message_id == str(call.result["message_id"])


@pytest.mark.parametrize("mode", MODES)
def test_the_same_update_delivered_twice_runs_one_turn(tcast, fake, start_runtime, mode):
    telegram_plugin(mode)
    rt = start_runtime(limits=SLOW_START)
    ready(fake, mode, rt)
    update = fake.push_message(42, "script:answer=once")
    assert fake.wait_sent(1), rt.log(PID)
    fake.redeliver(update)
    fake.push_message(42, "script:answer=after")  # a later message shows the redelivery was read
    assert len(fake.wait_sent(2)) == 2, rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert fake.texts() == ["once", "after"]
    assert Turn.objects.count() == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_429_with_retry_after_makes_the_send_wait_and_then_succeed(tcast, fake, start_runtime, mode):
    telegram_plugin(mode)
    rt = start_runtime(limits=SLOW_START)
    ready(fake, mode, rt)
    fake.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", retry_after=1)
    fake.push_message(42, "script:answer=patience")
    assert fake.wait_sent(1), rt.log(PID)
    assert fake.texts() == ["patience"]
    refused = [c for c in fake.calls if c.method == "sendMessage" and c.status == 429]
    assert len(refused) == 1
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 10), rt.log(PID)
    assert "waiting 1.0 s as Telegram asks" in rt.log(PID)


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_killed_mid_delivery_sends_each_part_exactly_once_after_the_restart(
        tcast, fake, start_runtime, mode):
    telegram_plugin(mode)
    rt = start_runtime(limits=SLOW_START)
    ready(fake, mode, rt)
    first_pid = rt.worker_pid(PID)
    long_answer = ("word " * 1000).strip() + "\n\n" + ("more " * 300).strip()  # two messages of 4096
    fake.hold_next("sendMessage", after=1)  # part one reaches Telegram; part two is in the air when killed
    fake.push_message(42, f"script:answer={long_answer}")
    assert wait_until(fake.held.is_set, 20), rt.log(PID)
    assert len(fake.sent()) == 1
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first_pid, signal.SIGKILL)
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 30), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first_pid)
    parts = split_text(long_answer, 4096, measure=utf16_len)
    assert len(parts) == 2
    assert fake.texts() == parts  # part one not again, part two once
    assert Turn.objects.count() == 1


def test_a_dropped_poll_loses_no_update(tcast, fake, start_runtime):
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.drop_next_poll()
    fake.push_message(42, "script:answer=still here")
    assert fake.wait_sent(1), rt.log(PID)
    assert [c.status for c in fake.calls if c.method == "getUpdates"].count(0) == 1  # the drop happened
    assert fake.texts() == ["still here"]


def test_updates_sent_while_the_webhook_worker_is_down_arrive_after_its_restart(tcast, fake, start_runtime):
    telegram_plugin("webhook")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "webhook", rt)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    fake.push_message(42, "script:answer=queued at Telegram")  # posts fail until the listener is back
    assert wait_until(lambda: fake.sent(), 30), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert fake.texts() == ["queued at Telegram"]


def test_a_webhook_post_without_the_secret_token_is_refused_and_runs_nothing(tcast, fake, start_runtime):
    telegram_plugin("webhook")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "webhook", rt)
    assert fake.webhook["secret_token"] == webhook_secret(fake.token)
    forged = fake.new_update(message=fake.message(42, "script:answer=forged"))
    assert fake.post_webhook(forged, None) == 403
    assert fake.post_webhook(forged, "guess") == 403
    # refused before a byte of its body is read (it was read first, up to 10 MB: this one would have been
    # waited for until the connection's timeout), and the connection closed
    url = httpx.URL(fake.webhook["url"])
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(f"POST {url.path} HTTP/1.1\r\nHost: x\r\nX-Telegram-Bot-Api-Secret-Token: guess\r\n"
                     f"Content-Length: 5000000\r\n\r\n".encode())
        answered = b""
        while chunk := conn.recv(65536):
            answered += chunk
    assert answered.startswith(b"HTTP/1.1 403 "), answered
    fake.push_message(42, "script:answer=genuine")
    assert fake.wait_sent(1), rt.log(PID)
    assert fake.texts() == ["genuine"]
    assert Receipt.objects.count() == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_revoked_token_disables_the_plugin_with_the_reason_and_it_stops_retrying(
        tcast, fake, start_runtime, mode, admin_client):
    telegram_plugin(mode)
    rt = start_runtime(limits=SLOW_START)
    ready(fake, mode, rt)
    fake.revoke()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == ("the channel refused the worker: 401 Unauthorized: the bot token is wrong "
                                      "or was revoked (@BotFather /token or /revoke)")
    calls = len(fake.calls)
    wait_until(lambda: False, 1.5)
    assert len(fake.calls) == calls  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert "the bot token is wrong or was revoked" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_bad_token_at_start_is_refused_before_anything_polls(tcast, fake, start_runtime, monkeypatch):
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "999:not-the-token")
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log(PID)
    assert "401 Unauthorized" in Plugin.objects.get().disabled_reason
    assert fake.count("getUpdates") == 0


def test_a_second_poller_409_disables_the_plugin_with_the_conflict(tcast, fake, start_runtime):
    fake.fail_next("getUpdates", 409, CONFLICT_OTHER_POLLER)
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log(PID)
    reason = Plugin.objects.get().disabled_reason
    assert reason.startswith("the channel refused the worker: 409 Conflict: terminated by other getUpdates "
                             "request")
    assert rt.log(PID).count("the channel refused this worker") == 1


def test_polling_while_a_webhook_is_set_is_reported_as_a_conflict(tcast, fake, start_runtime):
    fake.webhook = {"url": "https://elsewhere.example/hook", "secret_token": None}
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log(PID)
    assert "can't use getUpdates method while webhook is active" in Plugin.objects.get().disabled_reason


@pytest.fixture
def seen_contexts():
    from channels_app import hooks
    seen = []
    hooks.register("test-seen", 1, lambda ctx: seen.append(ctx) and None)
    yield seen
    hooks.unregister("test-seen")


@pytest.mark.parametrize("chat_type,chat_id,source_type", [("private", 42, "user"), ("group", -100, "group"),
                                                           ("supergroup", -1001, "group"),
                                                           ("channel", -1002, "room")])
def test_the_chat_type_becomes_the_source_type_the_rules_read(tcast, fake, start_runtime, seen_contexts,
                                                              chat_type, chat_id, source_type):
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.chat(chat_id, chat_type)
    fake.push_message(chat_id, "script:answer=hi", chat_type=chat_type, from_id=7)
    assert fake.wait_sent(1), rt.log(PID)
    assert int(fake.sent()[0].params["chat_id"]) == chat_id
    (ctx,) = seen_contexts
    expected_sender = str(chat_id) if chat_type == "channel" else "7"
    assert (ctx.channel, ctx.source_type, ctx.user_id) == ("telegram", source_type, expected_sender)
    assert Conversation.objects.get().external_id == str(chat_id)


def test_a_photo_in_is_stored_on_the_host_and_a_file_out_is_uploaded(tcast, fake, start_runtime):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    plugin = telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    photo = fake.add_file(b"\x89PNG fake photo bytes", "photos/file_1.jpg")
    fake.push_message(42, "script:answer=nice picture", photo=[{**photo, "width": 90, "height": 90}])
    assert fake.wait_sent(1), rt.log(PID)
    assert wait_until(PluginMedia.objects.exists, 5), rt.log(PID)
    stored = PluginMedia.objects.get()
    assert bytes(stored.data) == b"\x89PNG fake photo bytes" and stored.content_type == "image/jpeg"
    assert fake.count("getFile") == 1
    # out: a document from the host's media store goes up with sendDocument
    media_id = services.media_store(plugin_id=PID, data=b"%PDF-1.4 report", content_type="application/pdf",
                                    filename="report.pdf")
    actor = channel_actor_resolve(channel="telegram", user_id="42")
    conv, _ = conversation_resolve(channel="telegram", client_id=PID, external_id="42", actor=actor, caller=None)
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="your report",
                              attachments=[{"kind": "document", "content_type": "application/pdf",
                                            "media_id": media_id, "filename": "report.pdf"}])
    docs = fake.wait_sent(1, method="sendDocument")
    assert docs, rt.log(PID)
    assert docs[0].files["document"][0] == "report.pdf"
    assert docs[0].files["document"][2] == b"%PDF-1.4 report"
    assert fake.texts()[-2:] == ["your report", ""]


def test_a_deliverys_options_become_an_inline_keyboard_and_a_press_comes_back_as_a_message(
        tcast, fake, start_runtime):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    plugin = telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.chat(42)
    actor = channel_actor_resolve(channel="telegram", user_id="42")
    conv, _ = conversation_resolve(channel="telegram", client_id=PID, external_id="42", actor=actor, caller=None)
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="Deploy now?",
                              metadata={"options": ["yes", {"label": "Not yet", "value": "no"}]})
    sent = fake.wait_sent(1)
    assert sent, rt.log(PID)
    markup = sent[0].params["reply_markup"]
    assert markup == {"inline_keyboard": [[{"text": "yes", "callback_data": "yes"}],
                                          [{"text": "Not yet", "callback_data": "no"}]]}
    shown = fake.message(42, "Deploy now?")
    fake.push_callback(42, "script:answer=ok, later", message=shown)
    assert len(fake.wait_sent(2)) == 2, rt.log(PID)
    # (the listener answers the press once the hub has it: the reply can reach Telegram first)
    assert len(fake.wait_sent(1, method="answerCallbackQuery")) == 1, rt.log(PID)
    receipt = Receipt.objects.get()
    assert receipt.client_message_id.endswith(":cb")
    assert fake.texts()[-1] == "ok, later"


def test_an_operator_chosen_webhook_secret_is_the_one_telegram_must_send(tcast, fake, start_runtime, monkeypatch):
    """With the secret of tests/data/webhook-signature-vectors.json's `telegram-secret-token-ptb`, the worker's
    listener answers that vector's cases: no header and a wrong one 403, the configured one taken."""
    vector = next(v for v in json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
                  if v["id"] == "telegram-secret-token-ptb")
    secret = vector["inputs"]["configured_secret_token"]
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", secret)
    telegram_plugin("webhook", env_refs=["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL", "TELEGRAM_WEBHOOK_SECRET"])
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "webhook", rt)
    assert fake.webhook["secret_token"] == secret
    forged = fake.new_update(message=fake.message(42, "script:answer=forged"))
    assert fake.post_webhook(forged, webhook_secret(fake.token)) == 403  # the derived one no longer opens it
    for case in vector["expected"]["cases"]:
        update = fake.new_update(message=fake.message(42, f"script:answer=sent with {case['header']}"))
        assert fake.post_webhook(update, case["header"]) == case["status"], case
    assert fake.wait_sent(1), rt.log(PID)
    assert fake.texts() == [f"sent with {secret}"]


def test_a_webhook_secret_telegram_would_refuse_disables_the_plugin_before_set_webhook(
        tcast, fake, start_runtime, monkeypatch):
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "spaces are not allowed")
    telegram_plugin("webhook", env_refs=["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL", "TELEGRAM_WEBHOOK_SECRET"])
    rt = start_runtime(limits=SLOW_START)
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log(PID)
    assert Plugin.objects.get().disabled_reason == ("the channel refused the worker: TELEGRAM_WEBHOOK_SECRET must be "
                                                    "1-256 characters of A-Z, a-z, 0-9, _ and -")
    assert fake.count("setWebhook") == 0


def test_a_user_who_blocked_the_bot_dead_letters_that_delivery_and_the_plugin_keeps_running(
        tcast, fake, start_runtime):
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
    fake.push_message(42, "script:answer=you will not see this")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 20), rt.log(PID)
    assert OutboundDelivery.objects.get().last_error == "permanent failure: 403 Forbidden: bot was blocked by the user"
    assert fake.count("sendMessage") == 1  # permanent: not tried again
    fake.push_message(43, "script:answer=others still get answers")
    assert fake.wait_sent(1), rt.log(PID)
    assert Plugin.objects.get().state == "running"


def test_markdown_telegram_cannot_parse_goes_again_as_plain_text(tcast, fake, start_runtime):
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.fail_next("sendMessage", 400, "Bad Request: can't parse entities: Can't find end of Bold entity at "
                                       "byte offset 0")
    fake.push_message(42, "script:answer=**still** readable")
    sent = fake.wait_sent(1)
    assert sent, rt.log(PID)
    assert "parse_mode" not in sent[0].params and sent[0].params["text"] == "**still** readable"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 10)


def test_a_dead_letter_the_operator_requeues_is_sent_again(tcast, fake, start_runtime):
    """The admin's requeue of a dead letter hands the worker a new, higher attempt: its outbox, which recorded
    the failure, sends that one (a requeue at attempt 1 was acked with the old failure, never sent)."""
    from plugins_app.channel import services
    telegram_plugin("polling")
    rt = start_runtime(limits=SLOW_START)
    ready(fake, "polling", rt)
    fake.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
    fake.push_message(42, "script:answer=after the unblock")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 20), rt.log(PID)
    assert services.delivery_retry(delivery=OutboundDelivery.objects.get())  # the user unblocked the bot
    assert fake.wait_sent(1), rt.log(PID)
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 20), rt.log(PID)
    assert fake.count("sendMessage") == 2  # the refused send, then the one after the requeue
