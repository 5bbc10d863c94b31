"""A native action a before-turn hook names (hooks.NativeAction) runs as the turn, by the turn runner, after
the receipt commits, outside any transaction, and ends like a hook's answer; the hub finds it by name."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import transaction

from channels_app import hooks, runner, services
from channels_app.models import Event, Receipt, Steering, SteeringState, Turn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def action_hook():
    """A hook that names the native action "test-action" for every message; the action is the test's."""
    def hook(ctx):
        return hooks.NativeAction("test-action", reason="hook ran test-action", decided_by="test-hook")
    hooks.register("test-native", 1, hook)
    yield
    hooks.unregister("test-native")
    hooks.unregister_native_action("test-action")


def send(tcast, text="hi", on_turn=None, **kw):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    inbound = services.Submission(actor=actor, caller=tcast.operator, text=text, **kw)
    return services.message_submit(inbound=inbound, on_turn=on_turn)


def events(turn):
    return list(Event.objects.filter(turn=turn).order_by("id").values_list("type", flat=True))


def test_the_action_runs_after_the_receipt_commits_outside_any_transaction(tcast, action_hook):
    seen = []

    def action(*, turn, first_message):
        receipt = Receipt.objects.get(pk=turn.receipt_id)  # committed: another connection would read it too
        seen.append((transaction.get_connection().in_atomic_block, receipt.state, first_message,
                     turn.context["text"]))
        return "the action's answer"
    hooks.register_native_action("test-action", action)
    with mock.patch("channels_app.tasks.run_turn.delay") as delay:
        result = send(tcast, "do it")
    assert result.stopped is None and delay.call_count == 1  # dispatched like an agent turn
    assert not seen and Turn.objects.get(pk=result.turn.pk).state == "accepted"
    assert result.turn.context["native_action"] == {"action": "test-action", "decided_by": "test-hook",
                                                    "reason": "hook ran test-action", "first_message": True}
    runner.turn_run(result.turn.pk)
    assert seen == [(False, "running", True, "do it")]
    turn = Turn.objects.get(pk=result.turn.pk)
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert (turn.state, receipt.state, receipt.answer, receipt.reason) == (
        "completed", "completed", "the action's answer", "hook ran test-action")
    assert events(turn) == ["ugent.user_message", "turn.delta", "turn.completed"]
    done = Event.objects.get(turn=turn, type="turn.completed").data
    assert done["decided_by"] == "test-hook" and done["answer"] == "the action's answer"


def test_a_stop_sent_before_the_claim_means_the_action_never_runs(tcast, action_hook):
    ran = []
    hooks.register_native_action("test-action", lambda **kw: ran.append(1) or "ran")

    def stop_at_once(turn):  # before the accept commits, so before any claim
        Turn.objects.filter(pk=turn.pk).update(cancel_requested=True)
    result = send(tcast, on_turn=stop_at_once)  # eager: the turn runs as the accept commits
    turn = Turn.objects.get(pk=result.turn.pk)
    assert not ran and turn.state == "cancelled"
    assert Receipt.objects.get(pk=turn.receipt_id).state == "cancelled"


def test_steering_that_came_while_the_action_ran_is_dropped_and_said_so(tcast, action_hook):
    def action(*, turn, first_message):
        Steering.objects.create(turn_id=turn.pk, actor=turn.actor, text="and also")
        return "done"
    hooks.register_native_action("test-action", action)
    result = send(tcast)
    turn = Turn.objects.get(pk=result.turn.pk)
    assert turn.state == "completed"
    assert Steering.objects.get(turn=turn).state == SteeringState.DROPPED
    assert events(turn) == ["ugent.user_message", "turn.delta", "turn.steering_dropped", "turn.completed"]


def test_an_action_that_is_not_installed_fails_its_turn(tcast, action_hook):
    result = send(tcast)
    turn = Turn.objects.get(pk=result.turn.pk)
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert turn.state == "failed"
    assert receipt.reason == "No native action named 'test-action' is installed here."
    assert Event.objects.get(turn=turn, type="turn.failed").data["code"] == "native_action_not_installed"
