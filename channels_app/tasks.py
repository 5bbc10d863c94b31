"""Celery tasks of the hub: they take ids, fetch rows, call a service."""
from celery import shared_task
from celery.signals import beat_init
from celery.exceptions import SoftTimeLimitExceeded
from django.db import close_old_connections


@shared_task(acks_late=True, ignore_result=True)
def run_turn(turn_pk: int) -> None:
    from channels_app import runner
    close_old_connections()
    try:
        runner.turn_run(turn_pk)
    except SoftTimeLimitExceeded:
        from channels_app.models import Turn
        turn = Turn.objects.select_related("actor").get(pk=turn_pk)
        runner.turn_fail(turn=turn, writer=runner.DeltaWriter(turn), answer="",
                         reason="The turn ran out of time.", code="time_limit")
    finally:
        close_old_connections()


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
def prune_events() -> int:
    """The retention job (beat): delete events older than UGENT_EVENT_RETENTION_SECS."""
    from channels_app import streams
    close_old_connections()
    try:
        return streams.events_prune()
    finally:
        close_old_connections()


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def sweep_stale_turns() -> int:
    """Beat: turns whose worker died (servers mode) end as interrupted instead of running forever."""
    from channels_app import runner
    close_old_connections()
    try:
        return runner.turns_sweep_stale()
    finally:
        close_old_connections()


@beat_init.connect
def _retention_schedule(sender=None, **kwargs) -> None:
    """Every beat process (embedded or `celery beat`) makes sure the retention job is scheduled."""
    from channels_app import streams
    try:
        streams.retention_schedule_ensure()
    finally:
        close_old_connections()
