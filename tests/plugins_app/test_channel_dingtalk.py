"""channel-dingtalk end to end: the real supervisor runs the worker against a fake DingTalk on loopback.

The fake (tests/fakes/dingtalk.py) speaks DingTalk's OpenAPI (the app's access token, the robot's one-to-one and
group sends, file downloads; errors as HTTP statuses with ``code``/``message``) and POSTs robot messages to the
worker as DingTalk does, with ``timestamp`` and ``sign``; the worker is the built-in kind with no command.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.workers.dingtalk import message_parts
from tests.fakes.dingtalk import GROUP, STAFF, FakeDingTalk
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "dingtalk-main"
ENV_REFS = ["DINGTALK_APP_KEY", "DINGTALK_APP_SECRET", "DINGTALK_API_BASE_URL", "DINGTALK_OAPI_BASE_URL"]
LISTENING = re.compile(r"webhook listening on (http://\S+)")


@pytest.fixture
def ding(monkeypatch):
    fake = FakeDingTalk().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def dingtalk_plugin(*args: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second worker
    return make_plugin(PID, kind="channel-dingtalk", command="", args=["--bind", "127.0.0.1:0", *args],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def listening(rt, fake: FakeDingTalk, *, after: str | None = None) -> None:
    """Wait until the worker's webhook is up, and point the fake at it."""
    def url():
        found = LISTENING.findall(rt.log(PID))
        return found[-1] if found and found[-1] != after else None
    fake.webhook_url = wait_until(url, 30) or pytest.fail(rt.log(PID))


def answered(fake: FakeDingTalk, n: int = 1, timeout: float = 30) -> list[str]:
    assert wait_until(lambda: len(fake.texts()) >= n, timeout), fake.sends()
    return fake.texts()


def delivered() -> bool:
    return OutboundDelivery.objects.filter(state="delivered").exists()


