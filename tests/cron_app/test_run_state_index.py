"""The reads of runs by state across jobs (the sweep, every minute; start-up's recovery; the health board)
go through the index `cronrun_state`, not over every run ever made. The plans are SQLite's; what the sweep
and the board find among many ended runs is checked in both modes."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

from cron_app import selectors, services
from cron_app.models import CronRun, RunState
from tests.support.plans import statements_on, table_scans

pytestmark = pytest.mark.django_db(transaction=True)


def runs_made() -> None:
    CronRun.objects.bulk_create([CronRun(job_name=f"job-{i % 7}", trigger="schedule", state=RunState.COMPLETED)
                                 for i in range(60)] +
                                [CronRun(job_name="job-0", trigger="schedule", state=RunState.FAILED,
                                         error="boom")])


def state_reads():
    with mock.patch("cron_app.services._enqueue"):
        services.cron_runs_sweep()
        services.cron_runs_recover()
    selectors.cron_active_runs_count()
    selectors.cron_recent_failures()


def test_reads_of_runs_by_state_use_an_index_on_sqlite(tcast):
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")
    runs_made()
    found = statements_on("cron_app_cronrun", state_reads)
    assert len(found) >= 8, found  # the sweep's four, the recovery's three, the board's two
    assert table_scans("cron_app_cronrun", found) == []


def test_the_sweep_and_the_board_find_only_what_is_live_among_ended_runs(tcast):
    runs_made()
    queued = CronRun.objects.create(job_name="job-1", trigger="schedule", state=RunState.QUEUED)
    CronRun.objects.filter(pk=queued.pk).update(created_at=queued.created_at.replace(year=2000))
    with mock.patch("cron_app.services._enqueue") as enqueued:
        out = services.cron_runs_sweep()
    assert out["requeued"] == 1 and [c.args[0] for c in enqueued.call_args_list] == [queued.pk]
    assert selectors.cron_active_runs_count() == 1
    assert [f["state"] for f in selectors.cron_recent_failures()] == ["failed"]
