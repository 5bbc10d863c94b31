"""channel-dingtalk's parts on their own: the sign (the vector's algorithm), normalisation, splitting, the OpenAPI
client's answers to a refused token, throttling, 5xx and refusals."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.dingtalk import (TEXT_LIMIT_BYTES, DingTalkWorker, markdown_params, message_parts,
                                                  normalise, param_len, strip_mention, title_of)
from plugins_app.channel.workers.dingtalk.api import (AppRefused, DingTalkApi, DingTalkError, RateLimited,
                                                      RobotNotInGroup, Stopped, Unavailable, UserUnreachable)
from plugins_app.channel.workers.dingtalk.stream import StreamLink
from plugins_app.channel.workers.dingtalk.webhook import MAX_SKEW_MS, WebhookServer, signature, signature_valid
from tests.fakes.dingtalk import GROUP, STAFF, FakeDingTalk, sign

DATA = Path(__file__).resolve().parents[1] / "data"


def vector(vector_id: str) -> dict:
    vectors = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
    return next(v for v in vectors if v["id"] == vector_id)


# -- the sign -----------------------------------------------------------------------------------------

def test_the_sign_is_the_vectors_algorithm_for_the_inbound_callback():
    """The vector file holds no fixed input/output for DingTalk's robot sign (none is published): it states the
    algorithm. Each form it names is built here from its words, with the standard library, and the worker's
    sign matches the inbound form (no URL encoding), and only that one."""
    v = vector("dingtalk-robot-sign-algorithm")
    assert v["expected"] is None and "WITHOUT urlencode" in v["algorithm"] and "1 hour" in v["algorithm"]
    from urllib.parse import quote_plus
    for secret, ts in [("this is secret", "1577262236757"), ("SECb3d2e5a7f0c9", "1700000000000"),
                       ("应用密钥+/=", "1613630252678")]:
        string_to_sign = f"{ts}\n{secret}".encode("utf-8")
        expected = base64.b64encode(hmac.new(secret.encode("utf-8"), string_to_sign, hashlib.sha256).digest()).decode()
        assert signature(secret, ts) == expected == sign(secret, ts)  # sign(): the fake's, with `cryptography`
        assert signature_valid(secret, ts, expected, now_ms=int(ts))
        outbound = quote_plus(expected)  # the custom robot's outbound form is URL-encoded: not what arrives here
        if outbound != expected:
            assert not signature_valid(secret, ts, outbound, now_ms=int(ts))
    # a value computed once (2026-12-06, with `openssl dgst -sha256 -hmac` and checked with Python's hmac) from
    # the sample's secret and timestamp, written here as a literal: any change to the formula breaks it
    assert signature("this is secret", "1577262236757") == "hmPWwU+7lVdm3ZZz0r9tSfx0L4Q26jWOZr9+Gs6EZQM="


def test_a_sign_for_another_timestamp_or_secret_or_a_timestamp_an_hour_away_is_refused():
    secret, ts = "s3cret", "1700000000000"
    good = signature(secret, ts)
    now = int(ts)
    assert signature_valid(secret, ts, good, now_ms=now + MAX_SKEW_MS)
    assert signature_valid(secret, ts, good, now_ms=now - MAX_SKEW_MS)
    assert not signature_valid(secret, ts, good, now_ms=now + MAX_SKEW_MS + 1)
    assert not signature_valid(secret, ts, good, now_ms=now - MAX_SKEW_MS - 1)
    assert not signature_valid(secret, "1700000000001", good, now_ms=now)
    assert not signature_valid("other", ts, good, now_ms=now)
    assert not signature_valid(secret, ts, None, now_ms=now) and not signature_valid(secret, ts, "", now_ms=now)
    assert not signature_valid(secret, None, good, now_ms=now)
    assert not signature_valid(secret, "soon", good, now_ms=now)
    assert not signature_valid("", ts, signature("", ts), now_ms=now)


def server(records: list) -> WebhookServer:
    s = WebhookServer("127.0.0.1:0", "/dingtalk/robot", "s3cret", records.append)
    s.httpd.server_close()
    return s


def test_the_webhook_records_only_what_is_signed_and_recent_and_answers_401_otherwise():
    records: list = []
    s = server(records)
    body = json.dumps({"msgId": "msg1", "msgtype": "text"}).encode()
    now = int(time.time() * 1000)
    ts = str(now)
    good = {"timestamp": ts, "sign": signature("s3cret", ts)}
    old_ts = str(now - MAX_SKEW_MS - 60_000)
    assert s.handle("/dingtalk/robot", {}, body) == (401, {"message": "Invalid sign or timestamp"})
    assert s.handle("/dingtalk/robot", {"timestamp": ts, "sign": signature("other", ts)}, body)[0] == 401
    assert s.handle("/dingtalk/robot", {"timestamp": old_ts, "sign": signature("s3cret", old_ts)}, body)[0] == 401
    assert records == []
    assert s.handle("/elsewhere", good, body)[0] == 404
    assert s.handle("/dingtalk/robot", good, None)[0] == 413
    assert s.handle("/dingtalk/robot", good, body) == (200, {})
    assert records == [json.loads(body)]
    for n, bad in enumerate([b"not json", b"[1]"], 1):  # (each under a sign of its own: a sign takes one body)
        fresh = {"timestamp": str(now + n), "sign": signature("s3cret", str(now + n))}
        assert s.handle("/dingtalk/robot", fresh, bad)[0] == 400


def test_a_sign_carries_only_the_body_it_first_came_with_across_a_restart_over_http(tmp_path):
    """DingTalk's sign covers only the timestamp: one captured (timestamp, sign) carried ANY body for the hour
    (a new msgId, any sender). Now it carries the first body it came with (DingTalk sending it again), and
    a restarted worker still knows it."""
    records: list = []
    seen = str(tmp_path / "dt.dingtalk-seen.log")
    ts = str(int(time.time() * 1000))
    headers = {"Content-Type": "application/json", "timestamp": ts, "sign": signature("s3cret", ts)}
    real = json.dumps({"msgId": "m1", "conversationType": "1", "senderStaffId": "alice", "msgtype": "text",
                       "text": {"content": "hi"}}).encode()
    forged = json.dumps({"msgId": "m-forged", "conversationType": "1", "senderStaffId": "ceo", "msgtype": "text",
                         "text": {"content": "/model x"}}).encode()

    def serve():
        s = WebhookServer("127.0.0.1:0", "/dingtalk/robot", "s3cret", records.append, seen_path=seen)
        s.start()
        return s

    s = serve()
    try:
        assert httpx.post(s.url, content=real, headers=headers).status_code == 200
        refused = httpx.post(s.url, content=forged, headers=headers)
        assert (refused.status_code, refused.json()) == (401, {"message": "Invalid sign or timestamp"})
        assert httpx.post(s.url, content=real, headers=headers).status_code == 200  # DingTalk sending it again
    finally:
        s.stop()
    s = serve()  # the worker restarted within the hour
    try:
        assert httpx.post(s.url, content=forged, headers=headers).status_code == 401
        ts2 = str(int(ts) + 1)
        assert httpx.post(s.url, content=forged, headers=dict(headers, timestamp=ts2,
                                                              sign=signature("s3cret", ts2))).status_code == 200
    finally:
        s.stop()
    assert [r["msgId"] for r in records] == ["m1", "m1", "m-forged"]  # the last one signed afresh


def posted_raw(server, headers: dict, body: bytes, *, length: int | None = None, half_close: bool = False) -> bytes:
    """One POST over a socket of its own: ``body`` sent under a Content-Length of ``length``, the sending side
    then closed if asked (a client that stops mid-body); what came back, until the server closed."""
    import socket
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(server.httpd.server_address[:2], timeout=5) as conn:
        conn.sendall(f"POST {server.path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}Content-Length: "
                     f"{len(body) if length is None else length}\r\n\r\n".encode() + body)
        if half_close:
            conn.shutdown(socket.SHUT_WR)
        answered = b""
        while chunk := conn.recv(65536):
            answered += chunk
    return answered


def test_a_first_try_cut_mid_body_is_refused_and_dingtalks_retry_of_the_whole_message_is_taken():
    """The cut body was handed on: its hash tied to the sign, so DingTalk's retry (the same headers, the whole
    body) was refused 401 as a forgery, and the message lost."""
    records: list = []
    s = WebhookServer("127.0.0.1:0", "/dingtalk/robot", "s3cret", records.append)
    s.start()
    try:
        ts = str(int(time.time() * 1000))
        headers = {"timestamp": ts, "sign": signature("s3cret", ts)}
        body = json.dumps({"msgId": "m1", "msgtype": "text", "text": {"content": "hello there"}}).encode()
        cut = posted_raw(s, headers, body[:20], length=len(body), half_close=True)
        assert cut.startswith(b"HTTP/1.1 400 ") and records == []
        assert posted_raw(s, headers, body).startswith(b"HTTP/1.1 200 ")
    finally:
        s.stop()
    assert records == [json.loads(body)]


def robot_message(msg_id: str, conversation: str = "cid1", sender: str = "alice", text: str = "hi", **fields):
    return dict({"msgId": msg_id, "msgtype": "text", "conversationType": "2", "conversationId": conversation,
                 "senderStaffId": sender, "senderId": f"$:{sender}", "text": {"content": text},
                 "sessionWebhook": "https://oapi.dingtalk.com/robot/sendBySession?session=first",
                 "sessionWebhookExpiredTime": 4102444800000}, **fields)


def test_a_sign_takes_its_message_again_however_serialised_and_no_other_message():
    """The sign is tied to the message it first came with (its msgId, type, conversation and sender), not its
    bytes: DingTalk sending it again re-serialised, or with a refreshed sessionWebhook, was refused 401 (the
    message lost). Another message under that sign is still refused, even the same sender's in the same chat
    (what a captured sign would carry), and a message sent again brings no session webhook."""
    records: list = []
    s = WebhookServer("127.0.0.1:0", "/dingtalk/robot", "s3cret", records.append)
    now = int(time.time() * 1000)
    headers = {"timestamp": str(now), "sign": signature("s3cret", str(now))}
    first = robot_message("m1")
    assert s.handle("/dingtalk/robot", headers, json.dumps(first).encode()) == (200, {})
    again = dict(reversed(list(robot_message(
        "m1", sessionWebhook="https://oapi.dingtalk.com/robot/sendBySession?session=refreshed").items())))
    assert s.handle("/dingtalk/robot", headers, json.dumps(again, indent=1).encode()) == (200, {})
    for forged in (robot_message("m2", conversation="cid-other"),   # another chat
                   robot_message("m1", sender="ceo", text="/model x"),  # another sender under that msgId
                   robot_message("m2", text="transfer it all"),  # the same sender and chat, another message
                   robot_message("m1", msgtype="picture")):  # another type under that msgId
        assert s.handle("/dingtalk/robot", headers, json.dumps(forged).encode())[0] == 401, forged
    assert [r["msgId"] for r in records] == ["m1", "m1"]
    assert records[0]["sessionWebhook"].endswith("session=first")
    assert "sessionWebhook" not in records[1] and "sessionWebhookExpiredTime" not in records[1]
    s.httpd.server_close()


def test_a_session_webhook_is_kept_only_from_a_message_recorded_first_and_the_newest_by_its_creation(ding, tmp_path):
    """A message DingTalk sent again, or one recorded after a newer one of its chat (two requests side by
    side), put its older session URL in place of the newer one."""
    from plugins_app.channel.workers.dingtalk.session import SessionStore
    env = {k: v for k, v in ding.env().items() if k != "DINGTALK_APP_KEY"}
    worker = DingTalkWorker(argv=[], environ=env, socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False, state_dir=str(tmp_path))
    worker.sessions = SessionStore(worker.state_path("sessions", "json"))
    try:
        now = int(time.time() * 1000)
        older = ding.text("first", createAt=now - 1000)
        newer = ding.text("second", createAt=now)
        worker.accept(newer)
        worker.accept(older)  # recorded second, created first
        assert worker.sessions.get("user:" + STAFF)[0] == newer["sessionWebhook"]
        later = ding.text("third", createAt=now + 1000)
        worker.accept(later)
        worker.accept(dict(newer, sessionWebhook=ding.text("x")["sessionWebhook"]))  # sent again, a fresh URL
        assert worker.sessions.get("user:" + STAFF)[0] == later["sessionWebhook"]
        assert worker.state_path("sessions", "json") == str(tmp_path / "dt-test.dingtalk-sessions.json")
    finally:
        worker.api.close()
        if worker.outbox is not None:
            worker.outbox.close()


def test_a_message_that_cannot_be_recorded_is_answered_500():
    def boom(message):
        raise OSError("disk full")
    s = WebhookServer("127.0.0.1:0", "/dingtalk/robot", "s3cret", boom)
    s.httpd.server_close()
    ts = str(int(time.time() * 1000))
    assert s.handle("/dingtalk/robot", {"timestamp": ts, "sign": signature("s3cret", ts)}, b"{}")[0] == 500


# -- normalisation --------------------------------------------------------------------------------------

fake = FakeDingTalk()  # not started: only its message builders are used here


def test_a_one_to_one_message_is_the_users_conversation_and_keeps_its_msg_id():
    message = fake.text("  hello robot ")
    msg = normalise(message)
    assert (msg.channel, msg.conversation_id, msg.source_type, msg.sender_id) == ("dingtalk", f"user:{STAFF}", "user",
                                                                                   STAFF)
    assert (msg.message_id, msg.text, msg.sender_name) == (message["msgId"], "hello robot", "张三")
    assert msg.metadata["session_webhook"] == message["sessionWebhook"]
    assert msg.metadata["robot_code"] == fake.robot_code
    assert msg.timestamp.endswith("Z")
    msg.validate()
    assert normalise(json.loads(json.dumps(message))).key == msg.key  # a resend is the same message


def test_a_group_message_is_the_groups_conversation_without_the_leading_mention():
    msg = normalise(fake.text("@机器人 what is the weather?", group=True))
    assert (msg.conversation_id, msg.source_type, msg.sender_id) == (f"group:{GROUP}", "group", STAFF)
    assert msg.text == "what is the weather?"
    assert msg.metadata["is_in_at_list"] is True and msg.metadata["conversation_title"] == "机器人测试-TEST"
    assert normalise(fake.text(" plain text", group=True)).text == "plain text"  # DingTalk took the mention out
    assert strip_mention("@bot hi @someone") == "hi @someone"
    assert strip_mention("hi @bot") == "hi @bot"


def test_media_become_attachments_on_the_download_api_and_audio_carries_what_dingtalk_heard():
    base = "https://api.dingtalk.com"
    [pic] = normalise(fake.message("picture", content={"downloadCode": "c+1/2", "pictureDownloadCode": "p"}),
                      base_url=base).attachments
    assert (pic.kind, pic.content_type, pic.channel_ref) == ("image", "image/jpeg", "c+1/2")
    assert pic.url == f"{base}/v1.0/robot/messageFiles/download?downloadCode=c%2B1%2F2"
    doc = normalise(fake.message("file", content={"downloadCode": "f", "fileName": "report.pdf", "fileId": "1"}))
    assert (doc.attachments[0].kind, doc.attachments[0].content_type, doc.attachments[0].filename) == (
        "document", "application/pdf", "report.pdf")
    voice = normalise(fake.message("audio", content={"downloadCode": "a", "duration": 4000,
                                                     "recognition": "明天几点开会"}))
    assert voice.text == "明天几点开会" and voice.attachments[0].kind == "audio"
    rich = normalise(fake.message("richText", content={"richText": [
        {"text": "look at"}, {"type": "picture", "downloadCode": "r1", "pictureDownloadCode": "x"}, {"text": "this"}]}))
    assert rich.text == "look at\nthis" and [a.channel_ref for a in rich.attachments] == ["r1"]


@pytest.mark.parametrize("message", [
    fake.text("   "),
    fake.message("interactiveCard", content={}),
    {**fake.text("no id"), "msgId": ""},
    {**fake.text("no staff id"), "senderStaffId": ""},
    {**fake.text("no chat"), "conversationType": "3"},
    fake.message("picture", content={}),
])
def test_what_carries_nothing_to_answer_is_not_taken(message):
    assert normalise(message) is None


# -- splitting ---------------------------------------------------------------------------------------------

def test_an_answer_is_split_within_the_limit_counted_as_escaped_utf8():
    answer = "\n\n".join(f"段落 {i} " + "钉钉机器人消息。" * 150 for i in range(10))  # about 36,000 bytes
    parts = message_parts(answer)
    assert len(parts) > 1 and all(param_len(p) <= TEXT_LIMIT_BYTES for p in parts)
    assert "".join(parts).replace("\n", "").replace(" ", "") == answer.replace("\n", "").replace(" ", "")
    assert param_len('a"\n') == 5  # escapes count: a quote and a newline take two bytes each
    quotes = '"' * 4000  # 4,000 characters, 8,000 bytes escaped
    assert len(message_parts(quotes)) == 2
    assert message_parts("  \n ") == []
    params = markdown_params(parts)
    assert all(len(json.dumps(p, ensure_ascii=False).encode()) < 15000 for p in params)
    assert params[0]["title"].endswith(f"(1/{len(parts)})") and params[0]["text"] == parts[0]


def test_a_title_is_the_first_line_without_markup_cut_short():
    assert title_of("## Weather today\n\nSunny") == "Weather today"
    assert title_of("> " + "x" * 40) == "x" * 19 + "…"
    assert title_of("```python\ncode\n```", 1, 3) == "code (2/3)"
    assert title_of("---") == "…"


# -- the OpenAPI client ----------------------------------------------------------------------------------------

@pytest.fixture
def ding():
    with FakeDingTalk() as f:
        yield f


def api(f: FakeDingTalk, **kw) -> tuple[DingTalkApi, list[float]]:
    waits: list[float] = []

    def sleep(secs):
        waits.append(secs)
        return False
    return DingTalkApi(f.app_key, f.app_secret, f.robot_code, base_url=f.base_url, sleep=sleep, **kw), waits


MD = {"title": "hi", "text": "hi"}


def test_a_send_to_a_user_and_to_a_group_carries_the_token_and_a_json_msg_param(ding):
    client, _ = api(ding)
    key = client.send_to_user(STAFF, "sampleMarkdown", MD)
    client.send_to_group(GROUP, "sampleMarkdown", {"title": "群", "text": "大家好"})
    user_call, group_call = ding.sends()
    assert user_call.body == {"robotCode": ding.robot_code, "userIds": [STAFF], "msgKey": "sampleMarkdown",
                              "msgParam": '{"title": "hi", "text": "hi"}'}
    assert group_call.body["openConversationId"] == GROUP and json.loads(group_call.body["msgParam"])["text"] == "大家好"
    assert user_call.headers["x-acs-dingtalk-access-token"] in ding.tokens
    assert key == ding.sent[0]["key"] and ding.texts() == ["hi", "大家好"]
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 1


def test_a_stale_token_is_fetched_again_once_and_the_call_made_again(ding):
    client, _ = api(ding)
    client.send_to_user(STAFF, "sampleMarkdown", MD)
    ding.expire_tokens()
    client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert [(c.status, c.answer.get("code")) for c in ding.sends()] == [
        (200, None), (400, "InvalidAuthentication"), (200, None)]
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 2
    assert ding.texts() == ["hi", "hi"]


def test_a_token_refused_twice_in_a_row_is_the_apps_refusal(ding, monkeypatch):
    client, _ = api(ding)
    monkeypatch.setattr(ding, "_check_token", lambda token: (400, {"code": "InvalidAuthentication",
                                                                   "message": "不合法的access_token"}))
    with pytest.raises(AppRefused) as refused:
        client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert refused.value.code == "InvalidAuthentication"
    assert len(ding.calls_to("/v1.0/oauth2/accessToken")) == 2 and len(ding.sends()) == 2
    from plugins_app.channel.workers.dingtalk import refused as reason
    assert "DINGTALK_APP_SECRET" in reason(refused.value)


def test_the_tokens_expiry_runs_on_the_wall_clock(ding, monkeypatch):
    """A suspended host: the wall clock jumps past the token's lifetime, a monotonic one does not."""
    import types
    from plugins_app.channel.workers.dingtalk import api as api_module
    now = [1_800_000_000.0]
    monkeypatch.setattr(api_module, "time", types.SimpleNamespace(time=lambda: now[0], monotonic=lambda: 0.0))
    client = DingTalkApi(ding.app_key, ding.app_secret, ding.robot_code, base_url=ding.base_url)
    first = client.token()
    now[0] += 7200  # the host slept through the token's life
    assert client.token() != first
    client.close()


