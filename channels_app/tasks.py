"""Celery tasks of the hub: they take ids, fetch rows, call a service."""
import logging

from celery import shared_task
from celery.signals import beat_init
from celery.exceptions import SoftTimeLimitExceeded
from django.db import close_old_connections

from ugent_common.dbconn import call_with_fresh_connections, with_fresh_connections

log = logging.getLogger("ugent.turns")


@shared_task(acks_late=True, ignore_result=True)
@with_fresh_connections
def run_turn(turn_pk: int) -> None:
    """Run one accepted turn. On a worker's own thread the turn is handed to a turn thread and waited for
    (channels_app.dispatch.TurnThreads): an engine that never returns keeps that thread, which the lease
    keeper writes off, so the worker's thread comes back. On a turn thread already (embedded mode) it
    runs here."""
    from channels_app import dispatch
    if dispatch.on_turn_thread():
        _turn_run(turn_pk)
        return
    try:
        dispatch.worker_turn_threads(_turn_run_fresh).run(turn_pk)
    except SoftTimeLimitExceeded:  # the prefork pool's limit; the runner's own (UGENT_TURN_RUN_LIMIT) comes first
        from channels_app import runner
        from channels_app.models import Turn, TurnState
        turn = Turn.objects.select_related("actor").get(pk=turn_pk)
        runner.turn_end(turn=turn, state=TurnState.FAILED, answer_streamed=True,
                        reason=runner.TIME_LIMIT_REASON, code="time_limit")
        dispatch.turn_thread_write_off(turn_pk)


def _turn_run(turn_pk: int) -> None:
    from channels_app import runner
    runner.turn_run(turn_pk)


def _turn_run_fresh(turn_pk: int) -> None:
    call_with_fresh_connections(_turn_run, turn_pk)


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
@with_fresh_connections
def prune_events() -> int:
    """The retention job (beat): delete events older than UGENT_EVENT_RETENTION_SECS."""
    from channels_app import streams
    return streams.events_prune()


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
@with_fresh_connections
def sweep_stale_turns() -> int:
    """Beat, every UGENT_TURN_SWEEP_SECONDS: turns whose lease lapsed end as interrupted, turns past
    their queue deadline as abandoned, and accepted turns the broker lost are dispatched again."""
    from channels_app import runner
    return runner.turns_sweep_stale()


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def prune_files() -> int:
    """Beat, every UGENT_FILES_PRUNE_EVERY_SECS: delete uploaded files past their retention."""
    from channels_app import files
    return files.files_prune()


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def expire_pending_artifacts() -> int:
    """Beat, every UGENT_FILES_PRUNE_EVERY_SECS: a tool's artifacts still pending UGENT_ARTIFACT_PENDING_SECS
    after they were announced are listed as not arrived."""
    from channels_app import artifacts
    return artifacts.artifacts_expire_pending()


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)
@with_fresh_connections
def rollup_usage() -> int:
    """Beat, every UGENT_USAGE_ROLLUP_SECS: fold ended turns into each caller's and key's usage totals."""
    from channels_app import usage
    return usage.usage_rollup()


@beat_init.connect
def _retention_schedule(sender=None, **kwargs) -> None:
    """Every beat process (embedded or `celery beat`) makes sure the retention jobs and the usage rollup are
    scheduled."""
    from channels_app import streams
    try:
        streams.retention_schedule_ensure()
        from channels_app import files
        files.files_prune_schedule_ensure()
        from channels_app import usage
        usage.usage_rollup_schedule_ensure()
    finally:
        close_old_connections()
