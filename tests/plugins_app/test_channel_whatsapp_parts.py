"""channel-whatsapp's parts on their own: signatures (the published vectors and their negative cases), the
GET handshake, normalisation, formatting and splitting, Graph errors and rate-limit waits, sends."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from plugins_app.channel.sdk import Delivery, DeliveryFailed
from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.whatsapp import (MEDIA_URL_PREFIX, SentJournal, WhatsAppWorker,
                                                  message_parts, signature, signature_valid, to_whatsapp,
                                                  verification_answer)
from plugins_app.channel.workers.whatsapp.api import GraphApi, GraphError, RateLimited, classify, parse_error
from plugins_app.channel.sdk.text import shorten
from plugins_app.channel.workers.whatsapp.interactive import interactive_message
from plugins_app.channel.workers.whatsapp.webhook import WebhookServer
from tests.fakes.whatsapp import PHONE_NUMBER_ID, USER, FakeWhatsApp, graph_error, interactive_problems, sign

DATA = Path(__file__).resolve().parents[1] / "data"


def vector(vector_id: str) -> dict:
    vectors = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
    return next(v for v in vectors if v["id"] == vector_id)


def vector_cases() -> list[tuple[str, bytes, str]]:
    """(secret, body, header) of each published X-Hub-Signature-256 vector."""
    meta, github = vector("whatsapp-nodejs-sdk"), vector("github-x-hub-signature-256-docs")
    return [(meta["inputs"]["app_secret"], meta["inputs"]["body"].encode(), meta["expected"]["header"]),
            (github["inputs"]["secret"], github["inputs"]["body"].encode(), github["expected"]["header"])]


def worker(**env) -> WhatsAppWorker:
    environ = {"WHATSAPP_PHONE_NUMBER_ID": PHONE_NUMBER_ID, **env}
    return WhatsAppWorker(argv=[], environ=environ, socket_path="/nowhere", plugin_id="whatsapp-test", token="t",
                          install_signal_handlers=False)


# -- signatures -------------------------------------------------------------------------------------

@pytest.mark.parametrize("secret, body, header", vector_cases(), ids=["whatsapp-nodejs-sdk", "github-docs"])
def test_the_published_vectors_verify(secret, body, header):
    assert signature(secret, body) == header
    assert signature_valid(secret, body, header)
    assert signature_valid(secret, body, header.upper().replace("SHA256=", "sha256="))  # hex is hex in any case


@pytest.mark.parametrize("secret, body, header", vector_cases(), ids=["whatsapp-nodejs-sdk", "github-docs"])
def test_the_vectors_negative_cases_do_not_verify(secret, body, header):
    digest = header.removeprefix("sha256=")
    assert not signature_valid(secret, body + b" ", header)             # the body tampered with
    assert not signature_valid(secret, body.upper(), header)
    assert not signature_valid(secret + "x", body, header)              # another secret
    assert not signature_valid("", body, header)                        # no secret configured: nothing verifies
    assert not signature_valid(secret, body, None)                      # no header
    assert not signature_valid(secret, body, "")
    assert not signature_valid(secret, body, digest)                    # the hex without its scheme
    assert not signature_valid(secret, body, "sha1=" + digest)          # another scheme
    assert not signature_valid(secret, body, "sha256=")
    assert not signature_valid(secret, body, header[:-1])               # truncated
    assert not signature_valid(secret, body, header[:-1] + ("0" if header[-1] != "0" else "1"))  # one digit off


def server(records: list, *, fail: bool = False) -> WebhookServer:
    def on_payload(payload):
        if fail:
            raise OSError("disk full")
        records.append(payload)
    s = WebhookServer("127.0.0.1:0", "/whatsapp/webhook", app_secret="s3cret", verify_token="vt",
                      on_payload=on_payload)
    s.httpd.server_close()
    return s


def test_a_notification_is_recorded_only_with_a_good_signature():
    records: list = []
    s = server(records)
    body = json.dumps(FakeWhatsApp().message(text="hi")).encode()
    assert s.handle_post("/whatsapp/webhook", {}, body) == (401, "invalid signature")
    assert s.handle_post("/whatsapp/webhook", {"X-Hub-Signature-256": sign("other", body)}, body)[0] == 401
    assert records == []
    assert s.handle_post("/whatsapp/webhook", {"X-Hub-Signature-256": sign("s3cret", body)}, body) == (200, "ok")
    assert records == [json.loads(body)]
    assert s.handle_post("/elsewhere", {"X-Hub-Signature-256": sign("s3cret", body)}, body)[0] == 404
    assert s.handle_post("/whatsapp/webhook?x=1", {}, None)[0] == 413
    junk = b"not json"
    assert s.handle_post("/whatsapp/webhook", {"X-Hub-Signature-256": sign("s3cret", junk)}, junk)[0] == 400


def test_a_notification_that_cannot_be_recorded_is_not_answered_200_so_meta_sends_it_again():
    records: list = []
    body = b'{"object": "whatsapp_business_account", "entry": []}'
    assert server(records, fail=True).handle_post("/whatsapp/webhook", {"X-Hub-Signature-256": sign("s3cret", body)},
                                                  body) == (500, "not recorded")


# -- the GET handshake ---------------------------------------------------------------------------------

def test_the_verification_handshake_answers_the_challenge_only_for_the_verify_token():
    q = "hub.mode=subscribe&hub.challenge=1158201444&hub.verify_token="
    assert verification_answer(q + "vt", "vt") == (200, "1158201444")
    assert verification_answer(q + "wrong", "vt")[0] == 403
    assert verification_answer(q, "vt")[0] == 403
    assert verification_answer("hub.challenge=1&hub.verify_token=vt", "vt")[0] == 403      # no hub.mode
    assert verification_answer("hub.mode=unsubscribe&hub.challenge=1&hub.verify_token=vt", "vt")[0] == 403
    assert verification_answer(q, "")[0] == 403  # no verify token configured: nobody passes
    s = server([])
    assert s.handle_get("/whatsapp/webhook?" + q + "vt") == (200, "1158201444")
    assert s.handle_get("/other?" + q + "vt")[0] == 404


# -- normalisation ---------------------------------------------------------------------------------------

def test_a_text_message_is_normalised_with_its_wamid_sender_and_reply_context():
    fake = FakeWhatsApp()
    payload = fake.message(USER, "hello", name="Ann", context="wamid.PREVIOUS==")
    payload["entry"][0]["changes"][0]["value"]["messages"][0]["timestamp"] = "1700000000"
    [msg] = worker().normalise(payload)
    wamid = payload["entry"][0]["changes"][0]["value"]["messages"][0]["id"]
    assert (msg.channel, msg.conversation_id, msg.message_id, msg.sender_id, msg.sender_name, msg.source_type,
            msg.text) == ("whatsapp", USER, wamid, USER, "Ann", "user", "hello")
    assert msg.reply_to.message_id == "wamid.PREVIOUS=="
    assert msg.timestamp == "2023-11-14T22:13:20Z"
    assert msg.metadata["phone_number_id"] == PHONE_NUMBER_ID
    msg.validate()


@pytest.mark.parametrize("kind, media, expected_kind", [
    ("image", {"id": "111", "mime_type": "image/jpeg", "sha256": "x", "caption": "look"}, "image"),
    ("document", {"id": "222", "mime_type": "application/pdf", "filename": "a.pdf"}, "document"),
    ("audio", {"id": "333", "mime_type": "audio/ogg; codecs=opus", "voice": True}, "audio"),
    ("video", {"id": "444", "mime_type": "video/mp4"}, "video"),
    ("sticker", {"id": "555", "mime_type": "image/webp", "animated": False}, "image"),
])
def test_media_become_attachments_fetched_by_their_media_id(kind, media, expected_kind):
    [msg] = worker().normalise(FakeWhatsApp().message(text=None, kind=kind, media=media))
    [att] = msg.attachments
    assert (att.kind, att.content_type, att.url, att.channel_ref) == (
        expected_kind, media["mime_type"].split(";")[0], MEDIA_URL_PREFIX + media["id"], media["id"])
    assert att.filename == media.get("filename")
    assert msg.text == media.get("caption", "")
    msg.validate()


@pytest.mark.parametrize("kind, content, text", [
    ("button", {"payload": "YES_PAYLOAD", "text": "Yes"}, "Yes"),
    ("interactive", {"type": "button_reply", "button_reply": {"id": "opt-1", "title": "First"}}, "First"),
    ("interactive", {"type": "list_reply", "list_reply": {"id": "row-2", "title": "Second", "description": "d"}},
     "Second"),
    ("location", {"latitude": 52.52, "longitude": 13.405, "name": "Office", "address": "Main St 1"},
     "Office Main St 1 (52.52, 13.405)"),
])
def test_replies_to_buttons_and_locations_are_read_as_text(kind, content, text):
    [msg] = worker().normalise(FakeWhatsApp().message(text=None, kind=kind, media=content))
    assert msg.text == text and msg.attachments == []


def test_statuses_another_phone_number_and_unreadable_types_are_not_messages():
    fake, w = FakeWhatsApp(), worker()
    for status in ("sent", "delivered", "read", "failed"):
        assert w.normalise(fake.status("wamid.X==", status, errors=[{"code": 131026}])) == []
    assert w.normalise(fake.message(text="hi", phone_number_id="999")) == []
    assert w.normalise(fake.message(text=None, kind="reaction", media={"message_id": "wamid.X", "emoji": "👍"})) == []
    assert w.normalise(fake.message(text="   ")) == []
    other_field = fake.message(text="hi")
    other_field["entry"][0]["changes"][0]["field"] = "message_template_status_update"
    assert w.normalise(other_field) == []


def test_a_notification_with_messages_and_statuses_yields_only_the_messages():
    fake = FakeWhatsApp()
    payload = fake.message(text="one")
    value = payload["entry"][0]["changes"][0]["value"]
    value["statuses"] = fake.status("wamid.S==")["entry"][0]["changes"][0]["value"]["statuses"]
    value["messages"].append(dict(value["messages"][0], id="wamid.SECOND==", text={"body": "two"}))
    assert [m.text for m in worker().normalise(payload)] == ["one", "two"]


# -- formatting and splitting -----------------------------------------------------------------------------

@pytest.mark.parametrize("markdown, whatsapp", [
    ("**bold** and __bold__", "*bold* and *bold*"),
    ("*italic* and _italic_", "_italic_ and _italic_"),
    ("~~gone~~", "~gone~"),
    ("# Title", "*Title*"),
    ("## **Already bold** title", "*Already bold title*"),
    ("[docs](https://x.org/a?b=1)", "docs (https://x.org/a?b=1)"),
    ("[https://x.org](https://x.org)", "https://x.org"),
    ("- one\n  * two\n+ three", "- one\n  - two\n- three"),
    ("> quoted **b**", "> quoted *b*"),
    ("`a **b** _c_`", "`a **b** _c_`"),
    ("```python\nx = **y**\n```", "```x = **y**```"),
    ("2 * 3 * 4 and snake_case_name", "2 * 3 * 4 and snake_case_name"),
    ("***both***", "*_both_*"),
])
def test_markdown_becomes_whatsapp_formatting(markdown, whatsapp):
    assert to_whatsapp(markdown) == whatsapp


@pytest.mark.parametrize("url", [
    "https://docs.python.org/3/reference/datamodel.html#object.__init__",
    "https://github.com/org/repo/blob/main/pkg/__init__.py",
    "https://example.com/search?q=*foo*&x=1",
    "http://example.com/~~old~~/a_b_c",
])
def test_a_bare_url_reaches_whatsapp_unchanged(url):
    assert to_whatsapp(f"See {url} for details") == f"See {url} for details"
    assert to_whatsapp(f"**See** {url}") == f"*See* {url}"
    assert to_whatsapp(f"[the docs]({url}) and {url}") == f"the docs ({url}) and {url}"


def test_a_long_answer_is_split_within_4096_characters_with_code_fences_closed_in_each_part():
    answer = "intro\n\n```\n" + "\n".join(f"line {i} < {i + 1}" for i in range(900)) + "\n```\n\nend"
    parts = message_parts(answer)
    assert len(parts) > 1 and all(len(p) <= 4096 for p in parts)
    assert all(p.count("```") % 2 == 0 for p in parts)
    words = ("word " * 2000).strip()
    parts = message_parts(words)
    assert len(parts) == 3 and all(len(p) <= 4096 for p in parts)
    assert " ".join(parts).split() == words.split()
    assert message_parts("") == [] and message_parts("  \n ") == []
    assert message_parts("**x**") == ["*x*"]


@pytest.mark.parametrize("markdown", ["---", "***", "- - -", "___", "# a", "* b", "[t](u)", "![](u)", "***x***",
                                      "```\nx\n```", "```py", "```", "```\n\n```", "```py\nx", "> **q**", "__a__ ~~b~~ *c*"])
def test_conversion_never_makes_markdown_longer(markdown):
    assert len(to_whatsapp(markdown)) <= len(markdown)
    assert len(to_whatsapp(f"text\n\n{markdown}\n\nmore")) <= len(f"text\n\n{markdown}\n\nmore")


def long_code_answer() -> tuple[str, list[str]]:
    intro = "\n\n".join(f"**Note {i}**: keep this in mind.\n\n---" for i in range(8))
    lines = [f"result_{i} = compute(value_{i}, factor={i})" for i in range(120)]
    return intro + "\n\n```python\n" + "\n".join(lines) + "\n```\n\nDone.", lines


def test_a_part_past_the_limit_after_conversion_is_re_split_as_markdown_without_a_bogus_code_line(monkeypatch):
    from plugins_app.channel.workers.whatsapp import formatting
    md, lines = long_code_answer()
    parts = message_parts(md)  # the "---" rules once grew the first part past 4,096
    assert all(len(p) <= 4096 for p in parts)
    assert [l.strip("`") for p in parts for l in p.split("\n") if "result_" in l] == lines
    real = formatting.to_whatsapp  # a conversion that grows a part: split again as Markdown, never converted text
    monkeypatch.setattr(formatting, "to_whatsapp", lambda text: real(text).replace("keep", "keep keep keep"))
    parts = message_parts(md)
    assert len(parts) >= 2 and all(len(p) <= 4096 for p in parts)
    assert [l.strip("`") for p in parts for l in p.split("\n") if "result_" in l] == lines
    assert all(p.count("```") % 2 == 0 for p in parts)


# -- Graph errors, waits and sends -------------------------------------------------------------------------

@pytest.mark.parametrize("status, code, kind", [
    (401, 190, "auth"), (400, 190, "auth"), (401, None, "auth"), (403, 10, "auth"), (403, 200, "auth"),
    (429, 130429, "rate"), (400, 131056, "rate"), (400, 4, "rate"), (400, 80007, "rate"), (429, None, "rate"),
    (400, 131047, "permanent"), (400, 131026, "permanent"), (400, 100, "permanent"),
    (500, 1, "retry"), (503, None, "retry"), (400, 2, "retry"),
    (400, 133010, "account"), (403, 3, "account"), (400, 368, "account"), (400, 131031, "account"),
])
def test_graph_errors_are_classified(status, code, kind):
    assert classify(GraphError(status=status, code=code)) == kind


def test_a_graph_error_body_is_read_with_its_code_subcode_and_details():
    body = graph_error(131047, "Re-engagement message", details="more than 24 hours have passed", subcode=2494010)
    err = parse_error(httpx.Response(400, json=body, headers={"Retry-After": "7"}))
    assert (err.status, err.code, err.subcode, err.retry_after, err.kind) == (400, 131047, 2494010, 7.0, "OAuthException")
    assert str(err) == "HTTP 400, code 131047/2494010: Re-engagement message (more than 24 hours have passed)"
    assert parse_error(httpx.Response(502, text="<html>bad gateway</html>")).code is None


def scripted_api(answers: list[httpx.Response], seen: list, **kw) -> GraphApi:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)
    client = httpx.Client(transport=httpx.MockTransport(handler), headers={"Authorization": "Bearer tok"})
    return GraphApi("tok", PHONE_NUMBER_ID, base_url="https://graph.example/v21.0", client=client, **kw)


def ok(wamid: str = "wamid.OK==") -> httpx.Response:
    return httpx.Response(200, json={"messaging_product": "whatsapp", "contacts": [{"input": USER, "wa_id": USER}],
                                     "messages": [{"id": wamid}]})


def test_a_rate_limit_is_waited_out_honouring_retry_after_else_a_doubling_backoff():
    seen: list = []
    api = scripted_api([httpx.Response(429, json=graph_error(130429, "Rate limit hit"), headers={"Retry-After": "0.05"}),
                        httpx.Response(400, json=graph_error(131056, "pair rate limit")),
                        httpx.Response(400, json=graph_error(4, "app limit")),
                        ok()], seen, backoff=(0.01, 0.015))
    assert api.send({"to": USER})["messages"][0]["id"] == "wamid.OK=="
    assert api.waits == [0.05, 0.01, 0.015] and len(seen) == 4
    assert str(seen[0].url) == f"https://graph.example/v21.0/{PHONE_NUMBER_ID}/messages"
    assert seen[0].headers["Authorization"] == "Bearer tok"


def test_a_rate_limit_longer_than_the_bound_goes_back_to_the_hub_without_waiting_it():
    api = scripted_api([httpx.Response(429, json=graph_error(80007, "WABA limit"), headers={"Retry-After": "3600"})],
                       [], max_wait_secs=5)
    with pytest.raises(RateLimited):
        api.send({"to": USER})
    assert api.waits == []


def test_a_refused_download_host_never_gets_the_token():
    seen: list = []
    api = scripted_api([httpx.Response(200, json={"url": "https://evil.example/x", "mime_type": "image/jpeg"})], seen)
    with pytest.raises(ValueError, match="not Meta's"):
        api.download("111")
    assert len(seen) == 1
    assert api.media_host_allowed("https://lookaside.fbsbx.com/whatsapp_business/attachments/?mid=1")
    assert not api.media_host_allowed("https://fbsbx.com.evil.example/")


def test_a_token_refused_at_a_media_download_is_a_refusal_the_listener_raises():
    from plugins_app.channel.sdk import Attachment, ChannelRefused
    w = worker()
    w.api = scripted_api([httpx.Response(401, json=graph_error(190, "Error validating access token"))], [])
    with pytest.raises(GraphError):
        w.fetch_media(Attachment(kind="image", content_type="image/jpeg", url=MEDIA_URL_PREFIX + "123"))
    assert "WHATSAPP_ACCESS_TOKEN" in w._refusal
    with pytest.raises(ChannelRefused, match="code 190"):
        w.listen(lambda m: None)


@pytest.mark.parametrize("status, code, later", [
    (503, None, True), (500, 1, True), (429, None, True),           # Meta busy: the message waits for its file
    (400, 4, True), (400, 80007, True), (400, 130429, True),       # Meta's rate limits come with a 400
    (404, None, False), (400, 100, False), (451, None, False),     # any other 4xx: the file is not coming
])
def test_a_media_download_meta_cannot_give_now_waits_and_any_other_4xx_is_final(status, code, later):
    from plugins_app.channel.sdk import Attachment, MediaNotReady
    w = worker()
    w.api = scripted_api([httpx.Response(200, json={"url": "https://lookaside.fbsbx.com/whatsapp_business/attachments/"
                                                           "?mid=1", "mime_type": "image/jpeg"}),
                          httpx.Response(status, json=graph_error(code, "the file") if code else {})], [])
    with pytest.raises(MediaNotReady if later else GraphError):
        w.fetch_media(Attachment(kind="image", content_type="image/jpeg", url=MEDIA_URL_PREFIX + "123"))
    assert w._refusal is None


def delivery(text: str, **kw) -> Delivery:
    return Delivery(delivery_id=kw.pop("delivery_id", "d-1"), conversation_id=USER, text=text, channel="whatsapp", **kw)


def sending_worker(tmp_path, answers: list[httpx.Response], seen: list) -> WhatsAppWorker:
    w = worker()
    w.api = scripted_api(answers, seen)
    w._journal = SentJournal(str(tmp_path / "sent.sqlite3"))
    return w


def test_a_two_part_answer_replies_with_its_first_part_and_journals_each(tmp_path):
    seen: list = []
    text = ("word " * 800).strip() + "\n\n" + "**end** " + "tail " * 30
    w = sending_worker(tmp_path, [ok("wamid.ONE=="), ok("wamid.TWO==")], seen)
    d = delivery(text, reply_to_message_id="wamid.ASKED==")
    assert w.deliver(d) == "wamid.ONE=="
    bodies = [json.loads(r.content) for r in seen]
    assert bodies[0]["context"] == {"message_id": "wamid.ASKED=="} and "context" not in bodies[1]
    assert [b["text"]["body"] for b in bodies] == message_parts(text)
    assert bodies[1]["text"] == {"body": "*end* " + "tail " * 30, "preview_url": False}
    assert all((b["messaging_product"], b["recipient_type"], b["to"], b["type"]) ==
               ("whatsapp", "individual", USER, "text") for b in bodies)
    assert w.already_delivered(d)
    assert not w.already_delivered(delivery(text, delivery_id="d-2"))


def test_after_a_crash_only_the_parts_meta_did_not_take_are_sent(tmp_path):
    seen: list = []
    text = ("word " * 800).strip() + "\n\nlast part " + "tail " * 30
    w = sending_worker(tmp_path, [ok("wamid.TWO==")], seen)
    w._journal.record("d-1", 0, "wamid.ONE==")  # part one went out before the crash
    d = delivery(text, reply_to_message_id="wamid.ASKED==")
    assert not w.already_delivered(d)
    assert w.deliver(d) == "wamid.ONE=="
    assert [json.loads(r.content)["text"]["body"] for r in seen] == message_parts(text)[1:]


@pytest.mark.parametrize("kind, content_type, expected", [
    ("image", "image/jpeg", {"type": "image", "image": {"id": "m1"}}),
    ("document", "image/png", {"type": "image", "image": {"id": "m1"}}),
    ("audio", "audio/ogg; codecs=opus", {"type": "audio", "audio": {"id": "m1"}}),
    ("video", "video/mp4", {"type": "video", "video": {"id": "m1"}}),
    ("document", "application/pdf", {"type": "document", "document": {"id": "m1", "filename": "f.bin"}}),
])
def test_a_file_goes_as_the_message_type_whatsapp_shows_it_as(kind, content_type, expected):
    from plugins_app.channel.sdk import Attachment
    from plugins_app.channel.workers.whatsapp.worker import media_message
    assert media_message(Attachment(kind=kind, content_type=content_type, channel_ref="m1", filename="f.bin")) == expected
    assert media_message(Attachment(kind="image", content_type="image/png", url="https://x.org/a.png")) == \
        {"type": "image", "image": {"link": "https://x.org/a.png"}}


@pytest.mark.parametrize("kind, content_type", [
    ("document", "text/csv"), ("image", "image/gif"), ("image", "image/webp"), ("document", "application/zip"),
    ("document", None),
])
def test_a_file_no_whatsapp_message_takes_has_no_message_type(kind, content_type):
    from plugins_app.channel.sdk import Attachment
    from plugins_app.channel.workers.whatsapp.worker import message_type
    assert message_type(Attachment(kind=kind, content_type=content_type or "", channel_ref="m1")) is None


def test_a_file_metas_upload_refuses_is_replaced_by_a_note_and_the_text_still_goes(tmp_path):
    from plugins_app.channel.sdk import Attachment, Media
    seen: list = []
    refusal = graph_error(100, "(#100) Param file must be a file with one of the following types: audio/aac, "
                               "application/pdf. Received file of type 'application/pdf'.")
    w = sending_worker(tmp_path, [httpx.Response(400, json=refusal), ok("wamid.TEXT=="), ok("wamid.NOTE==")], seen)
    att = Attachment(kind="document", content_type="application/pdf", media_id="m_1", filename="r.pdf")
    d = delivery("see **the file**", attachments=[att])
    att.channel_ref = w.put_media(Media(b"%PDF", "application/pdf", "r.pdf"), att, d)
    assert w.deliver(d) == "wamid.TEXT=="
    texts = [json.loads(r.content)["text"]["body"] for r in seen[1:]]
    assert texts[0] == "see *the file*"
    assert texts[1].startswith("[r.pdf could not be sent: Meta refused the upload (HTTP 400, code 100: (#100) Param")
    assert w.already_delivered(d)


def test_an_unsupported_file_type_costs_the_user_only_that_file_named_in_a_note(tmp_path):
    import threading
    from plugins_app.channel.sdk import Attachment
    from plugins_app.channel.sdk.mock import MockBridge
    fake = FakeWhatsApp(send_statuses=False).start()
    with MockBridge(plugin_id="wa", heartbeat_secs=0.2) as bridge:
        w = WhatsAppWorker(argv=["--bind", "127.0.0.1:0"], environ=fake.env(),
                           **bridge.worker_kwargs(state_dir=str(tmp_path)))
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        try:
            csv = bridge.store_media(b"a,b\n1,2\n", "text/csv", "data.csv")
            pdf = bridge.store_media(b"%PDF-1.4", "application/pdf", "r.pdf")
            did = bridge.queue_delivery(USER, "Here is **your report**", attachments=[
                Attachment(kind="document", content_type="text/csv", media_id=csv, filename="data.csv"),
                Attachment(kind="document", content_type="application/pdf", media_id=pdf, filename="r.pdf")])
            bridge.wait_for(lambda: bridge.delivery(did)["state"] not in ("pending", "in_flight"), timeout=20)
            assert bridge.delivery(did)["state"] == "delivered", bridge.delivery(did)
            assert fake.texts() == ["Here is *your report*",
                                    "[data.csv could not be sent: WhatsApp does not take text/csv files]"]
            assert [u["filename"] for u in fake.uploads.values()] == ["r.pdf"]
            assert [m["type"] for m in fake.sent()] == ["text", "text", "document"]
        finally:
            w.stop()
            t.join(15)
            fake.stop()
    # the fake refuses, as Meta does, a type /media does not take
    refused = FakeWhatsApp().start()
    try:
        answer = httpx.post(f"{refused.base_url}/{PHONE_NUMBER_ID}/media",
                            headers={"Authorization": f"Bearer {refused.token}"},
                            data={"messaging_product": "whatsapp", "type": "text/csv"},
                            files={"file": ("d.csv", b"a,b", "text/csv")})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == 100
        assert answer.json()["error"]["message"].startswith("(#100) Param file must be a file with one of the "
                                                            "following types: ")
    finally:
        refused.stop()


def test_a_resumed_delivery_with_a_file_still_to_send_is_not_taken_for_delivered(tmp_path):
    from plugins_app.channel.sdk import Attachment
    w = sending_worker(tmp_path, [], [])
    d = delivery("see the file", attachments=[Attachment(kind="document", content_type="application/pdf",
                                                         media_id="m_1", filename="r.pdf")])
    w._journal.record("d-1", 0, "wamid.TEXT==")  # the text went out, the crash came before the file
    assert not w.already_delivered(d)
    w._journal.record("d-1", 1, "wamid.FILE==")
    assert w.already_delivered(d)


@pytest.mark.parametrize("status, body, permanent, reason", [
    (400, graph_error(131047, "Re-engagement message"), True, "131047: the 24-hour customer service window has closed"),
    (400, graph_error(131026, "Message undeliverable"), True, "HTTP 400, code 131026: Message undeliverable"),
    (500, graph_error(1, "An unknown error occurred", kind="OAuthException"), False, "HTTP 500, code 1"),
])
def test_a_refused_send_fails_permanently_or_not_by_its_code(tmp_path, status, body, permanent, reason):
    w = sending_worker(tmp_path, [httpx.Response(status, json=body)], [])
    with pytest.raises(DeliveryFailed) as failed:
        w.deliver(delivery("hi"))
    assert failed.value.permanent is permanent and failed.value.reason.startswith(reason)
    assert w._journal.done("d-1") == {}


def test_a_token_refused_at_a_send_is_a_refusal_the_listener_raises(tmp_path, monkeypatch):
    from plugins_app.channel.sdk import ChannelRefused
    from plugins_app.channel.workers.whatsapp import worker as module
    monkeypatch.setattr(module.WhatsAppWorker, "refusal_hold_secs", 0.0)
    w = sending_worker(tmp_path, [httpx.Response(401, json=graph_error(190, "Error validating access token"))], [])
    with pytest.raises(DeliveryFailed) as failed:
        w.deliver(delivery("hi"))
    assert not failed.value.permanent  # the answer waits for a new token
    assert "WHATSAPP_ACCESS_TOKEN" in w._refusal
    with pytest.raises(ChannelRefused, match="code 190"):
        w.listen(lambda m: None)


@pytest.mark.parametrize("code, message, fix", [
    (133010, "Account not registered", "register the number for the Cloud API"),
    (3, "(#3) Application does not have the capability to make this API call.", "lacks the capability"),
    (368, "Temporarily blocked for policies violations", "blocked for a policy violation"),
    (131031, "Account has been locked", "the business account is locked"),
])
def test_an_account_level_error_at_a_send_disables_the_plugin_instead_of_dead_lettering(
        tmp_path, monkeypatch, code, message, fix):
    from plugins_app.channel.sdk import ChannelRefused
    from plugins_app.channel.workers.whatsapp import worker as module
    monkeypatch.setattr(module.WhatsAppWorker, "refusal_hold_secs", 0.0)
    w = sending_worker(tmp_path, [httpx.Response(400, json=graph_error(code, message))], [])
    with pytest.raises(DeliveryFailed) as failed:
        w.deliver(delivery("hi"))
    assert not failed.value.permanent  # the answer waits for the operator's fix, no retries burnt meanwhile
    assert w._refusal.startswith(f"Meta refused to send for this WhatsApp account or number: HTTP 400, code {code}")
    assert fix in w._refusal and "WHATSAPP_ACCESS_TOKEN" not in w._refusal
    with pytest.raises(ChannelRefused, match=fix):
        w.listen(lambda m: None)
    with pytest.raises(DeliveryFailed) as again:  # another answer meanwhile: held, not sent, not dead-lettered
        w.deliver(delivery("more", delivery_id="d-2"))
    assert not again.value.permanent


@pytest.mark.parametrize("code, title, what", [
    (131047, "Re-engagement message", "the 24-hour customer service window had closed"),
    (131026, "Message undeliverable", "the message is undeliverable to them"),
])
def test_a_send_reported_failed_after_its_200_is_an_error_naming_the_delivery(tmp_path, caplog, code, title, what):
    w = sending_worker(tmp_path, [], [])
    w._journal.record("d-7", 1, "wamid.LATE==")
    status = FakeWhatsApp().status("wamid.LATE==", "failed", errors=[{"code": code, "title": title}])
    with caplog.at_level("INFO"):
        assert w.normalise(status) == []
    [record] = [r for r in caplog.records if "wamid.LATE==" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert f"failed (delivery d-7, part 2): {code}: {title}" in record.getMessage()
    assert what in record.getMessage()


def test_a_missing_variable_is_a_refusal_naming_it():
    from plugins_app.channel.sdk import ChannelRefused
    with pytest.raises(ChannelRefused, match="WHATSAPP_ACCESS_TOKEN is not set"):
        worker().connect()
    with pytest.raises(ChannelRefused, match="WHATSAPP_APP_SECRET is not set"):
        worker(WHATSAPP_ACCESS_TOKEN="t").connect()


# -- registration --------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_whatsapp_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-whatsapp"]
    assert kind.module == "plugins_app.channel.workers.whatsapp"
    assert kind.env_refs == ("WHATSAPP_ACCESS_TOKEN", "WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN",
                             "WHATSAPP_PHONE_NUMBER_ID")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "whatsapp-main"\nkind = "channel-whatsapp"\n'
                               'args = ["--bind", "127.0.0.1:3000"]\nenv_refs = ["WHATSAPP_ACCESS_TOKEN", '
                               '"WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN", "WHATSAPP_PHONE_NUMBER_ID"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.whatsapp", "--bind", "127.0.0.1:3000"])


# -- a question's options as an interactive message --------------------------------------------------

def options(n: int, label: str = "Option {n}") -> dict:
    return {"kind": "question", "options": [{"id": f"o{i}", "label": label.format(n=i), "value": f"q_abc:{i}"}
                                            for i in range(1, n + 1)]}


QUESTION = "Which one?\n1. Option 1\n2. Option 2"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_up_to_three_options_are_reply_buttons_whose_id_is_the_value(n):
    inter = interactive_message(QUESTION, options(n))
    assert inter == {"type": "button", "body": {"text": QUESTION}, "action": {"buttons": [
        {"type": "reply", "reply": {"id": f"q_abc:{i}", "title": f"Option {i}"}} for i in range(1, n + 1)]}}
    assert interactive_problems(inter) == []


@pytest.mark.parametrize("n", [4, 10])
def test_four_to_ten_options_are_one_list_of_rows(n):
    inter = interactive_message(QUESTION, options(n))
    assert inter["type"] == "list" and inter["body"] == {"text": QUESTION}
    assert inter["action"]["button"] == "Choose"
    [section] = inter["action"]["sections"]
    assert section["rows"] == [{"id": f"q_abc:{i}", "title": f"Option {i}"} for i in range(1, n + 1)]
    assert interactive_problems(inter) == []


def test_more_than_ten_options_a_body_past_1024_or_an_option_no_button_carries_stay_plain_text():
    assert interactive_message(QUESTION, options(11)) is None
    assert interactive_message("x" * 1025, options(2)) is None and interactive_message("x" * 1024, options(2))
    assert interactive_message("x" * 1025, options(5)) is None
    assert interactive_message(QUESTION, {}) is None and interactive_message(QUESTION, {"options": []}) is None
    for n, limit in ((3, 256), (4, 200)):  # a button's id at most 256, a row's at most 200
        meta = options(n)
        meta["options"][0]["value"] = "x" * limit
        assert interactive_message(QUESTION, meta) is not None
        meta["options"][0]["value"] = "x" * (limit + 1)
        assert interactive_message(QUESTION, meta) is None
    same = options(2)
    same["options"][1]["value"] = same["options"][0]["value"]
    assert interactive_message(QUESTION, same) is None
    spaced = options(2)
    spaced["options"][0]["value"] = " q_abc:1"
    assert interactive_message(QUESTION, spaced) is None


def test_long_labels_are_cut_at_a_word_and_titles_made_unique_by_their_number():
    inter = interactive_message(QUESTION, {"options": [
        {"label": "Postpone until the next sprint review", "value": "q:1"}, {"label": "Now", "value": "q:2"}]})
    assert [b["reply"]["title"] for b in inter["action"]["buttons"]] == ["Postpone until the\u2026", "Now"]
    inter = interactive_message(QUESTION, options(3, "Deploy to the staging cluster {n}"))
    titles = [b["reply"]["title"] for b in inter["action"]["buttons"]]
    assert titles == ["1. Deploy to the\u2026", "2. Deploy to the\u2026", "3. Deploy to the\u2026"]
    assert interactive_problems(inter) == []
    rows = interactive_message(QUESTION, options(4, "A rather long label for row {n} of four"))[
        "action"]["sections"][0]["rows"]
    assert rows[0] == {"id": "q_abc:1", "title": "1. A rather long label\u2026",
                       "description": "A rather long label for row 1 of four"}
    assert all(len(r["title"]) <= 24 and len(r["description"]) <= 72 for r in rows)
    assert shorten("Supercalifragilisticexpialidocious", 20) == "Supercalifragilisti\u2026"


def test_the_fake_refuses_what_meta_would():
    buttons = interactive_message(QUESTION, options(3))
    assert interactive_problems({**buttons, "action": {"buttons": buttons["action"]["buttons"] * 2}})
    long_title = json.loads(json.dumps(buttons))
    long_title["action"]["buttons"][0]["reply"]["title"] = "x" * 21
    assert interactive_problems(long_title)
    rows = interactive_message(QUESTION, options(10))
    eleven = json.loads(json.dumps(rows))
    eleven["action"]["sections"][0]["rows"].append({"id": "q_abc:11", "title": "Option 11"})
    assert interactive_problems(eleven)
    assert interactive_problems({**rows, "body": {"text": "x" * 1025}})


def question_delivery(n: int, text: str = QUESTION, **kw) -> Delivery:
    return delivery(text, delivery_id=kw.pop("delivery_id", "d_q_abc"), reply_to_message_id="wamid.ASKED==",
                    metadata=options(n), **kw)


def test_a_question_goes_as_one_interactive_part_replying_to_the_message_and_journaled(tmp_path):
    seen: list = []
    w = sending_worker(tmp_path, [ok("wamid.Q==")], seen)
    d = question_delivery(2)
    assert w.deliver(d) == "wamid.Q=="
    [body] = [json.loads(r.content) for r in seen]
    assert body["type"] == "interactive" and body["context"] == {"message_id": "wamid.ASKED=="}
    assert body["interactive"] == interactive_message(QUESTION, options(2)) and "text" not in body
    assert w._journal.done("d_q_abc") == {0: "wamid.Q=="} and w.already_delivered(d)
    assert w.deliver(d) == "wamid.Q==" and len(seen) == 1  # resumed after a crash: not sent again


def test_a_question_whatsapp_cannot_show_as_buttons_goes_as_its_numbered_text(tmp_path):
    seen: list = []
    w = sending_worker(tmp_path, [ok("wamid.A=="), ok("wamid.B=="), ok("wamid.C==")], seen)
    w.deliver(question_delivery(11, text="Which?\n" + "\n".join(f"{i}. Option {i}" for i in range(1, 12))))
    w.deliver(question_delivery(2, text="Which? " + "word " * 300, delivery_id="d_q_long"))
    bodies = [json.loads(r.content) for r in seen]
    assert [b["type"] for b in bodies] == ["text", "text"]
    assert bodies[0]["text"]["body"].endswith("11. Option 11")


@pytest.mark.parametrize("content, option, text", [
    ({"type": "button_reply", "button_reply": {"id": "q_abc:2", "title": "High"}}, "q_abc:2", "High"),
    ({"type": "list_reply", "list_reply": {"id": "q_abc:4", "title": "Extra large\u2026", "description": "d"}},
     "q_abc:4", "Extra large\u2026"),
])
def test_a_press_is_a_message_whose_option_is_the_id_and_whose_text_is_the_title(content, option, text):
    payload = FakeWhatsApp().message(text=None, kind="interactive", media=content, context="wamid.Q==")
    [msg] = worker().normalise(payload)
    assert (msg.metadata["option"], msg.text, msg.metadata["type"]) == (option, text, "interactive")
    assert msg.reply_to.message_id == "wamid.Q=="
    msg.validate()
    [again] = worker().normalise(payload)  # Meta's retry: the same wamid, the same message
    assert (again.message_id, again.text) == (msg.message_id, msg.text)
    assert "option" not in worker().normalise(FakeWhatsApp().message(text="High"))[0].metadata


@pytest.mark.parametrize("code", [100, 131008, 131009, 131051])
def test_an_interactive_message_meta_refuses_goes_as_the_numbered_text_under_the_same_step(tmp_path, code):
    seen: list = []
    w = sending_worker(tmp_path, [httpx.Response(400, json=graph_error(code, "refused")), ok("wamid.T==")], seen)
    d = question_delivery(2)
    assert w.deliver(d) == "wamid.T=="
    refused, text = [json.loads(r.content) for r in seen]
    assert refused["type"] == "interactive"
    assert text["type"] == "text" and text["text"] == {"body": QUESTION, "preview_url": False}
    assert text["context"] == {"message_id": "wamid.ASKED=="} and "interactive" not in text
    assert w._journal.done("d_q_abc") == {0: "wamid.T=="} and w.already_delivered(d)
    assert w.deliver(d) == "wamid.T==" and len(seen) == 2  # resumed after a crash: nothing sent again


def test_an_interactive_message_refused_for_another_reason_is_not_replaced_by_text(tmp_path):
    seen: list = []
    w = sending_worker(tmp_path, [httpx.Response(400, json=graph_error(131026, "undeliverable"))], seen)
    with pytest.raises(DeliveryFailed) as failed:
        w.deliver(question_delivery(2))
    assert failed.value.permanent and len(seen) == 1
