"""channel-wecom's outbound parts on their own: the media type and limit a file goes by, the upload on the
wire, the media ids kept across a crash, the parts a delivery sends, the question card's rendering and the
reading of a press (``template_card_event``)."""
from __future__ import annotations

import hashlib
import re
import uuid

import pytest

from plugins_app.channel.sdk import Attachment, Delivery, DeliveryFailed, Media
from plugins_app.channel.workers.wecom import (MB, UNSENT, UPLOADED, WeComWorker, amr_seconds, media_type, normalise,
                                               normalise_press, size_refusal)
from plugins_app.channel.workers.wecom.api import TASK_ID_EXISTS
from plugins_app.channel.workers.wecom.cards import question_card, task_id_of
from plugins_app.channel.workers.wecom.state import WeComState
from tests.fakes.wecom import AGENT_ID, USER, FakeWeCom, amr_nb

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

OPTIONS = [{"id": "low", "label": "Low", "value": "q_1:1"}, {"id": "high", "label": "High", "value": "q_1:2"}]
TEXT = "Which priority?\n1. Low\n2. High"


# -- the media type and its limit ------------------------------------------------------------------

@pytest.mark.parametrize("ctype, name, mtype", [
    ("image/jpeg", "a.jpg", "image"), ("image/png", None, "image"), ("image/jpg", "x", "image"),
    ("image/gif", "a.gif", "file"), ("image/webp", "a.webp", "file"),
    ("audio/amr", "memo.amr", "voice"), ("audio/mpeg", "song.mp3", "file"), ("audio/ogg", None, "file"),
    ("video/mp4", "clip.mp4", "video"), ("video/quicktime", "clip.mov", "file"),
    ("application/pdf", "report.pdf", "file"), ("text/plain; charset=utf-8", "notes.txt", "file"),
    ("application/octet-stream", "photo.JPG", "image"), ("application/octet-stream", "memo.amr", "voice"),
    ("application/octet-stream", "clip.mp4", "video"), ("application/octet-stream", "data.bin", "file"),
    ("", "photo.png", "image"), ("application/pdf", "looks-like.png", "file"),
])
def test_a_files_media_type_is_wecoms_image_voice_video_or_else_file(ctype, name, mtype):
    assert media_type(ctype, name) == mtype


@pytest.mark.parametrize("mtype, size, refused", [
    ("image", 10 * MB, False), ("image", 10 * MB + 1, True), ("voice", 2 * MB, False), ("voice", 2 * MB + 1, True),
    ("video", 10 * MB, False), ("video", 10 * MB + 1, True), ("file", 20 * MB, False), ("file", 20 * MB + 1, True),
    ("file", 6, False), ("file", 5, True), ("image", 0, True),
])
def test_wecoms_size_limits_per_media_type(mtype, size, refused):
    assert (size_refusal(mtype, size) is not None) == refused


def test_the_refusal_says_the_size_and_the_limit():
    assert size_refusal("voice", 3 * MB) == "it is 3.0 MB, over WeCom's 2 MB limit for a voice (amr)"
    assert size_refusal("file", 25 * MB) == "it is 25.0 MB, over WeCom's 20 MB limit for a file"
    assert size_refusal("image", 3) == "it is 3 bytes, and WeCom takes no file of 5 bytes or less"


# -- the worker's uploads and parts, against the fake -----------------------------------------------

@pytest.fixture
def wecom():
    with FakeWeCom() as f:
        yield f


@pytest.fixture
def worker(wecom, tmp_path):
    w = WeComWorker(argv=[], environ=wecom.env(), socket_path="/nowhere", plugin_id="wecom-test", token="t",
                    install_signal_handlers=False)
    w.state = WeComState(str(tmp_path / "wecom.sqlite3"))
    yield w
    w.state.close()
    w.api.close()


def delivery(*attachments: Attachment, text: str = "here", delivery_id: str = "d-1", metadata=None) -> Delivery:
    return Delivery(delivery_id=delivery_id, conversation_id=USER, text=text, attachments=list(attachments),
                    metadata=metadata or {})


