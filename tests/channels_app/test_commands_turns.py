"""Commands beside a conversation's turns: /steering, /btw, /refine and /harness with the snapshot's verifications."""
from __future__ import annotations

import time

import pytest
from django.test import Client

from channels_app import commands, harness
from channels_app.models import Message, Turn
from plugins_app.agent.models import AgentProfile
from tests.streams.conftest import get, post, threaded_turns  # noqa: F401  (a fixture)
from tests.support.http import chat
from tests.streams.test_stop_and_steering import finished, start_slow
from tests.conftest import OPERATOR_KEY
from tests.support import scripted
from ugent_common import bounded

pytestmark = pytest.mark.django_db(transaction=True)


def command(who, text, **extra):
    return post("/v1/ugent/commands", who, command=text, **extra)


def test_steering_command_steers_the_running_turn(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    resp = command(tcast.alice, "/steering script:answer=steered now", conversation_id="ca")
    assert resp.status_code == 200 and resp.json()["changed"] and resp.json()["data"]["turn_id"] == turn.turn_id
    done = finished(turn)
    assert done.state == "completed" and done.receipt.answer.endswith("steered now")
    resp = command(tcast.alice, "/steering again", conversation_id="ca")
    assert resp.status_code == 409 and resp.json()["error"]["message"] == "No turn is running in this conversation."
    assert command(tcast.alice, "/steering", conversation_id="ca").status_code == 400


def test_btw_answers_aside_without_touching_the_history_or_the_running_turn(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    messages = Message.objects.filter(conversation=turn.conversation).count()
    resp = command(tcast.alice, "/btw what is a turn?", conversation_id="ca")
    body = resp.json()
    assert resp.status_code == 200 and body["ok"] and body["data"]["answer"].startswith("echo: what is a turn?")
    call = scripted.CALLS[-1]
    assert call["session_id"].startswith("aside-") and call["messages"][0] == ("system", commands.BTW_PROMPT)
    assert Turn.objects.count() == 1
    assert not Message.objects.filter(content__contains="what is a turn?").exists()
    assert Message.objects.filter(conversation=turn.conversation).count() == messages
    done = finished(turn)
    assert done.state == "completed" and "w59" in done.receipt.answer  # not interrupted


def test_btw_says_why_when_the_engine_cannot_answer(tcast):
    AgentProfile.objects.create(name="broken", provider="no-such-engine")
    command(tcast.alice, "/model broken")
    body = command(tcast.alice, "/btw hello?").json()
    assert body["ok"] is False and body["text"].startswith("The engine could not answer:")


def test_btw_with_an_engine_that_never_returns_answers_in_time_and_does_not_pile_threads_on_it(tcast, settings):
    # The engine was asked on the request's own thread: one that never came back kept that thread for ever
    # (the API's, or a channel plugin's bridge lane), and the deadline was only looked at between its items.
    settings.UGENT_COMMAND_ENGINE_TIMEOUT = 0.5
    settings.UGENT_TURN_STUCK_MAX = 2
    wait_overrun_gone()
    for _ in range(2):
        body = command(tcast.alice, "/btw script:hang=4").json()
        assert body["ok"] is False and body["data"]["error"] == "The engine ran out of time.", body
    assert bounded.overrunning("engine:") == {"engine:scripted": 2}
    status = Client().get("/v1/ugent/status", HTTP_X_API_KEY=OPERATOR_KEY).json()["status"]
    assert status["overrun"]["calls"]["engine:scripted"] == 2
    body = command(tcast.alice, "/btw script:hang=4").json()
    assert body["ok"] is False and body["data"]["error"] == (
        "2 earlier questions to this engine are still running past their time limit: it is not asked again "
        "until they end."), body
    wait_overrun_gone()  # the hung asks came back: the engine is asked again
    body = command(tcast.alice, "/btw hello?").json()
    assert body["ok"] and body["data"]["answer"].startswith("echo: hello?")


def wait_overrun_gone() -> None:
    deadline = time.monotonic() + 20
    while bounded.overrunning("engine:") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bounded.overrunning("engine:") == {}


def test_refine_through_the_engine_and_offline_and_it_stores_nothing(tcast):
    chat(tcast.alice, "um  what is   the capital of france", conversation_id="ca")
    before = Message.objects.count()
    body = command(tcast.alice, "/refine", conversation_id="ca").json()
    assert body["data"]["via"] == "engine" and body["data"]["original"] == "um  what is   the capital of france"
    assert scripted.CALLS[-1]["messages"][0] == ("system", commands.REFINE_PROMPT)
    AgentProfile.objects.create(name="broken", provider="no-such-engine")
    command(tcast.alice, "/model broken")
    body = command(tcast.alice, "/refine", conversation_id="ca").json()
    assert body["data"]["via"] == "offline" and body["data"]["refined"] == "What is the capital of france?"
    assert Message.objects.count() == before and Turn.objects.count() == 1
    assert command(tcast.bob, "/refine", conversation_id="ca").status_code == 403


def test_refine_on_the_notes_engine_is_the_offline_rewrite_not_a_quote_of_the_notes(tcast, tmp_path):
    """docs/commands.md: /refine goes through the engine "when it can": the default ugent-notes quotes notes."""
    (tmp_path / "france.md").write_text("The capital of France is Paris. France is a country in Europe.\n")
    AgentProfile.objects.create(name="notes", provider="ugent-notes", config={"path": str(tmp_path)})
    chat(tcast.alice, "um  what is   the capital of france", conversation_id="ca")
    command(tcast.alice, "/model notes", conversation_id="ca")
    body = command(tcast.alice, "/refine", conversation_id="ca").json()
    assert body["data"]["via"] == "offline" and body["data"]["model"] is None
    assert body["data"]["refined"] == "What is the capital of france?" and "engine_error" not in body["data"]


def test_refine_offline_rules():
    assert commands.refine_offline("ok so  please fix the bug") == "Please fix the bug."
    assert commands.refine_offline("Done!") == "Done!"


def test_harness_goals_tasks_checks_and_the_snapshots_verifications(tcast, settings, tmp_path):
    settings.UGENT_WORKSPACE = str(tmp_path)
    chat(tcast.alice, "hello", conversation_id="ca")
    assert command(tcast.alice, "/harness", conversation_id="ca").json()["data"]["items"] == []
    goal = command(tcast.alice, "/harness goal find the capital", conversation_id="ca").json()["data"]["items"][0]
    task = command(tcast.alice, "/harness task write it down", conversation_id="ca").json()["data"]["items"][1]
    resp = command(tcast.alice, f"/harness check {goal['id']} nonsense", conversation_id="ca")
    assert resp.status_code == 400 and resp.json()["error"]["message"] == harness.BAD_CHECK
    command(tcast.alice, f"/harness check {goal['id']} phrase:Paris", conversation_id="ca")
    command(tcast.alice, f"/harness check {task['id']} file:capital.txt", conversation_id="ca")
    body = command(tcast.alice, "/harness verify", conversation_id="ca").json()
    assert [i["verification"]["passed"] for i in body["data"]["items"]] == [False, False]
    (tmp_path / "capital.txt").write_text("Paris")
    turn = Turn.objects.get(turn_id=chat(tcast.alice, "script:answer=It is Paris", conversation_id="ca")["x-ugent-turn-id"])
    snap = get("/v1/ugent/conversation/snapshot", tcast.alice, conversation_id="ca").json()
    latest = {v["id"]: v["verification"] for v in snap["verifications"]}
    assert latest[goal["id"]]["passed"] is True and latest[goal["id"]]["turn_id"] == turn.turn_id
    assert latest[task["id"]]["passed"] is True and latest[task["id"]]["detail"] == "capital.txt exists"
    assert command(tcast.alice, f"/harness done {goal['id']}", conversation_id="ca").json()["changed"] is True
    body = command(tcast.alice, f"/harness done {goal['id']}", conversation_id="ca").json()
    assert body["changed"] is False and body["text"] == f"#{goal['id']} was already done."
    resp = command(tcast.alice, "/harness done 999", conversation_id="ca")
    assert resp.status_code == 404 and resp.json()["error"]["message"] == harness.NO_ITEM.format(id="999")
    for typed in ("/harness done ²", "/harness check ² cmd: true", "/harness verify ²", "/harness done #١"):
        resp = command(tcast.alice, typed, conversation_id="ca")  # str.isdigit() holds: int() was a 500 or read 1
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "harness_item_not_found", typed
    resp = command(tcast.alice, "/harness frobnicate", conversation_id="ca")
    assert resp.status_code == 400 and resp.json()["error"]["message"] == commands.HARNESS_UNKNOWN.format(sub="frobnicate")
    assert command(tcast.bob, "/harness", conversation_id="ca").status_code == 403
