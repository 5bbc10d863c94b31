"""Handing accepted turns to whatever runs them: the daemon's own turn threads, or the broker.

Services and the runner's sweeps dispatch turns; the `run_turn` task is the Celery side of the
same hand-over. This module sits below both (it names the task, it does not import it), so the
hub's modules form no cycle: views → tasks → streams → services → runner → dispatch.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import weakref
from typing import Callable

from django.conf import settings
from django.db import connection

from ugent_common.tasks import task_named

log = logging.getLogger("ugent.turns")
RUN_TURN_TASK = "channels_app.tasks.run_turn"


def _run_turn_task():
    return task_named(RUN_TURN_TASK)


class _Job:
    __slots__ = ("turn_pk", "done", "thread", "written_off")

    def __init__(self, turn_pk: int):
        self.turn_pk = turn_pk
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.written_off = False


class TurnThreads:
    """The threads a process runs its turns on; a thread stuck in its turn is written off and replaced.

    An engine (or anything the runner calls) that never returns keeps its thread: Python cannot stop
    it. The lease keeper ends such a turn as failed once it is past its run limit and a grace
    (runner.LeaseKeeper); it then writes the thread off here (`write_off`). A written-off thread no
    longer counts against the pool's size, so the next turn gets a thread of its own, and whoever waits
    for the turn (`run`) goes on. When the stuck thread comes back after all, it ends.

    At most `stuck_max` threads are written off in a process: past that a stuck thread keeps its place
    (the pool runs one turn fewer at once) and every such turn is logged at ERROR, since each stuck
    thread holds memory and a database connection until the process restarts.

    `limit`: how many turns run at once (embedded mode's turn threads); None for the threads a Celery
    worker's own pool hands its turns to (`run`), whose concurrency that pool bounds. Idle threads of
    such a pool end once idle past CONN_MAX_AGE (at least a minute); a thread that ends closes its connection. Threads are daemon
    threads: a stuck one does not hold the process's exit.
    """

    IDLE_SECS = 60.0

    def __init__(self, target: Callable[[int], None], *, limit: int | None, stuck_max: int):
        self.target = target
        self.limit = limit
        self.stuck_max = stuck_max
        # An on-demand pool's idle thread ends, but not before its kept database connection would have expired
        # (CONN_MAX_AGE): the next turn would pay a new thread and a new connection (None: kept for ever).
        age = settings.DATABASES.get("default", {}).get("CONN_MAX_AGE", 0)
        self.idle_secs = None if age is None else max(self.IDLE_SECS, float(age))
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        # turn pk -> the jobs running it, oldest first: a turn's task delivered twice (a redelivery, the sweep
        # dispatching a turn it took for lost) runs beside the first until its claim fails, and must not
        # hide the first, which a write-off or a stop looks for
        self._running: dict[int, list[_Job]] = {}
        self._stuck: set[_Job] = set()
        self._live = 0  # threads not written off
        self._idle = 0
        self._stopping = False
        _pools.add(self)

    # -- handing turns over --
    def submit(self, turn_pk: int) -> _Job:
        """Queue the turn for the next free thread. RuntimeError once stopping."""
        job = _Job(turn_pk)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the turn threads are stopping")
            self._jobs.append(job)
            self._start_needed()
            self._cond.notify()
        return job

    def run(self, turn_pk: int) -> None:
        """Run the turn on a turn thread and wait until it ends or its thread is written off. On a turn
        thread already (embedded mode's pool applying the task), run it here."""
        if on_turn_thread():
            self.target(turn_pk)
            return
        self.submit(turn_pk).done.wait()

    # -- a stuck thread --
    def write_off(self, turn_pk: int) -> bool:
        """The turn has ended elsewhere while its thread is still in it: stop counting that thread.
        False when no thread of this pool runs it, or when `stuck_max` threads are written off already."""
        with self._cond:
            jobs = self._running.get(turn_pk)
            if not jobs:
                return False
            job = jobs[0]  # (the one that claimed it: a duplicate's failed claim ended long before)
            if len(self._stuck) >= self.stuck_max:
                log.error("turn thread stuck, not replaced: %d are stuck already, at most %d are replaced; "
                          "restart the process to get them back (turn_pk=%s, thread=%s)", len(self._stuck),
                          self.stuck_max, turn_pk, job.thread.name if job.thread else "-")
                return False
            job.written_off = True
            self._stuck.add(job)
            self._running_drop(job)
            self._live -= 1
            self._start_needed()
            self._cond.notify_all()  # a stop waiting for running turns waits for this one no more
            log.error("turn thread stuck past its turn's limit, written off and replaced (turn_pk=%s, thread=%s, "
                      "stuck=%d of at most %d)", turn_pk, job.thread.name if job.thread else "-", len(self._stuck),
                      self.stuck_max)
        job.done.set()
        return True

    # -- the threads --
    def _start_needed(self) -> None:
        """(Under the lock.) Start a thread when a job waits that no idle thread will take."""
        if len(self._jobs) > self._idle and (self.limit is None or self._live < self.limit):
            self._live += 1
            try:
                threading.Thread(target=self._loop, name=f"ugent-turn-{next(_thread_numbers)}", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had (a memory or thread limit): the slot is not lost
                self._live -= 1
                log.error("a turn thread could not start (%s): the turn waits for a thread to come free", exc)

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            # The thread ends (idle, stopping, or written off and back): its connection is its own and nobody
            # else would close it. Left to the garbage collector, a PostgreSQL session outlived its thread.
            try:
                connection.close()
            except Exception:
                log.exception("closing an ended turn thread's connection failed")

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._idle += 1
                    woken = self._cond.wait(None if self.limit is not None else self.idle_secs)
                    self._idle -= 1
                    if not woken and not self._jobs:
                        self._live -= 1  # idle long enough (on-demand pool): ends
                        return
                if not self._jobs:  # stopping
                    self._live -= 1
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                job.thread = threading.current_thread()
                self._running.setdefault(job.turn_pk, []).append(job)
            _current.job = job
            try:
                self.target(job.turn_pk)
            except BaseException:  # the runner catches its own failures; whatever escapes is logged
                log.exception("turn thread failed (turn_pk=%s)", job.turn_pk)
            finally:
                _current.job = None
                with self._cond:
                    if job.written_off:
                        self._stuck.discard(job)
                        log.warning("a written-off turn thread came back (turn_pk=%s); it ends", job.turn_pk)
                    else:
                        self._running_drop(job)
                    self._cond.notify_all()
                job.done.set()
            if job.written_off:
                return

    def _running_drop(self, job: _Job) -> None:
        """(Under the lock.) The job no longer runs here: this one, not another job of the same turn."""
        jobs = self._running.get(job.turn_pk, [])
        if job in jobs:
            jobs.remove(job)
        if not jobs:
            self._running.pop(job.turn_pk, None)

    # -- reports and the stop --
    def counts(self) -> dict:
        with self._cond:
            return {"running": sum(map(len, self._running.values())), "queued": len(self._jobs),
                    "stuck": len(self._stuck), "stuck_max": self.stuck_max}

    def stop(self, *, deadline: float | None = None) -> list[int]:
        """Queued turns stay accepted (they run at the next start); wait for running ones to end or be
        written off, until `deadline` (monotonic). The turns still running when it returns."""
        with self._cond:
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()
            while self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return sorted(self._running)


_thread_numbers = itertools.count(1)
_pools: "weakref.WeakSet[TurnThreads]" = weakref.WeakSet()
_current = threading.local()


def on_turn_thread() -> bool:
    """Whether this thread is a turn thread (a turn's task applied on it runs there, not handed on)."""
    return getattr(_current, "job", None) is not None


def turn_thread_write_off(turn_pk: int) -> bool:
    """The lease keeper ended this turn while its runner never came back: the thread running it is
    written off and replaced (TurnThreads.write_off). False when no turn thread of this process runs it."""
    return any(pool.write_off(turn_pk) for pool in list(_pools))


def turn_threads_counts() -> dict:
    """This process's turn threads: running, queued, and stuck (written off) against the most it replaces."""
    total = {"running": 0, "queued": 0, "stuck": 0, "stuck_max": settings.UGENT_TURN_STUCK_MAX}
    for pool in list(_pools):
        for key, value in pool.counts().items():
            if key != "stuck_max":
                total[key] += value
    return total


_worker_threads: TurnThreads | None = None
_worker_threads_lock = threading.Lock()


def worker_turn_threads(target: Callable[[int], None]) -> TurnThreads:
    """The turn threads a Celery worker's `run_turn` hands its turns to (made on first use): the
    worker's own pool cannot replace a thread an engine keeps, these can."""
    global _worker_threads
    with _worker_threads_lock:
        if _worker_threads is None:
            _worker_threads = TurnThreads(target, limit=None, stuck_max=settings.UGENT_TURN_STUCK_MAX)
        return _worker_threads


class LocalTurnPool:
    """Embedded mode's turn threads: `run_turn` applied in this process, without the broker hop.

    With the in-process broker a turn's task never leaves the process that accepted it, and the
    broker keeps nothing a restart would (accepted turns are re-queued from their rows at start-up),
    so the hop bought nothing but its cost: about 1 ms of a turn's CPU on the chat bench, publish,
    consumer and request included. The turn still runs as the `run_turn` Celery task (`Task.apply`:
    the same tracer and task signals), on `concurrency` turn threads (TurnThreads) as the worker's pool would.
    """

    def __init__(self, concurrency: int):
        self.task = _run_turn_task()
        self.threads = TurnThreads(self._run, limit=concurrency, stuck_max=settings.UGENT_TURN_STUCK_MAX)

    def submit(self, turn_pk: int) -> None:
        try:
            self.threads.submit(turn_pk)
        except RuntimeError:  # shutting down: the turn stays accepted and runs at the next start
            log.warning("turn not started: the daemon is stopping (turn_pk=%s); it runs at the next start",
                        turn_pk)

    def _run(self, turn_pk: int) -> None:
        result = self.task.apply(args=(turn_pk,))
        if result.failed():
            log.error("turn task failed (turn_pk=%s): %r", turn_pk, result.result)

    def stop(self) -> None:
        """Let running turns finish; turns not started stay accepted and run at the next start.

        The wait ends when every running turn has ended or had its thread written off: a healthy turn
        ends within its run limit, and the lease keeper ends a stuck one (and writes its thread off)
        two renewals after that, so a hung engine no longer holds the stop for ever."""
        left = self.threads.stop(deadline=time.monotonic() + settings.UGENT_TURN_RUN_LIMIT
                                 + 4 * settings.UGENT_TURN_LEASE_RENEW_SECONDS + 5)
        if left:
            log.warning("stopped with %d turn(s) still running (turn_pk=%s): they end interrupted at the next start",
                        len(left), ",".join(map(str, left)))


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
    return {"turn": {"name": settings.CELERY_TASK_DEFAULT_QUEUE, "waiting": broker_backlog(),
                     "threads": turn_threads_counts()},
            "background": {"name": settings.UGENT_BACKGROUND_QUEUE,
                           "waiting": broker_backlog(settings.UGENT_BACKGROUND_QUEUE)}}