def test_an_upload_is_multipart_field_media_with_its_type_and_name(worker, wecom):
    att = Attachment(kind="image", content_type="image/png", media_id="m_1", filename="chart.png")
    d = delivery(att)
    ref = worker.put_media(Media(b"\x89PNG\r\n-data", "image/png", "chart.png"), att, d)
    [(media_id, upload)] = wecom.uploads.items()
    assert ref == f"{UPLOADED}image:{media_id}"
    assert upload == {"type": "image", "data": b"\x89PNG\r\n-data", "filename": "chart.png",
                      "content_type": "image/png", "created_at": upload["created_at"]}
    [call] = wecom.calls_to("/cgi-bin/media/upload")
    assert call.params["type"] == "image" and call.params["access_token"] in wecom.tokens


def test_a_media_id_is_kept_so_a_resumed_delivery_uploads_nothing_again(worker, wecom):
    att = Attachment(kind="document", content_type="application/pdf", media_id="m_1", filename="r.pdf")
    first = worker.put_media(Media(b"%PDF-1.4 x", "application/pdf"), att, delivery(att))
    again = Attachment(kind="document", content_type="application/pdf", media_id="m_1", filename="r.pdf")
    assert worker.put_media(Media(b"%PDF-1.4 x", "application/pdf"), again, delivery(again)) == first
    assert len(wecom.calls_to("/cgi-bin/media/upload")) == 1
    other = Attachment(kind="document", content_type="application/pdf", media_id="m_1", filename="r.pdf")
    worker.put_media(Media(b"%PDF-1.4 x", "application/pdf"), other, delivery(other, delivery_id="d-2"))
    assert len(wecom.calls_to("/cgi-bin/media/upload")) == 2  # another delivery's file is its own


def test_a_media_id_near_its_three_days_is_uploaded_again(tmp_path):
    now = [1_000_000.0]
    state = WeComState(str(tmp_path / "s.sqlite3"), clock=lambda: now[0])
    state.record_upload("d-1", 0, "file", "MEDIA", now[0])
    assert state.upload_of("d-1", 0) == ("file", "MEDIA")
    now[0] += 3 * 86400 - 3601
    assert state.upload_of("d-1", 0) == ("file", "MEDIA")
    now[0] += 2
    assert state.upload_of("d-1", 0) is None
    state.close()


def test_rows_past_30_days_are_deleted_by_a_worker_that_keeps_running(tmp_path):
    now = [1_000_000.0]
    state = WeComState(str(tmp_path / "s.sqlite3"), clock=lambda: now[0])
    state.record_card("ugent-d_old", "d_old", OPTIONS)
    state.record_upload("d_old", 0, "file", "OLD", now[0])
    now[0] += 30 * 86400 + 1  # never restarted in between: no prune at start
    assert state.card("ugent-d_old") == OPTIONS
    state.record_card("ugent-d_new", "d_new", OPTIONS)
    assert state.card("ugent-d_old") is None and state.card("ugent-d_new") == OPTIONS
    assert state._db.execute("SELECT media_id FROM uploads").fetchall() == []
    state.close()


def test_an_oversized_file_is_not_uploaded_and_the_text_carries_a_note(worker, wecom):
    memo = Attachment(kind="audio", content_type="audio/amr", media_id="m_1", filename="memo.amr")
    tiny = Attachment(kind="document", content_type="text/plain", media_id="m_2")
    photo = Attachment(kind="image", content_type="image/jpeg", media_id="m_3", filename="p.jpg")
    d = delivery(memo, tiny, photo)
    memo.channel_ref = worker.put_media(Media(b"x" * (2 * MB + 1), "audio/amr"), memo, d)
    tiny.channel_ref = worker.put_media(Media(b"hey", "text/plain"), tiny, d)
    photo.channel_ref = worker.put_media(Media(b"\xff\xd8\xff" + b"j" * 50, "image/jpeg"), photo, d)
    assert memo.channel_ref.startswith(UNSENT) and tiny.channel_ref.startswith(UNSENT)
    [(media_id, upload)] = wecom.uploads.items()
    assert upload["filename"] == "p.jpg"
    assert worker.parts(d) == [
        ("text", {"content": "here\n\n[memo.amr was not sent: it is 2.0 MB, over WeCom's 2 MB limit for a voice "
                             "(amr)]\n\n[a document was not sent: it is 3 bytes, and WeCom takes no file of 5 bytes "
                             "or less]"}),
        ("image", {"media_id": media_id})]


