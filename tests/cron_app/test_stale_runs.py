"""A run past UGENT_CRON_RUN_TIME_LIMIT ends timed_out and frees its place for the runs waiting behind it."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from cron_app import conf, services
from cron_app.models import CronJob, CronRun, RunState, RunTrigger
from tests.cron_app.conftest import import_cron

QUEUED_JOB = '''
enabled = true
[[jobs]]
id = "q"
enabled = true
rule_trigger = true
overlap = "queue"
max_concurrent_runs = 1
[[jobs.tasks]]
id = "t"
prompt = "p"
'''


@pytest.mark.django_db(transaction=True)
def test_a_swept_run_hands_its_place_to_the_waiting_run(monkeypatch):
    import_cron(QUEUED_JOB)
    enqueued = []
    monkeypatch.setattr(services, "_enqueue", enqueued.append)
    job = CronJob.objects.get(name="q")
    first, _ = services._claim(job=job, trigger=RunTrigger.MANUAL)
    second, outcome = services._claim(job=job, trigger=RunTrigger.MANUAL)
    assert CronRun.objects.get(pk=second.pk).state == RunState.WAITING
    # the first run started longer ago than a whole run may take
    CronRun.objects.filter(pk=first.pk).update(
        state=RunState.RUNNING, started_at=timezone.now() - timedelta(seconds=conf.RUN_TIME_LIMIT + 120))
    third, outcome = services._claim(job=job, trigger=RunTrigger.MANUAL)
    swept = CronRun.objects.get(pk=first.pk)
    assert (swept.state, swept.error) == (
        RunState.TIMED_OUT, f"the run ran out of time (UGENT_CRON_RUN_TIME_LIMIT = {conf.RUN_TIME_LIMIT} s)")
    assert CronRun.objects.get(pk=second.pk).state == RunState.QUEUED  # moved up, not wedged behind
    assert second.pk in enqueued
    assert outcome == services.WAITING  # the newcomer queues behind it instead of "too many"
