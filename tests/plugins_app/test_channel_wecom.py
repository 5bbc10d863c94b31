"""channel-wecom end to end: the real supervisor runs the worker against a fake WeCom on loopback.

The fake (tests/fakes/wecom.py) speaks WeCom's server API (gettoken, message/send, media/get, errcodes in
HTTP 200 bodies) and calls the worker's callback URL as WeCom does, encrypted and signed; the worker is the
built-in kind with no command.
"""
from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from tests.fakes.wecom import AGENT_ID, USER, FakeWeCom
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "wecom-main"
ENV_REFS = ["WECOM_CORP_ID", "WECOM_AGENT_ID", "WECOM_SECRET", "WECOM_TOKEN", "WECOM_ENCODING_AES_KEY",
            "WECOM_API_BASE_URL"]
LISTENING = re.compile(r"callback listening on (http://\S+)")


@pytest.fixture
def wecom(monkeypatch):
    fake = FakeWeCom().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def wecom_plugin(*args: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second worker
    return make_plugin(PID, kind="channel-wecom", command="", args=["--bind", "127.0.0.1:0", *args],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def listening(rt, fake: FakeWeCom, *, after: str | None = None) -> None:
    """Wait until the worker's callback is up, and point the fake at it."""
    def url():
        found = LISTENING.findall(rt.log(PID))
        return found[-1] if found and found[-1] != after else None
    fake.callback_url = wait_until(url, 30) or pytest.fail(rt.log(PID))


def answered(fake: FakeWeCom, n: int = 1, timeout: float = 30) -> list[str]:
    assert wait_until(lambda: len(fake.texts()) >= n, timeout), fake.sends()
    return fake.texts()


def delivered() -> bool:
    return OutboundDelivery.objects.filter(state="delivered").exists()


def test_the_url_check_and_a_message_in_gets_the_agents_answer_sent(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    check = wecom.verify_url(echo="5927782489442352469")
    assert (check.status_code, check.text) == (200, "5927782489442352469")
    forged = wecom.verify_url(signature="0" * 40)
    assert (forged.status_code, forged.text) == (403, "")
    message = wecom.say("script:answer=hello from the agent")
    assert answered(wecom) == ["hello from the agent"]
    [send] = wecom.sends()
    assert send.body == {"touser": USER, "msgtype": "text", "agentid": int(AGENT_ID),
                         "text": {"content": "hello from the agent"}, "enable_duplicate_check": 1,
                         "duplicate_check_interval": 1800}
    assert wait_until(delivered, 15), rt.log(PID)
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    # the MsgId is the idempotency key; the user is the conversation
    assert delivery.turn.receipt.client_message_id == message["MsgId"]
    assert (delivery.conversation.channel, delivery.conversation.external_id) == ("wecom", USER)
    assert delivery.channel_message_id == wecom.sent[0]["msgid"]
    assert Receipt.objects.select_related("actor").get().actor.key == f"wecom:{USER}"
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 1  # the token is kept, not fetched per call
    assert Plugin.objects.get().state == "running"


def test_a_long_chinese_answer_is_split_at_2048_bytes(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    answer = "企业微信的消息按字节计算长度。" * 200   # 3,000 characters, 9,000 bytes
    wecom.say("script:answer=" + answer)
    assert wait_until(delivered, 30), rt.log(PID)
    texts = wecom.texts()
    assert len(texts) == 5 and all(len(t.encode()) <= 2048 for t in texts) and "".join(texts) == answer
    assert {c.errcode for c in wecom.sends()} == {0}


def test_the_same_callback_delivered_again_runs_one_turn(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    message = wecom.say("script:answer=only once")
    answered(wecom, 1)
    for _ in range(3):  # WeCom calls again a callback it had no answer for, up to three times
        again = wecom.resend(message)
        assert (again.status_code, again.text) == (200, "")
    wecom.say("script:answer=after")  # handled after the repeats (one queue, in order)
    answered(wecom, 2)
    wait_until(lambda: False, 0.5)
    assert wecom.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id=message["MsgId"]).count() == 1
    assert Receipt.objects.count() == 2


def test_events_are_answered_and_run_nothing(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    assert (wecom.post(wecom.event("enter_agent")).status_code) == 200
    forged = wecom.post(wecom.text("script:answer=no"), signature="0" * 40)
    assert (forged.status_code, forged.text) == (403, "")
    wecom.say("script:answer=the message")
    assert answered(wecom) == ["the message"]
    assert Receipt.objects.count() == 1


def test_an_image_in_is_downloaded_with_media_get_and_stored_on_the_host(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    photo = b"\xff\xd8\xff\xe0" + os.urandom(64)
    media_id = wecom.upload(photo, "image/jpeg", "photo.jpg")
    message = wecom.message("image", PicUrl="https://wework.qpic.cn/photo", MediaId=media_id)
    assert wecom.post(message).status_code == 200
    assert wait_until(lambda: PluginMedia.objects.exists(), 20), rt.log(PID)
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type) == (photo, "image/jpeg")
    [fetch] = wecom.calls_to("/cgi-bin/media/get")
    assert fetch.params["media_id"] == media_id and fetch.params["access_token"] in wecom.tokens


def test_a_45009_makes_the_send_wait_and_then_succeed(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.script_send(45009, 45009)
    wecom.say("script:answer=patience")
    assert answered(wecom) == ["patience"]
    limited1, limited2, sent = wecom.sends()
    assert (limited1.errcode, limited2.errcode, sent.errcode) == (45009, 45009, 0)
    assert limited1.answer["errmsg"] == "api freq out of limit"
    assert limited2.at - limited1.at >= 0.9 and sent.at - limited2.at >= 1.9  # 1 s, then 2 s
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host


def test_an_expired_token_is_fetched_again_and_the_message_sent_once(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.expire_tokens()
    wecom.say("script:answer=fresh token")
    assert answered(wecom) == ["fresh token"]
    expired, sent = wecom.sends()
    assert (expired.errcode, sent.errcode) == (42001, 0)
    assert expired.params["access_token"] != sent.params["access_token"]
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 2
    assert wait_until(delivered, 15), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert wecom.texts() == ["fresh token"] and OutboundDelivery.objects.get().attempt == 1


def test_a_worker_killed_after_the_send_left_answers_exactly_once_after_the_restart(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.hold_send_secs = 30  # WeCom delivered the message, the worker has no answer yet: the crash window
    wecom.say("script:answer=exactly once")
    answered(wecom, 1)
    first = rt.worker_pid(PID)
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    wecom.hold_send_secs = 0
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 30), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert wecom.texts() == ["exactly once"]
    first_send, again = wecom.sends()
    # the restarted worker sent again, the same content to the same user: WeCom's duplicate check held it
    assert first_send.body == again.body and again.body["enable_duplicate_check"] == 1
    assert again.errcode == 0 and again.answer["msgid"] == wecom.sent[0]["msgid"]
    assert OutboundDelivery.objects.get().channel_message_id == wecom.sent[0]["msgid"]


def test_a_user_outside_the_apps_visible_range_fails_the_delivery_with_the_reason(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say("script:answer=to nobody", user="Departed")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    delivery = OutboundDelivery.objects.get()
    assert "errcode 81013" in delivery.last_error and "visible range" in delivery.last_error
    assert len(wecom.sends()) == 1 and not wecom.texts()  # permanent: not retried
    assert Plugin.objects.get().state == "running"


def test_a_bad_secret_disables_the_plugin_before_it_listens(tcast, wecom, start_runtime, admin_client):
    wecom.reset_secret()
    wecom_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith("the channel refused the worker: gettoken: errcode 40001: invalid "
                                             "credential")
    assert plugin.disabled_reason.endswith("the app's secret (WECOM_SECRET) is wrong, or was reset in the admin "
                                           "console")
    wait_until(lambda: False, 1.5)
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 1  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert "callback listening" not in rt.log(PID)
    assert "WECOM_SECRET) is wrong" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_secret_reset_while_running_is_the_plugins_state_and_it_stops_retrying(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.reset_secret()
    wecom.expire_tokens()
    wecom.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: gettoken: errcode 40001")
    calls = len(wecom.calls)
    wait_until(lambda: False, 1.5)
    assert len(wecom.calls) == calls and rt.worker_pid(PID) is None
    assert [c.errcode for c in wecom.sends()] == [42001] and not wecom.texts()
    # the answer is not lost: it waits, retryable, for the operator's new secret
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)


def test_a_callback_sent_while_the_worker_is_down_is_taken_when_wecom_calls_again(tcast, wecom, start_runtime):
    import httpx
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say("script:answer=before")
    answered(wecom, 1)
    before, pid = wecom.callback_url, rt.worker_pid(PID)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: rt.worker_pid(PID) != pid, 15)
    message = wecom.text("script:answer=after")
    try:  # the old port is gone (or, briefly, not yet): WeCom got no answer
        status = wecom.post(message).status_code
    except httpx.HTTPError:
        status = 0
    assert status != 200
    listening(rt, wecom, after=before)  # the restarted worker listens on a new port (--bind :0)
    assert wecom.resend(message).status_code == 200
    assert answered(wecom, 2, timeout=45) == ["before", "after"]
    assert Receipt.objects.filter(client_message_id=message["MsgId"]).count() == 1


def test_a_mistyped_agent_id_is_the_plugins_state_not_messages_dropped_in_silence(tcast, wecom, start_runtime,
                                                                                   monkeypatch):
    """Only the app's own Token and EncodingAESKey verify its callbacks, so a verified callback naming another
    agent means WECOM_AGENT_ID is wrong: every message would have been skipped with a debug line."""
    monkeypatch.setenv("WECOM_AGENT_ID", str(int(AGENT_ID) + 18))
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say("hello")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    reason = Plugin.objects.get().disabled_reason
    assert f"a callback for agent {AGENT_ID} arrived, but WECOM_AGENT_ID is {int(AGENT_ID) + 18}" in reason


def test_an_agent_id_that_is_no_number_is_refused_at_start(tcast, wecom, start_runtime, monkeypatch):
    monkeypatch.setenv("WECOM_AGENT_ID", "my-app")
    wecom_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert "WECOM_AGENT_ID must be the app's AgentId, a number (it is 'my-app')" in Plugin.objects.get().disabled_reason