def test_an_upload_wecom_refuses_for_the_file_becomes_a_note(worker, wecom):
    odd = Attachment(kind="image", content_type="image/png", media_id="m_1", filename="odd.gif")
    d = delivery(odd, text="")
    wecom.upload_errcode = 40005
    odd.channel_ref = worker.put_media(Media(b"GIF89a-not-png", "image/png"), odd, d)
    assert odd.channel_ref == UNSENT + "WeCom does not take its type (errcode 40005)"
    assert worker.parts(d) == [("text", {"content": "[odd.gif was not sent: WeCom does not take its type "
                                                    "(errcode 40005)]"})]


@pytest.mark.parametrize("errcode, why", [
    (45001, "it is over WeCom's size limit (errcode 45001)"),
    (45007, "it plays longer than WeCom's 60 s for a voice (errcode 45007)"),
    (41005, "WeCom received no data for it (errcode 41005)"),
    (48002, "WeCom refused it (errcode 48002)"),  # one no list names: still this file's, not the answer's
])
def test_any_upload_refusal_but_a_transient_one_is_a_note_and_the_text_still_goes(worker, wecom, errcode, why):
    memo = Attachment(kind="audio", content_type="audio/amr", media_id="m_1", filename="memo.amr")
    d = delivery(memo, text="the memo")
    wecom.upload_errcode = errcode
    memo.channel_ref = worker.put_media(Media(amr_nb(5), "audio/amr"), memo, d)
    assert memo.channel_ref == UNSENT + why
    assert worker.parts(d) == [("text", {"content": f"the memo\n\n[memo.amr was not sent: {why}]"})]


@pytest.mark.parametrize("errcode", [-1, 45009])
def test_an_upload_refused_for_a_while_is_tried_again_not_noted(worker, wecom, errcode):
    worker.api.max_wait_secs = 0  # 45009 is not waited out here: straight back to the hub's retries
    memo = Attachment(kind="audio", content_type="audio/amr", media_id="m_1", filename="memo.amr")
    wecom.upload_errcode = errcode
    with pytest.raises(DeliveryFailed) as failed:
        worker.put_media(Media(amr_nb(5), "audio/amr"), memo, delivery(memo))
    assert not failed.value.permanent


def test_an_amr_nb_files_length_is_its_frames_at_20_ms_each_sized_by_their_mode():
    assert amr_seconds(amr_nb(61)) == pytest.approx(61) and amr_seconds(amr_nb(10, mode=0)) == pytest.approx(10)
    sid = bytes([(8 << 3) | 4]) + b"\0" * 5   # a comfort-noise frame: 6 bytes
    no_data = bytes([(15 << 3) | 4])           # no data: the header alone
    mixed = amr_nb(1, mode=7) + (amr_nb(1, mode=0) + sid * 10 + no_data * 5)[6:]
    assert amr_seconds(mixed) == pytest.approx(1 + 1 + 0.3)
    assert amr_seconds(b"#!AMR-WB\n" + b"x" * 100) is None and amr_seconds(b"RIFF....WAVE") is None


@pytest.mark.parametrize("seconds, mtype", [(59.9, "voice"), (60, "voice"), (61, "file"), (600, "file")])
def test_a_voice_over_60_seconds_goes_as_a_file(worker, wecom, seconds, mtype):
    memo = Attachment(kind="audio", content_type="audio/amr", media_id="m_1", filename="memo.amr")
    d = delivery(memo, text="")
    memo.channel_ref = worker.put_media(Media(amr_nb(seconds), "audio/amr"), memo, d)
    [(media_id, upload)] = wecom.uploads.items()
    assert memo.channel_ref == f"{UPLOADED}{mtype}:{media_id}" and upload["type"] == mtype
    assert upload["filename"] == "memo.amr"
    assert worker.parts(d) == [(mtype, {"media_id": media_id})]


