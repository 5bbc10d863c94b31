"""channel-wechat's parts on their own: reading OneBot 12 events, return codes, and the link against the fake."""
from __future__ import annotations

import threading

import pytest

from plugins_app.channel.sdk.wslink import LinkRefused, start_link
from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers import wechat
from plugins_app.channel.workers.wechat.onebot import ActionFailed, AnswerLost, BridgeAway, OneBotLink, is_response
from tests.fakes.wechat import FakeBridge
from tests.plugins_app.conftest import wait_until

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

ME = "wxid_me"


def event(detail_type="private", segments=None, **over):
    e = {"id": "e-1", "time": 1714564800.25, "type": "message", "detail_type": detail_type, "sub_type": "",
         "self": {"platform": "wechat", "user_id": ME}, "message_id": "900",
         "message": segments if segments is not None else [{"type": "text", "data": {"text": "hi"}}],
         "alt_message": "hi", "user_id": "wxid_alice"}
    if detail_type == "group":
        e["group_id"] = "42@chatroom"
    e.update(over)
    return e


def mention(user_id):
    return {"type": "mention", "data": {"user_id": user_id}}


def text(t):
    return {"type": "text", "data": {"text": t}}


def test_a_private_message_is_a_user_conversation_per_peer():
    msg = wechat.normalise(event())
    assert (msg.channel, msg.conversation_id, msg.message_id, msg.sender_id, msg.source_type, msg.text) == \
        ("wechat", "wxid_alice", "900", "wxid_alice", "user", "hi")
    assert msg.timestamp == "2024-05-01T12:00:00.000Z"
    assert msg.metadata == {"self_id": ME, "platform": "wechat", "event_id": "e-1"}
    msg.validate()


def test_a_group_message_needs_the_accounts_mention_unless_told_otherwise():
    plain = event("group", [text("hello all")])
    assert wechat.normalise(plain) is None
    assert wechat.normalise(event("group", [mention("wxid_bob"), text(" hi bob")])) is None
    assert wechat.normalise(event("group", [{"type": "mention_all", "data": {}}, text(" all")])) is None
    called = wechat.normalise(event("group", [mention(ME), text(" what time is it"), mention("wxid_bob")]))
    assert (called.conversation_id, called.source_type, called.text) == \
        ("group:42@chatroom", "group", "what time is it@wxid_bob")
    assert called.metadata["group_id"] == "42@chatroom"
    quoting = wechat.normalise(event("group", [{"type": "reply", "data": {"message_id": "800", "user_id": ME}},
                                               text("and this?")]))
    assert quoting.reply_to.message_id == "800" and quoting.reply_to.sender_id == ME
    assert wechat.normalise(plain, groups="all").text == "hello all"
    assert wechat.normalise(event("group", [mention(ME), text("x")]), groups="off") is None
    assert wechat.addressed(plain, None) is False


def test_the_accounts_own_messages_and_what_is_not_a_message_are_not_submitted():
    assert wechat.normalise(event(user_id=ME)) is None
    assert wechat.normalise(event(type="notice", detail_type="friend_increase")) is None
    assert wechat.normalise(event(detail_type="channel")) is None
    # an event without "self": the account the worker learnt from status_update
    assert wechat.normalise({**event(user_id="wxid_x"), "self": None}, self_id="wxid_x") is None


def test_files_become_attachments_fetched_by_file_id_and_locations_text():
    msg = wechat.normalise(event(segments=[
        {"type": "image", "data": {"file_id": "f-img"}}, {"type": "voice", "data": {"file_id": "f-v"}},
        {"type": "file", "data": {"file_id": "f-doc"}}, {"type": "video", "data": {"file_id": "f-vid"}},
        {"type": "location", "data": {"latitude": 31.03, "longitude": 121.44, "title": "SJTU", "content": "Minhang"}}]))
    assert [(a.kind, a.content_type, a.url, a.channel_ref) for a in msg.attachments] == [
        ("image", "image/jpeg", "onebot-file:f-img", "f-img"), ("audio", "audio/silk", "onebot-file:f-v", "f-v"),
        ("document", "application/octet-stream", "onebot-file:f-doc", "f-doc"),
        ("video", "video/mp4", "onebot-file:f-vid", "f-vid")]
    assert msg.text == "[location] SJTU Minhang (31.03, 121.44)"
    msg.validate()


