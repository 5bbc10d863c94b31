"""channel-line's parts on their own: signatures (LINE's SDK vectors), normalisation, splitting, retry keys,
the push client's answers to 409, 429 and 401."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

from plugins_app.channel.sdk.text import shorten, utf16_len
from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.line import (MESSAGES_PER_PUSH, TEXT_LIMIT, message_parts, normalise,
                                              push_batches, quick_reply)
from plugins_app.channel.workers.line.api import LineApi, LineError, RateLimited, TokenRefused, retry_key
from plugins_app.channel.workers.line.webhook import WebhookServer, signature, signature_valid
from tests.fakes.line import GROUP, ROOM, USER, FakeLine

HI = [{"type": "text", "text": "hi"}]
DATA = Path(__file__).resolve().parents[1] / "data"


def vector(vector_id: str) -> dict:
    vectors = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
    return next(v for v in vectors if v["id"] == vector_id)


# -- signatures -----------------------------------------------------------------------------------

@pytest.mark.parametrize("vector_id", ["line-python-sdk", "line-nodejs-sdk"])
def test_the_sdks_signature_vectors_verify_and_their_negative_cases_do_not(vector_id):
    v = vector(vector_id)
    secret, body = v["inputs"]["channel_secret"], v["inputs"]["body"].encode()
    assert signature(secret, body) == v["expected"]["signature"]
    assert signature_valid(secret, body, v["expected"]["signature"])
    negatives = v["expected"]["negative_cases"]
    assert negatives
    for case in negatives:
        assert signature_valid(secret, body, case["signature"]) is case["valid"] is False
    assert not signature_valid(secret, body + b" ", v["expected"]["signature"])  # a tampered body
    assert not signature_valid("another", body, v["expected"]["signature"])
    assert not signature_valid(secret, body, None) and not signature_valid(secret, body, "")


def server(records: list) -> WebhookServer:
    s = WebhookServer("127.0.0.1:0", "/line/webhook", "s3cret", records.append)
    s.httpd.server_close()
    return s


def test_the_webhook_records_only_what_is_signed_and_answers_401_otherwise():
    records: list = []
    s = server(records)
    body = json.dumps({"destination": "Ub07", "events": [{"type": "message"}]}).encode()
    good = {"X-Line-Signature": signature("s3cret", body)}
    assert s.handle("/line/webhook", {}, body) == (401, {"message": "Invalid signature"})
    assert s.handle("/line/webhook", {"X-Line-Signature": signature("other", body)}, body)[0] == 401
    assert s.handle("/line/webhook", {"X-Line-Signature": "garbage"}, body)[0] == 401
    assert records == []
    assert s.handle("/elsewhere", good, body)[0] == 404
    assert s.handle("/line/webhook", good, None)[0] == 413
    assert s.handle("/line/webhook", good, body) == (200, {})
    assert records == [json.loads(body)]
    junk = b"not json"
    assert s.handle("/line/webhook", {"X-Line-Signature": signature("s3cret", junk)}, junk)[0] == 400


def test_an_event_that_cannot_be_recorded_is_answered_500_so_line_redelivers():
    def boom(payload):
        raise OSError("disk full")
    s = WebhookServer("127.0.0.1:0", "/line/webhook", "s3cret", boom)
    s.httpd.server_close()
    body = b'{"destination":"U1","events":[]}'
    assert s.handle("/line/webhook", {"X-Line-Signature": signature("s3cret", body)}, body)[0] == 500


# -- normalisation ---------------------------------------------------------------------------------

fake = FakeLine()  # not started: only its event builders are used here


@pytest.mark.parametrize("source,conversation,kind", [
    (FakeLine.user(), USER, "user"), (FakeLine.group(), GROUP, "group"), (FakeLine.room(), ROOM, "room")])
def test_each_source_type_is_its_conversation_and_the_sender_is_the_user(source, conversation, kind):
    event = fake.event(fake.text_message("hi there", quotedMessageId="468789577898262530"), source=source)
    msg = normalise(event)
    assert (msg.channel, msg.conversation_id, msg.source_type, msg.sender_id) == ("line", conversation, kind, USER)
    assert msg.message_id == event["webhookEventId"]
    assert msg.text == "hi there"
    assert msg.reply_to.message_id == "468789577898262530"
    assert msg.metadata["reply_token"] == event["replyToken"]
    assert msg.metadata["line_message_id"] == event["message"]["id"]
    assert msg.timestamp.endswith("Z")
    msg.validate()


def test_a_redelivered_event_keeps_its_id_so_the_outbox_and_the_hub_see_one_message():
    event = fake.event(fake.text_message("again"))
    again = json.loads(json.dumps(event))
    again["deliveryContext"] = {"isRedelivery": True}
    first, second = normalise(event), normalise(again)
    assert first.key == second.key and second.metadata["redelivery"] is True


def test_media_becomes_an_attachment_on_the_data_api_and_a_file_keeps_its_name():
    image = normalise(fake.event(fake.media_message(b"x")), data_base_url="https://api-data.line.me")
    [att] = image.attachments
    assert (att.kind, att.content_type) == ("image", "image/jpeg")
    assert att.url == f"https://api-data.line.me/v2/bot/message/{att.channel_ref}/content"
    pdf = normalise(fake.event(fake.media_message(b"%PDF", mtype="file", file_name="report.pdf")))
    [att] = pdf.attachments
    assert (att.kind, att.content_type, att.filename, att.size) == ("document", "application/pdf", "report.pdf", 4)
    external = fake.event({"id": "1", "type": "image", "contentProvider": {
        "type": "external", "originalContentUrl": "https://example.com/a.jpg"}})
    assert normalise(external).attachments[0].url == "https://example.com/a.jpg"


def test_a_postback_is_a_message_with_its_data_as_the_option():
    event = fake.event(etype="postback", postback={"data": "action=buy&itemid=111"})
    msg = normalise(event)
    assert msg.text == msg.metadata["option"] == "action=buy&itemid=111"


@pytest.mark.parametrize("event", [
    fake.event(etype="follow"), fake.event(etype="unfollow"),
    fake.event({"id": "2", "type": "sticker", "packageId": "1", "stickerId": "1"}),
    fake.event(fake.text_message("   ")),
    fake.event(fake.text_message("standby"), mode="standby"),
    fake.event(fake.text_message("no source"), source={"type": "user"}),
    {**fake.event(fake.text_message("no id")), "webhookEventId": ""},
])
def test_what_is_not_a_persons_message_is_not_taken(event):
    assert normalise(event) is None


# -- splitting and retry keys -----------------------------------------------------------------------

def test_an_answer_is_split_at_5000_and_pushed_five_messages_at_a_time():
    answer = "\n\n".join(f"paragraph {i} " + "word " * 300 for i in range(30))  # about 45,000 characters
    parts = message_parts(answer)
    assert all(len(p) <= TEXT_LIMIT for p in parts) and " ".join(parts).split() == answer.split()
    batches = push_batches(parts)
    assert MESSAGES_PER_PUSH == 5 and [len(b) for b in batches[:-1]] == [5] * (len(batches) - 1)
    assert 1 <= len(batches[-1]) <= 5
    assert [m["text"] for b in batches for m in b] == parts
    assert all(m["type"] == "text" for b in batches for m in b)
    assert message_parts("   ") == [] and push_batches([]) == []
    # LINE counts UTF-16 units: 5,000 emoji (10,000 units) do not fit in one message
    emoji = "\U0001F600" * 5000
    parts = message_parts(emoji)
    assert len(parts) >= 2 and all(utf16_len(p) <= TEXT_LIMIT for p in parts) and "".join(parts) == emoji


def test_a_retry_key_is_a_uuid_stable_per_delivery_and_push():
    import uuid
    key = retry_key("dlv-1", 0, HI)
    assert str(uuid.UUID(key)) == key
    assert retry_key("dlv-1", 0, [{"text": "hi", "type": "text"}]) == key  # the same after any restart
    assert len({key, retry_key("dlv-1", 1, HI), retry_key("dlv-2", 0, HI)}) == 3


def test_a_push_whose_messages_differ_never_carries_an_old_retry_key():
    """LINE requires a retried request to be identical to the first: another split of the same answer
    (another version of the splitter) must not match the old key, or LINE answers 409 without sending."""
    assert retry_key("dlv-1", 0, HI) != retry_key("dlv-1", 0, [{"type": "text", "text": "hi!"}])
    assert retry_key("dlv-1", 0, HI) != retry_key("dlv-1", 0, HI + [{"type": "text", "text": "more"}])


# -- the push client --------------------------------------------------------------------------------

@pytest.fixture
def line():
    with FakeLine() as fake:
        yield fake


def api(fake: FakeLine, **kw) -> tuple[LineApi, list[float]]:
    waits: list[float] = []

    def sleep(secs):
        waits.append(secs)
        return False
    return LineApi(fake.token, base_url=fake.base_url, data_base_url=fake.base_url, sleep=sleep, **kw), waits


def test_a_push_sent_again_with_its_key_is_409_and_taken_as_delivered(line):
    client, _ = api(line)
    key = retry_key("dlv-1", 0, HI)
    sent, repeated = client.push(USER, [{"type": "text", "text": "hi"}], key)
    again, repeated_again = client.push(USER, [{"type": "text", "text": "hi"}], key)
    assert (repeated, repeated_again) == (False, True)
    assert again == sent and line.texts() == ["hi"]
    assert [c.status for c in line.pushes()] == [200, 409]


def test_429s_back_off_doubling_and_a_retry_after_is_honoured(line):
    client, waits = api(line, backoff_initial=1.0, backoff_max=4.0)
    line.rate_limit(times=4)
    client.push(USER, [{"type": "text", "text": "hi"}], retry_key("d", 0, HI))
    assert waits == [1.0, 2.0, 4.0, 4.0] and line.texts() == ["hi"]
    waits.clear()
    line.rate_limit(times=2, retry_after=7)  # a Retry-After that is there is what push() waits
    again = [{"type": "text", "text": "again"}]
    client.push(USER, again, retry_key("d", 1, again))
    assert waits == [7.0, 7.0] and line.texts() == ["hi", "again"]
    assert [c.status for c in line.pushes()][-3:] == [429, 429, 200]


def test_429s_past_the_longest_wait_give_up_to_the_hubs_retries(line):
    client, waits = api(line, backoff_initial=1.0, max_wait_secs=2.5)
    line.rate_limit(times=5)
    with pytest.raises(RateLimited):
        client.push(USER, [{"type": "text", "text": "hi"}], retry_key("d", 0, HI))
    assert waits == [1.0] and not line.texts()


def test_a_401_is_token_refused_and_a_400_carries_lines_details(line):
    client, _ = api(line)
    with pytest.raises(LineError) as bad:
        client.push("nobody", [{"type": "text", "text": "x" * 5001}], retry_key("d", 0, HI))
    assert bad.value.status == 400
    assert "to: The property, 'to'" in bad.value.message
    assert "messages[0].text: Length must be between 0 and 5000" in bad.value.message
    line.revoke()
    with pytest.raises(TokenRefused):
        client.push(USER, [{"type": "text", "text": "hi"}], retry_key("d", 1, HI))
    with pytest.raises(TokenRefused):
        client.bot_info()


def test_content_comes_from_the_data_api_with_the_token(line):
    client, _ = api(line)
    message = line.media_message(b"\x00\x01", mtype="audio", content_type="audio/m4a")
    assert client.content(message["id"]) == (b"\x00\x01", "audio/m4a")


def test_content_line_is_still_preparing_is_waited_for_on_the_transcoding_endpoint(line):
    """LINE answers 202 while it prepares a large video or audio; its state is on .../content/transcoding."""
    client, waits = api(line)
    message = line.media_message(b"\x00\x00\x00\x18ftypmp42", mtype="video", content_type="video/mp4")
    line.prepare(message["id"], polls=3)
    assert client.content(message["id"]) == (b"\x00\x00\x00\x18ftypmp42", "video/mp4")
    polls = line.calls_to(f"/v2/bot/message/{message['id']}/content/transcoding")
    assert [c.answer["status"] for c in polls] == ["processing"] * 3 + ["succeeded"]
    assert [c.status for c in line.calls_to(f"/v2/bot/message/{message['id']}/content")] == [202, 200]
    assert waits == [1.0, 1.0, 1.0]


def test_content_whose_preparation_fails_or_outlasts_the_wait_is_given_up(line):
    client, waits = api(line, content_wait_secs=5.0)
    slow = line.media_message(b"v", mtype="video", content_type="video/mp4")
    line.prepare(slow["id"], polls=1000)
    with pytest.raises(LineError) as late:
        client.content(slow["id"])
    assert late.value.status == 202 and "still not ready after 5 s" in late.value.message
    assert sum(waits) == 5.0
    broken = line.media_message(b"a", mtype="audio", content_type="audio/m4a")
    line.prepare(broken["id"], fail=True)
    with pytest.raises(LineError) as failed:
        client.content(broken["id"])
    assert "transcoding failed" in failed.value.message


def test_a_passing_500_or_network_error_on_a_download_is_tried_again_with_backoff(line):
    client, waits = api(line, content_tries=4, content_backoff=1.0)
    image = line.media_message(b"\xff\xd8jpeg")
    line.fail_content(times=2)
    assert client.content(image["id"]) == (b"\xff\xd8jpeg", "image/jpeg")
    assert [c.status for c in line.calls_to(f"/v2/bot/message/{image['id']}/content")] == [500, 500, 200]
    assert waits == [1.0, 2.0]
    line.fail_content(times=10)  # a fault that does not pass: given up after four tries
    with pytest.raises(LineError) as down:
        client.content(image["id"])
    assert down.value.status == 500
    assert len(line.calls_to(f"/v2/bot/message/{image['id']}/content")) == 3 + 4
    waits.clear()
    closed = LineApi(line.token, data_base_url="http://127.0.0.1:9", sleep=lambda s: waits.append(s) or False,
                     content_tries=3)
    with pytest.raises(httpx.TransportError):
        closed.content(image["id"])
    assert waits == [1.0, 2.0]
    closed.close()


def test_a_download_refused_for_the_token_makes_the_worker_refuse(line):
    from plugins_app.channel.workers.line import LineWorker
    worker = LineWorker(argv=[], environ=line.env(), socket_path="/nowhere", plugin_id="line-test", token="t",
                        install_signal_handlers=False)
    [att] = normalise(line.event(line.media_message(b"jpeg")), data_base_url=line.base_url).attachments
    assert worker.fetch_media(att) == b"jpeg"
    assert worker.fetch_media(normalise(line.event({"id": "9", "type": "image", "contentProvider": {
        "type": "external", "originalContentUrl": "https://example.com/a.jpg"}})).attachments[0]) is None
    line.revoke()
    with pytest.raises(TokenRefused):
        worker.fetch_media(att)
    assert worker._refusal.startswith(f"GET /v2/bot/message/{att.channel_ref}/content: 401 Unauthorized")
    worker.api.close()


def test_a_stopping_worker_cuts_a_429_wait_short(line):
    stopping = threading.Event()
    stopping.set()
    client = LineApi(line.token, base_url=line.base_url, stopping=stopping)
    line.rate_limit(times=1)
    from plugins_app.channel.workers.line.api import Stopped
    with pytest.raises(Stopped):
        client.push(USER, [{"type": "text", "text": "hi"}], retry_key("d", 0, HI))


# -- registration -----------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_line_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-line"]
    assert kind.module == "plugins_app.channel.workers.line"
    assert kind.env_refs == ("LINE_CHANNEL_ACCESS_TOKEN", "LINE_CHANNEL_SECRET")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "line-main"\nkind = "channel-line"\n'
                               'args = ["--bind", "127.0.0.1:3001"]\n'
                               'env_refs = ["LINE_CHANNEL_ACCESS_TOKEN", "LINE_CHANNEL_SECRET"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.line", "--bind", "127.0.0.1:3001"])


def test_a_body_refused_as_too_large_is_never_read_as_a_second_request():
    """The webhook answers 413 without reading the body; on a kept-alive connection that body's bytes were then
    parsed as the next request (a signed request smuggled inside a refused one was served). The connection is
    now closed after such an answer. (Slack's, WhatsApp's, WeCom's and Telegram's webhooks do the same.)"""
    import re
    import socket
    from plugins_app.channel.workers.line.webhook import WebhookServer, signature
    records: list = []
    server = WebhookServer("127.0.0.1:0", "/line/webhook", "s3cret", records.append)
    server.start()
    try:
        inner_body = json.dumps({"destination": "U1", "events": []}).encode()
        inner = (b"POST /line/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-Line-Signature: " + signature("s3cret", inner_body).encode() +
                 b"\r\nContent-Length: " + str(len(inner_body)).encode() + b"\r\n\r\n" + inner_body)
        outer = b"POST /line/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2000000\r\n\r\n"
        with socket.create_connection(server.httpd.server_address[:2], timeout=5) as conn:
            conn.sendall(outer + inner)  # the start of a 2 MB body whose first bytes look like a request
            data = b""
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break  # the server closed the connection
                data += chunk
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"413"] and records == []
    finally:
        server.stop()


# -- a question's options as quick replies -----------------------------------------------------------

def options(n: int, label: str = "Option {n}") -> dict:
    return {"kind": "question", "options": [{"id": f"o{i}", "label": label.format(n=i), "value": f"q_abc:{i}"}
                                            for i in range(1, n + 1)]}


def test_options_become_postback_quick_replies_whose_data_is_the_value_and_display_text_the_label():
    quick = quick_reply(options(2))
    assert quick == {"items": [
        {"type": "action", "action": {"type": "postback", "label": "Option 1", "data": "q_abc:1",
                                      "displayText": "Option 1"}},
        {"type": "action", "action": {"type": "postback", "label": "Option 2", "data": "q_abc:2",
                                      "displayText": "Option 2"}}]}
    assert quick_reply({"kind": "question", "options": []}) is None and quick_reply({}) is None
    assert quick_reply(None) is None


def test_a_long_label_is_cut_at_a_word_to_20_and_the_chat_still_shows_it_whole():
    label = "Postpone until the next sprint review"
    [item] = quick_reply({"options": [{"id": "p", "label": label, "value": "q_abc:1"}]})["items"]
    assert item["action"]["label"] == "Postpone until the\u2026" and utf16_len(item["action"]["label"]) <= 20
    assert item["action"]["displayText"] == label
    assert shorten("Supercalifragilisticexpialidocious", 20, measure=utf16_len) == "Supercalifragilisti\u2026"
    # LINE's limit in UTF-16 units: emoji count twice
    assert utf16_len(shorten("\U0001F600" * 15, 20, measure=utf16_len)) <= 20
    assert shorten("Low", 20, measure=utf16_len) == "Low"


def test_thirteen_options_are_all_buttons_and_fourteen_leave_the_numbered_text_alone():
    assert len(quick_reply(options(13))["items"]) == 13
    assert quick_reply(options(14)) is None
    # an option LINE could not carry (data past 300 characters): no buttons at all, never a set missing one
    too_long = options(2)
    too_long["options"][1]["value"] = "x" * 301
    assert quick_reply(too_long) is None


def test_the_quick_reply_rides_on_the_last_message_of_the_last_push_and_changes_its_retry_key():
    answer = "\n\n".join(f"paragraph {i} " + "word " * 300 for i in range(25))  # 8 parts: two pushes
    parts = message_parts(answer)
    quick = quick_reply(options(2))
    batches = push_batches(parts, quick)
    flat = [m for b in batches for m in b]
    assert len(batches) >= 2 and flat[-1]["quickReply"] == quick
    assert all("quickReply" not in m for m in flat[:-1])
    assert [m["text"] for m in flat] == parts
    assert [retry_key("d_q", n, b) for n, b in enumerate(batches)][-1] != \
        retry_key("d_q", len(batches) - 1, push_batches(parts)[-1])
    assert push_batches([], quick) == []


def test_a_tap_is_a_postback_whose_data_is_the_option_and_a_redelivered_tap_is_the_same_message():
    event = fake.event(etype="postback", postback={"data": "q_abc:2"})
    msg = normalise(event)
    assert msg.metadata["option"] == "q_abc:2" and msg.metadata["event_type"] == "postback"
    assert msg.message_id == event["webhookEventId"]
    again = normalise({**event, "deliveryContext": {"isRedelivery": True}})
    assert (again.message_id, again.text, again.metadata["option"]) == (msg.message_id, msg.text, "q_abc:2")
    assert normalise(fake.event(etype="postback", postback={"data": ""})) is None


def test_the_fake_refuses_quick_replies_line_would_refuse(line):
    def push(quick):
        return httpx.post(f"{line.base_url}/v2/bot/message/push", headers={"Authorization": f"Bearer {line.token}"},
                          json={"to": USER, "messages": [{"type": "text", "text": "q", "quickReply": quick}]})
    ok = push(quick_reply(options(13)))
    assert ok.status_code == 200 and len(line.quick_replies()[0]) == 13
    fourteen = {"items": quick_reply(options(13))["items"] + quick_reply(options(1))["items"]}
    assert push(fourteen).status_code == 400
    long_label = quick_reply(options(1))
    long_label["items"][0]["action"]["label"] = "x" * 21
    answer = push(long_label)
    assert answer.status_code == 400 and answer.json()["details"][0]["property"].endswith(".action.label")