@pytest.mark.parametrize("kind, ctype, name, uploaded", [
    ("video", "video/mp4", None, ("video", "video.mp4")), ("image", "image/png", "chart", ("image", "chart.png")),
    ("image", "image/jpeg", "photo.JPG", ("image", "photo.JPG")), ("image", "image/png", "odd.gif", ("image", "odd.gif.png")),
    ("document", "application/pdf", None, ("file", "document.pdf")), ("document", "text/csv", "t.csv", ("file", "t.csv")),
])
def test_a_file_is_uploaded_with_a_name_that_says_its_type(worker, wecom, kind, ctype, name, uploaded):
    att = Attachment(kind=kind, content_type=ctype, media_id="m_1", filename=name)
    worker.put_media(Media(b"\x00\x00\x00\x18ftypmp42", ctype), att, delivery(att))
    [upload] = wecom.uploads.values()
    assert (upload["type"], upload["filename"]) == uploaded


def test_a_files_part_goes_after_the_text_and_a_link_only_file_is_named_in_the_text(worker):
    pdf = Attachment(kind="document", content_type="application/pdf", media_id="m_1", channel_ref=f"{UPLOADED}file:MF")
    link = Attachment(kind="document", content_type="application/pdf", url="https://example.com/r.pdf",
                      filename="r.pdf")
    assert worker.parts(delivery(pdf, link, text="see")) == [
        ("text", {"content": "see\n\n[r.pdf: https://example.com/r.pdf]"}), ("file", {"media_id": "MF"})]
    assert worker.parts(delivery(pdf, text="")) == [("file", {"media_id": "MF"})]


# -- the question card -----------------------------------------------------------------------------

def test_a_question_is_a_button_card_with_the_prompt_as_title_and_the_values_as_keys():
    card = question_card("d_q_1", TEXT, {"kind": "question", "options": OPTIONS})
    assert card == {"card_type": "button_interaction", "main_title": {"title": "Which priority?"},
                    "task_id": "ugent-d_q_1",
                    "button_list": [{"text": "Low", "style": 1, "key": "q_1:1"},
                                    {"text": "High", "style": 1, "key": "q_1:2"}]}


def test_a_confirms_yes_or_no_is_left_to_the_buttons():
    yes_no = [{"id": "yes", "label": "Yes", "value": "q_2:1"}, {"id": "no", "label": "No", "value": "q_2:2"}]
    card = question_card("d_q_2", "Deploy now? (yes or no)", {"options": yes_no})
    assert card["main_title"] == {"title": "Deploy now?"} and [b["text"] for b in card["button_list"]] == ["Yes", "No"]


def test_long_labels_are_cut_on_the_buttons_and_listed_whole_below_the_title():
    options = [{"id": "a", "label": "Roll back the release", "value": "q:1"}, {"id": "b", "label": "Wait", "value": "q:2"}]
    card = question_card("d", "What now?\n1. Roll back the release\n2. Wait", {"options": options})
    assert [b["text"] for b in card["button_list"]] == ["Roll back…", "Wait"]
    assert all(len(b["text"]) <= 10 for b in card["button_list"])
    assert card["sub_title_text"] == "1. Roll back the release\n2. Wait"


def test_a_long_prompt_is_cut_in_the_title_and_whole_below_it():
    prompt = "Which of the two environments should the nightly job use?"
    card = question_card("d", "\n".join([prompt, "1. Low", "2. High"]), {"options": OPTIONS})
    assert len(card["main_title"]["title"]) == 36 and card["main_title"]["title"].endswith("…")
    assert card["sub_title_text"] == prompt


@pytest.mark.parametrize("options", [
    [], None, "q:1",
    [{"id": str(n), "label": f"Option {n}", "value": f"q:{n}"} for n in range(1, 8)],  # 7: more than 6 buttons
    [{"id": "a", "label": "A", "value": "q:" + "x" * 1023}],                            # a key over 1,024 bytes
    [{"id": "a", "label": "A", "value": "q:1"}, {"id": "b", "label": "B", "value": "q:1"}],  # one key twice
    [{"id": "a", "label": "", "value": "q:1"}], [{"id": "a", "label": "A"}],
])
def test_no_card_where_a_card_cannot_carry_the_options(options):
    assert question_card("d", TEXT, {"options": options}) is None


