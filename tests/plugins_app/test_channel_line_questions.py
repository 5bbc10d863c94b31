"""A question through the LINE worker, end to end under the real supervisor: the turn's engine calls ask_user,
the question's delivery is pushed with its options as quick reply buttons (postback actions), the fake LINE
taps one (a postback event), and the turn completes with that option, once, however often LINE sends the tap.
"""
from __future__ import annotations

import json
import sys

import pytest

from channels_app.models import Question, Turn
from plugins_app.channel.models import OutboundDelivery
from tests.plugins_app.conftest import wait_until
from tests.plugins_app.test_channel_line import PID, answered, line, line_plugin, listening  # noqa: F401
from tests.streams.conftest import threaded_turns  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

ASK = {"kind": "choice", "prompt": "Which priority?",
       "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High"},
                   {"id": "later", "label": "Later, once the release candidate is out"}]}
SCRIPT = f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted"


def finished(timeout=30):
    return wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).first(), timeout)


def test_line_shows_the_question_as_quick_replies_and_a_tap_answers_it_once(tcast, line, start_runtime,
                                                                            threaded_turns):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.say(SCRIPT)
    assert wait_until(lambda: line.quick_replies(), 30), rt.log(PID)
    q = Question.objects.get()
    [shown] = [m for m in line.pushed if m.get("quickReply")]
    assert shown["text"] == "Which priority?\n1. Low\n2. High\n3. Later, once the release candidate is out"
    items = shown["quickReply"]["items"]
    assert [i["type"] for i in items] == ["action"] * 3
    assert [i["action"] for i in items] == [
        {"type": "postback", "label": "Low", "data": f"{q.request_id}:1", "displayText": "Low"},
        {"type": "postback", "label": "High", "data": f"{q.request_id}:2", "displayText": "High"},
        {"type": "postback", "label": "Later, once the\u2026", "data": f"{q.request_id}:3",
         "displayText": "Later, once the release candidate is out"}]
    tap = line.press(items[1])  # the user taps "High"
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "high"' in turn.receipt.answer and turn.receipt.answer.endswith("noted")
    assert answered(line, 2)[1] == turn.receipt.answer  # the turn's answer follows the question
    assert "quickReply" not in line.pushed[1]
    assert line.redeliver(tap).status_code == 200  # LINE sends the tap again: nothing doubled
    line.say("script:answer=after")  # taken after the redelivery (one queue, in order)
    answered(line, 3)
    wait_until(lambda: False, 0.5)
    assert line.texts()[2:] == ["after"]  # no second answer, no "already answered" notice
    assert Turn.objects.count() == 2 and Question.objects.get().answer == {"answers": {"choice": "high"}}
    assert OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}", state="delivered").exists()


def test_line_with_more_than_13_options_sends_the_numbered_text_and_a_typed_number_answers(
        tcast, line, start_runtime, threaded_turns):
    ask = {"kind": "choice", "prompt": "Which day?",
           "options": [{"id": f"d{n}", "label": f"Day {n}"} for n in range(1, 15)]}
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.say(f"script:call=ask_user{json.dumps(ask)}|result|answer= noted")
    texts = answered(line, 1)
    assert texts[0].startswith("Which day?\n1. Day 1\n") and texts[0].endswith("\n14. Day 14")
    assert line.quick_replies() == []
    line.say("14")
    turn = finished()
    assert turn and turn.state == "completed", rt.log(PID)
    assert '"option_id": "d14"' in turn.receipt.answer
    assert Turn.objects.count() == 1
