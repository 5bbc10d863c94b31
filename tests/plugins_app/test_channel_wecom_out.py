"""channel-wecom end to end, what goes out besides text: an answer's files (media/upload, then message/send of
an image, voice, video or file) and a question's options (a ``button_interaction`` template card, whose press
comes back as the ``template_card_event`` callback). The real supervisor runs the worker against the fake WeCom
on loopback (tests/fakes/wecom.py)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys

import pytest
from django.db import transaction

from channels_app.models import Question, Receipt, Turn
from channels_app.services import Submission
from plugins_app.channel.models import OutboundDelivery, Plugin
from plugins_app.channel.workers.wecom import press_id
from tests.fakes.wecom import AGENT_ID, USER, FakeWeCom
from tests.plugins_app.conftest import enqueue_with_files, wait_until
from tests.plugins_app.test_channel_wecom import PID, delivered, listening, wecom_plugin
from tests.streams import conftest as streams

threaded_turns = streams.threaded_turns  # a fixture: turns run in threads of their own

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(200)
PDF = b"%PDF-1.4 the report"
ASK = {"kind": "choice", "prompt": "Which priority?",
       "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High"}]}
SCRIPT = f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted"


@pytest.fixture
def wecom(monkeypatch):
    fake = FakeWeCom().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def enqueue(plugin: Plugin, text: str, *files: tuple[bytes, str, str]) -> OutboundDelivery:
    """A delivery to USER carrying ``files`` ((data, content type, name)), stored on the host first."""
    return enqueue_with_files(plugin, channel="wecom", user_id=USER, external_id=USER, text=text, files=files)


def sent(fake: FakeWeCom, n: int, rt, timeout: float = 30) -> list[dict]:
    assert wait_until(lambda: len(fake.messages()) >= n, timeout), (fake.sends(), rt.log(PID))
    return fake.messages()


# --- files out -------------------------------------------------------------------------------------

def test_files_are_uploaded_by_type_and_sent_after_the_text(tcast, wecom, start_runtime):
    plugin = wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    enqueue(plugin, "your chart and report", (PNG, "image/png", "chart.png"), (PDF, "application/pdf", "report.pdf"))
    text, image, document = sent(wecom, 3, rt)
    assert (text["msgtype"], text["content"]) == ("text", "your chart and report")
    uploads = {u["filename"]: (media_id, u) for media_id, u in wecom.uploads.items()}
    chart_id, chart = uploads["chart.png"]
    report_id, report = uploads["report.pdf"]
    assert (chart["type"], chart["data"], chart["content_type"]) == ("image", PNG, "image/png")
    assert (report["type"], report["data"], report["content_type"]) == ("file", PDF, "application/pdf")
    assert (image["msgtype"], image["content"]) == ("image", chart_id)
    assert (document["msgtype"], document["content"]) == ("file", report_id)
    image_send = [c for c in wecom.sends() if c.body["msgtype"] == "image"][0]
    assert image_send.body["image"] == {"media_id": chart_id} and image_send.body["enable_duplicate_check"] == 1
    [upload_call, _] = wecom.calls_to("/cgi-bin/media/upload")
    assert upload_call.params["access_token"] in wecom.tokens and upload_call.params["type"] in ("image", "file")
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().channel_message_id == text["msgid"]


def test_a_worker_killed_after_the_upload_sends_the_file_once_and_uploads_it_once(tcast, wecom, start_runtime):
    plugin = wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.hold_send_secs, wecom.hold_msgtype = 30, "file"  # WeCom showed the file; the worker has no answer yet
    enqueue(plugin, "the report", (PDF, "application/pdf", "report.pdf"))
    sent(wecom, 2, rt)
    first = rt.worker_pid(PID)
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    wecom.hold_send_secs = 0
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    # one upload: the restarted worker sent the media id it had kept, and the duplicate check held the repeat
    assert len(wecom.calls_to("/cgi-bin/media/upload")) == 1
    [(media_id, _)] = wecom.uploads.items()
    file_sends = [c for c in wecom.sends() if c.body["msgtype"] == "file"]
    assert len(file_sends) == 2 and {c.body["file"]["media_id"] for c in file_sends} == {media_id}
    assert [(m["msgtype"], m["content"]) for m in wecom.messages()] == [("text", "the report"), ("file", media_id)]


def test_a_file_over_its_types_limit_is_not_sent_and_the_text_says_so(tcast, wecom, start_runtime):
    plugin = wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    # just over WeCom's 2 MB for a voice (AMR-WB: an AMR-NB this size would play far over 60 s, and go as a file)
    memo = b"#!AMR-WB\n" + os.urandom(2 * 1024 * 1024 - 3)
    enqueue(plugin, "the memo", (memo, "audio/amr", "memo.amr"), (PNG, "image/png", "chart.png"))
    text, image = sent(wecom, 2, rt)
    assert text["content"] == ("the memo\n\n[memo.amr was not sent: it is 2.0 MB, over WeCom's 2 MB limit for a "
                               "voice (amr)]")
    assert image["msgtype"] == "image"
    assert [u["filename"] for u in wecom.uploads.values()] == ["chart.png"]  # the memo was never uploaded
    assert wait_until(delivered, 15), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert len(wecom.messages()) == 2


# --- question options ------------------------------------------------------------------------------

def finished(timeout=30):
    return wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).first(), timeout)


@pytest.mark.usefixtures("threaded_turns")
def test_a_question_shows_as_a_card_and_a_press_answers_it_once(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say(SCRIPT)
    [card] = sent(wecom, 1, rt)
    q = Question.objects.get()
    assert card["msgtype"] == "template_card"
    assert card["content"] == {"card_type": "button_interaction", "main_title": {"title": "Which priority?"},
                               "task_id": f"ugent-d_{q.request_id}",
                               "button_list": [{"text": "Low", "style": 1, "key": f"{q.request_id}:1"},
                                               {"text": "High", "style": 1, "key": f"{q.request_id}:2"}]}
    press = wecom.press(card["content"]["task_id"], f"{q.request_id}:2")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "high"' in turn.receipt.answer and turn.receipt.answer.endswith("noted")
    answered = sent(wecom, 2, rt)
    assert answered[1]["content"] == turn.receipt.answer
    for _ in range(2):  # WeCom calls again a callback it had no answer for
        again = wecom.resend(press)
        assert (again.status_code, again.text) == (200, "")
    wecom.say("script:answer=after")  # read after the repeats: one queue, in order
    assert wait_until(lambda: wecom.texts()[-1:] == ["after"], 30), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert len(wecom.messages()) == 3  # no notice for the repeats: they were one press
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}
    pressed = Receipt.objects.get(client_message_id__startswith="card:")
    assert pressed.client_message_id == press_id(USER, press["CreateTime"], press["TaskId"], press["EventKey"])
    assert pressed.client_message_id.startswith(f"card:{USER}:{press['CreateTime']}:{press['TaskId']}:")
    assert Turn.objects.count() == 2
    assert OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}", state="delivered").exists()


@pytest.mark.usefixtures("threaded_turns")
def test_a_card_wecom_refuses_goes_out_as_the_numbered_text(tcast, wecom, start_runtime):
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.card_errcode = 40058
    wecom.say(SCRIPT)
    assert wait_until(lambda: wecom.texts(), 30), rt.log(PID)
    assert wecom.texts() == ["Which priority?\n1. Low\n2. High"]
    assert [c.errcode for c in wecom.sends()] == [40058, 0]
    wecom.say("2")  # a typed reply answers it
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}


@pytest.mark.usefixtures("threaded_turns")
def test_a_worker_killed_between_the_card_and_the_press_reads_the_press_back_from_its_state_file(
        tcast, wecom, start_runtime):
    """The card's options are in the worker's state file before the card goes: a worker restarted (kill -9)
    after the card and before the press still turns the press into the option's label, and the press
    answers the question once."""
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say(SCRIPT)
    [card] = sent(wecom, 1, rt)
    q = Question.objects.get()
    assert wait_until(lambda: OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}",
                                                              state="delivered").exists(), 20), rt.log(PID)
    before, first = wecom.callback_url, rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, first), 30), rt.log(PID)
    listening(rt, wecom, after=before)  # the restarted worker listens on a new port (--bind :0)
    press = wecom.press(card["content"]["task_id"], f"{q.request_id}:2")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "high"' in turn.receipt.answer
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}
    pressed = Receipt.objects.get(client_message_id=press_id(USER, press["CreateTime"], press["TaskId"],
                                                             press["EventKey"]))
    # the press reached the host as the option's label, which only the state file still knew (the restarted
    # worker never saw the card): without it, the text would be the raw key q-…:2
    assert pressed.content_hash == Submission(actor=None, text="High").content_hash()
    answered = sent(wecom, 2, rt)
    assert [m["msgtype"] for m in answered] == ["template_card", "text"]
    assert answered[1]["content"] == turn.receipt.answer


# --- the card after a press -------------------------------------------------------------------------

UPDATE = "/cgi-bin/message/update_template_card"


def asked(wecom: FakeWeCom, start_runtime):
    """A running worker whose agent asked SCRIPT's question: (the runtime, the card's task id, the question)."""
    wecom_plugin()
    rt = start_runtime()
    listening(rt, wecom)
    wecom.say(SCRIPT)
    [card] = sent(wecom, 1, rt)
    return rt, card["content"]["task_id"], Question.objects.get()


@pytest.mark.usefixtures("threaded_turns")
def test_a_press_the_host_applies_turns_the_cards_buttons_into_the_chosen_option_once(tcast, wecom, start_runtime):
    """After the host took a press as the answer, the worker updates the card (update_template_card with the
    press's response code): its buttons become one, not pressable, saying the option chosen. WeCom calling
    again with the press updates nothing more."""
    rt, task_id, q = asked(wecom, start_runtime)
    press = wecom.press(task_id, f"{q.request_id}:2")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert wait_until(lambda: wecom.card_updates, 30), (wecom.calls_to(UPDATE), rt.log(PID))
    assert wecom.card_updates == [{"task_id": task_id, "user": USER, "replace_name": "High"}]
    [update] = wecom.calls_to(UPDATE)
    assert update.body == {"userids": [USER], "agentid": int(AGENT_ID), "response_code": press["ResponseCode"],
                           "button": {"replace_name": "High"}}
    assert not wecom.pressable(task_id)
    for _ in range(2):  # WeCom calls again a callback it had no answer for
        again = wecom.resend(press)
        assert (again.status_code, again.text) == (200, "")
    wecom.say("script:answer=after")  # read after the repeats: one queue, in order
    assert wait_until(lambda: wecom.texts()[-1:] == ["after"], 30), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert len(wecom.calls_to(UPDATE)) == 1 and len(wecom.card_updates) == 1
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}
    assert Receipt.objects.filter(client_message_id__startswith="card:").count() == 1


@pytest.mark.usefixtures("threaded_turns")
def test_a_press_on_a_question_answered_already_leaves_its_card_as_it_is(tcast, wecom, start_runtime):
    """A typed reply answered the question first: the press gets the host's notice, and the card is not updated
    (the host did not take the press as the answer)."""
    rt, task_id, q = asked(wecom, start_runtime)
    wecom.say("1")  # typed: Low
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    wecom.press(task_id, f"{q.request_id}:2")
    assert wait_until(lambda: "This question was already answered." in wecom.texts(), 30), rt.log(PID)
    assert wait_until(lambda: "was not taken as the answer" in rt.log(PID), 30), rt.log(PID)
    assert wecom.calls_to(UPDATE) == [] and wecom.pressable(task_id)
    assert Question.objects.get().answer == {"answers": {"choice": "low"}}


@pytest.mark.usefixtures("threaded_turns")
def test_a_card_update_wecom_refuses_is_logged_and_the_answer_stands_once(tcast, wecom, start_runtime):
    wecom.update_errcode = 40058
    rt, task_id, q = asked(wecom, start_runtime)
    press = wecom.press(task_id, f"{q.request_id}:2")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert wait_until(lambda: "could not be updated" in rt.log(PID), 30), rt.log(PID)
    answered = sent(wecom, 2, rt)
    assert answered[1]["content"] == turn.receipt.answer
    again = wecom.resend(press)
    assert (again.status_code, again.text) == (200, "")
    wecom.say("script:answer=after")
    assert wait_until(lambda: wecom.texts()[-1:] == ["after"], 30), rt.log(PID)
    assert [c.errcode for c in wecom.calls_to(UPDATE)] == [40058]  # tried once: the code is WeCom's to take once
    assert len(wecom.messages()) == 3 and Turn.objects.count() == 2
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}


def press_row(outbox: sqlite3.Connection, press: dict) -> tuple[int, dict | None] | None:
    """(attempts, the host's recorded answer) of the press's row in the worker's outbox, or None before it is."""
    key = f"{USER}\x1f{press_id(USER, press['CreateTime'], press['TaskId'], press['EventKey'])}"
    row = outbox.execute("SELECT attempts, result FROM inbound WHERE key = ?", (key,)).fetchone()
    return None if row is None else (row[0], json.loads(row[1]) if row[1] else None)


@pytest.mark.usefixtures("threaded_turns")
def test_a_press_the_host_applied_while_the_worker_was_killed_before_the_answer_still_updates_its_card_once(
        tcast, wecom, start_runtime):
    """kill -9 after the host applied a press but before the worker recorded the host's answer: the restarted
    worker submits the press again, the host answers it as the duplicate of a receipt completed with no turn (no
    ``reply``), and the card is updated all the same, once.

    The host is held (the question's row locked) until the worker has submitted the press; then the worker's
    outbox is held (its write lock), so the host's answer cannot be recorded; the host applies the press, the
    worker is killed, and the outbox let go."""
    rt, task_id, q = asked(wecom, start_runtime)
    assert wait_until(lambda: OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}",
                                                              state="delivered").exists(), 20), rt.log(PID)
    [path] = list(rt.root.rglob("*.outbox.sqlite3"))
    outbox = sqlite3.connect(str(path), isolation_level=None, timeout=30)
    first = rt.worker_pid(PID)
    try:
        with transaction.atomic():
            Question.objects.select_for_update().get(pk=q.pk)
            press = wecom.press(task_id, f"{q.request_id}:2")
            assert wait_until(lambda: (press_row(outbox, press) or (0,))[0] >= 1, 20), rt.log(PID)
            outbox.execute("BEGIN IMMEDIATE")  # the worker's record of the host's answer waits behind this
        receipt = Receipt.objects.filter(client_message_id__startswith="card:")
        assert wait_until(lambda: receipt.filter(state="completed").exists(), 30), rt.log(PID)
        assert Question.objects.get().answer == {"answers": {"choice": "high"}}
        os.kill(first, signal.SIGKILL)
    finally:
        if outbox.in_transaction:
            outbox.execute("ROLLBACK")
    assert press_row(outbox, press)[1] is None  # the host's answer was never recorded: the press is replayed
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, first), 30), rt.log(PID)
    assert wait_until(lambda: (press_row(outbox, press) or (0, None))[1], 30), rt.log(PID)
    replayed = press_row(outbox, press)[1]
    assert replayed["duplicate"] is True and replayed["receipt_state"] == "completed" and "reply" not in replayed
    assert wait_until(lambda: wecom.card_updates, 40), (wecom.calls_to(UPDATE), rt.log(PID))
    assert wecom.card_updates == [{"task_id": task_id, "user": USER, "replace_name": "High"}]
    assert not wecom.pressable(task_id)
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert wait_until(lambda: len(wecom.messages()) >= 2, 30), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert len(wecom.calls_to(UPDATE)) == 1 and receipt.count() == 1 and Turn.objects.count() == 1
    outbox.close()
