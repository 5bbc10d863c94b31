"""Where an accepted turn goes: the daemon's own turn threads in embedded mode, Celery's broker otherwise."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from channels_app import dispatch, services, tasks
from channels_app.models import Receipt, Turn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pool():
    started = []

    def start(concurrency=2):
        started.append(dispatch.local_turn_pool_start(concurrency))
        return started[-1]

    yield start
    dispatch.local_turn_pool_stop()
    dispatch.local_turn_pool_forget()


def _submit(tcast, text="hello"):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    return services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator, text=text))


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_without_a_local_pool_a_turn_is_published_to_the_broker(tcast, monkeypatch):
    published = []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", published.append)
    result = _submit(tcast)
    assert published == [result.turn.pk]


def test_the_turn_is_handed_on_before_the_accepts_wake_ups_go_out(tcast, monkeypatch):
    """At the accept's commit the worker gets the turn first: in servers mode it starts on the turn while
    this process still publishes the user message's wake-ups, one Redis round trip sooner."""
    from channels_app import notify
    order = []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: order.append(("dispatch", pk)))
    real_publish = notify.publish
    monkeypatch.setattr(notify, "publish", lambda *topics, **kw: order.append(("publish",)) or real_publish(*topics, **kw))
    result = _submit(tcast)
    assert order and order[0] == ("dispatch", result.turn.pk), order
    assert ("publish",) in order


def test_with_the_local_pool_a_turn_runs_on_a_turn_thread_without_the_broker(tcast, monkeypatch, pool):
    published, threads = [], []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", published.append)
    from channels_app import runner
    real = runner.turn_run
    monkeypatch.setattr(runner, "turn_run", lambda pk: threads.append(threading.current_thread().name) or real(pk))
    pool(2)
    result = _submit(tcast, "hello pool")
    assert _wait_for(lambda: Turn.objects.get(pk=result.turn.pk).state == "completed", timeout=30)
    assert Receipt.objects.get(pk=result.receipt.pk).state == "completed"
    assert published == []
    assert len(threads) == 1 and threads[0].startswith("ugent-turn")


def test_stopping_the_pool_lets_running_turns_finish_and_leaves_queued_ones_accepted(tcast, monkeypatch, pool):
    """Queued turns are not lost: they stay accepted, and the next start re-queues them from their rows."""
    from channels_app import runner
    release, ran = threading.Event(), []

    def slow_first(pk):
        ran.append(pk)
        if len(ran) == 1:
            release.wait(30)

    monkeypatch.setattr(runner, "turn_run", slow_first)
    pool(1)
    first, second, third = (_submit(tcast, f"m{i}") for i in range(3))
    # up to 30 s: on a loaded 2-core CI run the turn thread's first start was seen to take over 10 s
    assert _wait_for(lambda: ran, timeout=30), "the first turn never started on the pool's turn thread"
    assert ran == [first.turn.pk]
    stopper = threading.Thread(target=dispatch.local_turn_pool_stop)
    stopper.start()
    time.sleep(0.1)
    release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert ran == [first.turn.pk]
    assert {t.state for t in Turn.objects.filter(pk__in=[second.turn.pk, third.turn.pk])} == {"accepted"}
    # a message accepted while the daemon stops is not handed to the broker: it waits for the next start
    published = []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", published.append)
    late = _submit(tcast, "late")
    assert published == [] and Turn.objects.get(pk=late.turn.pk).state == "accepted"
    # the next start re-queues every one of them from their rows
    dispatch.local_turn_pool_forget()
    assert runner.turns_requeue_accepted() >= 3
    assert {second.turn.pk, third.turn.pk, late.turn.pk} <= set(published)


def test_a_task_that_fails_outside_the_runners_own_handling_is_logged(tcast, monkeypatch, pool, caplog):
    from channels_app import runner

    def broken(pk):
        raise RuntimeError("database went away")

    monkeypatch.setattr(runner, "turn_run", broken)
    pool(1)
    with caplog.at_level(logging.ERROR, logger="ugent.turns"):
        result = _submit(tcast)
        assert _wait_for(lambda: any("turn task failed" in r.getMessage() for r in caplog.records), timeout=30)
    message = next(r.getMessage() for r in caplog.records if "turn task failed" in r.getMessage())
    assert f"turn_pk={result.turn.pk}" in message and "database went away" in message


def test_a_turn_thread_that_ends_closes_its_database_connection(monkeypatch):
    """A turn thread's connection is its own, and nobody else closes it: a thread that ends (a worker's on-demand
    thread idle a while, or any at a stop) closes it. Left to the garbage collector, each such PostgreSQL
    session stayed open after its thread had gone, a worker's whole pool of them after every idle minute."""
    from django.db import connections
    seen = []

    def target(pk):
        connections["default"].ensure_connection()
        seen.append((connections["default"], threading.current_thread()))

    for limit in (None, 1):  # (a Celery worker's threads end when idle; the daemon's at its stop)
        pool = dispatch.TurnThreads(target, limit=limit, stuck_max=4)
        pool.idle_secs = 0.1
        pool.run(1)
        if limit is not None:
            assert pool.stop(deadline=time.monotonic() + 10) == []
        wrapper, thread = seen[-1]
        thread.join(10)
        assert not thread.is_alive()
        assert wrapper.connection is None, f"limit={limit}: the ended thread's connection is still open"
