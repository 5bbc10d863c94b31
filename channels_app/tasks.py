"""Celery tasks of the hub: they take ids, fetch rows, call a service."""
import logging
from concurrent.futures import ThreadPoolExecutor

from celery import shared_task
from celery.signals import beat_init
from celery.exceptions import SoftTimeLimitExceeded
from django.db import close_old_connections

from ugent_site.dbconn import with_fresh_connections

log = logging.getLogger("ugent.turns")


@shared_task(acks_late=True, ignore_result=True)
@with_fresh_connections
def run_turn(turn_pk: int) -> None:
    from channels_app import runner
    try:
        runner.turn_run(turn_pk)
    except SoftTimeLimitExceeded:  # the prefork pool's limit; the runner's own (UGENT_TURN_RUN_LIMIT) comes first
        from channels_app.models import Turn, TurnState
        turn = Turn.objects.select_related("actor").get(pk=turn_pk)
        runner.turn_end(turn=turn, state=TurnState.FAILED, answer_streamed=True,
                        reason=runner.TIME_LIMIT_REASON, code="time_limit")


class LocalTurnPool:
    """Embedded mode's turn threads: `run_turn` applied in this process, without the broker hop.

    With the in-process broker a turn's task never leaves the process that accepted it, and the
    broker keeps nothing a restart would (accepted turns are re-queued from their rows at start-up),
    so the hop bought nothing but its cost: about 1 ms of a turn's CPU on the chat bench, publish,
    consumer and request included. The turn still runs as the `run_turn` Celery task (`Task.apply`:
    the same tracer and task signals), on `concurrency` threads as the worker's pool would.
    """

    def __init__(self, concurrency: int):
        self.executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ugent-turn")

    def submit(self, turn_pk: int) -> None:
        try:
            self.executor.submit(self._run, turn_pk)
        except RuntimeError:  # shutting down: the turn stays accepted and runs at the next start
            log.warning("turn not started: the daemon is stopping (turn_pk=%s); it runs at the next start",
                        turn_pk)

    @staticmethod
    def _run(turn_pk: int) -> None:
        result = run_turn.apply(args=(turn_pk,))
        if result.failed():
            log.error("turn task failed (turn_pk=%s): %r", turn_pk, result.result)

    def stop(self) -> None:
        """Let running turns finish; turns not started stay accepted and run at the next start."""
        self.executor.shutdown(wait=True, cancel_futures=True)


_local_pool: LocalTurnPool | None = None


def local_turn_pool_start(concurrency: int) -> LocalTurnPool:
    global _local_pool
    _local_pool = LocalTurnPool(concurrency)
    return _local_pool


def local_turn_pool_stop() -> None:
    """Stop the turn threads. The pool stays the process's dispatcher: a turn accepted while the
    daemon stops stays accepted (re-queued at the next start) instead of going to the broker."""
    if _local_pool is not None:
        _local_pool.stop()


def local_turn_pool_forget() -> None:
    """Back to dispatching through the broker (tests)."""
    global _local_pool
    _local_pool = None


def local_turn_pool_active() -> bool:
    return _local_pool is not None


def turn_dispatch(turn_pk: int) -> bool:
    """Hand an accepted (committed) turn to a worker: the daemon's own turn threads in embedded mode,
    a Celery worker through the broker otherwise. False when the broker could not take it: the turn
    stays accepted in its row, and the sweep dispatches it again once the broker is back."""
    pool = _local_pool
    if pool is None:
        try:
            run_turn.delay(turn_pk)
        except Exception as exc:  # kombu's OperationalError after its publish retries, or a socket error
            log.warning("turn queued, not dispatched: the broker is unreachable (turn_pk=%s): %s", turn_pk, exc)
            return False
    else:
        pool.submit(turn_pk)
    return True


def broker_backlog() -> int | None:
    """How many messages wait in this deployment's queue on the broker; None when it cannot be asked.

    Only a Redis broker is asked (its queue is a list per priority step, kombu's naming); the
    in-process broker never holds a turn across a restart, and eager tests have no queue: 0."""
    from celery import current_app
    from django.conf import settings
    url = settings.CELERY_BROKER_URL
    if current_app.conf.task_always_eager or not url.startswith(("redis://", "rediss://", "unix://")):
        return 0
    import redis
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        return sum(client.llen(key) for key in [queue] + [f"{queue}\x06\x16{p}" for p in (3, 6, 9)])
    except redis.RedisError:
        return None
    finally:
        client.close()


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


@beat_init.connect
def _retention_schedule(sender=None, **kwargs) -> None:
    """Every beat process (embedded or `celery beat`) makes sure the retention job is scheduled."""
    from channels_app import streams
    try:
        streams.retention_schedule_ensure()
    finally:
        close_old_connections()