def test_a_token_is_refreshed_before_it_expires():
    now = [0.0]
    with FakeDingTalk() as f:
        client = DingTalkApi(f.app_key, f.app_secret, f.robot_code, base_url=f.base_url, clock=lambda: now[0])
        first = client.token()
        now[0] = 6000.0
        assert client.token() == first
        now[0] = 6901.0  # past 7,200 - 300
        assert client.token() != first
        client.close()


def test_throttling_and_5xx_are_waited_out_doubling_and_give_up_past_the_bound(ding):
    client, waits = api(ding, backoff_initial=1.0, backoff_max=4.0)
    ding.script(429, times=2)
    ding.script(403, "Forbidden.AccessDenied.QpsLimitForApi", "api qps limit")
    ding.script(500, times=2)
    client.send_to_group(GROUP, "sampleMarkdown", MD)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0] and ding.texts() == ["hi"]
    assert [c.status for c in ding.sends()] == [429, 429, 403, 500, 500, 200]
    limited, _ = api(ding, max_wait_secs=2.5)
    ding.script(429, times=2)  # waited 1 s; a second wait of 2 s passes the bound of 2.5 s
    with pytest.raises(RateLimited):
        limited.send_to_user(STAFF, "sampleMarkdown", MD)
    ding.script(503, times=2)
    down, _ = api(ding, max_wait_secs=2.5)
    with pytest.raises(Unavailable):
        down.send_to_user(STAFF, "sampleMarkdown", MD)
    assert ding.texts() == ["hi"] and [c.status for c in ding.sends()][6:] == [429, 429, 503, 503]


