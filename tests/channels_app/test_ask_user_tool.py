"""ask_user through the tool loop: the engine asks for the tool, the turn raises the question, the user's
reply (ugent_interaction_reply) is the tool's result, and the engine goes on with it (issue #13, items 1-2).

The pieces are tested alone in test_tools.py (the loop) and test_questions.py (question_ask and the
replies); this is the one path a real engine takes.
"""
from __future__ import annotations

import json

import pytest

from channels_app.models import Event, Question, ToolCall, Turn
from tests.streams.conftest import threaded_turns, wait_for  # noqa: F401 (a fixture)
from tests.support.http import chat

pytestmark = pytest.mark.django_db(transaction=True)

ASK = {"kind": "choice", "prompt": "Which priority?",
       "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High"}]}
SCRIPT = f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted"


def requested(turn):
    event = Event.objects.filter(turn=turn, type="interaction.requested").first()
    return event.data if event else None


def test_the_engines_ask_user_call_waits_for_the_reply_and_gets_it_as_the_tool_result(tcast, threaded_turns):
    resp = chat(tcast.alice, SCRIPT, conversation_id="ca", stream=True)
    assert resp.status_code == 200
    turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
    data = wait_for(lambda: requested(turn), timeout=30)
    assert data["timeout_at"] and Question.objects.get().state == "waiting"
    reply = chat(tcast.alice, "High", conversation_id="ca", ugent_interaction_reply={
        "request_id": data["request_id"], "action": "submit",
        "answers": [{"question_id": "choice", "option_id": "high"}]})
    assert reply.status_code == 200, reply.content
    done = wait_for(lambda: Turn.objects.filter(pk=turn.pk, finished_at__isnull=False).first(), timeout=30)
    assert done.state == "completed"
    call = ToolCall.objects.get(turn=turn)
    assert call.name == "ask_user" and not call.error
    answer = done.receipt.answer
    assert '"option_id": "high"' in answer or '"option_id":"high"' in answer, answer
    assert answer.endswith("noted") and Question.objects.get().state == "answered"
    assert Turn.objects.count() == 1  # the reply ran no turn of its own


def test_someone_else_cannot_answer_the_tools_question(tcast, threaded_turns):
    resp = chat(tcast.alice, SCRIPT, conversation_id="ca", stream=True)
    turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
    data = wait_for(lambda: requested(turn), timeout=30)
    reply = chat(tcast.bob, "High", conversation_id="ca", ugent_interaction_reply={
        "request_id": data["request_id"], "action": "submit",
        "answers": [{"question_id": "choice", "option_id": "high"}]})
    assert reply.status_code in (403, 404)
    assert Question.objects.get().state == "waiting"
    chat(tcast.alice, "never mind", conversation_id="ca",
         ugent_interaction_reply={"request_id": data["request_id"], "action": "abort"})
    done = wait_for(lambda: Turn.objects.filter(pk=turn.pk, finished_at__isnull=False).first(), timeout=30)
    assert done.state == "completed" and Question.objects.get().state == "aborted"