def test_a_message_of_an_implementations_own_segments_is_read_as_its_alt_message():
    link = event(segments=[{"type": "wx.link", "data": {"url": "https://x"}}], alt_message="[链接] a title")
    assert wechat.normalise(link).text == "[链接] a title"
    assert wechat.normalise(event(segments=[{"type": "wx.emoji", "data": {}}], alt_message="")) is None


def test_conversations_map_back_to_send_message_targets():
    assert wechat.conversation_of(event()) == "wxid_alice"
    assert wechat.target_of("wxid_alice") == {"detail_type": "private", "user_id": "wxid_alice"}
    assert wechat.target_of("group:42@chatroom") == {"detail_type": "group", "group_id": "42@chatroom"}


@pytest.mark.parametrize("retcode, final, refuses", [
    (10001, True, False), (10003, True, False), (10005, True, False), (10101, True, True), (10102, True, True),
    (20002, False, False), (31000, False, False), (32000, False, False), (33001, False, False),
    (34002, True, False), (35001, True, False), (36000, False, False), (60001, False, False)])
def test_return_codes_say_what_a_retry_would_do(retcode, final, refuses):
    exc = ActionFailed("send_message", retcode, "m")
    assert (exc.final, exc.refuses_account) == (final, refuses)
    assert exc.file_gone == (final or 32000 <= retcode < 33000)  # get_file: the bridge has no such file


def test_answers_are_told_from_events():
    assert is_response({"status": "ok", "retcode": 0, "data": None, "message": "", "echo": "ugent-1"})
    assert not is_response({"type": "meta", "detail_type": "heartbeat", "interval": 5000})
    assert not is_response({"type": "message", "echo": "x", "status": "ok"})


def test_the_kind_is_installed_with_its_environment():
    kind = installed_kinds()["channel-wechat"]
    assert kind.module == "plugins_app.channel.workers.wechat"
    assert kind.env_refs == ("WECHAT_ONEBOT_URL", "WECHAT_ONEBOT_ACCESS_TOKEN")


# ---------------------------------------------------------------- the link against the fake bridge


@pytest.fixture
def bridge():
    fake = FakeBridge().start()
    yield fake
    fake.stop()


def run_link(url, token, events=None):
    stopping = threading.Event()
    link = OneBotLink(url, token, (events if events is not None else []).append, stopping)
    ended = {}
    thread = start_link(link, name="test-onebot", refused=lambda exc: ended.setdefault("refused", exc),
                        failed=lambda exc: ended.setdefault("failed", exc))
    return link, stopping, thread, ended


def test_actions_are_answered_by_echo_and_events_arrive_between_them(bridge):
    events = []
    link, stopping, thread, _ = run_link(bridge.url, bridge.access_token, events)
    try:
        assert wait_until(lambda: link.impl == "FakeOneBot", 10)
        assert [e["detail_type"] for e in events[:2]] == ["connect", "status_update"]
        assert link.actions.call("get_self_info", {}, timeout=5)["user_id"] == bridge.self_id
        bridge.push_private("wxid_alice", "hello")
        with pytest.raises(ActionFailed) as failed:
            link.actions.call("no_such_action", {}, timeout=5)
        assert failed.value.retcode == 10002 and failed.value.final
        assert wait_until(lambda: any(e.get("type") == "message" for e in events), 5)
        echoes = [a["echo"] for a in bridge.actions]
        assert len(set(echoes)) == 2 and all(isinstance(e, str) for e in echoes)
    finally:
        stopping.set()
        thread.join(5)