def test_no_card_where_the_question_would_not_fit_on_it_whole():
    prompt = "x" * 161
    assert question_card("d", prompt + "\n1. Low\n2. High", {"options": OPTIONS}) is None


def test_six_options_fit():
    six = [{"id": str(n), "label": f"Opt {n}", "value": f"q:{n}"} for n in range(1, 7)]
    assert len(question_card("d", "Pick", {"options": six})["button_list"]) == 6


@pytest.mark.parametrize("delivery_id", ["d_q_abc", "d q/ü:1", "d_" + "x" * 200, "a@b-c_d"])
def test_a_task_id_is_wecoms_alphabet_within_128_bytes_and_one_per_delivery(delivery_id):
    task_id = task_id_of(delivery_id)
    assert re.fullmatch(r"[A-Za-z0-9_@-]{1,128}", task_id) and task_id.startswith("ugent-")
    assert task_id == task_id_of(delivery_id) and task_id != task_id_of(delivery_id + "2")


def test_a_sent_card_is_refused_when_its_task_id_was_used_but_a_resend_is_held_by_the_duplicate_check(wecom):
    from plugins_app.channel.workers.wecom.api import WeComApi, WeComError
    api = WeComApi(wecom.corp_id, wecom.secret, wecom.agent_id, base_url=wecom.base_url)
    card = question_card("d_q_1", TEXT, {"options": OPTIONS})
    first = api.send(USER, "template_card", card)
    assert first["response_code"] and api.send(USER, "template_card", card)["msgid"] == first["msgid"]
    changed = dict(card, main_title={"title": "Another"})
    with pytest.raises(WeComError) as refused:
        api.send(USER, "template_card", changed)
    assert refused.value.errcode == 42014
    api.close()


def question(delivery_id: str = "d_q_1") -> Delivery:
    return delivery(text=TEXT, delivery_id=delivery_id, metadata={"kind": "question", "options": OPTIONS})


def test_a_card_whose_task_id_wecom_already_has_was_sent_before_and_nothing_else_goes(worker, wecom):
    """42014 at a card: this delivery's card went out before a crash (past the duplicate check's 30 minutes),
    so neither the card nor the numbered text is sent again; its options are kept for the press."""
    d = question()
    card = question_card(d.delivery_id, d.text, d.metadata)
    wecom.script_send(TASK_ID_EXISTS)
    assert worker._send_card(d, card) is None
    assert [c.errcode for c in wecom.sends()] == [TASK_ID_EXISTS] and wecom.messages() == []
    assert worker.state.card(card["task_id"]) == OPTIONS


@pytest.mark.parametrize("stale", [42001, 40014, 40001])
def test_a_token_still_stale_after_its_refresh_is_no_card_refusal_the_send_is_retried(worker, wecom, stale):
    d = question()
    card = question_card(d.delivery_id, d.text, d.metadata)
    wecom.script_send(stale, stale)  # refused, the token fetched again, refused again
    with pytest.raises(DeliveryFailed) as failed:
        worker._send_card(d, card)
    assert not failed.value.permanent
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 2 and len(wecom.sends()) == 2
    assert wecom.messages() == []  # not the numbered text in the card's place
    assert worker._send_card(d, card)["msgid"]  # the hub's retry: the card goes
    assert [m["msgtype"] for m in wecom.messages()] == ["template_card"]


# -- a press ---------------------------------------------------------------------------------------

def press(**over) -> dict:
    event = {"ToUserName": "ww1", "FromUserName": USER, "CreateTime": "1733480000", "MsgType": "event",
             "Event": "template_card_event", "EventKey": "q_1:2", "TaskId": "ugent-d_q_1",
             "CardType": "button_interaction", "ResponseCode": "RC-1", "AgentID": AGENT_ID}
    event.update(over)
    return event