def test_a_message_in_gets_the_agents_answer_sent_to_the_user(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    message = ding.say("script:answer=hello from the agent")
    assert answered(ding) == ["hello from the agent"]
    [send] = ding.sends()
    assert send.path == "/v1.0/robot/oToMessages/batchSend" and send.status == 200
    assert send.body == {"robotCode": ding.app_key, "userIds": [STAFF], "msgKey": "sampleMarkdown",
                         "msgParam": json.dumps({"title": "hello from the agent", "text": "hello from the agent"},
                                                ensure_ascii=False)}
    assert send.headers["x-acs-dingtalk-access-token"] in ding.tokens
    assert wait_until(delivered, 15), rt.log(PID)
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    # the msgId is the idempotency key; the user is the conversation
    assert delivery.turn.receipt.client_message_id == message["msgId"]
    assert (delivery.conversation.channel, delivery.conversation.external_id) == ("dingtalk", f"user:{STAFF}")
    assert delivery.channel_message_id == ding.sent[0]["key"]
    receipt = Receipt.objects.select_related("actor").get()
    assert receipt.actor.key == f"dingtalk:{STAFF}"
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 1  # the token is kept, not fetched per call
    assert Plugin.objects.get().state == "running"


def test_a_group_mention_is_answered_in_the_group(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.post(ding.text("@机器人 script:answer=to the group", group=True))
    assert answered(ding) == ["to the group"]
    [send] = ding.sends()
    assert send.path == "/v1.0/robot/groupMessages/send"
    assert send.body["openConversationId"] == GROUP and ding.sent[0]["kind"] == "group"
    assert wait_until(lambda: Receipt.objects.exists(), 10)
    receipt = Receipt.objects.select_related("conversation", "actor").get()
    assert receipt.conversation.external_id == f"group:{GROUP}" and receipt.actor.key == f"dingtalk:{STAFF}"


def test_a_group_the_robot_was_removed_from_fails_its_answer_and_only_that(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.post(ding.text("@机器人 script:answer=before", group=True))
    assert answered(ding) == ["before"]
    ding.groups.discard(GROUP)  # the robot removed in the group's settings; its mention arrived just before
    ding.post(ding.text("@机器人 script:answer=to a group without the robot", group=True))
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    dead = OutboundDelivery.objects.get(state="dead_letter")
    assert "invalidParameter.robotCode.notExsit" in dead.last_error and "not in this group" in dead.last_error
    assert [c.status for c in ding.sends()] == [200, 400]  # permanent: not retried
    # the plugin goes on: the robot's other chats are answered
    assert Plugin.objects.get().state == "running" and Plugin.objects.get().enabled
    ding.say("script:answer=one to one still works")
    assert answered(ding, 2) == ["before", "one to one still works"]
    assert Plugin.objects.get().enabled


def test_a_long_answer_is_split_within_dingtalks_limit(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    answer = "\n\n".join(f"第{i}段。" + "钉钉按字节计算消息参数的长度。" * 40 for i in range(12))  # about 21,000 bytes
    ding.say("script:answer=" + answer)
    assert wait_until(delivered, 30), rt.log(PID)
    texts = ding.texts()
    assert texts == message_parts(answer) and len(texts) >= 5
    assert all(len(json.dumps(t, ensure_ascii=False).encode()) <= 5002 for t in texts)
    assert "".join(texts).replace("\n", "") == answer.replace("\n", "")
    assert {c.status for c in ding.sends()} == {200}
    titles = [m["param"]["title"] for m in ding.sent]
    assert titles[0].endswith(f"(1/{len(texts)})") and titles[-1].endswith(f"({len(texts)}/{len(texts)})")


def test_the_same_message_sent_again_runs_one_turn(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    message = ding.say("script:answer=only once")
    answered(ding, 1)
    for _ in range(2):  # DingTalk sending the message again: the same msgId, signed afresh
        assert ding.post(message).status_code == 200
    ding.say("script:answer=after")  # handled after the repeats (one queue, in order)
    answered(ding, 2)
    wait_until(lambda: False, 0.5)
    assert ding.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id=message["msgId"]).count() == 1
    assert Receipt.objects.count() == 2


def test_a_bad_sign_or_an_old_timestamp_is_refused_and_records_nothing(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    message = ding.text("script:answer=no")
    forged = ding.post(message, secret="another-secret")
    missing = ding.post(message, signature="")
    stale = ding.post(message, timestamp=str(int(time.time() * 1000) - 2 * 3600 * 1000))
    assert (forged.status_code, forged.json()) == (401, {"message": "Invalid sign or timestamp"})
    assert missing.status_code == 401 and stale.status_code == 401
    wait_until(lambda: False, 1.0)
    assert not Receipt.objects.exists() and not ding.sends()
    ding.say("script:answer=the genuine one")
    assert answered(ding) == ["the genuine one"]
    assert Receipt.objects.count() == 1


def test_a_picture_in_is_downloaded_and_stored_on_the_host(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    photo = b"\xff\xd8\xff\xe0" + os.urandom(64)
    code = ding.upload(photo)
    assert ding.post(ding.message("picture", content={"downloadCode": code, "pictureDownloadCode": "p"})
                     ).status_code == 200
    assert wait_until(lambda: PluginMedia.objects.exists(), 20), rt.log(PID)
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type) == (photo, "image/jpeg")
    [ask] = ding.calls_to("/v1.0/robot/messageFiles/download")
    assert ask.body == {"downloadCode": code, "robotCode": ding.app_key}


def test_throttling_and_a_5xx_make_the_send_wait_and_then_succeed(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.script(429)
    ding.script(503)
    ding.say("script:answer=patience")
    assert answered(ding) == ["patience"]
    limited, down, sent = ding.sends()
    assert (limited.status, limited.answer["code"]) == (429, "Throttling.Api")
    assert (down.status, sent.status) == (503, 200)
    assert limited.body == down.body == sent.body
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host


def test_an_expired_token_is_fetched_again_and_the_message_sent_once(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.expire_tokens()
    ding.say("script:answer=fresh token")
    assert answered(ding) == ["fresh token"]
    expired, sent = ding.sends()
    assert (expired.status, expired.answer["code"], sent.status) == (400, "InvalidAuthentication", 200)
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 2
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1


def test_a_worker_killed_mid_delivery_sends_each_part_exactly_once_after_the_restart(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    answer = "\n\n".join((f"part {i} " + "word " * 900).strip() for i in range(3))  # three messages
    parts = message_parts(answer)
    assert len(parts) == 3
    ding.hold_next(after=1)  # part one reaches DingTalk; part two is in the air when the worker is killed
    ding.say("script:answer=" + answer)
    assert wait_until(ding.held.is_set, 30), rt.log(PID)
    first = rt.worker_pid(PID)
    assert ding.texts() == parts[:1]
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    assert wait_until(delivered, 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert ding.texts() == parts  # part one not again, parts two and three once
    assert Turn.objects.count() == 1
    assert OutboundDelivery.objects.get().channel_message_id == ding.sent[0]["key"]


def test_a_send_lost_with_the_killed_worker_goes_out_once_after_the_restart(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.say("script:answer=first")
    answered(ding, 1)
    assert wait_until(delivered, 15), rt.log(PID)
    first = rt.worker_pid(PID)
    ding.hold_next(after=0)  # the next answer's send never arrives, and the worker dies waiting
    ding.say("script:answer=second")
    assert wait_until(ding.held.is_set, 30), rt.log(PID)
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 2, 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert ding.texts() == ["first", "second"]  # the lost one once; the first, acked before the kill, not again


def test_a_user_dingtalk_does_not_know_fails_the_delivery_with_the_reason(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.say("script:answer=to nobody", staff="departed")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    delivery = OutboundDelivery.objects.get()
    assert "invalidStaffIdList" in delivery.last_error
    assert len(ding.sends()) == 1 and not ding.texts()  # permanent: not retried
    assert Plugin.objects.get().state == "running"


def test_a_bad_secret_disables_the_plugin_before_it_listens(tcast, ding, start_runtime, admin_client):
    ding.reset_secret()
    dingtalk_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith("the channel refused the worker: POST /v1.0/oauth2/accessToken: HTTP 400 "
                                             "invalidClientIdOrSecret")
    assert "DINGTALK_APP_SECRET" in plugin.disabled_reason
    wait_until(lambda: False, 1.5)
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 1  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert "webhook listening" not in rt.log(PID)
    assert "DINGTALK_APP_SECRET" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_secret_reset_while_running_is_the_plugins_state_and_it_stops_retrying(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.reset_secret()
    ding.expire_tokens()
    ding.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: POST /v1.0/oauth2/accessToken: HTTP 400 invalidClientIdOrSecret")
    calls = len(ding.calls)
    wait_until(lambda: False, 1.5)
    assert len(ding.calls) == calls and rt.worker_pid(PID) is None
    assert [(c.status, c.answer["code"]) for c in ding.sends()] == [(400, "InvalidAuthentication")]
    assert not ding.texts()
    # the answer is not lost: it waits, retryable, for the operator's new secret
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)


def test_a_host_left_out_of_the_apps_ip_whitelist_disables_the_plugin_with_the_fix(tcast, ding, start_runtime):
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.ip_allowed = False  # the operator set the app's IP whitelist without this host
    ding.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    reason = Plugin.objects.get().disabled_reason
    assert "HTTP 403 Forbidden.AccessDenied.IpNotInWhiteList" in reason and "IP whitelist" in reason
    assert [(c.status, c.answer["code"]) for c in ding.sends()] == [(403, "Forbidden.AccessDenied.IpNotInWhiteList")]
    # the answer is not dead-lettered: it waits, retryable, for the operator's fix
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)
    assert not ding.texts()


def test_a_message_sent_while_the_worker_is_down_is_taken_when_dingtalk_sends_it_again(tcast, ding, start_runtime):
    import httpx
    dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.say("script:answer=before")
    answered(ding, 1)
    # delivered, so the kill cannot land between the send and the journal's record of it (the one part a
    # crash may send twice: DingTalk has no idempotency key): this test is about the message coming in
    assert wait_until(delivered, 15), rt.log(PID)
    before, pid = ding.webhook_url, rt.worker_pid(PID)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: rt.worker_pid(PID) != pid, 15)
    message = ding.text("script:answer=after")
    try:  # the old port is gone (or, briefly, not yet): DingTalk got no answer
        status = ding.post(message).status_code
    except httpx.HTTPError:
        status = 0
    assert status != 200
    listening(rt, ding, after=before)  # the restarted worker listens on a new port (--bind :0)
    assert ding.post(message).status_code == 200
    assert answered(ding, 2, timeout=45) == ["before", "after"]
    assert Receipt.objects.filter(client_message_id=message["msgId"]).count() == 1


def session_plugin() -> Plugin:
    """A robot with no app credentials: only the secret that signs what DingTalk sends."""
    return make_plugin(PID, kind="channel-dingtalk", command="", args=["--bind", "127.0.0.1:0"],
                       env_refs=["DINGTALK_APP_SECRET", "DINGTALK_API_BASE_URL", "DINGTALK_OAPI_BASE_URL"],
                       heartbeat_secs=1.0)


def test_without_an_app_key_the_answer_goes_through_the_messages_session_webhook(tcast, ding, start_runtime):
    session_plugin()
    rt = start_runtime()
    listening(rt, ding)
    message = ding.say("script:answer=by the session webhook", group=True)
    assert answered(ding) == ["by the session webhook"]
    [send] = ding.sends()
    assert send.path == "/robot/sendBySession" and send.answer == {"errcode": 0, "errmsg": "ok"}
    assert message["sessionWebhook"].endswith(ding.sent[0]["to"])
    assert send.body == {"msgtype": "markdown", "markdown": {"title": "by the session webh…",  # 20 characters
                                                             "text": "by the session webhook"}}
    assert wait_until(delivered, 15), rt.log(PID)
    assert not ding.calls_to("/v1.0/oauth2/accessToken")  # no credentials, no token
    # a picture cannot be downloaded without a token: the agent is told so, and the message still runs
    code = ding.upload(b"\xff\xd8jpeg")
    assert ding.post(ding.message("picture", content={"downloadCode": code})).status_code == 200
    assert wait_until(lambda: Receipt.objects.count() == 2, 15), rt.log(PID)
    assert not ding.calls_to("/v1.0/robot/messageFiles/download") and not PluginMedia.objects.exists()


def test_without_an_app_key_a_captured_sign_cannot_carry_a_forged_session_webhook(tcast, ding, start_runtime):
    """The sign covers only the timestamp: a body forged under a captured (timestamp, sign), with a new msgId
    and its own sessionWebhook said to last until 2100, took over every later answer of the conversation."""
    session_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ts = str(int(time.time() * 1000))
    genuine = ding.text(" script:answer=first", group=True)
    assert ding.post(genuine, timestamp=ts).status_code == 200
    assert answered(ding) == ["first"]
    elsewhere = ding.text("x")["sessionWebhook"]  # a session of another chat, on DingTalk's own host
    forged = ding.text(" script:answer=leaked", group=True, sessionWebhook=elsewhere,
                       sessionWebhookExpiredTime=4102444800000)
    assert ding.post(forged, timestamp=ts).status_code == 401
    ding.say("script:answer=second", group=True)
    assert answered(ding, 2) == ["first", "second"]
    wait_until(lambda: False, 0.5)
    assert ding.texts() == ["first", "second"] and Receipt.objects.count() == 2
    assert [s["to"] for s in ding.sent] and not [s for s in ding.sent if elsewhere.endswith(s["to"])]


def test_without_an_app_key_an_answer_after_the_session_webhook_expired_is_dead_lettered(tcast, ding, start_runtime):
    session_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.session_ttl_ms = 5_000  # within the worker's margin of 10 s: expired for sending
    ding.say("script:answer=too late")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    delivery = OutboundDelivery.objects.get()
    assert "sessionWebhook" in delivery.last_error and "expired" in delivery.last_error
    assert "DINGTALK_APP_KEY" in delivery.last_error
    assert not ding.sends() and Plugin.objects.get().state == "running"


# ---------------------------------------------------------------------- Stream mode

def stream_plugin() -> Plugin:
    return dingtalk_plugin("--mode", "stream")


def streaming(rt, fake: FakeDingTalk, opened: int = 1) -> None:
    """Wait until the worker has opened its ``opened``-th stream connection and it is up."""
    assert wait_until(lambda: fake.sockets_opened >= opened and fake.sockets(), 30), rt.log(PID)


def stream_acked(fake: FakeDingTalk, message: dict) -> bool:
    """A frame carrying ``message`` was acknowledged by the worker (whether the fake counted it or not)."""
    with fake.lock:
        ids = [mid for p in fake.pushes if p.message["msgId"] == message["msgId"] for mid in p.frame_ids]
        return any((a.get("headers") or {}).get("messageId") in ids and a.get("code") == 200 for a in fake.acks)


def test_stream_a_message_in_over_the_stream_is_answered_and_acknowledged(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    message = ding.stream_say("script:answer=over the stream")
    assert answered(ding) == ["over the stream"]
    assert wait_until(ding.settled, 15), ding.acks
    [send] = ding.sends()
    assert send.path == "/v1.0/robot/oToMessages/batchSend" and send.body["userIds"] == [STAFF]
    [opened] = ding.opens
    assert (opened["clientId"], opened["clientSecret"]) == (ding.app_key, ding.app_secret)
    assert opened["subscriptions"] == [{"type": "CALLBACK", "topic": "/v1.0/im/bot/messages/get"}]
    [frame_id] = ding.pushes[0].frame_ids
    [ack] = [a for a in ding.acks if a["headers"]["messageId"] == frame_id]
    assert ack == {"code": 200, "headers": {"contentType": "application/json", "messageId": frame_id},
                   "message": "OK", "data": json.dumps({"response": None})}
    assert Receipt.objects.get().client_message_id == message["msgId"]
    assert "webhook listening" not in rt.log(PID)  # no address to expose in Stream mode
    assert Plugin.objects.get().state == "running"


def test_stream_a_ping_is_answered_with_its_data(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    [mid] = ding.ping()
    assert wait_until(lambda: "answer" in ding.pongs[mid], 15), rt.log(PID)
    pong = ding.pongs[mid]
    assert pong["answer"] == {"code": 200, "headers": {"contentType": "application/json", "messageId": mid},
                              "message": "OK", "data": pong["expected"]}
    assert ding.sockets_opened == 1  # the connection goes on


def test_stream_a_message_recorded_before_a_kill_is_answered_once_from_the_outbox_after_the_restart(
        tcast, ding, start_runtime):
    """DingTalk pushes a robot message once and never again, so only the worker's outbox can bring back one the
    worker had recorded (and acknowledged) when it was killed: here it dies while the message's picture is being
    downloaded, before the message reached the hub, and the restarted worker's replay answers it, once."""
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    first = rt.worker_pid(PID)
    code = ding.upload(b"\xff\xd8\xff\xe0" + os.urandom(64))
    ding.hold_downloads = True  # the download before the submit never answers: the worker dies waiting
    message = ding.message("richText", content={"richText": [{"text": "script:answer=only once"},
                                                               {"type": "picture", "downloadCode": code}]})
    ding.push(message)
    assert wait_until(ding.download_held.is_set, 30), rt.log(PID)
    assert stream_acked(ding, message)  # recorded (and acknowledged) before the submit began
    assert not Receipt.objects.exists() and not ding.sends()  # the hub has not seen it
    os.kill(first, signal.SIGKILL)
    ding.hold_downloads = False
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, first), 30), rt.log(PID)
    assert answered(ding, 1, timeout=45) == ["only once"]
    assert len(ding.pushes[0].frame_ids) == 1  # DingTalk never pushed it again: the outbox's replay answered
    ding.stream_say("script:answer=after")
    assert answered(ding, 2, timeout=30) == ["only once", "after"]
    wait_until(lambda: False, 1.0)
    assert ding.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id=message["msgId"]).count() == 1
    assert Receipt.objects.count() == 2 and PluginMedia.objects.count() == 1


def test_stream_a_disconnect_moves_to_a_new_connection_and_loses_nothing(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    before = ding.stream_say("script:answer=before the disconnect")
    assert answered(ding, 1) == ["before the disconnect"]
    ding.disconnect_grace = 300.0  # DingTalk does not close it in this test's time: the worker must move on
    assert ding.disconnect() == 1
    streaming(rt, ding, opened=2)
    later = ding.stream_say("script:answer=after the disconnect")
    assert answered(ding, 2) == ["before the disconnect", "after the disconnect"]
    assert wait_until(ding.settled, 15), ding.acks
    assert len(ding.opens) == 2  # a new ticket for the new connection
    assert wait_until(lambda: len(ding.sockets()) == 1, 10)  # the worker closed the old one
    with ding.lock:  # the disconnect got no answer: only the two messages were acknowledged
        assert sorted(a["headers"]["messageId"] for a in ding.acks) == sorted(
            mid for p in ding.pushes for mid in p.frame_ids)
    for m in (before, later):
        assert Receipt.objects.filter(client_message_id=m["msgId"]).count() == 1
    assert Turn.objects.count() == 2


def test_stream_a_dropped_socket_is_reopened(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    ding.stream_say("script:answer=before the drop")
    assert answered(ding, 1) == ["before the drop"]
    ding.drop_sockets()
    streaming(rt, ding, opened=2)
    ding.stream_say("script:answer=after the drop")
    assert answered(ding, 2) == ["before the drop", "after the drop"]
    assert Turn.objects.count() == 2
    assert Plugin.objects.get().state == "running"


def test_stream_the_same_msg_id_twice_runs_one_turn(tcast, ding, start_runtime):
    """DingTalk does not push a robot message twice; the fake's opt-in ``resend`` does (an acknowledgement lost,
    a socket dropped with the message in flight), to check that the worker's dedupe on ``msgId`` holds."""
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    ding.resend = True
    ding.lose_acks = True
    owed = ding.stream_say("script:answer=in flight at the drop")
    assert wait_until(lambda: stream_acked(ding, owed), 15), rt.log(PID)
    ding.lose_acks = False
    ding.drop_sockets()
    streaming(rt, ding, opened=2)
    assert wait_until(ding.settled, 30), rt.log(PID)  # pushed again on the new connection, and taken
    assert len(ding.pushes[0].frame_ids) >= 2
    assert answered(ding, 1) == ["in flight at the drop"]
    wait_until(lambda: False, 1.0)
    assert ding.texts() == ["in flight at the drop"]
    assert Turn.objects.count() == 1 and Receipt.objects.count() == 1


def test_stream_a_bad_secret_disables_the_plugin_before_it_listens(tcast, ding, start_runtime):
    ding.reset_secret()
    stream_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith("the channel refused the worker: POST /v1.0/gateway/connections/open: "
                                             "HTTP 401 authFailed: 鉴权失败"), plugin.disabled_reason
    assert "DINGTALK_APP_SECRET" in plugin.disabled_reason
    wait_until(lambda: False, 1.5)
    assert len(ding.calls_to("/v1.0/gateway/connections/open")) == 1  # no retry loop against a refusal
    assert rt.worker_pid(PID) is None and not ding.sockets_opened


def test_stream_a_secret_reset_while_running_disables_the_plugin_at_the_reconnect(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    ding.reset_secret()
    ding.drop_sockets()  # the next connection needs a ticket, which the reset secret no longer gets
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert "POST /v1.0/gateway/connections/open: HTTP 401 authFailed" in Plugin.objects.get().disabled_reason
    calls = len(ding.calls_to("/v1.0/gateway/connections/open"))
    wait_until(lambda: False, 1.5)
    assert len(ding.calls_to("/v1.0/gateway/connections/open")) == calls == 2
    assert rt.worker_pid(PID) is None