def test_an_action_on_a_dropped_connection_is_bridge_away_or_answer_lost_not_a_hang(bridge):
    link, stopping, thread, _ = run_link(bridge.url, bridge.access_token)
    try:
        assert wait_until(lambda: link.conn is not None and bridge.connected(), 10)
        bridge.drop()
        # sent into the dead socket before the link saw the drop: the answer is lost (it may have been carried
        # out); once the link knows, nothing goes out: the bridge is away
        with pytest.raises((BridgeAway, AnswerLost)):
            for _ in range(50):  # until the link sees the drop: then every call says so at once
                link.actions.call("get_self_info", {}, timeout=2)
        assert wait_until(lambda: link.connections_opened >= 2, 10)  # and it reconnected
        assert link.actions.call("get_self_info", {}, timeout=5)["user_id"] == bridge.self_id
    finally:
        stopping.set()
        thread.join(5)


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_ends_the_link_with_link_refused(status):
    fake = FakeBridge(refuse_status=status).start()
    try:
        link, stopping, thread, ended = run_link(fake.url, "wrong")
        thread.join(10)
        assert not thread.is_alive()
        assert isinstance(ended.get("refused"), LinkRefused)
        assert f"HTTP {status} Authorization Header is invalid" in str(ended["refused"])
        assert len(fake.connections) == 1
        stopping.set()
    finally:
        fake.stop()


def test_another_handshake_status_is_tried_again(bridge):
    link, stopping, thread, ended = run_link(bridge.url + "/wrong-path", bridge.access_token)
    try:
        assert wait_until(lambda: len(bridge.connections) >= 2, 10)  # 404: not a refusal, tried again
        assert not ended
    finally:
        stopping.set()
        thread.join(5)


def test_the_parser_and_its_defaults():
    opts = wechat.parse_args([])
    assert (opts.groups, opts.reply_segment, opts.max_chars) == ("mention", "auto", 2000)
    assert wechat.parse_args(["--groups", "all", "--reply-segment", "off"]).groups == "all"
    assert "comwechat" in wechat.NO_REPLY_IMPLS


def test_an_event_whose_self_is_malformed_is_still_read():
    msg = wechat.normalise({**event(), "self": "wxid_me"}, self_id=ME)
    assert (msg.sender_id, msg.metadata) == ("wxid_alice", {"self_id": ME, "event_id": "e-1"})


def test_a_file_url_on_every_address_is_reached_at_the_bridges_host():
    from plugins_app.channel.workers.wechat import WeChatWorker
    w = WeChatWorker.__new__(WeChatWorker)
    w.url = "ws://10.0.0.5:8000"
    assert w.reachable("http://0.0.0.0:8000/get_file/abc") == "http://10.0.0.5:8000/get_file/abc"
    assert w.reachable("http://127.0.0.1:8000/get_file/abc?x=1") == "http://10.0.0.5:8000/get_file/abc?x=1"
    assert w.reachable("http://files.example:9000/f") == "http://files.example:9000/f"  # a real host: as given
    w.url = "ws://[fd00::5]:8000"
    assert w.reachable("http://0.0.0.0:8000/get_file/abc") == "http://[fd00::5]:8000/get_file/abc"


def test_a_quote_in_a_group_naming_the_room_names_no_sender():
    """ComWeChatBotClient writes the chatroom's id as a group quote's user_id: that is nobody, and it does not
    address the account (a mention does)."""
    from plugins_app.channel.workers.wechat import normalise
    event = {"type": "message", "detail_type": "group", "group_id": "123@chatroom", "user_id": "wxid_bob",
             "message_id": "9", "self": {"platform": "wechat", "user_id": "wxid_me"},
             "message": [{"type": "reply", "data": {"message_id": "8", "user_id": "123@chatroom"}},
                         {"type": "mention", "data": {"user_id": "wxid_me"}}, {"type": "text", "data": {"text": "so?"}}]}
    msg = normalise(event)
    assert msg.reply_to.message_id == "8" and msg.reply_to.sender_id is None
    event["message"] = event["message"][:1] + event["message"][2:]  # the quote alone
    assert normalise(event) is None
