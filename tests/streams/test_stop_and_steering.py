"""POST /v1/ugent/stop and /v1/ugent/steering: who may, what the turn does, and what a finished turn says."""
from __future__ import annotations

import pytest

from channels_app import runner
from channels_app.models import Event, Message, Receipt, Steering, Turn
from tests.streams.conftest import post, wait_for
from tests.support.http import chat
from tests.support import scripted

pytestmark = pytest.mark.django_db(transaction=True)

SLOW = "script:slow=0.05|answer=" + " ".join(f"w{i}" for i in range(60))


def start_slow(who, conversation_id="ca", text=SLOW, **extra):
    resp = chat(who, text, conversation_id=conversation_id, stream=True, **extra)
    assert resp.status_code == 200
    turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
    wait_for(lambda: Event.objects.filter(turn=turn, type="turn.delta").exists())
    return turn


def finished(turn):
    return wait_for(lambda: Turn.objects.filter(pk=turn.pk, finished_at__isnull=False).first())


# --- stop --------------------------------------------------------------------

def test_the_turns_own_user_stops_it_and_the_partial_answer_is_kept_and_marked(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    resp = post("/v1/ugent/stop", tcast.alice, conversation_id="ca")
    assert resp.status_code == 202 and resp.json()["turn_id"] == turn.turn_id
    done = finished(turn)
    assert done.state == "cancelled" and done.stop_requested_by == "web:alice"
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert receipt.state == "cancelled" and receipt.reason == "stopped"
    assert receipt.answer.startswith("w0") and len(receipt.answer.split()) < 60
    types = list(Event.objects.filter(turn=turn).values_list("type", flat=True))
    assert "turn.stop_requested" in types and types[-1] == "turn.cancelled"
    last = Event.objects.filter(turn=turn).last()
    assert last.data["partial"] is True and last.data["answer"] == receipt.answer
    assert Message.objects.get(turn=turn, role="assistant").content == receipt.answer


def test_the_operator_stops_any_conversations_running_turn(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    resp = post("/v1/ugent/stop", {"key": tcast.keys["operator"]}, conversation_id="ca")
    assert resp.status_code == 202
    assert finished(turn).state == "cancelled"


def test_anyone_holding_the_exact_turn_id_may_stop_it(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    outsider = {"key": tcast.keys["outsider"]}
    resp = post("/v1/ugent/stop", outsider, conversation_id="ca", turn_id=turn.turn_id)
    assert resp.status_code == 202
    assert finished(turn).state == "cancelled"


@pytest.mark.parametrize("who", ["bob", "carol", "app", "outsider"])
def test_others_without_the_turn_id_cannot_stop_or_steer_it_and_learn_nothing(tcast, threaded_turns, who):
    turn = start_slow(tcast.alice)
    caller = {"bob": tcast.bob, "carol": tcast.carol, "app": {"key": tcast.keys["app"]},
              "outsider": {"key": tcast.keys["outsider"]}}[who]
    for path, extra in (("/v1/ugent/stop", {}), ("/v1/ugent/steering", {"message": "hijack"})):
        resp = post(path, caller, conversation_id="ca", **extra)
        assert resp.status_code == 404 and resp.json()["error"]["message"] == "No such conversation."
        resp = post(path, caller, conversation_id="ca", turn_id="turn-guessed", **extra)
        assert resp.status_code == 404
    assert not Turn.objects.get(pk=turn.pk).cancel_requested and not Steering.objects.exists()
    post("/v1/ugent/stop", tcast.alice, conversation_id="ca")
    finished(turn)


def test_stopping_a_finished_turn_says_so_and_changes_nothing(tcast):
    resp = chat(tcast.alice, "hello", conversation_id="ca")
    turn_id = resp["x-ugent-turn-id"]
    before = Event.objects.count()
    resp = post("/v1/ugent/stop", tcast.alice, conversation_id="ca", turn_id=turn_id)
    assert resp.status_code == 409
    assert resp.json()["error"]["message"] == "This turn already finished (completed): there is nothing to stop."
    resp = post("/v1/ugent/stop", tcast.alice, conversation_id="ca")
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "no_running_turn"
    assert Event.objects.count() == before and Turn.objects.get().state == "completed"


def test_stop_refuses_bad_input_and_a_missing_key(tcast):
    assert post("/v1/ugent/stop", tcast.alice).status_code == 400
    assert post("/v1/ugent/stop", {"key": "ugk_nope"}, conversation_id="ca").status_code == 401
    resp = post("/v1/ugent/stop", tcast.alice, conversation_id="nope")
    assert resp.status_code == 404


def test_a_turn_stopped_before_it_starts_runs_no_engine(tcast, monkeypatch):
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    chat(tcast.alice, "never answered", conversation_id="ca", stream=True)
    turn = Turn.objects.get()
    assert post("/v1/ugent/stop", tcast.alice, conversation_id="ca").status_code == 202
    calls = len(scripted.CALLS)
    runner.turn_run(turn.pk)
    assert Turn.objects.get().state == "cancelled" and len(scripted.CALLS) == calls


# --- steering ----------------------------------------------------------------

def test_a_steered_message_reaches_the_engine_before_its_next_step(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message="script:answer=steered now")
    assert resp.status_code == 202 and resp.json()["state"] == "pending"
    done = finished(turn)
    assert done.state == "completed"
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert receipt.answer.startswith("w0") and receipt.answer.endswith("steered now")
    assert "w59" not in receipt.answer  # the first step was cut short
    call = scripted.CALLS[-1]["messages"]
    assert call[-1] == ("user", "script:answer=steered now") and call[-2][0] == "assistant"
    assert receipt.answer.startswith(call[-2][1])
    steering = Steering.objects.get()
    assert steering.state == "applied" and steering.applied_at is not None
    steered = Event.objects.get(type="turn.steered")
    assert steered.data["message"] == "script:answer=steered now"
    assert Message.objects.filter(turn=turn, role="user").count() == 2


def test_steering_by_exact_turn_id_and_by_the_operator(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca",
                turn_id=turn.turn_id, message=SLOW)  # still slow: the turn is running for the next steering
    assert resp.status_code == 202
    resp = post("/v1/ugent/steering", {"key": tcast.keys["operator"]}, conversation_id="ca",
                message="script:answer=and from the operator")
    assert resp.status_code == 202
    # the exact turn_id lets a stranger stop a turn, never steer it: words in someone else's turn
    for stranger in ({"key": tcast.keys["outsider"]}, tcast.bob, tcast.carol):
        resp = post("/v1/ugent/steering", stranger, conversation_id="ca", turn_id=turn.turn_id,
                    message="script:answer=hijacked")
        assert resp.status_code == 404 and resp.json()["error"]["message"] == "No such turn in this conversation."
    finished(turn)
    assert Steering.objects.filter(state="applied").count() == 2 and Steering.objects.count() == 2


def test_steering_a_finished_turn_says_so(tcast):
    resp = chat(tcast.alice, "hello", conversation_id="ca")
    resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", turn_id=resp["x-ugent-turn-id"],
                message="too late")
    assert resp.status_code == 409
    assert resp.json()["error"]["message"] == ("This turn already finished (completed): steering reaches only "
                                               "a running turn. Send the message as a new turn.")
    resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message="too late")
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "no_running_turn"
    assert not Steering.objects.exists()


def test_steering_refuses_an_empty_message(tcast, threaded_turns):
    turn = start_slow(tcast.alice)
    for body in ({}, {"message": "   "}):
        resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", **body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "message"
    assert not Steering.objects.exists()
    post("/v1/ugent/stop", tcast.alice, conversation_id="ca")
    finished(turn)


def test_steering_that_waits_when_the_engine_ends_is_run_not_lost(tcast, monkeypatch):
    """A steering committed after the engine's last step but before completion runs as one more step."""
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    chat(tcast.alice, "script:answer=first", conversation_id="ca", stream=True)
    turn = Turn.objects.get()
    real_complete = runner.turn_complete
    injected = []

    def complete_after_a_late_steering(**kw):
        if not injected:
            injected.append(Steering.objects.create(turn=turn, actor=turn.actor, text="script:answer=second"))
        return real_complete(**kw)
    monkeypatch.setattr(runner, "turn_complete", complete_after_a_late_steering)
    runner.turn_run(turn.pk)
    receipt = Receipt.objects.get()
    assert receipt.state == "completed" and receipt.answer == "firstsecond"
    assert Steering.objects.get().state == "applied"


def test_steering_left_on_a_stopped_turn_is_dropped_and_says_so(tcast, monkeypatch):
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    chat(tcast.alice, "script:answer=x", conversation_id="ca", stream=True)
    turn = Turn.objects.get()
    Steering.objects.create(turn=turn, actor=turn.actor, text="late")
    Turn.objects.filter(pk=turn.pk).update(cancel_requested=True)
    runner.turn_run(turn.pk)
    assert Steering.objects.get().state == "dropped"
    assert Event.objects.filter(type="turn.steering_dropped").exists()
    resp = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", turn_id=turn.turn_id, message="more")
    assert resp.status_code == 409


def test_a_resent_steering_steers_once_even_after_its_turn_ended(tcast, threaded_turns):
    # a client whose 202 was lost sends the same steering again under its key: the turn is steered once
    turn = start_slow(tcast.alice)
    first = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message=SLOW, client_message_id="s1")
    again = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message=SLOW, client_message_id="s1")
    assert first.status_code == again.status_code == 202, again.content
    assert "duplicate" not in first.json() and again.json()["duplicate"] is True
    assert again.json()["id"] == first.json()["id"] and again.json()["turn_id"] == turn.turn_id
    assert Steering.objects.filter(turn=turn).count() == 1
    other = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message="other words",
                 client_message_id="s1")
    assert other.status_code == 409 and other.json()["error"]["code"] == "steering_key_reused"
    post("/v1/ugent/stop", tcast.alice, conversation_id="ca")
    finished(turn)
    late = post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message=SLOW, client_message_id="s1")
    assert late.status_code == 202 and late.json()["duplicate"] is True and late.json()["id"] == first.json()["id"]
    assert Steering.objects.count() == 1
    # someone else's key in the conversation tells nothing: the conversation is not theirs
    assert post("/v1/ugent/steering", tcast.bob, conversation_id="ca", message=SLOW,
                client_message_id="s1").status_code == 404


def test_an_unkeyed_steering_sent_twice_steers_twice(tcast, threaded_turns):
    start_slow(tcast.alice)
    for _ in range(2):
        assert post("/v1/ugent/steering", tcast.alice, conversation_id="ca", message=SLOW).status_code == 202
    assert Steering.objects.count() == 2
