"""Celery tasks of the hub: they take ids, fetch rows, call a service."""
from celery import shared_task
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
