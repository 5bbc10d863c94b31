"""The turn threads (channels_app.dispatch.TurnThreads) on real threads: a thread stuck in its turn is
written off and replaced, whoever waits for that turn goes on, a thread that comes back ends, at most
`stuck_max` are replaced, and a stop waits for healthy turns only.

The daemon-level behaviour (a hung engine, the lease keeper writing its thread off, in both run modes) is
tests/channels_app/test_turn_liveness.py's; these pin the pool's own rules.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest

from channels_app import dispatch
from channels_app.dispatch import TurnThreads

pytestmark = pytest.mark.mode_free  # no database, no broker: threads only

WAIT = 10.0  # the most any step here may take before the test calls it lost (not a measurement)


class Turns:
    """A target whose turns block until released (a hung engine), recording which thread ran each."""

    def __init__(self):
        self.release = {}
        self.ran: dict[int, str] = {}
        self.started: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def gate(self, pk: int) -> threading.Event:
        with self.lock:
            self.started.setdefault(pk, threading.Event())
            return self.release.setdefault(pk, threading.Event())

    def __call__(self, pk: int) -> None:
        gate = self.gate(pk)
        self.ran[pk] = threading.current_thread().name
        self.started[pk].set()
        assert gate.wait(60), f"turn {pk} was never released"

    def wait_started(self, pk: int) -> None:
        self.gate(pk)
        assert self.started[pk].wait(WAIT), f"turn {pk} never started"


@pytest.fixture
def turns():
    t = Turns()
    yield t
    for gate in list(t.release.values()):
        gate.set()


def test_a_stuck_thread_written_off_frees_its_slot_and_its_waiter(turns):
    pool = TurnThreads(turns, limit=1, stuck_max=4)
    stuck = pool.submit(1)
    turns.wait_started(1)
    queued = pool.submit(2)
    turns.gate(2).set()  # turn 2 would finish at once, if it ever got a thread
    assert not queued.done.wait(0.3)  # one slot, held by the stuck turn
    assert pool.counts() == {"running": 1, "queued": 1, "stuck": 0, "stuck_max": 4}

    assert pool.write_off(1) is True
    assert stuck.done.wait(WAIT)  # whoever waited for turn 1 goes on
    assert queued.done.wait(WAIT)  # and turn 2 got a thread of its own
    assert turns.ran[2] != turns.ran[1]
    assert pool.counts() == {"running": 0, "queued": 0, "stuck": 1, "stuck_max": 4}
    assert pool.write_off(1) is False  # once


def test_a_written_off_thread_that_comes_back_ends_and_the_pool_keeps_its_size(turns):
    pool = TurnThreads(turns, limit=1, stuck_max=4)
    pool.submit(1)
    turns.wait_started(1)
    pool.write_off(1)
    turns.gate(1).set()  # the engine returns after all
    deadline = time.monotonic() + WAIT
    while pool.counts()["stuck"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.counts()["stuck"] == 0
    # Still one turn at a time: the returned thread did not take a second slot.
    first = pool.submit(3)
    turns.wait_started(3)
    second = pool.submit(4)
    turns.gate(4).set()
    assert not second.done.wait(0.3)
    turns.gate(3).set()
    assert first.done.wait(WAIT) and second.done.wait(WAIT)
    assert turns.ran[3] == turns.ran[4]  # one live thread ran both


def test_past_stuck_max_a_stuck_thread_keeps_its_place(turns, caplog):
    pool = TurnThreads(turns, limit=2, stuck_max=1)
    pool.submit(1)
    pool.submit(2)
    turns.wait_started(1)
    turns.wait_started(2)
    assert pool.write_off(1) is True
    with caplog.at_level(logging.ERROR, logger="ugent.turns"):
        assert pool.write_off(2) is False
    assert "turn thread stuck, not replaced: 1 are stuck already, at most 1 are replaced" in caplog.text
    assert pool.counts() == {"running": 1, "queued": 0, "stuck": 1, "stuck_max": 1}
    # one slot left of two: the replacement of turn 1's thread
    job = pool.submit(3)
    turns.gate(3).set()
    assert job.done.wait(WAIT)


def test_the_stop_waits_for_running_turns_drops_queued_ones_and_is_bounded(turns):
    pool = TurnThreads(turns, limit=1, stuck_max=4)
    pool.submit(1)
    turns.wait_started(1)
    queued = pool.submit(2)
    stopper = {}
    t = threading.Thread(target=lambda: stopper.setdefault("left", pool.stop(deadline=time.monotonic() + 60)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # a healthy turn is waited for
    turns.gate(1).set()
    t.join(WAIT)
    assert stopper["left"] == []
    assert 2 not in turns.ran and not queued.done.is_set()  # never started: it stays accepted in its row
    with pytest.raises(RuntimeError):
        pool.submit(3)

    hung = TurnThreads(turns, limit=1, stuck_max=4)
    hung.submit(5)
    turns.wait_started(5)
    assert hung.stop(deadline=time.monotonic() + 0.2) == [5]  # the deadline ends the wait


def test_a_stuck_turn_written_off_during_the_stop_ends_the_wait(turns):
    pool = TurnThreads(turns, limit=1, stuck_max=4)
    pool.submit(1)
    turns.wait_started(1)
    stopper = {}
    t = threading.Thread(target=lambda: stopper.setdefault("left", pool.stop(deadline=time.monotonic() + 60)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    pool.write_off(1)  # the lease keeper's, while the daemon stops
    t.join(WAIT)
    assert not t.is_alive() and stopper["left"] == []


def test_a_workers_run_waits_and_returns_when_its_turn_is_written_off(turns):
    pool = TurnThreads(turns, limit=None, stuck_max=4)
    returned = threading.Event()
    threading.Thread(target=lambda: (pool.run(7), returned.set()), daemon=True).start()
    turns.wait_started(7)
    assert not returned.wait(0.2)
    pool.write_off(7)
    assert returned.wait(WAIT)
    # ...and runs a turn applied on a turn thread in place: no second hop, no wait on itself
    inner = []

    def outer_target(pk):
        inner.append((threading.current_thread().name, dispatch.on_turn_thread()))
        pool.run(8)
    outer = TurnThreads(outer_target, limit=1, stuck_max=4)
    turns.gate(8).set()
    assert outer.submit(9).done.wait(WAIT)
    assert inner[0][1] is True and turns.ran[8] == inner[0][0]
    assert not dispatch.on_turn_thread()  # (this test's own thread is none)


def test_a_second_task_for_a_turn_being_run_leaves_the_first_the_pools(turns):
    # A turn's task delivered twice to one process (the sweep re-dispatching a turn it took for lost, a
    # redelivery): the second finds the turn claimed and returns at once while the first still runs it. The
    # first must stay the pool's: written off when stuck (its waiter, a worker's thread, freed) and waited
    # for by a stop. Keyed by the turn alone, the second's end dropped the first from the pool's books.
    calls = []

    def target(pk):
        calls.append(pk)
        if len(calls) == 1:
            turns(pk)  # the claim's winner, stuck in its engine; the second's claim fails and it returns

    pool = TurnThreads(target, limit=None, stuck_max=4)
    back = threading.Event()
    threading.Thread(target=lambda: (pool.run(1), back.set()), daemon=True).start()
    turns.wait_started(1)
    pool.run(1)  # the duplicate: returns at once
    assert pool.counts()["running"] == 1
    assert pool.write_off(1) is True
    assert back.wait(WAIT)

    calls.clear()
    local = TurnThreads(target, limit=2, stuck_max=4)  # embedded mode's: its stop waits for the first
    turns.started.pop(1)
    turns.release.pop(1).set()
    local.submit(1)
    turns.wait_started(1)
    assert local.submit(1).done.wait(WAIT)
    assert local.stop(deadline=time.monotonic() + 0.3) == [1]
