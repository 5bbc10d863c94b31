"""A question through the WhatsApp worker, end to end under the real supervisor: the turn's engine calls
ask_user, the question's delivery goes out as an interactive message (reply buttons for up to 3 options, a
list for 4 to 10), the fake Cloud API presses one, and the turn completes with that option, once, however
often Meta sends the press.
"""
from __future__ import annotations

import json
import sys

import pytest

from channels_app.models import Question, Turn
from plugins_app.channel.models import OutboundDelivery
from tests.plugins_app.conftest import wait_until
from tests.plugins_app.test_channel_whatsapp import PID, fake, listening, whatsapp_plugin  # noqa: F401
from tests.streams.conftest import threaded_turns  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

ASK = {"kind": "choice", "prompt": "Which priority?",
       "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High"}]}
SCRIPT = f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted"


def finished(timeout=30):
    return wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).first(), timeout)


def test_whatsapp_shows_the_question_as_reply_buttons_and_a_press_answers_it_once(tcast, fake, start_runtime,
                                                                                   threaded_turns):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    asked = fake.say(SCRIPT)
    assert wait_until(lambda: fake.interactives(), 30), rt.log(PID)
    q = Question.objects.get()
    [shown] = fake.interactives()
    assert shown["context"] == {"message_id": asked["entry"][0]["changes"][0]["value"]["messages"][0]["id"]}
    assert shown["interactive"] == {
        "type": "button", "body": {"text": "Which priority?\n1. Low\n2. High"},
        "action": {"buttons": [{"type": "reply", "reply": {"id": f"{q.request_id}:1", "title": "Low"}},
                               {"type": "reply", "reply": {"id": f"{q.request_id}:2", "title": "High"}}]}}
    press = fake.press(shown, 1)  # the user presses "High"
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "high"' in turn.receipt.answer and turn.receipt.answer.endswith("noted")
    assert wait_until(lambda: len(fake.texts()) == 1, 20), rt.log(PID)
    assert fake.texts() == [turn.receipt.answer]
    fake.redeliver(press)  # Meta sends the press again: nothing doubled
    assert wait_until(fake.settled, 20)
    fake.say("script:answer=after")
    assert wait_until(lambda: len(fake.texts()) == 2, 20), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert fake.texts()[1:] == ["after"] and len(fake.sent()) == 3  # no "already answered" notice
    assert Turn.objects.count() == 2 and Question.objects.get().answer == {"answers": {"choice": "high"}}
    assert OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}", state="delivered").exists()


def test_whatsapp_shows_four_options_as_a_list_and_a_row_pressed_answers(tcast, fake, start_runtime,
                                                                        threaded_turns):
    ask = {"kind": "choice", "prompt": "Which size?",
           "options": [{"id": s, "label": label} for s, label in
                       (("s", "Small"), ("m", "Medium"), ("l", "Large"),
                        ("xl", "Extra large, for the whole team of twelve"))]}
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.say(f"script:call=ask_user{json.dumps(ask)}|result|answer= noted")
    assert wait_until(lambda: fake.interactives(), 30), rt.log(PID)
    q = Question.objects.get()
    [shown] = fake.interactives()
    inter = shown["interactive"]
    assert inter["type"] == "list" and inter["action"]["button"] == "Choose"
    [section] = inter["action"]["sections"]
    assert section["rows"] == [
        {"id": f"{q.request_id}:1", "title": "Small"}, {"id": f"{q.request_id}:2", "title": "Medium"},
        {"id": f"{q.request_id}:3", "title": "Large"},
        {"id": f"{q.request_id}:4", "title": "Extra large, for the\u2026",
         "description": "Extra large, for the whole team of twelve"}]
    fake.press(shown, 3)
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "xl"' in turn.receipt.answer
    assert Turn.objects.count() == 1 and Question.objects.get().state == "answered"


def test_whatsapp_a_press_after_the_question_expired_is_told_so_and_starts_no_turn(tcast, fake, start_runtime,
                                                                                    threaded_turns):
    """The press names its question by the button's id (metadata.option): once the asking turn ended, only
    that id tells it from a plain message "Low", which would run a turn of its own."""
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.say(f"script:call=ask_user{json.dumps(dict(ASK, timeout_s=1))}|result|answer= gave up")
    assert wait_until(lambda: fake.interactives(), 30), rt.log(PID)
    turn = finished()
    assert turn and Question.objects.get().state == "expired", rt.log(PID)
    assert wait_until(lambda: len(fake.texts()) == 1, 20), rt.log(PID)  # the turn's answer
    fake.press(fake.interactives()[0], 0)  # "Low", too late
    assert wait_until(lambda: len(fake.texts()) == 2, 20), rt.log(PID)
    assert fake.texts()[1] == "This question has expired."
    assert Turn.objects.count() == 1


def test_whatsapp_an_interactive_message_meta_refuses_goes_as_the_numbered_text_and_a_typed_reply_answers(
        tcast, fake, start_runtime, threaded_turns):
    """Meta refuses the buttons (131051: the type is not supported for this number): the question is shown as
    its numbered text instead of dead-lettering unseen, and the user's typed "2" answers it."""
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.refuse_interactive(131051)
    fake.say(SCRIPT)
    assert wait_until(lambda: fake.texts(), 30), rt.log(PID)
    q = Question.objects.get()
    assert fake.texts() == ["Which priority?\n1. Low\n2. High"] and not fake.interactives()
    assert [c.status for c in fake.sends()] == [400, 200]
    assert wait_until(lambda: OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}",
                                                              state="delivered").exists(), 20), rt.log(PID)
    fake.say("2")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert Question.objects.get().answer == {"answers": {"choice": "high"}}
