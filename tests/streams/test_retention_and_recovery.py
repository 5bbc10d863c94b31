"""The retention job that prunes the log, its beat schedule, and start-up recovery of interrupted turns."""
from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from channels_app import runner, streams, tasks
from channels_app.models import Event, EventLogMark, Receipt, Turn
from tests.streams.conftest import stream
from tests.support.http import chat

pytestmark = pytest.mark.django_db(transaction=True)


def test_pruning_deletes_only_events_older_than_the_retention_age_and_marks_where(tcast):
    chat(tcast.alice, "old", conversation_id="ca")
    old = list(Event.objects.values_list("id", flat=True))
    Event.objects.update(created_at=timezone.now() - datetime.timedelta(days=30))
    chat(tcast.alice, "new", conversation_id="ca")
    assert tasks.prune_events.delay().get() == len(old)  # the beat task, run eagerly
    assert not Event.objects.filter(id__in=old).exists() and Event.objects.exists()
    assert EventLogMark.objects.get(name="pruned_through").value == max(old)
    assert streams.events_prune() == 0  # nothing else is old enough
    assert EventLogMark.objects.get().value == max(old)


def test_the_retention_job_is_scheduled_in_beat_and_an_update_changes_its_interval(db):
    from django_celery_beat.models import PeriodicTask
    tasks._retention_schedule(sender=None)  # what every beat process runs at start
    entry = PeriodicTask.objects.get(name=streams.RETENTION_TASK_NAME)
    assert entry.task == "channels_app.tasks.prune_events" and entry.enabled
    assert entry.interval.every == streams.EVENT_PRUNE_EVERY_SECS
    streams.retention_schedule_ensure(every_seconds=120)
    assert PeriodicTask.objects.get(name=streams.RETENTION_TASK_NAME).interval.every == 120
    assert PeriodicTask.objects.filter(name=streams.RETENTION_TASK_NAME).count() == 1


def test_turns_left_running_by_a_crashed_process_become_interrupted_with_an_event(tcast, monkeypatch):
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    chat(tcast.alice, "running when it crashed", conversation_id="ca", stream=True)
    chat(tcast.alice, "accepted, not started", conversation_id="cb", stream=True)
    crashed, waiting = Turn.objects.order_by("id")
    Turn.objects.filter(pk=crashed.pk).update(state="running", started_at=timezone.now())
    Receipt.objects.filter(pk=crashed.receipt_id).update(state="running", started_at=timezone.now())
    assert runner.turns_recover_interrupted() == 1
    assert runner.turns_recover_interrupted() == 0  # a second start-up changes nothing
    crashed.refresh_from_db()
    assert crashed.state == "interrupted" and Receipt.objects.get(pk=crashed.receipt_id).state == "interrupted"
    assert Turn.objects.get(pk=waiting.pk).state == "accepted"
    frames = stream("/v1/ugent/events", tcast.alice, cursor="0", conversation_id="ca")
    assert frames[-1]["event"] == "turn.failed" and frames[-1]["data"]["data"]["state"] == "interrupted"


def test_finding_what_to_prune_reads_the_old_events_not_the_week_the_log_keeps(tcast):
    """The hourly prune's boundary read walked every retained event (`MAX(id) WHERE created_at < ?`, no
    index on created_at); it now stops at the first young event, so its cost does not grow with the log."""
    from django.db import connection

    from tests.support.plans import vm_steps
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count")
    chat(tcast.alice, "seed", conversation_id="ca")
    seed = Event.objects.order_by("id").first()
    old_at = timezone.now() - datetime.timedelta(days=30)

    def log_with(young: int) -> int:
        Event.objects.all().delete()
        Event.objects.bulk_create([Event(conversation_id=seed.conversation_id, type="x.old", data={"n": i})
                                   for i in range(20)])
        Event.objects.update(created_at=old_at)
        Event.objects.bulk_create([Event(conversation_id=seed.conversation_id, type="x.new", data={"n": i})
                                   for i in range(young)])
        last_old = Event.objects.filter(type="x.old").order_by("-id").values_list("id", flat=True).first()
        found = []
        steps = vm_steps(lambda: found.append(streams._log_last_old_id(timezone.now()
                                                                       - datetime.timedelta(days=7))))
        assert found == [last_old]
        return steps
    small, large = log_with(200), log_with(20_000)
    assert large < 2 * small + 20, (small, large)  # before: about 100x more for 100x the retained log
    assert streams.events_prune() == 20 and not Event.objects.filter(type="x.old").exists()
    assert Event.objects.filter(type="x.new").count() == 20_000
