"""The run of a turn as one object: its steps can be called one by one, and every end goes through turn_end."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection, transaction
from django.utils import timezone

from channels_app import hooks, runner, services
from channels_app.models import Event, Message, Receipt, Turn, TurnState

pytestmark = pytest.mark.django_db(transaction=True)


def accepted_turn(tcast, text="hi"):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        result = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                         text=text))
    return Turn.objects.select_related("actor").get(pk=result.turn.pk)


def events(turn):
    return list(Event.objects.filter(turn=turn).order_by("id").values_list("type", "data"))


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_steps_run_one_by_one_to_a_completed_turn(tcast):
    turn = accepted_turn(tcast, "script:answer=one two")
    run = runner.TurnRun(turn.pk)
    assert run.claim()
    claimed = Turn.objects.get(pk=turn.pk)
    assert claimed.state == "running" and claimed.lease_expires_at > timezone.now()
    assert Receipt.objects.get(pk=turn.receipt_id).state == "running"
    run.compose()
    assert run.messages[-1].content == "script:answer=one two"
    assert not run.take_steering()
    run.engine_step()
    assert "".join(run.answer) == "one two"
    assert run.complete()
    done = Turn.objects.get(pk=turn.pk)
    assert done.state == "completed" and done.lease_expires_at is None
    assert Receipt.objects.get(pk=turn.receipt_id).answer == "one two"
    assert events(turn)[-1][0] == "turn.completed"


def test_a_claimed_turn_is_never_claimed_again(tcast):
    turn = accepted_turn(tcast)
    assert runner.TurnRun(turn.pk).claim()
    assert not runner.TurnRun(turn.pk).claim()


def test_the_claim_marks_the_receipt_running_in_its_own_round_trip(tcast):
    """The claim, the receipt's running and the turn's fetch are one batch: one statement sent on
    PostgreSQL (two with BEGIN and COMMIT aside), where the receipt's update was a trip of its own."""
    from django.test.utils import CaptureQueriesContext
    turn = accepted_turn(tcast)
    with CaptureQueriesContext(connection) as seen:
        assert runner.TurnRun(turn.pk).claim()
    sent = [q["sql"] for q in seen.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    claimed = Turn.objects.get(pk=turn.pk)
    assert (receipt.state, receipt.started_at) == ("running", claimed.started_at)
    if connection.vendor == "postgresql":
        assert len(sent) == 1, sent
    assert not [q for q in sent if q.startswith("UPDATE") and "receipt" in q.split("SET")[0]
                and "WHERE" in q and '"id" = ' in q.split("WHERE")[-1] and "SELECT" not in q]


def test_the_claim_reads_the_history_compose_shows_the_engine(tcast):
    """On PostgreSQL the history and the summary ride the claim's batch: compose reads no message. In both
    modes the engine is shown what a read of its own would (the earlier turn's question and answer)."""
    from django.test.utils import CaptureQueriesContext
    first = accepted_turn(tcast, "script:answer=first answer")
    runner.turn_run(first.pk)
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    conv = Turn.objects.get(pk=first.pk).conversation
    with mock.patch("channels_app.tasks.run_turn.delay"):
        second = services.message_submit(inbound=services.Submission(
            actor=actor, caller=tcast.operator, text="again", conversation_id=conv.external_id)).turn
    run = runner.TurnRun(second.pk)
    assert run.claim()
    with CaptureQueriesContext(connection) as seen:
        run.compose()
    read = [q["sql"] for q in seen.captured_queries if "channels_app_message" in q["sql"]]
    assert (read == []) if connection.vendor == "postgresql" else len(read) == 2, read
    shown = [(m.role.value, m.content) for m in run.messages]
    assert shown == [(m.role.value, m.content) for m in runner.build_messages(run.turn)]
    assert shown[-3:] == [("user", "script:answer=first answer"), ("assistant", "first answer"), ("user", "again")]


def test_a_lost_claim_leaves_the_other_workers_receipt_as_it_was(tcast):
    turn = accepted_turn(tcast)
    assert runner.TurnRun(turn.pk).claim()
    before = Receipt.objects.get(pk=turn.receipt_id)
    assert not runner.TurnRun(turn.pk).claim()  # a redelivered task: the turn is running already
    after = Receipt.objects.get(pk=turn.receipt_id)
    assert (after.state, after.started_at, after.updated_at) == (before.state, before.started_at, before.updated_at)


@pytest.mark.parametrize("state", sorted(runner.END_STATES))
def test_every_end_state_writes_turn_receipt_message_event_and_hook_in_one_transaction(tcast, state):
    turn = accepted_turn(tcast)
    from_state = TurnState.ACCEPTED if state in ("abandoned", "refused") else TurnState.RUNNING
    Turn.objects.filter(pk=turn.pk).update(state=from_state)
    seen = []

    def after(*, turn, state, answer):
        seen.append((state, answer, connection.in_atomic_block, Turn.objects.get(pk=turn.pk).state))
    hooks.register_after_turn("test-end", after)
    try:
        outcome = runner.turn_end(turn=turn, state=state, answer="partial", reason="why", from_state=from_state)
    finally:
        hooks.unregister_after_turn("test-end")
    end = runner.END_STATES[state]
    assert outcome is runner.EndOutcome.ENDED
    assert seen == [(state, "partial", True, state)]  # the hook sees the end, inside its transaction
    assert Turn.objects.get(pk=turn.pk).state == state
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert (receipt.state, receipt.answer, receipt.reason) == (state, "partial", "why")
    assert Message.objects.filter(turn=turn, role="assistant", content="partial").exists()
    etype, data = events(turn)[-1]
    assert etype == end.event and data["state"] == state and data["answer"] == "partial"
    # only one end wins: a second one writes nothing
    assert runner.turn_end(turn=turn, state=state, from_state=from_state) is runner.EndOutcome.ALREADY_ENDED
    assert len([e for e in events(turn) if e[0] == end.event]) == 1


def _completed_with(turn, answer):
    run = runner.DeltaWriter(turn)
    return runner.turn_end(turn=turn, state=TurnState.COMPLETED, answer=answer, citations=[], writer=run,
                           unless_steering_waits=True)


def test_the_common_end_writes_turn_answer_and_receipt_in_the_locks_round_trip(tcast):
    """On PostgreSQL a completion is two statements sent (BEGIN and COMMIT aside): the lock's batch with
    the turn, the answer, the receipt and the after-turn hooks' probes (the harness's); the event
    append. They were five."""
    from django.test.utils import CaptureQueriesContext
    run = runner.TurnRun(accepted_turn(tcast).pk)
    assert run.claim()
    turn = run.turn  # as the runner holds it: its conversation and actor came with the claim
    with CaptureQueriesContext(connection) as seen:
        assert _completed_with(turn, "the answer") is runner.EndOutcome.ENDED
    # BEGIN and COMMIT aside, and the memory settings each process keeps once read
    sent = [q["sql"] for q in seen.captured_queries
            if q["sql"] not in ("BEGIN", "COMMIT") and "plugins_app_memorysettings" not in q["sql"]]
    if connection.vendor == "postgresql":
        assert len(sent) == 2, "\n".join(q[:150] for q in sent)
    assert Turn.objects.get(pk=turn.pk).state == "completed"
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert (receipt.state, receipt.answer) == ("completed", "the answer")
    assert list(Message.objects.filter(turn=turn, role="assistant").values_list("content", flat=True)) == ["the answer"]


def test_a_hook_is_given_a_probe_only_when_registered_with_one(tcast):
    """A hook registered with a probe gets what its statement found; a hook without one (even one that
    wraps a hook that has one) is called as before."""
    import functools
    from channels_app import harness
    seen = []

    @functools.wraps(harness.harness_after_turn)
    def wrapped(**kw):
        seen.append(("wrapped", sorted(kw)))

    def probing(**kw):
        seen.append(("probing", kw.get("probed")))
    hooks.register_after_turn("test-wrapped", wrapped)
    hooks.register_after_turn("test-probing", probing, probe=harness.harness_probe)
    try:
        for answer in ("one", "two"):
            run = runner.TurnRun(accepted_turn(tcast).pk)
            assert run.claim()
            if answer == "two":
                from channels_app.models import HarnessItem
                HarnessItem.objects.create(conversation_id=run.turn.conversation_id, kind="goal", text="g",
                                           check_spec="phrase:two")
            assert _completed_with(run.turn, answer) is runner.EndOutcome.ENDED
    finally:
        hooks.unregister_after_turn("test-wrapped")
        hooks.unregister_after_turn("test-probing")
    assert seen == [("wrapped", ["answer", "state", "turn"]), ("probing", False),
                    ("wrapped", ["answer", "state", "turn"]), ("probing", True)]


def test_a_completion_that_meets_a_waiting_steering_writes_nothing(tcast):
    from channels_app.models import Steering
    turn = accepted_turn(tcast)
    Turn.objects.filter(pk=turn.pk).update(state="running")
    Steering.objects.create(turn=turn, actor=turn.actor, text="and also this")
    before = Receipt.objects.get(pk=turn.receipt_id)
    assert _completed_with(turn, "too soon") is runner.EndOutcome.STEERING_WAITS
    assert Turn.objects.get(pk=turn.pk).state == "running"
    after = Receipt.objects.get(pk=turn.receipt_id)
    assert (after.state, after.answer, after.updated_at) == (before.state, before.answer, before.updated_at)
    assert not Message.objects.filter(turn=turn, role="assistant").exists()
    assert not Event.objects.filter(turn=turn, type="turn.completed").exists()


def test_an_end_that_lost_to_another_changes_neither_receipt_nor_answer(tcast):
    turn = accepted_turn(tcast)
    Turn.objects.filter(pk=turn.pk).update(state="running")
    assert runner.turn_end(turn=turn, state=TurnState.CANCELLED, answer="cut short") is runner.EndOutcome.ENDED
    before = Receipt.objects.get(pk=turn.receipt_id)
    assert _completed_with(turn, "the whole answer") is runner.EndOutcome.ALREADY_ENDED
    after = Receipt.objects.get(pk=turn.receipt_id)
    assert (after.state, after.answer, after.updated_at) == ("cancelled", "cut short", before.updated_at)
    assert list(Message.objects.filter(turn=turn, role="assistant").values_list("content", flat=True)) == ["cut short"]
    assert Turn.objects.get(pk=turn.pk).state == "cancelled"


def test_an_after_turn_hook_that_fails_rolls_the_whole_end_back(tcast):
    turn = accepted_turn(tcast)
    Turn.objects.filter(pk=turn.pk).update(state="running")

    def broken(**kw):
        raise RuntimeError("hook failed")
    hooks.register_after_turn("test-broken", broken)
    try:
        with pytest.raises(RuntimeError):
            runner.turn_end(turn=turn, state="completed", answer="x")
    finally:
        hooks.unregister_after_turn("test-broken")
    assert Turn.objects.get(pk=turn.pk).state == "running"
    assert Receipt.objects.get(pk=turn.receipt_id).state == "accepted"
    assert not Event.objects.filter(turn=turn, type="turn.completed").exists()


def test_a_turn_past_its_run_limit_ends_failed_with_a_reason_and_nothing_after(tcast, settings):
    settings.UGENT_TURN_RUN_LIMIT = 0.3
    turn = accepted_turn(tcast, "script:slow=0.05|answer=" + " ".join(f"w{i}" for i in range(100)))
    runner.turn_run(turn.pk)
    turn.refresh_from_db()
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert turn.state == "failed" and receipt.reason == runner.TIME_LIMIT_REASON
    assert receipt.answer.startswith("w0") and "w99" not in receipt.answer  # it keeps what it answered
    etype, data = events(turn)[-1]
    assert etype == "turn.failed" and data["code"] == "time_limit"


def test_a_runner_whose_turn_was_ended_elsewhere_writes_nothing_after_the_terminal_event(tcast):
    turn = accepted_turn(tcast, "script:slow=0.02|answer=" + " ".join(f"w{i}" for i in range(400)))

    def run():
        try:
            runner.turn_run(turn.pk)
        finally:
            connection.close()
    worker = threading.Thread(target=run)
    worker.start()
    assert wait_for(lambda: Event.objects.filter(turn=turn, type="turn.delta").count() >= 3)
    Turn.objects.filter(pk=turn.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert runner.turns_recover_interrupted(lapsed_before=timezone.now()) == 1
    worker.join(30)
    assert not worker.is_alive()
    types = [t for t, _ in events(turn)]
    assert types[-1] == "turn.failed" and types.count("turn.failed") == 1
    assert Turn.objects.get(pk=turn.pk).state == "interrupted"
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    streamed = "".join(d["text"] for t, d in events(turn) if t == "turn.delta" and d["segment"] == "answer")
    assert receipt.state == "interrupted" and receipt.answer == streamed and streamed.startswith("w0")


def test_a_delta_flush_after_the_turn_ended_raises_and_writes_nothing(tcast):
    turn = accepted_turn(tcast)
    Turn.objects.filter(pk=turn.pk).update(state="interrupted")
    writer = runner.DeltaWriter(turn)
    writer.buffer, writer.segment = ["late"], "answer"
    before = Event.objects.count()
    with pytest.raises(runner.TurnEnded):
        writer.flush()
    assert Event.objects.count() == before


def test_a_turn_waiting_past_its_queue_deadline_is_abandoned_when_claimed(tcast, settings):
    turn = accepted_turn(tcast)
    Turn.objects.filter(pk=turn.pk).update(created_at=timezone.now() - timedelta(
        seconds=settings.UGENT_TURN_QUEUE_TIMEOUT + 5))
    runner.turn_run(turn.pk)
    turn.refresh_from_db()
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert turn.state == "abandoned" and turn.started_at is None
    assert (receipt.state, receipt.reason, receipt.started_at) == ("abandoned", runner.QUEUE_TIMEOUT_REASON, None)
    etype, data = events(turn)[-1]
    assert etype == "turn.failed" and data["code"] == "abandoned"
    assert not Message.objects.filter(turn=turn, role="assistant").exists()  # the engine never ran


def test_a_turn_whose_profile_was_removed_is_abandoned_when_claimed(tcast):
    turn = accepted_turn(tcast)
    tcast.profile.delete()
    runner.turn_run(turn.pk)
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert Turn.objects.get(pk=turn.pk).state == "abandoned"
    assert (receipt.state, receipt.reason) == ("abandoned", runner.PROFILE_REMOVED_REASON)


def test_a_hook_answer_is_recorded_through_the_same_end(tcast):
    def refuse(ctx):
        return hooks.HookStop(answer="no", state="refused", reason="rule", decided_by="test")
    hooks.register("test-refuse", 1, refuse)
    seen = []
    hooks.register_after_turn("test-seen", lambda **kw: seen.append((kw["state"], transaction.get_connection()
                                                                      .in_atomic_block)))
    try:
        turn = accepted_turn(tcast, "anything")
    finally:
        hooks.unregister("test-refuse")
        hooks.unregister_after_turn("test-seen")
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    assert turn.state == "refused" and (receipt.state, receipt.answer, receipt.reason) == ("refused", "no", "rule")
    assert seen == [("refused", True)]
    etype, data = events(turn)[-1]
    assert etype == "turn.completed" and data["decided_by"] == "test" and data["state"] == "refused"


def _appends_of(answer_whole, monkeypatch, tcast):
    """The event appends a turn's run makes (each one transaction), recorded on their way to the real one."""
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        result = services.message_submit(inbound=services.Submission(
            actor=actor, caller=tcast.operator, text="script:answer=one two three", answer_whole=answer_whole))
    appends = []
    real = runner.events_append

    def recording(**kwargs):
        appends.append([t for t, _d, _a in kwargs["items"]])
        return real(**kwargs)
    monkeypatch.setattr(runner, "events_append", recording)
    runner.turn_run(result.turn.pk)
    assert Turn.objects.get(pk=result.turn.pk).state == "completed"
    assert Receipt.objects.get(pk=result.turn.receipt_id).answer == "one two three"
    return appends


def test_a_turn_whose_sender_streams_writes_its_first_delta_at_once(tcast, monkeypatch):
    appends = _appends_of(False, monkeypatch, tcast)
    assert appends[0] == ["turn.delta"] and appends[-1][-1] == "turn.completed"


def test_a_turn_whose_sender_reads_the_whole_answer_writes_a_fast_answer_with_its_end(tcast, monkeypatch):
    """A non-stream request (answer_whole): the first delta is coalesced, so an answer that comes at
    once is one transaction with the turn's end, and every delta is still in the log."""
    monkeypatch.setattr(runner, "COALESCE_SECONDS", 3600)  # however slowly the tokens come here
    appends = _appends_of(True, monkeypatch, tcast)
    assert len(appends) == 1 and appends[0][0] == "turn.delta" and appends[0][-1] == "turn.completed"
