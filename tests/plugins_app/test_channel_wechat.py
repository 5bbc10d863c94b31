"""channel-wechat end to end: the real supervisor starts the worker against a fake OneBot 12 bridge on loopback."""
from __future__ import annotations

import os
import signal

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from tests.fakes.wechat import FakeBridge
from tests.plugins_app.conftest import enqueue_with_files, wait_until

ALICE = "wxid_alice"
GROUP = "34567890123@chatroom"


@pytest.fixture
def bridge(monkeypatch):
    """``bridge(**options)``: a fake bridge started, the worker's environment pointing at it; stopped after."""
    made = []

    def start(**options) -> FakeBridge:
        fake = FakeBridge(**options).start()
        made.append(fake)
        monkeypatch.setenv("WECHAT_ONEBOT_URL", fake.url)
        monkeypatch.setenv("WECHAT_ONEBOT_ACCESS_TOKEN", fake.access_token)
        return fake
    yield start
    for fake in made:
        fake.stop()


@pytest.fixture
def fake(bridge):
    return bridge()


def make_wechat(**over):
    fields = dict(plugin_id="wechat-main", kind="channel-wechat", command="", args=[],
                  env_refs=["WECHAT_ONEBOT_URL", "WECHAT_ONEBOT_ACCESS_TOKEN"], max_in_flight=8, max_retries=2,
                  heartbeat_secs=0.5)
    fields.update(over)
    return Plugin.objects.create(**fields)


def running(fake, start_runtime):
    """The plugin made, the supervisor started, and the worker connected to ``fake``: the runtime."""
    make_wechat()
    rt = start_runtime()
    ready(fake, rt)
    return rt


def ready(fake, rt, n=1):
    """The worker holds its n-th connection to the bridge."""
    assert wait_until(lambda: fake.connected() and len([c for c in fake.connections if c["accepted"]]) >= n, 20), \
        rt.log("wechat-main")


def test_a_private_message_is_answered_with_send_message_quoting_it(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    assert fake.connections[0]["authorization"] == f"Bearer {fake.access_token}"
    question = fake.push_private(ALICE, "script:answer=hello from the agent")
    assert wait_until(lambda: fake.sent(), 20), rt.log("wechat-main")
    sent = fake.sent()[0]
    assert (sent["detail_type"], sent["user_id"]) == ("private", ALICE)
    assert sent["message"] == [{"type": "reply", "data": {"message_id": question["message_id"]}},
                               {"type": "text", "data": {"text": "hello from the agent"}}]
    receipt = Receipt.objects.select_related("conversation").get()
    assert receipt.client_message_id == question["message_id"]
    assert receipt.conversation.external_id == ALICE
    assert receipt.actor.key == f"wechat:{ALICE}"
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 10), rt.log("wechat-main")
    assert OutboundDelivery.objects.get().channel_message_id == sent["message_id"]


def test_comwechat_gets_no_reply_segment_it_cannot_send(tcast, bridge, start_runtime):
    fake = bridge(impl="ComWechat", refuse_status=403)
    rt = running(fake, start_runtime)
    fake.push_private(ALICE, "script:answer=plain")
    assert wait_until(lambda: fake.sent(), 20), rt.log("wechat-main")
    assert fake.sent()[0]["message"] == [{"type": "text", "data": {"text": "plain"}}]