def test_a_press_is_the_options_label_with_its_value_as_the_option():
    msg = normalise_press(press(), OPTIONS, agent_id=AGENT_ID)
    assert (msg.text, msg.metadata["option"], msg.conversation_id, msg.sender_id) == ("High", "q_1:2", USER, USER)
    assert msg.message_id == f"card:{USER}:1733480000:ugent-d_q_1:{hashlib.sha256(b'q_1:2').hexdigest()[:12]}"
    assert msg.metadata["response_code"] == "RC-1" and msg.metadata["task_id"] == "ugent-d_q_1"
    assert msg.timestamp.startswith("2024-12-06T")
    # WeCom calls again with the same event: the same message id, so the host takes it once
    assert normalise_press(press(), OPTIONS, agent_id=AGENT_ID).message_id == msg.message_id
    # the plain normaliser leaves it to normalise_press
    assert normalise(press()) is None


def test_two_buttons_of_one_card_pressed_within_one_second_are_two_messages():
    low = normalise_press(press(EventKey="q_1:1"), OPTIONS, agent_id=AGENT_ID)
    high = normalise_press(press(EventKey="q_1:2"), OPTIONS, agent_id=AGENT_ID)
    assert low.message_id != high.message_id and (low.text, high.text) == ("Low", "High")
    long_key = normalise_press(press(EventKey="k" * 1024), None, agent_id=AGENT_ID)
    assert len(long_key.message_id) < 255


def test_a_press_on_a_card_this_worker_no_longer_knows_still_carries_its_token():
    msg = normalise_press(press(), None, agent_id=AGENT_ID)
    assert (msg.text, msg.metadata["option"]) == ("q_1:2", "q_1:2")


@pytest.mark.parametrize("over", [{"TaskId": "someone-elses-card"}, {"AgentID": "1000099"}, {"EventKey": ""},
                                  {"Event": "click"}, {"TaskId": ""}])
def test_what_is_not_a_press_on_this_workers_card_is_not_taken(over):
    assert normalise_press(press(**over), None, agent_id=AGENT_ID) is None


def test_the_operators_page_shows_reply_tokens_and_task_ids_as_the_host_makes_them():
    """docs/channels/wecom.md names what an operator sees in WeCom's logs: a request id is q-<32 hex>."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "channels" / "wecom.md").read_text()
    request_id = f"q-{uuid.uuid4().hex}"
    assert task_id_of(f"d_{request_id}") == f"ugent-d_{request_id}"
    assert "<EventKey>q-<32 hex>:2</EventKey>" in page and "<TaskId>ugent-d_q-<32 hex></TaskId>" in page
    assert not re.search(r"\bq_…|ugent-d_q_", page)
    questions = (Path(__file__).resolve().parents[2] / "docs" / "questions.md").read_text()
    assert "`test_channel_wecom_out.py`" in questions  # the Tests paragraph names WeCom's question tests


# -- a pressed card, updated once the host applied the press ----------------------------------------

@pytest.fixture
def pressing(wecom, tmp_path):
    """A worker whose outbox and state are in tmp_path, and the card of a question it sent (options recorded)."""
    w = WeComWorker(argv=[], environ=wecom.env(), socket_path="/nowhere", plugin_id="wecom-test", token="t",
                    state_dir=str(tmp_path), install_signal_handlers=False)
    w.state = WeComState(str(tmp_path / "wecom.sqlite3"))
    card = question_card("d-q1", TEXT, {"options": OPTIONS})
    w.state.record_card(card["task_id"], "d-q1", OPTIONS)
    w.api.send(USER, "template_card", card)
    yield w, card["task_id"]
    w.state.close()
    w.api.close()
    w.outbox.close()


def pressed(w: WeComWorker, wecom: FakeWeCom, task_id: str, key: str = "q_1:2") -> tuple[dict, str]:
    """A press taken by the worker's callback handler: (the event, its outbox key)."""
    event = {"ToUserName": wecom.corp_id, "FromUserName": USER, "CreateTime": "1733482920", "MsgType": "event",
             "Event": "template_card_event", "EventKey": key, "TaskId": task_id, "CardType": "button_interaction",
             "ResponseCode": wecom._response_code(task_id, USER), "AgentID": AGENT_ID}
    w.accept(event)
    [row] = w._outbox().inbound_pending()
    return event, row.key


