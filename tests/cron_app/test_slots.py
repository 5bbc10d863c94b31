"""Scheduled slots: fired once however many beats fire them, and a missed one caught up once."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import close_old_connections
from django.utils import timezone

from channels_app.models import Turn
from cron_app import services
from cron_app.apps import CronStartup
from cron_app.models import CronJob, CronRun
from cron_app.schedule import slot_at_or_before
from cron_app.tasks import cron_fire

pytestmark = pytest.mark.django_db(transaction=True)

UTC = dt_timezone.utc


def scheduled_job(cron_toml, schedule: str, *, catch_up: str = "once", since=None, tz: str = ""):
    cron_toml(f'''
enabled = true
[[jobs]]
id = "nightly"
schedule = "{schedule}"
{f'timezone = "{tz}"' if tz else ''}
catch_up = "{catch_up}"
[[jobs.tasks]]
id = "report"
prompt = "Write the nightly report."
''')
    if since is not None:
        CronJob.objects.filter(name="nightly").update(schedule_since=since)
    return CronJob.objects.get(name="nightly")


def test_two_beats_firing_the_same_slot_make_one_run(tcast, cron_toml):
    scheduled_job(cron_toml, "*/5 * * * *", since=datetime(2026, 1, 1, tzinfo=UTC))
    at = "2026-03-04T10:15:20+00:00"
    barrier = threading.Barrier(2)

    def beat():
        barrier.wait()
        try:
            cron_fire("nightly", at)  # what each beat's message makes a worker do
        finally:
            close_old_connections()

    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    run = CronRun.objects.get()
    assert run.slot == datetime(2026, 3, 4, 10, 15, tzinfo=UTC)
    assert (run.trigger, run.state) == ("scheduled", "completed")
    assert run.acts_for.key == "cron:system"
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 1
    # a restarted beat firing the same slot again, later in the grace window, runs nothing
    cron_fire("nightly", "2026-03-04T10:17:00+00:00")
    assert CronRun.objects.count() == 1
    # the next slot is a new run
    cron_fire("nightly", "2026-03-04T10:20:01+00:00")
    assert CronRun.objects.count() == 2


def test_a_slot_missed_while_down_runs_once_on_start_as_a_catch_up(tcast, cron_toml):
    now = timezone.now()
    earlier = now - timedelta(hours=1)
    # fires daily at a minute an hour ago; the schedule was set two days ago, the daemon was down since
    scheduled_job(cron_toml, f"{earlier.minute} {earlier.hour} * * *", since=now - timedelta(days=2))
    CronStartup().start()
    run = CronRun.objects.get()
    assert run.trigger == "catch_up" and run.state == "completed"
    assert run.slot == earlier.replace(second=0, microsecond=0)
    # starting again (or beat's own late firing of that slot) runs it no more
    CronStartup().start()
    cron_fire("nightly")
    assert CronRun.objects.count() == 1


def test_several_missed_slots_catch_up_once(tcast, cron_toml):
    scheduled_job(cron_toml, "0 * * * *", since=datetime(2026, 3, 1, tzinfo=UTC))
    runs = services.cron_catch_up(now=datetime(2026, 3, 4, 10, 30, tzinfo=UTC))
    assert len(runs) == 1 and runs[0].slot == datetime(2026, 3, 4, 10, 0, tzinfo=UTC)
    assert CronRun.objects.get().trigger == "catch_up"


def test_catch_up_none_records_the_missed_slot_as_skipped(tcast, cron_toml):
    scheduled_job(cron_toml, "0 3 * * *", catch_up="none", since=datetime(2026, 3, 1, tzinfo=UTC))
    services.cron_catch_up(now=datetime(2026, 3, 4, 10, 0, tzinfo=UTC))
    run = CronRun.objects.get()
    assert (run.trigger, run.state) == ("catch_up", "skipped")
    assert run.error == "missed while cron was not running (catch_up = none)"
    assert not Turn.objects.exists()


def test_a_slot_before_the_schedule_existed_is_not_owed(tcast, cron_toml):
    scheduled_job(cron_toml, "0 3 * * *", since=datetime(2026, 3, 4, 9, 0, tzinfo=UTC))
    assert services.cron_catch_up(now=datetime(2026, 3, 4, 10, 0, tzinfo=UTC)) == []
    assert not CronRun.objects.exists()


def test_a_fresh_schedule_owes_nothing_on_start(tcast, cron_toml):
    scheduled_job(cron_toml, "0 3 * * *")  # schedule_since = now, set by the import
    CronStartup().start()
    assert not CronRun.objects.exists()


def test_a_slot_that_finds_the_last_run_still_going_is_skipped_and_says_why(tcast, cron_toml, no_enqueue):
    scheduled_job(cron_toml, "*/5 * * * *", since=datetime(2026, 1, 1, tzinfo=UTC))
    services.cron_slot_fire(job_name="nightly", now=datetime(2026, 3, 4, 10, 0, 5, tzinfo=UTC))
    services.cron_slot_fire(job_name="nightly", now=datetime(2026, 3, 4, 10, 5, 5, tzinfo=UTC))
    first, second = CronRun.objects.order_by("id")
    assert first.state == "queued"
    assert second.state == "skipped" and second.error == "the previous run was still running (overlap = skip)"


def test_cron_switched_off_fires_nothing(tcast, cron_toml):
    scheduled_job(cron_toml, "*/5 * * * *", since=datetime(2026, 1, 1, tzinfo=UTC))
    services.cron_settings_set(enabled=False)
    cron_fire("nightly", "2026-03-04T10:15:20+00:00")
    assert not CronRun.objects.exists()


@pytest.mark.parametrize("expr, tz, now, slot", [
    ("30 2 * * *", "", "2026-03-04T02:29:59+00:00", "2026-03-03T02:30:00+00:00"),
    ("30 2 * * *", "", "2026-03-04T02:30:00+00:00", "2026-03-04T02:30:00+00:00"),
    ("0 9 * * 1", "", "2026-03-04T10:00:00+00:00", "2026-03-02T09:00:00+00:00"),  # Monday
    ("0 9 * * *", "Europe/Paris", "2026-03-04T10:00:00+00:00", "2026-03-04T08:00:00+00:00"),
    ("0 0 29 2 *", "", "2026-03-04T10:00:00+00:00", "2024-02-29T00:00:00+00:00"),
    ("*/15 * * * *", "", "2026-03-04T10:44:00+00:00", "2026-03-04T10:30:00+00:00"),
])
def test_the_slot_is_the_latest_firing_at_or_before_now(expr, tz, now, slot):
    assert slot_at_or_before(expr, tz, datetime.fromisoformat(now)) == datetime.fromisoformat(slot)


def test_a_firing_that_waited_in_the_queue_claims_the_slot_beat_fired_for(tcast, cron_toml):
    """Beat stamps the message when it sends it; a worker that takes it two slots later still runs that slot."""
    from cron_app.tasks import FIRED_AT_HEADER, _stamp_fire_time
    scheduled_job(cron_toml, "*/5 * * * *", since=datetime(2026, 1, 1, tzinfo=UTC))
    headers = {}
    _stamp_fire_time(sender="cron_app.tasks.cron_fire", headers=headers)
    fired = datetime.fromisoformat(headers[FIRED_AT_HEADER])
    assert abs((timezone.now() - fired).total_seconds()) < 60
    other = {}
    _stamp_fire_time(sender="channels_app.tasks.run_turn", headers=other)
    assert other == {}  # only cron's firings are stamped

    stamped = {FIRED_AT_HEADER: "2026-03-04T10:15:02+00:00"}
    cron_fire.apply(kwargs={"job": "nightly"}, headers=stamped)  # taken long after 10:15, as a worker would
    run = CronRun.objects.get()
    assert run.slot == datetime(2026, 3, 4, 10, 15, tzinfo=UTC)
    assert run.trigger == "scheduled"  # on time when beat fired it, not a catch-up