def test_a_group_message_is_answered_only_when_it_mentions_the_account(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.push_group(GROUP, ALICE, [fake.text("script:answer=not for me")])
    fake.push_group(GROUP, ALICE, [fake.mention("wxid_carol"), fake.text(" script:answer=nor this")])
    asked = fake.push_group(GROUP, ALICE, [fake.mention(fake.self_id), fake.text(" script:answer=in the group")])
    assert wait_until(lambda: fake.sent(), 20), rt.log("wechat-main")
    sent = fake.sent()[0]
    assert (sent["detail_type"], sent["group_id"]) == ("group", GROUP)
    assert sent["message"][0] == {"type": "reply", "data": {"message_id": asked["message_id"]}}
    assert fake.texts() == ["in the group"]
    receipt = Receipt.objects.select_related("conversation").get()
    assert receipt.client_message_id == asked["message_id"]
    assert receipt.conversation.external_id == f"group:{GROUP}"
    assert Turn.objects.count() == 1


def test_the_accounts_own_messages_are_not_submitted(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.push_private(fake.self_id, "script:answer=loop")  # sent from the account's phone
    fake.push_group(GROUP, fake.self_id, [fake.mention(fake.self_id), fake.text("script:answer=loop too")])
    fake.push_private(ALICE, "script:answer=human")
    assert wait_until(lambda: fake.texts() == ["human"], 20), rt.log("wechat-main")
    assert Receipt.objects.count() == 1


def test_the_same_message_pushed_twice_runs_one_turn(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    event = fake.push_private(ALICE, "script:answer=once")
    assert wait_until(lambda: fake.texts() == ["once"], 20), rt.log("wechat-main")
    fake.push(event)  # the same message_id, a new event id
    fake.push_private(ALICE, "script:answer=after")  # a later message shows the repeat was read
    assert wait_until(lambda: fake.texts() == ["once", "after"], 20), rt.log("wechat-main")
    assert Turn.objects.count() == 2


def test_a_wrong_access_token_disables_the_plugin_with_the_reason_and_is_not_retried(
        tcast, fake, start_runtime, monkeypatch, admin_client):
    monkeypatch.setenv("WECHAT_ONEBOT_ACCESS_TOKEN", "not-the-token")
    make_wechat()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 20), rt.log("wechat-main")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == (
        "the channel refused the worker: the OneBot bridge refused the access token (WECHAT_ONEBOT_ACCESS_TOKEN): "
        "HTTP 401 Authorization Header is invalid")
    wait_until(lambda: False, 1.5)
    assert len(fake.connections) == 1 and not fake.connections[0]["accepted"]  # not retried
    assert "refused the access token" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_dropped_socket_is_reconnected_and_the_worker_goes_on(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.push_private(ALICE, "script:answer=one")
    assert wait_until(lambda: fake.texts() == ["one"], 20), rt.log("wechat-main")
    fake.drop()
    ready(fake, rt, 2)
    fake.push_private(ALICE, "script:answer=two")
    assert wait_until(lambda: fake.texts() == ["one", "two"], 20), rt.log("wechat-main")
    assert Receipt.objects.count() == 2


def test_an_image_is_fetched_with_get_file_and_stored_on_the_host(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    png = b"\x89PNG\r\n\x1a\nfake-image"
    image = fake.file("image", "cat.png", png)
    fake.fail_next("get_file", 33000, "download failed")  # not now: the message waits and the file comes
    fake.push_private(ALICE, [image, fake.text("script:answer=got it")])
    assert wait_until(lambda: fake.texts() == ["got it"], 30), rt.log("wechat-main")
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type) == (png, "image/png")  # the type the file's name says
    calls = fake.calls("get_file")
    assert len(calls) == 2 and calls[-1]["params"] == {"file_id": image["data"]["file_id"], "type": "url"}
    assert fake.downloads == ["/get_file/" + image["data"]["file_id"]]


def test_comwechat_media_comes_by_its_file_url_and_never_in_the_answer(tcast, bridge, start_runtime):
    """ComWeChatBotClient cannot put a binary file in a JSON answer (asked for one, it closes the connection):
    the worker asks for a URL, downloads it, and the link stays up."""
    fake = bridge(impl="ComWechat", refuse_status=403, url_host="0.0.0.0")
    rt = running(fake, start_runtime)
    voice = fake.file("image", "msg.amr", b"#!AMR\n" + bytes(range(256)))  # its voice notes come as "image"
    fake.push_private(ALICE, [voice, fake.text("script:answer=heard")])
    assert wait_until(lambda: fake.texts() == ["heard"], 30), rt.log("wechat-main")
    media = PluginMedia.objects.get()
    assert bytes(media.data) == b"#!AMR\n" + bytes(range(256)) and media.content_type == "audio/amr"
    assert [c["params"]["type"] for c in fake.calls("get_file")] == ["url"]
    assert len([c for c in fake.connections if c["accepted"]]) == 1  # never dropped
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 1, 10)
    assert OutboundDelivery.objects.get().channel_message_id in (None, "")  # it names no message id


def test_a_bridge_without_file_urls_gives_the_bytes_in_its_answer(tcast, bridge, start_runtime):
    fake = bridge(serve_urls=False)
    rt = running(fake, start_runtime)
    image = fake.file("image", "cat.png", b"\x89PNG\r\n\x1a\nfake")
    fake.push_private(ALICE, [image, fake.text("script:answer=seen")])
    assert wait_until(lambda: fake.texts() == ["seen"], 30), rt.log("wechat-main")
    assert bytes(PluginMedia.objects.get().data) == b"\x89PNG\r\n\x1a\nfake"
    assert [c["params"]["type"] for c in fake.calls("get_file")] == ["url", "data"]


def test_a_send_whose_answer_is_lost_with_the_socket_is_not_lost(tcast, fake, start_runtime):
    """The bridge carried the send out and the connection dropped before its answer: the worker cannot know it
    was sent (OneBot has no idempotency key), so the hub's retry sends that part again once the link is back:
    the journal's one window, as for an answer that never came (docs/channels/wechat.md)."""
    rt = running(fake, start_runtime)
    fake.drop_after_next("send_message")
    fake.push_private(ALICE, "script:answer=said once or twice")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 30), rt.log("wechat-main")
    delivery = OutboundDelivery.objects.get()
    assert delivery.attempt == 2  # the hub's retry, not a resend in place on the next connection
    assert fake.texts() == ["said once or twice", "said once or twice"]
    assert len([c for c in fake.connections if c["accepted"]]) == 2


def test_a_file_the_bridge_cannot_give_leaves_a_note(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.push_private(ALICE, [{"type": "file", "data": {"file_id": "gone"}}, fake.text("what is this")])
    assert wait_until(lambda: Receipt.objects.exists(), 20), rt.log("wechat-main")
    assert not PluginMedia.objects.exists()
    assert wait_until(lambda: fake.sent(), 20), rt.log("wechat-main")
    assert "could not be fetched from the channel: the bridge answered get_file: retcode 32000" in fake.texts()[0]


def test_a_long_answer_is_split_into_several_messages(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    words = " ".join(f"word{i}" for i in range(900))  # about 7,000 characters
    fake.push_private(ALICE, f"script:answer={words}")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 20), rt.log("wechat-main")
    parts = fake.texts()
    assert len(parts) >= 4 and all(len(p) <= 2000 for p in parts)
    assert " ".join(parts).split() == words.split()
    assert [m["message"][0]["type"] for m in fake.sent()] == ["reply"] + ["text"] * (len(parts) - 1)


def test_a_passing_failure_is_retried_and_only_the_missing_parts_go_again(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    words = " ".join(f"w{i}" for i in range(700))  # three parts
    fake.push_private(ALICE, "script:answer=warm up")
    assert wait_until(lambda: fake.texts() == ["warm up"], 20), rt.log("wechat-main")
    sends_before = len(fake.calls("send_message"))
    # the second part fails once with "I am tired": the hub retries the delivery, the first part is not sent again
    original = fake._send_message
    count = {"n": 0}

    def second_fails(params):
        count["n"] += 1
        if count["n"] == 2:
            return fake._failed(36000, "tired")
        return original(params)
    fake._send_message = second_fails
    fake.push_private(ALICE, f"script:answer={words}")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 2, 30), \
        rt.log("wechat-main")
    delivery = OutboundDelivery.objects.order_by("-id").first()
    assert delivery.attempt == 2
    texts = fake.texts()[1:]
    assert " ".join(texts).split() == words.split()  # each part once
    assert len(fake.calls("send_message")) - sends_before == len(texts) + 1  # the failed one too


def test_a_send_the_platform_refuses_is_dead_lettered_at_once(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.fail_next("send_message", 34002, "the account is muted in this group")
    fake.push_private(ALICE, "script:answer=muted")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 20), \
        rt.log("wechat-main")
    assert OutboundDelivery.objects.get().last_error == \
        "permanent failure: wechat: send_message failed: retcode 34002: the account is muted in this group"
    assert len(fake.calls("send_message")) == 1  # not retried
    assert Plugin.objects.get().enabled


def test_a_bridge_of_several_accounts_disables_the_plugin(tcast, fake, start_runtime):
    rt = running(fake, start_runtime)
    fake.fail_next("send_message", 10101, "who am i")
    fake.push_private(ALICE, "script:answer=whose")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("wechat-main")
    assert "cannot tell which account to act as (send_message: retcode 10101: who am i)" in \
        Plugin.objects.get().disabled_reason


def test_an_answer_with_an_image_uploads_it_and_sends_an_image_segment(tcast, fake, start_runtime):
    plugin = make_wechat()
    rt = start_runtime()
    ready(fake, rt)
    png = b"\x89PNG\r\n\x1a\nchart"
    enqueue_with_files(plugin, channel="wechat", user_id=ALICE, external_id=ALICE, text="here is the chart",
                       files=((png, "image/png", "chart.png"),))
    assert wait_until(lambda: len(fake.sent()) == 2, 20), rt.log("wechat-main")
    text, image = fake.sent()
    assert text["message"] == [{"type": "text", "data": {"text": "here is the chart"}}]
    file_id = image["message"][0]["data"]["file_id"]
    assert image["message"][0]["type"] == "image" and fake.uploads[file_id] == ("chart.png", png)


# --- kill -9 -------------------------------------------------------------------------------------------------

def test_the_worker_killed_mid_delivery_sends_each_part_once(tcast, fake, start_runtime):
    """Three parts: the first taken, the second in the air when the worker is killed. The next worker resumes
    the delivery from the journal: the first is not sent again, the second and third go, the turn ran once."""
    rt = running(fake, start_runtime)
    answer = " ".join(f"w{i}" for i in range(700))
    fake.hold("send_message", after=1)
    fake.push_private(ALICE, "script:answer=" + answer)
    assert wait_until(fake.held.is_set, 30), rt.log("wechat-main")
    first = rt.worker_pid("wechat-main")
    assert len(fake.texts()) == 1
    os.kill(first, signal.SIGKILL)
    fake.hold(None)
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 60), rt.log("wechat-main")
    assert rt.worker_pid("wechat-main") not in (None, first)
    assert " ".join(fake.texts()).split() == answer.split()  # every word once: no part twice, none lost
    assert Turn.objects.count() == 1


def test_the_worker_killed_while_a_file_is_fetched_answers_the_message_once(tcast, fake, start_runtime):
    """Recorded in the outbox, its file not yet fetched: the next worker fetches it and submits the message,
    once."""
    rt = running(fake, start_runtime)
    first = rt.worker_pid("wechat-main")
    image = fake.file("image", "cat.jpg", b"\xff\xd8\xff\xe0" + os.urandom(32))
    fake.hold("get_file")
    fake.push_private(ALICE, [image, fake.text("script:answer=only once")])
    assert wait_until(fake.held.is_set, 30), rt.log("wechat-main")
    assert not Receipt.objects.exists()
    os.kill(first, signal.SIGKILL)
    fake.hold(None)
    assert wait_until(lambda: fake.texts() == ["only once"], 60), rt.log("wechat-main")
    fake.push_private(ALICE, "script:answer=after")
    assert wait_until(lambda: fake.texts() == ["only once", "after"], 30), rt.log("wechat-main")
    assert Receipt.objects.count() == 2 and PluginMedia.objects.count() == 1
