"""channel-discord end to end: the real supervisor starts the worker against a fake Discord on loopback."""
from __future__ import annotations

import os
import signal

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from tests.fakes.discord import MESSAGE_CONTENT, FakeDiscord
from tests.plugins_app.conftest import wait_until


CHANNEL = "3300000000000000003"
GUILD = "4400000000000000004"


@pytest.fixture
def fake(monkeypatch):
    fake = FakeDiscord(heartbeat_interval_ms=400).start()
    monkeypatch.setenv("DISCORD_BOT_TOKEN", fake.token)
    monkeypatch.setenv("DISCORD_API_BASE_URL", fake.api_base_url)
    yield fake
    fake.stop()


def make_discord(**over):
    fields = dict(plugin_id="discord-main", kind="channel-discord", command="", args=[],
                  env_refs=["DISCORD_BOT_TOKEN", "DISCORD_API_BASE_URL"], max_in_flight=8, max_retries=2,
                  heartbeat_secs=0.5)
    fields.update(over)
    return Plugin.objects.create(**fields)


def ready(fake, rt, n=1):
    """The worker is on the Gateway with a session (the n-th connection made)."""
    assert wait_until(lambda: fake.connected() and len(fake.connections) >= n and fake.current is not None, 20), \
        rt.log("discord-main")


def nth_connection(fake, rt, n):
    """The n-th gateway connection (0-based), once the worker said IDENTIFY or RESUME on it."""
    found = wait_until(lambda: len(fake.connections) > n and fake.connections[n].get("op") and fake.connected(), 20)
    assert found, rt.log("discord-main")
    return fake.connections[n]


def answers(fake):
    return [m["content"] for m in fake.sent()]


def test_a_guild_message_is_answered_in_its_channel_and_identify_asks_for_message_content(
        tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    assert fake.connections[0]["op"] == "identify" and fake.connections[0]["intents"] & MESSAGE_CONTENT
    question = fake.push_message(CHANNEL, "script:answer=hello **from** the agent", guild_id=GUILD)
    assert wait_until(lambda: answers(fake), 20), rt.log("discord-main")
    sent = fake.sent()[0]
    assert (sent["channel_id"], sent["content"]) == (CHANNEL, "hello **from** the agent")
    assert sent["_payload"]["allowed_mentions"] == {"parse": []} and sent["_payload"]["enforce_nonce"] is True
    receipt = Receipt.objects.select_related("conversation").get()
    assert receipt.client_message_id == question["id"]
    assert receipt.conversation.external_id == CHANNEL
    assert receipt.actor.key == f"discord:{question['author']['id']}"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 10)
    assert OutboundDelivery.objects.get().channel_message_id == sent["id"]
    assert wait_until(lambda: fake.heartbeats >= 1, 10)  # the first beat comes within one interval (jittered)


def test_a_long_answer_is_split_at_2000_characters(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    words = " ".join(f"word{i}" for i in range(900))  # about 7,000 characters
    fake.push_message(CHANNEL, f"script:answer={words}")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 20), rt.log("discord-main")
    parts = answers(fake)
    assert len(parts) >= 4 and all(len(p) <= 2000 for p in parts)
    assert " ".join(parts).split() == words.split()