def test_a_user_held_back_by_flow_control_is_waited_for_and_sent_once(ding):
    client, waits = api(ding, backoff_initial=1.0)
    ding.flow_control(times=2)
    key = client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert waits == [1.0, 2.0] and ding.texts() == ["hi"] and key == ding.sent[0]["key"]
    assert [c.answer["flowControlledStaffIdList"] for c in ding.sends()] == [[STAFF], [STAFF], []]
    ding.flow_control(times=3)
    bounded, _ = api(ding, max_wait_secs=2.5)
    with pytest.raises(RateLimited):
        bounded.send_to_user(STAFF, "sampleMarkdown", MD)
    assert ding.texts() == ["hi"]


def test_refusals_of_the_app_and_of_one_message_are_told_apart(ding):
    client, _ = api(ding)
    with pytest.raises(UserUnreachable):
        client.send_to_user("departed", "sampleMarkdown", MD)
    with pytest.raises(RobotNotInGroup) as bad_group:  # a group the robot is not in: that message, not the app
        client.send_to_group("cidUnknown==", "sampleMarkdown", MD)
    assert not isinstance(bad_group.value, AppRefused) and bad_group.value.status == 400
    assert bad_group.value.code == "invalidParameter.robotCode.notExsit"
    for code in ("invalidParameter.robotCode.empty", "invalidParameter.robotCode.coolApp"):
        ding.script(400, code, "机器人robotCode无效，请检查机器人是否在群内")
        with pytest.raises(RobotNotInGroup):
            client.send_to_group(GROUP, "sampleMarkdown", MD)
    ding.script(400, "invalidParameter.robotCode.auth", "此应用appkey和机器人robotCode不匹配")
    with pytest.raises(AppRefused):  # the app and the robot do not match: every send would fail
        client.send_to_group(GROUP, "sampleMarkdown", MD)
    with pytest.raises(DingTalkError) as too_long:
        client.send_to_user(STAFF, "sampleMarkdown", {"title": "t", "text": "x" * 15001})
    assert too_long.value.code == "invalidParameter.msgParam.length"
    wrong_robot = DingTalkApi(ding.app_key, ding.app_secret, "dingother", base_url=ding.base_url)
    with pytest.raises(AppRefused) as robot:
        wrong_robot.send_to_user(STAFF, "sampleMarkdown", MD)
    assert robot.value.code == "invalidParameter.robotCode.notExsit"
    ding.permission = False
    with pytest.raises(AppRefused) as permission:
        client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert permission.value.status == 403
    ding.reset_secret()
    ding.expire_tokens()
    with pytest.raises(AppRefused) as secret:
        client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert secret.value.code == "invalidClientIdOrSecret"
    assert not ding.texts()
    wrong_robot.close()


