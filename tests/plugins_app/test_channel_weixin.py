"""channel-weixin end to end: the real supervisor runs the worker against a fake WeChat official account
platform on loopback, in plaintext mode and in safe mode.

The fake (tests/fakes/weixin.py) speaks the official account API (stable_token, message/custom/send,
media/get, media/upload, errcodes in HTTP 200 bodies) and calls the worker's server URL as WeChat does,
signed and (safe mode) encrypted; the worker is the built-in kind with no command.
"""
from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from tests.fakes.weixin import USER, FakeWeixin
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "weixin-main"
ENV_REFS = ["WEIXIN_APP_ID", "WEIXIN_APP_SECRET", "WEIXIN_TOKEN", "WEIXIN_ENCODING_AES_KEY", "WEIXIN_API_BASE_URL"]
LISTENING = re.compile(r"callback listening on (http://\S+)")


def fake_platform(monkeypatch, safe: bool) -> FakeWeixin:
    fake = FakeWeixin(safe=safe).start()
    monkeypatch.delenv("WEIXIN_ENCODING_AES_KEY", raising=False)
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    return fake


@pytest.fixture(params=["plaintext", "safe"])
def weixin(request, monkeypatch):
    fake = fake_platform(monkeypatch, request.param == "safe")
    yield fake
    fake.stop()


@pytest.fixture
def weixin_safe(monkeypatch):
    fake = fake_platform(monkeypatch, True)
    yield fake
    fake.stop()