def test_the_platform_redelivering_the_same_message_runs_one_turn(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    d = fake.push_message(CHANNEL, "script:answer=once")
    assert wait_until(lambda: answers(fake) == ["once"], 20), rt.log("discord-main")
    fake.redeliver(d)
    fake.push_message(CHANNEL, "script:answer=after")  # a later message shows the repeat was read
    assert wait_until(lambda: answers(fake) == ["once", "after"], 20), rt.log("discord-main")
    assert Turn.objects.count() == 2


def test_the_bots_own_messages_are_not_submitted(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.push_message(CHANNEL, "script:answer=loop", author_id="1100000000000000001", username="ugent-bot", bot=True)
    fake.push_message(CHANNEL, "script:answer=other bot", author_id="5500000000000000005", bot=True)
    fake.push_message(CHANNEL, "script:answer=human")
    assert wait_until(lambda: answers(fake) == ["human"], 20), rt.log("discord-main")
    assert Receipt.objects.count() == 1


def test_a_worker_killed_mid_delivery_sends_exactly_one_answer_after_the_restart(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.hold_sends = 30  # Discord made the message; its answer never reaches the worker
    fake.push_message(CHANNEL, "script:answer=only once")
    assert wait_until(lambda: answers(fake), 20), rt.log("discord-main")
    first = rt.worker_pid("discord-main")
    assert OutboundDelivery.objects.get().state == "in_flight"
    fake.hold_sends = 0
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 30), rt.log("discord-main")
    assert rt.worker_pid("discord-main") not in (None, first)
    posts = [r for r in fake.requests if r["method"] == "POST"]
    assert len(posts) == 2  # sent again after the restart, with the same nonce ...
    assert answers(fake) == ["only once"]  # ... so Discord returned the first message, not a second


def test_a_429_is_waited_out_and_the_same_send_succeeds(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.inject_429(retry_after=0.6)
    fake.inject_429(retry_after=0.3, is_global=True)
    fake.push_message(CHANNEL, "script:answer=patient")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 20), rt.log("discord-main")
    assert [r["status"] for r in fake.requests if r["method"] == "POST"] == [429, 429, 200]
    assert answers(fake) == ["patient"]


def test_a_dropped_socket_resumes_with_seq_on_the_resume_url_and_loses_nothing(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.push_message(CHANNEL, "script:answer=one")
    assert wait_until(lambda: answers(fake) == ["one"], 20), rt.log("discord-main")
    fake.drop()
    fake.push_message(CHANNEL, "script:answer=two")  # sent while the socket is down: replayed on RESUME
    assert wait_until(lambda: answers(fake) == ["one", "two"], 30), rt.log("discord-main")
    resume = nth_connection(fake, rt, 1)
    assert (resume["op"], resume["path"]) == ("resume", "/resume/?v=10&encoding=json")
    assert resume["seq"] == 2  # READY and "one": "two" came after it
    assert Receipt.objects.count() == 2


def test_reconnect_and_invalid_session_are_followed(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.reconnect()
    assert nth_connection(fake, rt, 1)["op"] == "resume"
    fake.invalid_session(False)
    assert nth_connection(fake, rt, 2)["op"] == "identify"  # a session Discord ended is identified afresh
    fake.push_message(CHANNEL, "script:answer=still here")
    assert wait_until(lambda: answers(fake) == ["still here"], 20), rt.log("discord-main")


def test_a_missed_heartbeat_ack_reconnects_and_resumes(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.mute_acks = True
    assert wait_until(lambda: len(fake.connections) >= 2, 20), rt.log("discord-main")
    fake.mute_acks = False
    assert nth_connection(fake, rt, 1)["op"] == "resume"
    assert wait_until(lambda: "zombied" in rt.log("discord-main"), 5)
    fake.push_message(CHANNEL, "script:answer=back")
    assert wait_until(lambda: answers(fake) == ["back"], 20), rt.log("discord-main")


def test_a_worker_killed_while_messages_arrive_resumes_its_session_after_the_restart(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.push_message(CHANNEL, "script:answer=before")
    assert wait_until(lambda: answers(fake) == ["before"], 20), rt.log("discord-main")
    first = rt.worker_pid("discord-main")
    os.kill(first, signal.SIGKILL)
    fake.drop()
    fake.push_message(CHANNEL, "script:answer=while down")
    assert wait_until(lambda: answers(fake) == ["before", "while down"], 30), rt.log("discord-main")
    assert fake.connections[-1]["op"] == "resume"
    assert Turn.objects.count() == 2


def test_a_revoked_token_disables_the_plugin_with_the_reason_and_it_stops_retrying(
        tcast, fake, start_runtime, admin_client):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.revoke()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log("discord-main")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == ("the channel refused the worker: "
                                      "4004 Authentication failed: the bot token is wrong or was reset")
    wait_until(lambda: False, 1.5)
    assert len(fake.connections) == 1  # not retried
    assert "the bot token is wrong or was reset" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_bad_token_at_start_is_refused_without_a_gateway_connection(tcast, fake, start_runtime, monkeypatch):
    monkeypatch.setenv("DISCORD_BOT_TOKEN", "not-the-token")
    make_discord()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log("discord-main")
    assert Plugin.objects.get().disabled_reason == \
        "the channel refused the worker: discord refused the bot token: 401 401: Unauthorized (code 0)"
    assert fake.connections == []
    assert [r["path"] for r in fake.requests] == ["/api/v10/gateway/bot"]


def test_a_missing_message_content_intent_4014_is_reported_and_not_retried(tcast, fake, start_runtime):
    fake.message_content_allowed = False
    make_discord()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log("discord-main")
    assert "4014 Disallowed intent(s): turn on the Message Content intent" in Plugin.objects.get().disabled_reason
    wait_until(lambda: False, 1.0)
    assert len(fake.connections) == 1


def test_attachments_in_are_stored_on_the_host_and_out_go_as_multipart(tcast, fake, start_runtime):
    from channels_app.models import Conversation
    from plugins_app.channel import services
    plugin = make_discord()
    rt = start_runtime()
    ready(fake, rt)
    png = b"\x89PNG\r\n\x1a\nfake-image"
    fake.push_message(CHANNEL, "script:answer=got it", attachments=[fake.attachment("cat.png", png, "image/png")])
    assert wait_until(lambda: answers(fake) == ["got it"], 20), rt.log("discord-main")
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type, media.filename) == (png, "image/png", "cat.png")
    # out: a host file becomes a files[0] part beside payload_json
    media_id = services.media_store(plugin_id=plugin.plugin_id, data=b"%PDF-1.4 report", content_type="application/pdf",
                                    filename="report.pdf")
    conv = Conversation.objects.get()
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="here is the report", attachments=[
        {"kind": "document", "content_type": "application/pdf", "media_id": media_id, "filename": "report.pdf"}])
    assert wait_until(lambda: len(fake.sent()) == 2, 20), rt.log("discord-main")
    sent = fake.sent()[1]
    assert sent["content"] == "here is the report"
    assert [(f["field"], f["filename"], f["data"]) for f in sent["_files"]] == \
        [("files[0]", "report.pdf", b"%PDF-1.4 report")]
    assert sent["_payload"]["attachments"] == [{"id": 0, "filename": "report.pdf"}]


def test_a_send_discord_refuses_for_missing_access_is_dead_lettered_with_its_reason(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.fail_next_send(403, {"message": "Missing Permissions", "code": 50013})
    fake.push_message(CHANNEL, "script:answer=not allowed here")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 20), \
        rt.log("discord-main")
    assert OutboundDelivery.objects.get().last_error == "permanent failure: discord: 403 Missing Permissions (code 50013)"
    assert [r["status"] for r in fake.requests if r["method"] == "POST"] == [403]  # not retried
    assert Plugin.objects.get().enabled


def test_a_401_on_a_send_stops_the_worker_with_the_refusal(tcast, fake, start_runtime):
    make_discord()
    rt = start_runtime()
    ready(fake, rt)
    fake.fail_next_send(401, {"message": "401: Unauthorized", "code": 0})
    fake.push_message(CHANNEL, "script:answer=token gone")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log("discord-main")
    assert Plugin.objects.get().disabled_reason == \
        "the channel refused the worker: discord refused the bot token: 401 401: Unauthorized (code 0)"


def test_a_saved_session_whose_resume_url_is_dead_falls_back_to_identify(tcast, fake, start_runtime, short_dir):
    import json
    state = short_dir / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "discord-main.discord-session.json").write_text(json.dumps(
        {"session_id": "s-stale", "resume_gateway_url": "ws://127.0.0.1:1", "seq": 5}))
    make_discord()
    rt = start_runtime()
    assert nth_connection(fake, rt, 0)["op"] == "identify"
    assert "attempts to resume failed; identifying afresh" in rt.log("discord-main")
    fake.push_message(CHANNEL, "script:answer=fresh")
    assert wait_until(lambda: answers(fake) == ["fresh"], 20), rt.log("discord-main")