def test_a_host_outside_the_apps_ip_whitelist_is_the_apps_refusal_with_the_fix(ding):
    from plugins_app.channel.workers.dingtalk import refused
    client, waits = api(ding)
    code = ding.upload(b"jpeg")
    ding.ip_allowed = False
    for call in (lambda: client.send_to_user(STAFF, "sampleMarkdown", MD), lambda: client.download(code)):
        with pytest.raises(AppRefused) as denied:
            call()
        assert (denied.value.status, denied.value.code) == (403, "Forbidden.AccessDenied.IpNotInWhiteList")
        assert "IP whitelist" in refused(denied.value)
    ding.ip_allowed = True
    ding.script(403, "Forbidden.AccessDenied.QpsLimitForApi", "api qps limit")  # a throttle, not a refusal
    client.send_to_user(STAFF, "sampleMarkdown", MD)
    assert waits == [1.0] and ding.texts() == ["hi"]


def test_a_download_asks_for_the_url_with_the_token_and_fetches_it_without(ding):
    client, _ = api(ding)
    code = ding.upload(b"\xff\xd8jpeg", "image/jpeg")
    assert client.download(code) == (b"\xff\xd8jpeg", "image/jpeg")
    [ask] = ding.calls_to("/v1.0/robot/messageFiles/download")
    assert ask.body == {"downloadCode": code, "robotCode": ding.robot_code}
    with pytest.raises(DingTalkError):
        client.download("unknown")


def test_a_download_past_its_bound_is_given_up_not_read_whole(ding, caplog):
    from plugins_app.channel.workers.dingtalk.api import TooLarge
    client, _ = api(ding)
    code = ding.upload(b"x" * 5000, "application/pdf")
    assert client.download(code, max_bytes=5000) == (b"x" * 5000, "application/pdf")
    with pytest.raises(TooLarge):  # by its Content-Length
        client.download(code, max_bytes=4999)
    ding.files_without_length = True
    assert client.download(code, max_bytes=5000)[0] == b"x" * 5000
    with pytest.raises(TooLarge):  # as it is read
        client.download(code, max_bytes=1000)
    # the worker: its bound, and a log line saying it gave up
    import plugins_app.channel.workers.dingtalk as worker_module
    worker = DingTalkWorker(argv=[], environ=ding.env(), socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    [att] = normalise(ding.message("file", content={"downloadCode": code, "fileName": "a.pdf"}),
                      base_url=ding.base_url).attachments
    caplog.set_level("ERROR", logger="ugent.worker.dt-test")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_module, "MAX_DOWNLOAD_BYTES", 4096)
        with pytest.raises(TooLarge):
            worker.fetch_media(att)
    assert "gave up downloading" in caplog.text and "over 4096 bytes" in caplog.text
    assert not worker._refusal
    worker.api.close()


