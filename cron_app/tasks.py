"""Celery tasks of cron: they take ids (or a job's name), fetch rows, call a service."""
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import before_task_publish
from django.utils import timezone

from cron_app import conf
from ugent_common.dbconn import with_fresh_connections

#: The header beat's message carries: when it fired, so a message that waits in a busy queue
#: still claims the slot it fired for, not whichever slot is current when a worker takes it.
FIRED_AT_HEADER = "ugent_fired_at"


@before_task_publish.connect
def _stamp_fire_time(sender=None, headers=None, **kwargs) -> None:
    if sender == "cron_app.tasks.cron_fire" and headers is not None and FIRED_AT_HEADER not in headers:
        headers[FIRED_AT_HEADER] = timezone.now().isoformat()


@shared_task(bind=True, ignore_result=True)
@with_fresh_connections
def cron_fire(self, job: str, at: str | None = None) -> None:
    """Beat's entry for a scheduled job: claim the slot it fired for (once, whoever else fires it).

    The firing's moment is `at` (ISO time, to replay one), else the time stamped on the message
    when beat sent it, else now.
    """
    from django.utils.dateparse import parse_datetime

    from cron_app.services import cron_slot_fire
    fired = at or self.request.get(FIRED_AT_HEADER) or (self.request.headers or {}).get(FIRED_AT_HEADER)
    cron_slot_fire(job_name=job, now=parse_datetime(fired) if fired else None)


@shared_task(acks_late=True, ignore_result=True, soft_time_limit=conf.STEP_SOFT_TIME_LIMIT,
             time_limit=conf.STEP_TIME_LIMIT)
@with_fresh_connections
def cron_run(run_pk: int) -> None:
    """One step of a run (start it, submit its next task's turn, or end it). It never waits for a
    turn: the turn's end queues the next step. Redelivered, it resumes the run where it stands."""
    from cron_app import services
    try:
        services.cron_run_advance(run_pk=run_pk)
    except SoftTimeLimitExceeded:
        services.cron_run_time_out(run_pk=run_pk)


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)
@with_fresh_connections
def cron_task_deadline(run_pk: int, task_id: str) -> None:
    """Sent with a task's deadline as its eta: cut the task off if its turn is still going."""
    from cron_app import services
    services.cron_task_deadline(run_pk=run_pk, task_id=task_id)


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
@with_fresh_connections
def cron_sweep() -> None:
    """Beat: resume runs whose step a broker lost, cut off overdue tasks, end overlong runs."""
    from cron_app import services
    services.cron_runs_sweep()


SWEEP_TASK_NAME = "ugent: cron sweep (resume runs, cut off overdue tasks)"


def cron_sweep_schedule_ensure() -> None:
    """Create or update the beat entry that runs cron_sweep (django-celery-beat)."""
    from ugent_common.tasks import beat_every
    beat_every(SWEEP_TASK_NAME, "cron_app.tasks.cron_sweep", conf.SWEEP_EVERY_SECS,
               "Resumes cron runs whose step a broker lost; cuts off tasks past UGENT_CRON_TASK_TIME_LIMIT.")
