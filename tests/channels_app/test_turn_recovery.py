"""A turn's liveness is its lease: the sweep ends only turns whose lease lapsed, keeping what they streamed;
accepted turns past their queue deadline are abandoned; turns the broker lost are dispatched again."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.test import Client
from django.utils import timezone
from kombu.exceptions import OperationalError

from channels_app import dispatch, runner, services, tasks
from channels_app.models import Event, Message, Receipt, Turn

pytestmark = pytest.mark.django_db(transaction=True)


def running_turn(tcast, text="hi", started_ago=0, lease_in=20.0, streamed=()):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        result = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                         text=text))
    now = timezone.now()
    started = now - timedelta(seconds=started_ago)
    Turn.objects.filter(pk=result.turn.pk).update(state="running", started_at=started,
                                                  lease_expires_at=now + timedelta(seconds=lease_in))
    Receipt.objects.filter(pk=result.receipt.pk).update(state="running", started_at=started)
    for segment, text in streamed:
        Event.objects.create(conversation_id=result.conversation.pk, turn_id=result.turn.pk, type="turn.delta",
                             data={"turn_id": result.turn.turn_id, "segment": segment, "text": text})
    return Turn.objects.select_related("actor").get(pk=result.turn.pk)


def test_the_sweep_ends_a_turn_whose_lease_lapsed_keeping_what_it_streamed(tcast):
    turn = running_turn(tcast, lease_in=-1, streamed=[("answer", "dropped"), ("answer_reset", ""),
                                                       ("answer", "Half"), ("thinking", "hmm"), ("answer", " done")])
    assert runner.turns_sweep_stale() == 1
    turn.refresh_from_db()
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert turn.state == "interrupted" and turn.lease_expires_at is None
    assert (receipt.state, receipt.answer, receipt.reason) == ("interrupted", "Half done", runner.INTERRUPTED_REASON)
    assert Message.objects.get(turn=turn, role="assistant").content == "Half done"
    ev = Event.objects.get(turn=turn, type="turn.failed")
    assert ev.data["state"] == "interrupted" and ev.data["answer"] == "Half done" and ev.audience == ["web:alice"]
    assert runner.turns_sweep_stale() == 0  # once only
    # the receipt shows what streamed
    resp = Client().get("/v1/ugent/receipt", {"conversation_id": turn.conversation.external_id,
                                              "client_message_id": receipt.client_message_id},
                        HTTP_X_API_KEY=tcast.keys["operator"])
    assert resp.json()["answer"] == "Half done"


def test_a_turn_running_long_past_its_time_limit_with_a_fresh_lease_is_not_swept(tcast, settings):
    turn = running_turn(tcast, started_ago=settings.CELERY_TASK_TIME_LIMIT + 120, lease_in=10)
    assert runner.turns_sweep_stale() == 0
    assert Turn.objects.get(pk=turn.pk).state == "running"


def test_a_lease_renewed_between_the_sweeps_read_and_its_write_wins(tcast):
    turn = running_turn(tcast, lease_in=-1)
    lapsed = timezone.now()
    Turn.objects.filter(pk=turn.pk).update(lease_expires_at=lapsed + timedelta(seconds=20))  # the keeper renewed
    assert runner.turn_end(turn=turn, state="interrupted", where=runner.Q(lease_expires_at__lt=lapsed)) \
        is runner.EndOutcome.ALREADY_ENDED
    assert Turn.objects.get(pk=turn.pk).state == "running"


def test_a_late_finish_after_the_sweep_writes_nothing(tcast):
    turn = running_turn(tcast, lease_in=-1)
    runner.turns_sweep_stale()
    assert runner.turn_complete(turn=turn, writer=runner.DeltaWriter(turn), answer="too late", citations=[])
    assert runner.turn_end(turn=turn, state="failed", reason="x") is runner.EndOutcome.ALREADY_ENDED
    turn.refresh_from_db()
    assert turn.state == "interrupted"
    assert Receipt.objects.get(pk=turn.receipt_id).state == "interrupted"
    assert not Event.objects.filter(turn=turn, type="turn.completed").exists()


def test_the_lease_keeper_renews_the_turns_it_holds_and_ends_one_past_its_limit(tcast, settings):
    keeper = runner.LeaseKeeper()
    alive = running_turn(tcast, "alive", lease_in=1, streamed=[("answer", "so far")])
    stuck = running_turn(tcast, "stuck", lease_in=1, streamed=[("answer", "stuck at")])
    keeper._held = {alive.pk: float("inf"), stuck.pk: 0.0}  # the stuck one's deadline has long passed
    assert keeper.tick() == 2
    assert Turn.objects.get(pk=alive.pk).lease_expires_at > timezone.now() + timedelta(seconds=10)
    assert Turn.objects.get(pk=alive.pk).state == "running"
    receipt = Receipt.objects.get(pk=stuck.receipt_id)
    assert (receipt.state, receipt.reason, receipt.answer) == ("failed", runner.TIME_LIMIT_REASON, "stuck at")
    assert keeper.held() == [alive.pk]


def test_the_lease_keeper_outlives_an_error_between_its_renewals(tcast, settings, monkeypatch):
    # an error after a renewal (closing the connection) must not end the keeper: the turns it holds
    # would lapse and be swept while they still run
    settings.UGENT_TURN_LEASE_RENEW_SECONDS = 0.05
    keeper = runner.LeaseKeeper()
    turn = running_turn(tcast, "alive", lease_in=1)
    real, calls = runner.close_old_connections, []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("connection reset")
        real()
    monkeypatch.setattr(runner, "close_old_connections", flaky)
    keeper.hold(turn.pk)
    try:
        deadline = timezone.now() + timedelta(seconds=10)
        while len(calls) < 3 and timezone.now() < deadline:
            Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now())
            time.sleep(0.05)
        assert len(calls) >= 3 and keeper._thread.is_alive()
        Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now())
        time.sleep(0.3)
        assert Turn.objects.get(pk=turn.pk).lease_expires_at > timezone.now() + timedelta(seconds=10)
    finally:
        keeper.release(turn.pk)
        keeper._wake.set()


def test_one_overdue_turn_whose_end_fails_does_not_keep_the_others_running(tcast, monkeypatch):
    keeper = runner.LeaseKeeper()
    first = running_turn(tcast, "first", lease_in=1)
    second = running_turn(tcast, "second", lease_in=1)
    keeper._held = {first.pk: 0.0, second.pk: 0.0}  # both long past their limit
    real = runner.turn_end

    def end(*, turn, **kw):
        if turn.pk == first.pk:
            raise RuntimeError("database hiccup")
        return real(turn=turn, **kw)
    monkeypatch.setattr(runner, "turn_end", end)
    keeper.tick()
    assert Turn.objects.get(pk=second.pk).state == "failed"
    assert Turn.objects.get(pk=first.pk).state == "running" and keeper.held() == [first.pk]  # tried again
    monkeypatch.setattr(runner, "turn_end", real)
    keeper.tick()
    assert Turn.objects.get(pk=first.pk).state == "failed" and keeper.held() == []


def test_after_a_failed_renewal_the_lease_keeper_lets_go_of_its_connection(tcast, settings, monkeypatch):
    # a renewal that failed on a connection the database dropped must not leave every later tick on it
    settings.UGENT_TURN_LEASE_RENEW_SECONDS = 0.05
    keeper = runner.LeaseKeeper()
    turn = running_turn(tcast, "alive", lease_in=1)
    ticks, closes = [], []

    def tick():
        ticks.append(1)
        raise RuntimeError("the connection is closed")
    monkeypatch.setattr(keeper, "tick", tick)
    monkeypatch.setattr(runner, "close_old_connections", lambda: closes.append(len(ticks)))
    keeper.hold(turn.pk)
    try:
        deadline = time.monotonic() + 10
        while len(ticks) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ticks) >= 3 and closes[:2] == [1, 2] and keeper._thread.is_alive()
    finally:
        keeper.release(turn.pk)
        keeper._wake.set()


def test_a_lease_keeper_that_died_is_replaced_by_the_next_hold(tcast):
    keeper = runner.LeaseKeeper()
    import threading
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    keeper._thread = dead  # as a keeper whose loop ended by an error would leave it
    turn = running_turn(tcast, "alive", lease_in=1)
    keeper.hold(turn.pk)
    try:
        assert keeper._thread is not dead and keeper._thread.is_alive()
    finally:
        keeper.release(turn.pk)
        keeper._wake.set()


def test_the_sweep_abandons_accepted_turns_past_their_queue_deadline(tcast, settings):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        old, new = (services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                           text=t)) for t in ("old", "new"))
    Turn.objects.filter(pk=old.turn.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.UGENT_TURN_QUEUE_TIMEOUT + 1))
    with mock.patch("channels_app.tasks.run_turn.delay"):
        assert runner.turns_sweep_stale() == 1
    assert Receipt.objects.get(pk=old.receipt.pk).state == "abandoned"
    assert Turn.objects.get(pk=new.turn.pk).state == "accepted"
    ev = Event.objects.get(turn_id=old.turn.pk, type="turn.failed")
    assert ev.data["state"] == "abandoned" and ev.data["reason"] == runner.QUEUE_TIMEOUT_REASON


def test_lost_turns_are_dispatched_again_only_when_the_broker_queue_cannot_hold_them(tcast, settings, monkeypatch):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        lost = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                      text="lost"))
    Turn.objects.filter(pk=lost.turn.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.UGENT_TURN_REQUEUE_SECONDS + 1))
    dispatched = []
    monkeypatch.setattr(dispatch, "turn_dispatch", lambda pk: dispatched.append(pk) or True)
    monkeypatch.setattr(dispatch, "broker_backlog", lambda: 1)  # its task may still be waiting in the queue
    assert runner.turns_requeue_lost() == 0
    monkeypatch.setattr(dispatch, "broker_backlog", lambda: None)  # the broker is down: wait for it
    assert runner.turns_requeue_lost() == 0
    monkeypatch.setattr(dispatch, "broker_backlog", lambda: 0)  # back, and empty: the task was lost
    assert runner.turns_requeue_lost() == 1 and dispatched == [lost.turn.pk]


def _chat(tcast, **extra):
    body = {"messages": [{"role": "user", "content": "hello"}], "user": "alice", **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=tcast.keys["operator"])


def test_a_message_accepted_while_the_broker_is_down_is_answered_as_queued(tcast, monkeypatch):
    def down(pk):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", down)
    resp = _chat(tcast, conversation_id="c1", client_message_id="m1")
    assert resp.status_code == 202
    body = resp.json()
    turn = Turn.objects.get()
    assert body["ugent_turn_id"] == turn.turn_id == resp["x-ugent-turn-id"]
    assert body["ugent_conversation_id"] == "c1" == resp["x-ugent-conversation-id"]
    assert body["ugent_receipt"] == {"conversation_id": "c1", "client_message_id": "m1", "state": "accepted",
                                     "turn_id": turn.turn_id, "queued": True}
    assert turn.state == "accepted" and Receipt.objects.get().state == "accepted"


def test_a_stream_accepted_while_the_broker_is_down_says_queued_first(tcast, monkeypatch):
    def down(pk):
        raise OperationalError("Connection refused.")
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", down)
    from tests.streams.conftest import read_frames
    resp = _chat(tcast, conversation_id="c2", stream=True)
    assert resp.status_code == 200
    frames = [f for f in read_frames(resp, timeout=1.0) if f["event"] or f["data"]]
    assert frames[0]["event"] == "ugent.receipt"
    assert frames[0]["data"]["ugent_receipt"]["queued"] is True
    assert frames[0]["data"]["ugent_receipt"]["turn_id"] == Turn.objects.get().turn_id


def test_the_sweep_is_scheduled_in_beat_every_few_seconds(tcast, settings):
    from django_celery_beat.models import PeriodicTask

    from channels_app.streams import retention_schedule_ensure
    retention_schedule_ensure()
    entry = PeriodicTask.objects.get(task="channels_app.tasks.sweep_stale_turns", enabled=True)
    assert entry.interval.every == settings.UGENT_TURN_SWEEP_SECONDS