def test_a_press_the_host_applied_replaces_the_cards_buttons_with_the_option_once(pressing, wecom):
    w, task_id = pressing
    event, key = pressed(w, wecom, task_id)
    assert w.update_cards() == 0 and wecom.card_updates == []  # the host has not answered yet
    w._outbox().inbound_acked(key, {"accepted": True, "duplicate": False, "reply": "applied", "question": "q_1"})
    assert w.update_cards() == 1
    [call] = wecom.calls_to("/cgi-bin/message/update_template_card")
    assert call.body == {"userids": [USER], "agentid": int(AGENT_ID), "response_code": event["ResponseCode"],
                         "button": {"replace_name": "High"}}
    assert call.errcode == 0 and not wecom.pressable(task_id)
    w.accept(event)  # WeCom calls again with the same press
    assert w.update_cards() == 0 and len(wecom.calls_to("/cgi-bin/message/update_template_card")) == 1


def test_two_threads_update_a_pressed_card_once(pressing, wecom):
    import threading
    w, task_id = pressing
    _, key = pressed(w, wecom, task_id)
    w._outbox().inbound_acked(key, {"accepted": True, "reply": "applied"})
    threads = [threading.Thread(target=w.update_cards) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wecom.calls_to("/cgi-bin/message/update_template_card")) == 1 and len(wecom.card_updates) == 1


#: The host's answer to a press submitted again when its first answer was lost (a call timed out, the worker killed
#: before it recorded the answer): a duplicate (channels_app.services._duplicate) of the press's receipt, which
#: only a reply applied completes without a turn (channels_app.questions.question_reply_from_channel).
APPLIED_BEFORE = {"accepted": True, "duplicate": True, "code": "DuplicateProcessed", "turn_id": None,
                  "receipt_state": "completed"}


def test_a_press_the_host_applied_but_whose_answer_was_lost_still_updates_its_card_once(pressing, wecom):
    """The replay of a press the host had applied is answered as a duplicate, without ``reply``: its receipt
    completed with no turn says it was applied, so the card is updated all the same."""
    w, task_id = pressing
    event, key = pressed(w, wecom, task_id)
    w._outbox().inbound_acked(key, dict(APPLIED_BEFORE))
    assert w.update_cards() == 1 and w.update_cards() == 0
    assert wecom.card_updates == [{"task_id": task_id, "user": USER, "replace_name": "High"}]
    assert w.state.press_state(key) == "updated" and not wecom.pressable(task_id)


@pytest.mark.parametrize("state, result", [
    ("acked", {"accepted": True, "reply": "refused", "question_state": "answered"}),  # already answered
    ("acked", {"accepted": True, "reply": "does_not_fit", "question_state": "waiting"}),
    ("acked", {"accepted": True, "duplicate": False, "turn_id": "t_1"}),                # not taken as a reply
    ("acked", {"accepted": False, "reason": "sender not allowed"}),
    ("rejected", None),
    # a press submitted again, its first answer lost: the duplicate of a reply refused (or not fitting) ...
    ("acked", {**APPLIED_BEFORE, "receipt_state": "refused"}),
    # ... of a message that was no reply (it has a turn) ...
    ("acked", {**APPLIED_BEFORE, "turn_id": "t_1"}),
    # ... of one still running, of another message under the press's id, of a command (no receipt)
    ("acked", {**APPLIED_BEFORE, "code": "DuplicateInFlight", "receipt_state": "running", "turn_id": "t_1"}),
    ("acked", {**APPLIED_BEFORE, "code": "DuplicateContentMismatch"}),
    ("acked", {"accepted": True, "duplicate": True, "command": "help"}),
])
def test_a_press_the_host_did_not_apply_leaves_the_card_pressable(pressing, wecom, state, result):
    w, task_id = pressing
    _, key = pressed(w, wecom, task_id)
    if state == "acked":
        w._outbox().inbound_acked(key, result)
    else:
        w._outbox().inbound_rejected(key, "malformed")
    assert w.update_cards() == 0 and w.update_cards() == 0
    assert wecom.calls_to("/cgi-bin/message/update_template_card") == [] and wecom.pressable(task_id)
    assert w.state.press_state(key) == "skipped"


