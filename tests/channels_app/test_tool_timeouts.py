"""A hub tool that waits by design has its own time limit, not the per-tool timeout.

`ask_user` waits for the user's answer (UGENT_QUESTION_DEFAULT_TIMEOUT, 120 s, up to
UGENT_QUESTION_MAX_TIMEOUT), and a delegated task runs an engine loop of its own. Both ran under
UGENT_TOOL_TIMEOUT_SECONDS (30 s): the engine was told "the tool did not answer within 30 s" while the
question still waited for its user, whose answer then went nowhere; and each such call counted as a call
left running past its limit, so a few slow users shut ask_user off for everyone (UGENT_TOOL_OVERRUN_MAX).
"""
from __future__ import annotations

import json
import time

import pytest

from channels_app import tools as hub_tools
from channels_app.models import Question, ToolCall, Turn
from tests.streams.conftest import threaded_turns, wait_for  # noqa: F401 (a fixture)
from tests.support.http import chat

pytestmark = pytest.mark.django_db(transaction=True)

ASK = {"kind": "choice", "prompt": "Which colour?", "options": [{"id": "r", "label": "Red"},
                                                               {"id": "g", "label": "Green"}], "timeout_s": 20}


def test_ask_user_waits_for_its_answer_past_the_per_tool_timeout(tcast, threaded_turns, settings):  # noqa: F811
    settings.UGENT_TOOL_TIMEOUT_SECONDS = 0.3
    settings.UGENT_TOOL_OVERRUN_MAX = 1
    resp = chat(tcast.alice, f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted", conversation_id="ca",
                stream=True)
    assert resp.status_code == 200
    question = wait_for(lambda: Question.objects.filter(state="waiting").first(), timeout=20)
    assert question is not None
    # longer than the per-tool timeout: the tool must still be waiting for the user
    time.sleep(1.0)
    assert not ToolCall.objects.filter(state="error").exists(), list(ToolCall.objects.values("error"))
    assert hub_tools.overrunning() == {}
    body = {"request_id": question.request_id, "action": "submit", "value": "green"}
    assert chat(tcast.alice, "green", conversation_id="ca", ugent_interaction_reply=body).status_code == 200
    turn = wait_for(lambda: Turn.objects.filter(finished_at__isnull=False).first(), timeout=30)
    assert turn is not None and turn.state == "completed"
    call = ToolCall.objects.get(name="ask_user")
    assert call.state == "done" and call.result["state"] == "answered", call.error
    assert call.result["answers"] == [{"question_id": "choice", "option_id": "g"}]


def test_a_delegated_task_runs_past_the_per_tool_timeout(tcast, settings):
    settings.UGENT_TOOL_TIMEOUT_SECONDS = 0.3
    task = json.dumps({"task": "script:hang=1"})  # (one step: a script's steps are split on "|")
    resp = chat(tcast.alice, f"script:call=delegate_research{task}|result", conversation_id="cd")
    assert resp.status_code == 200, resp.content
    call = ToolCall.objects.get(name="delegate_research", depth=0)
    assert call.state == "done", call.error
    assert call.result["answer"] == ""


@pytest.mark.parametrize("name, value", [("UGENT_TOOL_TIMEOUT_SECONDS", 0), ("UGENT_QUESTION_FIT_TIMEOUT", -1),
                                         ("UGENT_TOOL_OVERRUN_MAX", 0), ("UGENT_PLUGIN_START_TIMEOUT", 0)])
def test_a_bound_that_would_refuse_every_plugin_call_stops_the_start(settings, name, value):
    from django.core import checks
    assert not [m for m in checks.run_checks() if m.id == "ugent.E005"]
    setattr(settings, name, value)
    found = [m for m in checks.run_checks() if m.id == "ugent.E005"]
    assert len(found) == 1 and found[0].msg.startswith(f"{name} is {value:g}: it must be "), found
