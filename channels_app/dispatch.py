"""Handing accepted turns to whatever runs them: the daemon's own turn threads, or the broker.

Services and the runner's sweeps dispatch turns; the `run_turn` task is the Celery side of the
same hand-over. This module sits below both (it names the task, it does not import it), so the
hub's modules form no cycle: views → tasks → streams → services → runner → dispatch.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ugent_common.tasks import task_named

log = logging.getLogger("ugent.turns")
RUN_TURN_TASK = "channels_app.tasks.run_turn"


def _run_turn_task():
    return task_named(RUN_TURN_TASK)


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
        self.task = _run_turn_task()

    def submit(self, turn_pk: int) -> None:
        try:
            self.executor.submit(self._run, turn_pk)
        except RuntimeError:  # shutting down: the turn stays accepted and runs at the next start
            log.warning("turn not started: the daemon is stopping (turn_pk=%s); it runs at the next start",
                        turn_pk)

    def _run(self, turn_pk: int) -> None:
        result = self.task.apply(args=(turn_pk,))
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
            _run_turn_task().delay(turn_pk)
        except Exception as exc:  # kombu's OperationalError after its publish retries, or a socket error
            log.warning("turn queued, not dispatched: the broker is unreachable (turn_pk=%s): %s", turn_pk, exc)
            return False
    else:
        pool.submit(turn_pk)
    return True


def broker_backlog(queue: str | None = None) -> int | None:
    """How many messages wait in this deployment's turn queue (or `queue`) on the broker; None when it cannot
    be asked.

    Only a Redis broker is asked (its queue is a list per priority step, kombu's naming); the
    in-process broker never holds a turn across a restart, and eager tests have no queue: 0."""
    from celery import current_app
    from django.conf import settings
    url = settings.CELERY_BROKER_URL
    if current_app.conf.task_always_eager or not url.startswith(("redis://", "rediss://", "unix://")):
        return 0
    import redis
    queue = queue or settings.CELERY_TASK_DEFAULT_QUEUE
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        return sum(client.llen(key) for key in [queue] + [f"{queue}\x06\x16{p}" for p in (3, 6, 9)])
    except redis.RedisError:
        return None
    finally:
        client.close()


def queues_status() -> dict:
    """The queues section of GET /v1/ugent/status: each queue's name and how many messages wait in it. A
    background queue that only grows has no worker taking it (docs/deploy.md, "Queues")."""
    from django.conf import settings
    return {"turn": {"name": settings.CELERY_TASK_DEFAULT_QUEUE, "waiting": broker_backlog()},
            "background": {"name": settings.UGENT_BACKGROUND_QUEUE,
                           "waiting": broker_backlog(settings.UGENT_BACKGROUND_QUEUE)}}
