"""Turns whose worker died end as interrupted, never running forever, and a late finish writes nothing."""
from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from channels_app import runner, services
from channels_app.models import Event, Message, Receipt, Turn

pytestmark = pytest.mark.django_db(transaction=True)


def running_turn(tcast, text="hi", started_ago=0):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        result = services.message_submit(inbound=services.InboundMessage(actor=actor, caller=tcast.operator,
                                                                         text=text))
    started = timezone.now() - timedelta(seconds=started_ago)
    Turn.objects.filter(pk=result.turn.pk).update(state="running", started_at=started)
    Receipt.objects.filter(pk=result.receipt.pk).update(state="running", started_at=started)
    return Turn.objects.select_related("actor").get(pk=result.turn.pk)


def test_the_sweep_ends_only_turns_past_their_hard_limit(tcast, settings):
    old = running_turn(tcast, "old", started_ago=settings.CELERY_TASK_TIME_LIMIT + 120)
    fresh = running_turn(tcast, "fresh", started_ago=5)
    assert runner.turns_sweep_stale() == 1
    old.refresh_from_db()
    fresh.refresh_from_db()
    assert old.state == "interrupted" and fresh.state == "running"
    assert Receipt.objects.get(pk=old.receipt_id).state == "interrupted"
    ev = Event.objects.get(turn=old, type="turn.failed")
    assert ev.data["state"] == "interrupted" and ev.audience == ["web:alice"]
    assert runner.turns_sweep_stale() == 0  # once only


def test_a_late_finish_after_the_sweep_writes_nothing(tcast, settings):
    turn = running_turn(tcast, "slow", started_ago=settings.CELERY_TASK_TIME_LIMIT + 120)
    runner.turns_sweep_stale()
    runner.turn_complete(turn=turn, writer=runner.DeltaWriter(turn), answer="too late", citations=[])
    runner.turn_fail(turn=turn, writer=runner.DeltaWriter(turn), answer="", reason="x", code="y")
    turn.refresh_from_db()
    assert turn.state == "interrupted"
    assert Receipt.objects.get(pk=turn.receipt_id).state == "interrupted"
    assert not Message.objects.filter(turn=turn, role="assistant").exists()
    assert not Event.objects.filter(turn=turn, type__in=["turn.completed"]).exists()


def test_the_sweep_is_scheduled_in_beat(tcast):
    from django_celery_beat.models import PeriodicTask

    from channels_app.streams import retention_schedule_ensure
    retention_schedule_ensure()
    assert PeriodicTask.objects.filter(task="channels_app.tasks.sweep_stale_turns", enabled=True).exists()
