"""Celery tasks of cron: they take ids (or a job's name), fetch rows, call a service."""
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.db import close_old_connections

from cron_app import conf


@shared_task(ignore_result=True)
def cron_fire(job: str, at: str | None = None) -> None:
    """Beat's entry for a scheduled job: claim the slot it fired for (once, whoever else fires it).

    `at` (ISO time) replays a firing as of that moment; beat sends none, and now is used.
    """
    from django.utils.dateparse import parse_datetime

    from cron_app.services import cron_slot_fire
    close_old_connections()
    try:
        cron_slot_fire(job_name=job, now=parse_datetime(at) if at else None)
    finally:
        close_old_connections()


@shared_task(acks_late=True, ignore_result=True, soft_time_limit=conf.RUN_SOFT_TIME_LIMIT,
             time_limit=conf.RUN_TIME_LIMIT)
def cron_run(run_pk: int) -> None:
    from cron_app import services
    close_old_connections()
    try:
        services.cron_run_execute(run_pk=run_pk)
    except SoftTimeLimitExceeded:
        services.cron_run_time_out(run_pk=run_pk)
    finally:
        close_old_connections()