def test_a_stopping_worker_cuts_a_wait_short(ding):
    stopping = threading.Event()
    stopping.set()
    client = DingTalkApi(ding.app_key, ding.app_secret, ding.robot_code, base_url=ding.base_url, stopping=stopping)
    ding.script(429)
    with pytest.raises(Stopped):
        client.send_to_user(STAFF, "sampleMarkdown", MD)
    client.close()


def test_a_download_refused_for_the_app_makes_the_worker_refuse(ding):
    worker = DingTalkWorker(argv=[], environ=ding.env(), socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    code = ding.upload(b"jpeg")
    [att] = normalise(ding.message("picture", content={"downloadCode": code}), base_url=ding.base_url).attachments
    assert worker.fetch_media(att) == b"jpeg"
    ding.reset_secret()
    ding.expire_tokens()
    with pytest.raises(AppRefused):
        worker.fetch_media(att)
    assert "DINGTALK_APP_SECRET" in worker._refusal
    worker.api.close()


def test_a_resumed_delivery_skips_the_parts_the_journal_names_and_a_finished_one_counts_as_delivered(ding, tmp_path):
    """The crash windows the outbox cannot close: killed between parts (the resume sends only what is left) and
    killed after the last part went out but before the ack (already_delivered: nothing is sent again)."""
    from plugins_app.channel.sdk import Delivery
    from plugins_app.channel.sdk.journal import SentJournal
    worker = DingTalkWorker(argv=[], environ=ding.env(), socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    worker._journal = SentJournal(str(tmp_path / "sent.sqlite3"))
    answer = "\n\n".join((f"part {i} " + "word " * 900).strip() for i in range(3))
    parts = message_parts(answer)
    delivery = Delivery(delivery_id="d_1", conversation_id=f"user:{STAFF}", text=answer)
    worker._journal.record("d_1", 0, "key-of-part-0")  # part one went out before the crash
    assert not worker.already_delivered(delivery)
    assert worker.deliver(delivery) == "key-of-part-0"
    assert ding.texts() == parts[1:]
    assert worker.already_delivered(delivery)
    assert worker.deliver(delivery) == "key-of-part-0" and ding.texts() == parts[1:]  # nothing sent twice
    group = Delivery(delivery_id="d_2", conversation_id=f"group:{GROUP}", text="hi")
    assert worker.deliver(group) == ding.sent[-1]["key"] and ding.sent[-1]["to"] == GROUP
    from plugins_app.channel.sdk import DeliveryFailed
    with pytest.raises(DeliveryFailed) as bad:
        worker.deliver(Delivery(delivery_id="d_3", conversation_id="cid-without-kind", text="hi"))
    assert bad.value.permanent
    with pytest.raises(DeliveryFailed) as empty:
        worker.deliver(Delivery(delivery_id="d_4", conversation_id=f"user:{STAFF}", text="  "))
    assert empty.value.permanent
    worker._journal.close()
    worker.api.close()


# -- without app credentials: the session webhook -------------------------------------------------------------

def test_a_session_webhook_send_waits_out_throttling_and_an_expired_one_is_refused(ding):
    from plugins_app.channel.workers.dingtalk.api import SessionRefused
    client, waits = api(ding)
    url = ding.message()["sessionWebhook"]
    # DingTalk's errcode for a robot sending too fast
    ding.script_answer(200, {"errcode": 130101, "errmsg": "send too fast, exceed 20 times per minute"})
    client.send_by_session(url, {"title": "hi", "text": "hi"})
    assert waits == [1.0] and ding.texts() == ["hi"]
    assert ding.sends()[-1].body == {"msgtype": "markdown", "markdown": {"title": "hi", "text": "hi"}}
    ding.expire_sessions()
    with pytest.raises(SessionRefused) as expired:
        client.send_by_session(url, {"title": "hi", "text": "again"})
    assert expired.value.code == "300001" and ding.texts() == ["hi"]


def test_a_session_webhook_send_counts_as_sent_only_for_errcode_0_and_waits_out_a_busy_dingtalk(ding, tmp_path):
    from plugins_app.channel.sdk import Delivery, DeliveryFailed
    from plugins_app.channel.sdk.journal import SentJournal
    from plugins_app.channel.workers.dingtalk.api import SessionRefused
    client, waits = api(ding)
    url = ding.message()["sessionWebhook"]
    ding.script_answer(200, {"errcode": -1, "errmsg": "系统繁忙"})  # DingTalk's global "busy: try again"
    client.send_by_session(url, {"title": "hi", "text": "after busy"})
    assert waits == [1.0] and ding.texts() == ["after busy"]
    ding.script_answer(200, b"<html><body>ok</body></html>")  # 200, but no DingTalk answer: nothing says it went
    with pytest.raises(DingTalkError) as not_json:
        client.send_by_session(url, {"title": "hi", "text": "lost"})
    assert not isinstance(not_json.value, SessionRefused) and not_json.value.status == 200
    ding.script_answer(200, {"errmsg": "ok"})  # JSON without an errcode: not a success either
    with pytest.raises(DingTalkError):
        client.send_by_session(url, {"title": "hi", "text": "lost"})
    # the worker: not journaled as sent, and the hub tries again (retryable)
    env = {k: v for k, v in ding.env().items() if k != "DINGTALK_APP_KEY"}
    worker = DingTalkWorker(argv=[], environ=env, socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    from plugins_app.channel.workers.dingtalk.session import SessionStore
    worker.sessions = SessionStore(str(tmp_path / "s.json"))
    worker._journal = SentJournal(str(tmp_path / "sent.sqlite3"))
    message = ding.text("hi")
    worker._remember_session(f"user:{STAFF}", message)
    ding.script_answer(200, b"<html>gateway</html>")
    delivery = Delivery(delivery_id="d_s", conversation_id=f"user:{STAFF}", text="through a proxy")
    with pytest.raises(DeliveryFailed) as failed:
        worker.deliver(delivery)
    assert not failed.value.permanent and worker._journal.done("d_s") == {}
    worker.deliver(delivery)  # the hub's retry
    assert ding.texts() == ["after busy", "through a proxy"] and len(worker._journal.done("d_s")) == 1
    worker._journal.close()
    worker.api.close()


def test_the_session_store_keeps_each_conversations_newest_webhook_across_restarts(tmp_path):
    """The newest message's session, never the one whose body says it lasts longest (a forged body said
    2100: every later answer of the conversation went to its URL), and never past two hours from now."""
    from plugins_app.channel.workers.dingtalk.session import MAX_SESSION_MS, SessionStore
    path = str(tmp_path / "sessions.json")
    now = int(time.time() * 1000)
    later = now + 3_600_000
    store = SessionStore(path)
    store.remember("user:a", "https://oapi.dingtalk.com/robot/sendBySession?session=forged", 4102444800000)
    [(_, capped)] = [store.get("user:a")]
    assert now + MAX_SESSION_MS <= capped <= int(time.time() * 1000) + MAX_SESSION_MS
    store.remember("user:a", "https://oapi.dingtalk.com/robot/sendBySession?session=new", later)
    store.remember("user:b", "https://oapi.dingtalk.com/robot/sendBySession?session=gone", 1)
    again = SessionStore(path)  # a restarted worker
    assert again.get("user:a") == ("https://oapi.dingtalk.com/robot/sendBySession?session=new", later)
    again.remember("group:c", "https://oapi.dingtalk.com/robot/sendBySession?session=c", later)
    assert again.get("user:b") is None and SessionStore(path).get("group:c") is not None  # the expired one dropped


def test_without_an_app_key_a_session_webhook_on_another_host_is_never_kept(ding, tmp_path):
    env = {k: v for k, v in ding.env().items() if k != "DINGTALK_APP_KEY"}
    worker = DingTalkWorker(argv=[], environ=env, socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    from plugins_app.channel.workers.dingtalk.session import SessionStore
    worker.sessions = SessionStore(str(tmp_path / "s.json"))
    assert worker.session_mode
    message = ding.text("hi", sessionWebhook="https://attacker.example/robot/sendBySession?session=x")
    worker._remember_session("user:x", message)
    assert worker.sessions.get("user:x") is None
    worker._remember_session("user:x", ding.text("hi"))
    assert worker.sessions.get("user:x")[0].startswith(f"{ding.base_url}/robot/sendBySession?session=")
    worker.api.close()


def test_an_unusable_session_webhook_is_logged_without_its_token(ding, tmp_path, caplog):
    env = {k: v for k, v in ding.env().items() if k != "DINGTALK_APP_KEY"}
    worker = DingTalkWorker(argv=[], environ=env, socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    from plugins_app.channel.workers.dingtalk.session import SessionStore
    worker.sessions = SessionStore(str(tmp_path / "s.json"))
    secret = "b1f2c3d4e5f6a7b8"
    caplog.set_level("WARNING", logger="ugent.worker.dt-test")
    for url, expires in ((f"https://x.example/robot/sendBySession?session={secret}", None),  # another host
                         (f"{ding.base_url}/robot/sendBySession?session={secret}", 0)):  # no expiry
        worker._remember_session("user:x", ding.text("hi", sessionWebhook=url, sessionWebhookExpiredTime=expires))
    assert "https://x.example/robot/sendBySession" in caplog.text
    assert f"{ding.base_url}/robot/sendBySession" in caplog.text
    assert secret not in caplog.text and "session=" not in caplog.text
    assert worker.sessions.get("user:x") is None
    worker.api.close()


# -- registration -------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_dingtalk_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-dingtalk"]
    assert kind.module == "plugins_app.channel.workers.dingtalk"
    assert kind.env_refs == ("DINGTALK_APP_KEY", "DINGTALK_APP_SECRET")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "dingtalk-main"\nkind = "channel-dingtalk"\n'
                               'args = ["--bind", "127.0.0.1:3002"]\n'
                               'env_refs = ["DINGTALK_APP_KEY", "DINGTALK_APP_SECRET"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.dingtalk", "--bind", "127.0.0.1:3002"])


# -- Stream mode ----------------------------------------------------------------------------------------------

def stream_link(ding: FakeDingTalk, on_message) -> tuple[StreamLink, threading.Event, httpx.Client]:
    stopping, client = threading.Event(), httpx.Client(timeout=5)
    link = StreamLink(ding.app_key, ding.app_secret, on_message, stopping, base_url=ding.base_url, client=client)
    return link, stopping, client


def run_link(link) -> threading.Thread:
    """``link.run()`` on a thread; what ended it (an exception) is kept as ``thread.ended``."""
    def main():
        try:
            link.run()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            thread.ended = exc

    thread = threading.Thread(target=main, daemon=True)
    thread.ended = None
    thread.start()
    return thread


def acks_of(ding: FakeDingTalk, n: int = 0) -> list[dict]:
    with ding.lock:
        ids = set(ding.pushes[n].frame_ids)
        return [a for a in ding.acks if (a.get("headers") or {}).get("messageId") in ids]


def test_the_stream_acknowledges_a_message_once_it_is_recorded(ding):
    from tests.plugins_app.conftest import wait_until
    seen: list[tuple[str, int]] = []

    def record(message):
        seen.append((message["msgId"], len(acks_of(ding))))  # the acks DingTalk had when the worker recorded it

    link, stopping, client = stream_link(ding, record)
    thread = run_link(link)
    message = ding.stream_say("hello")
    assert wait_until(ding.settled, 10), ding.acks
    stopping.set()
    thread.join(5)
    client.close()
    assert seen == [(message["msgId"], 0)]
    [frame] = ding.pushes[0].frame_ids  # pushed once
    [ack] = acks_of(ding)
    assert ack["headers"]["messageId"] == frame and link.acked == 1 and thread.ended is None


def test_a_record_that_fails_for_a_moment_is_tried_again_in_place_and_then_acknowledged(ding, caplog):
    """DingTalk never pushes a robot message again: a record that fails (a database locked for a moment) is
    tried again with the message in hand, not given up at the first failure."""
    from tests.plugins_app.conftest import wait_until
    tries: list[str] = []

    def record(message):
        tries.append(message["msgId"])
        if len(tries) < 3:
            raise OSError("database is locked")

    caplog.set_level("WARNING", logger="ugent.worker.dingtalk.stream")
    link, stopping, client = stream_link(ding, record)
    thread = run_link(link)
    message = ding.stream_say("hello")
    assert wait_until(lambda: link.acked == 1, 10), (tries, ding.acks)
    assert tries == [message["msgId"]] * 3 and len(acks_of(ding)) == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    stopping.set()
    thread.join(5)
    client.close()
    assert thread.ended is None


def test_a_message_that_cannot_be_recorded_is_logged_as_lost_and_the_messages_behind_it_are_not(ding, caplog):
    """One the worker still cannot record is lost (DingTalk does not push it again): its msgId is logged at
    ERROR, and the link reads on, so the messages DingTalk pushed behind it on the same connection are
    recorded and acknowledged (closing the connection would have lost them too)."""
    from tests.plugins_app.conftest import wait_until
    records: list[str] = []

    def record(message):
        records.append(message["msgId"])
        if message["text"]["content"] == "lost":
            raise OSError("disk full")

    caplog.set_level("ERROR", logger="ugent.worker.dingtalk.stream")
    link, stopping, client = stream_link(ding, record)
    link.record_tries = 2
    thread = run_link(link)
    lost = ding.stream_say("lost")
    behind = [ding.stream_say("one"), ding.stream_say("two")]
    assert wait_until(lambda: link.acked == 2, 15), (records, ding.acks)
    # the link counts an ack as it sends it; the fake DingTalk records it once its socket has read the frame
    assert wait_until(lambda: len(acks_of(ding, 1)) == len(acks_of(ding, 2)) == 1, 15), ding.acks
    assert records == [lost["msgId"]] * 2 + [m["msgId"] for m in behind]
    [error] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert lost["msgId"] in error.getMessage() and "LOST" in error.getMessage()
    assert not acks_of(ding, 0) and len(acks_of(ding, 1)) == len(acks_of(ding, 2)) == 1
    assert thread.is_alive() and link.connections_opened == 1  # the same connection read on
    assert len(ding.pushes[0].frame_ids) == 1  # and DingTalk did not push the lost one again
    stopping.set()
    thread.join(5)
    client.close()
    assert thread.ended is None


def test_a_disconnect_gets_no_answer_and_the_link_moves_to_a_new_connection(ding):
    from tests.plugins_app.conftest import wait_until
    got: list[dict] = []
    link, stopping, client = stream_link(ding, got.append)
    thread = run_link(link)
    assert wait_until(lambda: ding.sockets(), 10)
    [old] = ding.sockets()
    ding.disconnect_grace = 300.0  # DingTalk does not close it in this test's time: the worker must
    assert ding.disconnect() == 1
    assert wait_until(lambda: ding.sockets_opened == 2 and ding.sockets() and old not in ding.sockets(), 10)
    ding.stream_say("on the new connection")
    assert wait_until(ding.settled, 10) and len(got) == 1
    with ding.lock:
        assert [a["headers"]["messageId"] for a in ding.acks] == ding.pushes[0].frame_ids  # nothing else answered
    assert len(ding.opens) == 2 and link.conn is not None
    stopping.set()
    thread.join(5)
    client.close()
    assert thread.ended is None


def test_disconnecting_the_worker_takes_the_links_connection_once(ding):
    """The link's thread may set ``conn`` to None at any moment (its connection dropped): the worker's
    ``disconnect`` reads it once, so it never calls ``close`` on None."""
    class Racing(StreamLink):
        @property
        def conn(self):  # the link's thread clears it right after the first read
            self._reads += 1
            return self._conn if self._reads == 1 else None

        @conn.setter
        def conn(self, value):
            self._conn, self._reads = value, 0

    worker = DingTalkWorker(argv=["--mode", "stream"], environ=ding.env(), socket_path="/nowhere",
                            plugin_id="dt-test", token="t", install_signal_handlers=False)
    worker.link = Racing(ding.app_key, ding.app_secret, lambda m: None, worker.stopping, base_url=ding.base_url,
                         client=worker.api.client)
    opened = worker.link._open()
    worker.link.conn = opened
    worker.disconnect()
    assert opened.state.name == "CLOSED"


def test_the_stream_asks_a_fresh_ticket_per_connection_and_tries_a_busy_gateway_again(ding):
    from plugins_app.channel.workers.dingtalk.stream import OPEN_PATH, StreamRefused
    from tests.plugins_app.conftest import wait_until
    link, stopping, client = stream_link(ding, lambda m: None)
    ding.script_open(503)
    thread = run_link(link)
    assert wait_until(lambda: ding.sockets(), 10)
    ding.drop_sockets()
    # (the gateway counts a socket at its handshake, the link once its greeting is done: wait for both)
    assert wait_until(lambda: ding.sockets_opened == 2 and ding.sockets() and link.connections_opened == 2, 10)
    assert [c.status for c in ding.calls_to(OPEN_PATH)] == [503, 200, 200]
    assert len(ding.opens) == 2 and link.connections_opened == 2
    # the secret reset: the next ticket is refused, and the link ends (no loop against a refusal)
    ding.reset_secret()
    ding.drop_sockets()
    thread.join(10)
    assert not thread.is_alive() and isinstance(thread.ended, StreamRefused)
    assert (thread.ended.status, thread.ended.code) == (401, "authFailed")
    assert [c.status for c in ding.calls_to(OPEN_PATH)][3:] == [401]
    stopping.set()
    client.close()


def test_the_stream_answers_what_it_did_not_subscribe_to_and_survives_frames_that_are_not_json(ding):
    from plugins_app.channel.workers.dingtalk.stream import ack
    from tests.plugins_app.conftest import wait_until
    got: list[dict] = []
    link, stopping, client = stream_link(ding, got.append)
    thread = run_link(link)
    assert wait_until(lambda: ding.sockets(), 10)
    [conn] = ding.sockets()
    conn.send("not json")
    conn.send(json.dumps(ding._frame("EVENT", "chat_update_title", "ev-1", "{}")))
    ding.stream_say("still read")
    assert wait_until(ding.settled, 10) and len(got) == 1
    assert any(a == json.loads(ack("ev-1")) for a in ding.acks)  # acknowledged, so it is not sent again
    stopping.set()
    thread.join(5)
    client.close()


def test_the_mode_is_http_unless_told(ding):
    from plugins_app.channel.workers.dingtalk import parse_args
    assert parse_args([]).mode == "http" and parse_args(["--mode", "stream"]).mode == "stream"
    with pytest.raises(SystemExit):
        parse_args(["--mode", "socket"])


def test_a_gateway_out_of_reach_at_the_start_is_tried_again_not_fatal(ding):
    from tests.plugins_app.conftest import wait_until
    link, stopping, client = stream_link(ding, lambda m: None)
    ding.script_open(503)
    link.prepare()  # no exception: the worker starts and keeps trying
    thread = run_link(link)
    assert wait_until(lambda: ding.sockets(), 10)
    assert [c.status for c in ding.calls_to("/v1.0/gateway/connections/open")] == [503, 200]
    stopping.set()
    thread.join(5)
    client.close()
    assert thread.ended is None


# -- an answer's files ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype, name, planned", [
    ("image/png", "chart.png", ("image", "png")), ("image/jpeg", None, ("image", "jpg")),
    ("application/octet-stream", "photo.GIF", ("image", "gif")), ("application/pdf", "report.pdf", ("file", "pdf")),
    ("application/pdf", None, ("file", "pdf")), ("application/zip", "all.zip", ("file", "zip")),
    ("text/plain", "notes.txt", (None, "txt")), ("audio/mpeg", "memo.mp3", ("voice", "mp3")),
    ("audio/wav", None, ("voice", "wav")), ("application/octet-stream", "memo.amr", ("voice", "amr")),
    ("video/mp4", "clip.mp4", (None, "mp4")),
    ("image/webp", "sticker.webp", (None, "webp"))])
def test_a_file_goes_as_an_image_or_a_file_by_what_dingtalk_takes(ctype, name, planned):
    from plugins_app.channel.workers.dingtalk import upload_plan
    assert upload_plan(ctype, name) == planned


def file_worker(ding: FakeDingTalk, tmp_path) -> DingTalkWorker:
    from plugins_app.channel.sdk.journal import SentJournal
    worker = DingTalkWorker(argv=[], environ=ding.env(), socket_path="/nowhere", plugin_id="dt-test", token="t",
                            install_signal_handlers=False)
    worker._journal = SentJournal(str(tmp_path / "sent.sqlite3"))
    worker.api.backoff_initial = 0.01
    return worker


def file_delivery(*files):
    from plugins_app.channel.sdk import Attachment, Delivery
    return Delivery(delivery_id="d_f", conversation_id=f"user:{STAFF}", text="the files",
                    attachments=[Attachment(kind=kind, content_type=ctype, media_id=f"m{i}", filename=name)
                                 for i, (kind, ctype, name) in enumerate(files)])


def test_an_upload_is_multipart_media_with_its_type_and_its_media_id_is_kept_for_a_resend(ding, tmp_path):
    from plugins_app.channel.sdk.messages import Media
    worker = file_worker(ding, tmp_path)
    delivery = file_delivery(("image", "image/png", "chart.png"))
    media = Media(b"\x89PNG\r\n\x1a\n0123", "image/png", "chart.png")
    ref = worker.put_media(media, delivery.attachments[0], delivery)
    [call] = ding.calls_to("/media/upload")
    assert call.body["params"]["type"] == "image" and call.body["fields"] == ["media"]
    [(media_id, upload)] = ding.uploads.items()
    assert (upload["filename"], upload["data"]) == ("chart.png", media.data) and media_id in ref
    # a resend (after a kill between the upload and the send): the same media id, no second upload
    again = file_delivery(("image", "image/png", "chart.png"))
    assert worker.put_media(media, again.attachments[0], again) == ref
    assert len(ding.calls_to("/media/upload")) == 1
    again.attachments[0].channel_ref = ref
    worker.deliver(again)
    assert [(m["msgKey"], m["param"]) for m in ding.sent] == [
        ("sampleMarkdown", {"title": "the files", "text": "the files"}), ("sampleImageMsg", {"photoURL": media_id})]
    # its part sent: a later resend neither uploads nor sends it
    assert worker.already_delivered(again)
    assert worker.put_media(media, again.attachments[0], again) == "sent"
    worker._journal.close()
    worker.api.close()


def test_a_file_over_dingtalks_20_mb_is_not_uploaded_and_becomes_a_note(ding, tmp_path):
    from plugins_app.channel.sdk.messages import Media
    worker = file_worker(ding, tmp_path)
    delivery = file_delivery(("document", "application/pdf", "big.pdf"))
    ref = worker.put_media(Media(b"\0" * (20 * 1024 * 1024 + 1), "application/pdf"), delivery.attachments[0], delivery)
    assert ref == "unsent:it is 20.0 MB, over DingTalk's 20 MB for a file" and not ding.calls_to("/media/upload")
    worker._journal.close()
    worker.api.close()


def test_an_upload_fetches_a_stale_token_again_waits_out_a_throttle_and_tells_the_apps_refusal(ding, tmp_path):
    from plugins_app.channel.sdk.messages import Media
    worker = file_worker(ding, tmp_path)
    worker.api.token()
    ding.expire_tokens()  # 40014: fetched again once, the upload made again
    media_id = worker.api.upload(b"%PDF-1.4 x", "file", "a.pdf", "application/pdf")
    assert media_id in ding.uploads and len(ding.calls_to("/v1.0/oauth2/accessToken")) == 2
    ding.upload_errcode = 90018  # throttled: waited out past the bound, then RateLimited
    worker.api.max_wait_secs = 0.05
    with pytest.raises(RateLimited):
        worker.api.upload(b"%PDF-1.4 x", "file", "a.pdf", "application/pdf")
    ding.upload_errcode = 60011  # no permission to upload: the files' refusal (notes); the text still goes out
    from plugins_app.channel.workers.dingtalk.api import UploadRefused
    with pytest.raises(UploadRefused, match="may not upload files"):
        worker.api.upload(b"%PDF-1.4 x", "file", "a.pdf", "application/pdf")
    delivery = file_delivery(("document", "application/pdf", "a.pdf"))
    delivery.delivery_id = "d_f60011"  # (its own: the journal keeps what a delivery's upload gave)
    worker.put_media(Media(b"%PDF-1.4 x", "application/pdf"), delivery.attachments[0], delivery)
    assert not worker._refusal
    ding.upload_errcode = 60020  # this host not in the app's IP whitelist: the app's refusal, not the file's
    worker.refusal_hold_secs = 0.0  # (the send's hold until the worker stops: 30 s here, where nothing stops it)
    delivery = file_delivery(("document", "application/pdf", "a.pdf"))
    from plugins_app.channel.sdk import DeliveryFailed
    with pytest.raises(DeliveryFailed):
        worker.put_media(Media(b"%PDF-1.4 x", "application/pdf"), delivery.attachments[0], delivery)
    assert "whitelist" in worker._refusal
    worker._journal.close()
    worker.api.close()


def wav(seconds: float, rate: int = 8000) -> bytes:
    """A mono 16-bit PCM WAV playing ``seconds``, with a LIST chunk before its data (as many writers put one)."""
    import struct
    pcm = b"\0\0" * int(rate * seconds)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 5) + b"INFO\0\0"
    chunks += b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def test_a_wavs_duration_is_its_data_over_its_byte_rate():
    from plugins_app.channel.sdk.audio import wav_seconds
    assert wav_seconds(wav(2.5)) == pytest.approx(2.5)
    assert wav_seconds(b"RIFF\0\0\0\0WAVEdata\4\0\0\0abcd") is None  # no fmt chunk: no byte rate
    assert wav_seconds(b"#!AMR\n" + b"\0" * 40) is None and wav_seconds(b"") is None


def test_a_voice_goes_as_sample_audio_with_its_duration_and_an_mp3_becomes_a_note(ding, tmp_path):
    from plugins_app.channel.sdk.messages import Media
    worker = file_worker(ding, tmp_path)
    delivery = file_delivery(("audio", "audio/wav", "memo.wav"), ("audio", "audio/mpeg", "song.mp3"))
    memo, song = delivery.attachments
    memo.channel_ref = worker.put_media(Media(wav(1.5), "audio/wav"), memo, delivery)
    song.channel_ref = worker.put_media(Media(b"ID3" + b"\0" * 64, "audio/mpeg"), song, delivery)
    [(media_id, upload)] = ding.uploads.items()
    assert (upload["type"], upload["filename"]) == ("voice", "memo.wav")
    worker.deliver(delivery)
    assert [(m["msgKey"], m["param"]) for m in ding.sent[1:]] == [
        ("sampleAudio", {"mediaId": media_id, "duration": "1500"}),
        ("sampleMarkdown", {"title": "[song.mp3 was not s…", "text": "[song.mp3 was not sent: DingTalk's voice "
                            "message needs its duration, which the worker reads from AMR-NB and WAV only, not mp3]"})]
    worker._journal.close()
    worker.api.close()