def test_a_card_update_wecom_refuses_is_logged_once_and_not_tried_again(pressing, wecom, caplog):
    w, task_id = pressing
    _, key = pressed(w, wecom, task_id)
    w._outbox().inbound_acked(key, {"accepted": True, "reply": "applied"})
    wecom.expire_response_codes()  # past its 72 hours: WeCom refuses the code
    assert w.update_cards() == 0 and w.update_cards() == 0
    assert [c.errcode for c in wecom.calls_to("/cgi-bin/message/update_template_card")] == [40058]
    assert w.state.press_state(key) == "failed" and wecom.pressable(task_id)
    assert "could not be updated" in caplog.text and "the answer stands" in caplog.text


def test_a_press_on_a_card_without_its_options_shows_a_check_mark(pressing, wecom):
    w, _ = pressing
    event, key = pressed(w, wecom, "ugent-d-unknown", key="q_9:1")
    w._outbox().inbound_acked(key, {"accepted": True, "reply": "applied"})
    assert w.update_cards() == 1
    assert wecom.card_updates == [{"task_id": "ugent-d-unknown", "user": USER, "replace_name": "✓"}]


def test_an_update_cut_short_by_a_stop_is_made_by_the_restarted_worker_once(pressing, wecom, tmp_path):
    """WeCom busy (45009) while the worker stops: the update was never made, so the press waits in the state
    file, and the worker started next (same state and outbox) makes it, once."""
    w, task_id = pressing
    event, key = pressed(w, wecom, task_id)
    w._outbox().inbound_acked(key, {"accepted": True, "reply": "applied"})
    wecom.update_errcode = 45009
    w.stopping.set()
    assert w.update_cards() == 0 and w.state.press_state(key) == "waiting"
    wecom.update_errcode = None
    w.state.close()
    again = WeComWorker(argv=[], environ=wecom.env(), socket_path="/nowhere", plugin_id="wecom-test", token="t",
                        state_dir=str(tmp_path), install_signal_handlers=False)
    again.state = WeComState(str(tmp_path / "wecom.sqlite3"))
    try:
        assert again.update_cards() == 1 and again.update_cards() == 0
        assert wecom.card_updates == [{"task_id": task_id, "user": USER, "replace_name": "High"}]
        assert [c.body["response_code"] for c in wecom.calls_to("/cgi-bin/message/update_template_card")
                if c.errcode == 0] == [event["ResponseCode"]]
    finally:
        again.state.close()
        again.api.close()
        again.outbox.close()
        w.state = WeComState(str(tmp_path / "wecom.sqlite3"))  # for the fixture's teardown


def test_a_press_left_updating_by_a_stop_is_logged_and_failed_at_start_not_tried_again(wecom, tmp_path, caplog):
    """A worker killed (or stopped past disconnect's wait) inside update_template_card leaves its press
    ``updating``: whether WeCom made the update is unknown. The next start says so and marks it failed."""
    w = WeComWorker(argv=["--bind", "127.0.0.1:0"], environ=wecom.env(), socket_path="/nowhere",
                    plugin_id="wecom-test", token="t", state_dir=str(tmp_path), install_signal_handlers=False)
    path = str(tmp_path / "wecom-test.wecom.sqlite3")
    before = WeComState(path)
    before.record_press("wecom\x1fcard:cut", USER, "RC-cut", "High")
    before.record_press("wecom\x1fcard:waits", USER, "RC-waits", "Low")
    assert before.move_press("wecom\x1fcard:cut", "waiting", "updating")
    before.close()
    caplog.set_level("WARNING")
    w.connect()
    try:
        assert w.state.press_state("wecom\x1fcard:cut") == "failed"
        assert w.state.press_state("wecom\x1fcard:waits") == "waiting"  # a press not claimed yet still waits
        [record] = [r for r in caplog.records if "cut short" in r.getMessage()]
        assert record.levelname == "WARNING" and "card:cut" in record.getMessage()
        assert w.update_cards() == 0 and wecom.calls_to("/cgi-bin/message/update_template_card") == []
    finally:
        w.stopping.set()
        w.disconnect()
        if w.outbox is not None:
            w.outbox.close()