def weixin_plugin(*args: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second worker
    return make_plugin(PID, kind="channel-weixin", command="", args=["--bind", "127.0.0.1:0", *args],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def listening(rt, fake: FakeWeixin, *, after: str | None = None) -> None:
    """Wait until the worker's server URL is up, and point the fake at it."""
    def url():
        found = LISTENING.findall(rt.log(PID))
        return found[-1] if found and found[-1] != after else None
    fake.callback_url = wait_until(url, 30) or pytest.fail(rt.log(PID))


def answered(fake: FakeWeixin, n: int = 1, timeout: float = 30) -> list[str]:
    assert wait_until(lambda: len(fake.texts()) >= n, timeout), fake.sends()
    return fake.texts()


def delivered() -> bool:
    return OutboundDelivery.objects.filter(state="delivered").exists()


def started(start_runtime, fake: FakeWeixin, *args: str):
    weixin_plugin(*args)
    rt = start_runtime()
    listening(rt, fake)
    return rt


def test_the_url_check_and_a_message_in_gets_the_agents_answer_sent(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    check = weixin.verify_url(echo="5927782489442352469")
    assert (check.status_code, check.text) == (200, "5927782489442352469")
    forged = weixin.verify_url(signature="0" * 40)
    assert (forged.status_code, forged.text) == (403, "")
    message = weixin.say("script:answer=hello from the agent")
    assert answered(weixin) == ["hello from the agent"]
    [send] = weixin.sends()
    assert send.body == {"touser": USER, "msgtype": "text", "text": {"content": "hello from the agent"}}
    assert wait_until(delivered, 15), rt.log(PID)
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    # the MsgId is the idempotency key; the user's OpenID is the conversation
    assert delivery.turn.receipt.client_message_id == message["MsgId"]
    assert (delivery.conversation.channel, delivery.conversation.external_id) == ("weixin", USER)
    assert Receipt.objects.select_related("actor").get().actor.key == f"weixin:{USER}"
    assert len(weixin.calls_to("/cgi-bin/stable_token")) == 1  # the token is kept, not fetched per call
    assert ("safe mode" if weixin.safe else "plaintext mode") in rt.log(PID)
    assert Plugin.objects.get().state == "running"


def test_a_long_chinese_answer_is_split_at_2048_bytes(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    answer = "公众号的客服消息按字节计算长度。" * 180   # 2,880 characters, 8,640 bytes
    weixin.say("script:answer=" + answer)
    assert wait_until(delivered, 30), rt.log(PID)
    texts = weixin.texts()
    assert len(texts) == 5 and all(len(t.encode()) <= 2048 for t in texts) and "".join(texts) == answer
    assert {c.errcode for c in weixin.sends()} == {0}


def test_an_answer_past_five_messages_is_cut_saying_so_not_refused_with_45047(tcast, weixin_safe, start_runtime):
    rt = started(start_runtime, weixin_safe)
    weixin_safe.say("script:answer=" + "长" * 4000)   # 12,000 bytes: six messages' worth
    assert wait_until(delivered, 30), rt.log(PID)
    texts = weixin_safe.texts()
    assert len(texts) == 5 and all(len(t.encode()) <= 2048 for t in texts)
    assert texts[-1].endswith("WeChat lets an account send 5 messages for one message of yours]")
    assert {c.errcode for c in weixin_safe.sends()} == {0}


def test_the_same_post_delivered_again_runs_one_turn(tcast, weixin, start_runtime):
    started(start_runtime, weixin)
    message = weixin.say("script:answer=only once")
    answered(weixin, 1)
    for _ in range(3):  # WeChat calls again a POST it had no answer for within 5 s, up to three times
        again = weixin.resend(message)
        assert (again.status_code, again.text) == (200, "success")
    weixin.say("script:answer=after")  # handled after the repeats (one queue, in order)
    answered(weixin, 2)
    wait_until(lambda: False, 0.5)
    assert weixin.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id=message["MsgId"]).count() == 1
    assert Receipt.objects.count() == 2


def test_bad_signatures_are_refused_and_change_nothing_and_events_run_nothing(tcast, weixin, start_runtime):
    started(start_runtime, weixin)
    assert weixin.post(weixin.event("subscribe")).text == "success"
    forged = weixin.post(weixin.text("script:answer=no"), signature="0" * 40)
    assert (forged.status_code, forged.text) == (403, "")
    stale = weixin.post(weixin.text("script:answer=no"), timestamp="1410685589")  # a replay from 2014
    assert (stale.status_code, stale.text) == (403, "")
    if weixin.safe:  # a forged msg_signature, and a plaintext POST to a worker in safe mode
        assert weixin.post(weixin.text("script:answer=no"), msg_signature="0" * 40).status_code == 403
        assert weixin.post(weixin.text("script:answer=no"), safe=False).status_code == 403
    else:  # a signature seen once, sent again with another body
        url, _ = weixin.request(weixin.text("script:answer=first"))
        _, other = weixin.request(weixin.text("script:answer=forged"))
        assert weixin.send_request(url, weixin.request(weixin.text("script:answer=x"))[1]).status_code == 200
        assert weixin.send_request(url, other).status_code == 403
        # a URL check's query, read from an access log, signs no POST
        import httpx
        checked, forged_body = weixin.request(weixin.text("script:answer=from the log"))
        assert httpx.get(checked + "&echostr=1", timeout=5.0).text == "1"
        assert weixin.send_request(checked, forged_body).status_code == 403
    weixin.say("script:answer=the message")
    assert wait_until(lambda: "the message" in weixin.texts(), 30)
    wait_until(lambda: False, 0.5)
    assert "no" not in weixin.texts() and "forged" not in weixin.texts() and "from the log" not in weixin.texts()
    assert Receipt.objects.count() == (1 if weixin.safe else 2)


def test_an_image_in_is_downloaded_with_media_get_and_stored_on_the_host(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    photo = b"\xff\xd8\xff\xe0" + os.urandom(64)
    media_id = weixin.upload(photo, "image/jpeg", "photo.jpg")
    message = weixin.message("image", PicUrl="http://mmbiz.qpic.cn/mmbiz_jpg/photo/0", MediaId=media_id)
    assert weixin.post(message).text == "success"
    assert wait_until(lambda: PluginMedia.objects.exists(), 20), rt.log(PID)
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type) == (photo, "image/jpeg")
    [fetch] = weixin.calls_to("/cgi-bin/media/get")
    assert fetch.params["media_id"] == media_id and fetch.params["access_token"] in weixin.tokens


def test_a_voice_message_with_recognition_is_its_text_and_its_audio(tcast, weixin_safe, start_runtime):
    rt = started(start_runtime, weixin_safe)
    voice = b"#!AMR\n" + os.urandom(64)
    media_id = weixin_safe.upload(voice, "audio/amr", "voice.amr")
    message = weixin_safe.message("voice", MediaId=media_id, Format="amr",
                                  Recognition="script:answer=heard you")
    assert weixin_safe.post(message).text == "success"
    assert answered(weixin_safe) == ["heard you"]
    assert wait_until(lambda: PluginMedia.objects.exists(), 20), rt.log(PID)
    assert (bytes(PluginMedia.objects.get().data), PluginMedia.objects.get().content_type) == (voice, "audio/amr")


def test_busy_and_5xx_make_the_send_wait_and_then_succeed(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    weixin.script_send(-1, 0, 45009)   # system busy, HTTP 502, the call quota
    weixin.say("script:answer=patience")
    assert answered(weixin) == ["patience"]
    busy, bad_gateway, quota, sent = weixin.sends()
    assert (busy.errcode, bad_gateway.errcode, quota.errcode, sent.errcode) == (-1, 502, 45009, 0)
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host


def test_an_expired_token_is_fetched_again_and_the_message_sent_once(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    weixin.expire_tokens()
    weixin.say("script:answer=fresh token")
    assert answered(weixin) == ["fresh token"]
    expired, sent = weixin.sends()
    assert (expired.errcode, sent.errcode) == (42001, 0)
    assert expired.params["access_token"] != sent.params["access_token"]
    assert len(weixin.calls_to("/cgi-bin/stable_token")) == 2
    assert wait_until(delivered, 15), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert weixin.texts() == ["fresh token"] and OutboundDelivery.objects.get().attempt == 1


def test_a_worker_killed_between_two_parts_sends_only_the_rest_after_the_restart(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    answer = "第一部分。" * 120 + "\n\n" + "第二部分。" * 120 + "\n\n" + "第三部分。" * 120  # three messages
    weixin.hold_before(2)  # the first part went out; the second waits, not delivered
    weixin.say("script:answer=" + answer)
    assert wait_until(lambda: weixin.held(2), 30), rt.log(PID)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    weixin.release(2, deliver=False)  # its sender is gone: WeChat never took it
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert weixin.texts() == answer.split("\n\n")  # the first part once, the rest once


def test_a_worker_killed_with_a_part_in_flight_sends_no_part_wechat_answered_again(tcast, weixin_safe,
                                                                                   start_runtime):
    """WeChat has no idempotency key: the one part in flight when the worker died (WeChat took it, the worker
    never heard so) is the window left, and goes out a second time. Every part WeChat answered is journaled
    and not sent again; nothing is lost."""
    rt = started(start_runtime, weixin_safe)
    answer = "上半部分。" * 120 + "\n\n" + "下半部分。" * 120  # two messages
    weixin_safe.hold_before(2)
    weixin_safe.say("script:answer=" + answer)
    assert wait_until(lambda: weixin_safe.held(2), 30), rt.log(PID)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    weixin_safe.release(2, deliver=True)  # WeChat took it after all; its answer reached nobody
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    one, two = answer.split("\n\n")
    assert weixin_safe.texts() == [one, two, two]


def test_a_delivered_answer_is_not_sent_again_by_a_worker_killed_after_it(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    weixin.say("script:answer=" + "第一部分。" * 120 + "\n\n" + "第二部分。" * 120)
    assert wait_until(lambda: len(weixin.texts()) == 2 and delivered(), 30), rt.log(PID)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    listening(rt, weixin, after=weixin.callback_url)
    weixin.say("script:answer=next")
    assert answered(weixin, 3) == ["第一部分。" * 120, "第二部分。" * 120, "next"]
    wait_until(lambda: False, 0.5)
    assert len(weixin.sends()) == 3


def test_a_closed_48_hour_window_dead_letters_the_delivery_with_the_reason(tcast, weixin, start_runtime):
    rt = started(start_runtime, weixin)
    message = weixin.text("script:answer=too late")
    weixin.last_message[USER] = -1e9
    url, body = weixin.request(message)  # posted without reopening the fake's window
    assert weixin.send_request(url, body).text == "success"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    delivery = OutboundDelivery.objects.get()
    assert "errcode 45015" in delivery.last_error and "48 hours" in delivery.last_error
    assert len(weixin.sends()) == 1 and not weixin.texts()  # permanent: not retried
    assert Plugin.objects.get().state == "running"


def test_a_bad_secret_disables_the_plugin_before_it_listens(tcast, weixin, start_runtime, admin_client):
    weixin.reset_secret()
    weixin_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith("the channel refused the worker: stable_token: errcode 40125: "
                                             "invalid appsecret")
    assert "the AppSecret (WEIXIN_APP_SECRET) is not valid" in plugin.disabled_reason
    wait_until(lambda: False, 1.5)
    assert len(weixin.calls_to("/cgi-bin/stable_token")) == 1  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert "callback listening" not in rt.log(PID)
    assert "WEIXIN_APP_SECRET) is not valid" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_an_ip_not_whitelisted_while_running_disables_the_plugin_and_the_answer_waits(tcast, weixin_safe,
                                                                                      start_runtime):
    rt = started(start_runtime, weixin_safe)
    weixin_safe.ip_blocked = True
    weixin_safe.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    reason = Plugin.objects.get().disabled_reason
    assert "errcode 40164" in reason and "IP whitelist" in reason
    calls = len(weixin_safe.calls)
    wait_until(lambda: False, 1.5)
    assert len(weixin_safe.calls) == calls and rt.worker_pid(PID) is None
    assert [c.errcode for c in weixin_safe.sends()] == [40164] and not weixin_safe.texts()
    # the answer is not lost: it waits, retryable, for the operator's fix
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)


def test_a_post_sent_while_the_worker_is_down_is_taken_when_wechat_calls_again(tcast, weixin, start_runtime):
    import httpx
    rt = started(start_runtime, weixin)
    weixin.say("script:answer=before")
    answered(weixin, 1)
    # settled before the kill: a kill between WeChat taking the send and the journal is the one window left
    assert wait_until(delivered, 15), rt.log(PID)
    before, pid = weixin.callback_url, rt.worker_pid(PID)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: rt.worker_pid(PID) != pid, 15)
    message = weixin.text("script:answer=after")
    try:  # the old port is gone (or, briefly, not yet): WeChat got no answer
        status = weixin.post(message).status_code
    except httpx.HTTPError:
        status = 0
    assert status != 200
    listening(rt, weixin, after=before)  # the restarted worker listens on a new port (--bind :0)
    assert weixin.post(message).text == "success"
    assert answered(weixin, 2, timeout=45) == ["before", "after"]
    assert Receipt.objects.filter(client_message_id=message["MsgId"]).count() == 1
