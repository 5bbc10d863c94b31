"""Runs end in a recorded state: completed with each task's output, failed or timed out with the reason
and an event, and never stuck."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
from django.db import close_old_connections
from django.utils import timezone

from channels_app import runner
from channels_app.models import Event, Turn
from cron_app import services
from cron_app.models import CronRun
from tests.cron_app.conftest import run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


def job(cron_toml, *prompts, extra=""):
    tasks = "".join(f'\n[[jobs.tasks]]\nid = "t{i}"\nprompt = "{p}"\n' for i, p in enumerate(prompts))
    cron_toml(f'enabled = true\n[[jobs]]\nid = "work"\n{extra}\n{tasks}')


def test_a_manual_run_runs_every_task_in_order_and_keeps_each_output(tcast, cron_toml):
    job(cron_toml, "script:answer=first part", "script:answer=second part")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    assert (run.trigger, run.state) == ("manual", "completed")
    assert [(o["task"], o["state"], o["output"]) for o in run.outputs] == [
        ("t0", "completed", "first part"), ("t1", "completed", "second part")]
    assert run.result == "[t0]\nfirst part\n\n[t1]\nsecond part"
    turns = list(Turn.objects.filter(conversation_id=run.conversation_id).order_by("id"))
    assert len(turns) == 2 and turns[0].finished_at <= turns[1].started_at  # one after the other
    assert [e.type for e in Event.objects.filter(conversation_id=run.conversation_id, turn__isnull=True)
            .order_by("id")] == ["cron.run.started", "cron.run.completed"]


def test_a_failing_task_fails_the_run_with_the_reason_and_an_event(tcast, cron_toml):
    job(cron_toml, "script:fail=upstream exploded", "script:answer=never")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    assert run.state == "failed"
    assert run.error == "task 't0' failed: upstream exploded"
    assert [o["task"] for o in run.outputs] == ["t0"]  # the second task never ran
    ev = Event.objects.get(conversation_id=run.conversation_id, type="cron.run.failed")
    assert ev.data["state"] == "failed" and ev.data["reason"] == run.error


def test_an_unknown_model_fails_the_run_before_anything_runs(tcast, cron_toml):
    cron_toml('[[jobs]]\nid = "work"\n[[jobs.tasks]]\nid = "t0"\nprompt = "hi"\nmodel = "no-such-model"\n')
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    assert run.state == "failed" and run.error == "task 't0' could not start: The model 'no-such-model' is not available here."
    assert Event.objects.filter(conversation_id=run.conversation_id, type="cron.run.failed").exists()


def _worker_threads(monkeypatch):
    """Turns run on threads of their own, as a worker pool would, not inside the step that submits them."""
    workers = []

    def worker_runs_it(turn_pk):
        def body():
            try:
                runner.turn_run(turn_pk)
            finally:
                close_old_connections()
        t = threading.Thread(target=body)
        t.start()
        workers.append(t)

    monkeypatch.setattr("channels_app.tasks.run_turn.delay", worker_runs_it)
    return workers


def test_a_run_waits_on_nothing_and_a_hung_task_is_cut_off_through_the_hubs_stop(tcast, cron_toml, monkeypatch):
    workers = _worker_threads(monkeypatch)
    job(cron_toml, "script:sleep=30|answer=too late", "script:answer=never")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    # the run's step returned while its turn still runs: nothing sits waiting for the turn
    assert run.state == "running" and run.outputs[0]["state"] in ("accepted", "running")
    deadline = datetime.fromisoformat(run.outputs[0]["deadline"])
    assert services.cron_task_deadline(run_pk=run.pk, task_id="t0", now=deadline - timedelta(seconds=1)) is False
    assert CronRun.objects.get(pk=run.pk).state == "running"  # an early deadline task changes nothing
    assert services.cron_task_deadline(run_pk=run.pk, task_id="t0", now=deadline) is True
    run.refresh_from_db()
    assert run.state == "timed_out"
    assert run.error == "task 't0' ran out of time (UGENT_CRON_TASK_TIME_LIMIT = 600 s)"
    assert run.outputs[0]["state"] == "timed_out" and len(run.outputs) == 1
    assert Event.objects.get(conversation_id=run.conversation_id, type="cron.run.failed").data["state"] == "timed_out"
    for t in workers:
        t.join(10)
    turn = Turn.objects.get(conversation_id=run.conversation_id)
    # stopped through the hub's stop service, which the runner honoured: cancelled, with its event
    assert (turn.state, turn.cancel_requested, turn.stop_requested_by) == ("cancelled", True, f"cron run {run.pk}")
    assert Event.objects.filter(turn=turn, type="turn.stop_requested").count() == 1
    assert services.cron_task_deadline(run_pk=run.pk, task_id="t0", now=deadline) is False  # once


def test_a_task_that_ends_in_time_is_not_cut_off_by_a_late_deadline(tcast, cron_toml):
    job(cron_toml, "script:answer=quick")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    assert run.state == "completed"
    later = timezone.now() + timedelta(days=1)
    assert services.cron_task_deadline(run_pk=run.pk, task_id="t0", now=later) is False
    assert CronRun.objects.get(pk=run.pk).state == "completed"


def test_a_turn_refused_before_the_agent_fails_the_run_through_the_after_turn_hook(tcast, cron_toml):
    from channels_app import hooks

    def refuse(ctx):
        if ctx.channel == "cron":
            return hooks.HookStop(answer="no", state="refused", reason="not today")
    hooks.register("cron-test-refuse", 1, refuse)
    try:
        job(cron_toml, "a", "b")
        run = services.cron_run_manual(job_name="work")
    finally:
        hooks.unregister("cron-test-refuse")
    run.refresh_from_db()
    assert (run.state, run.error) == ("failed", "task 't0' refused: not today")
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 1


def test_a_redelivered_step_resumes_the_run_and_runs_each_task_once(tcast, cron_toml, no_enqueue):
    """The turn's end queued the next step, and that message was lost or redelivered: each delivery
    of the step resumes the run where it stands; no task's turn runs twice."""
    job(cron_toml, "script:answer=one", "script:answer=two", "script:answer=three")
    run = services.cron_run_manual(job_name="work")
    for _ in range(6):  # four steps, and deliveries of a step beyond them (redelivered, repeated)
        services.cron_run_advance(run_pk=run.pk)
    run.refresh_from_db()
    assert [o["state"] for o in run.outputs] == ["completed", "completed", "completed"]
    assert run.state == "completed" and run.result == "[t0]\none\n\n[t1]\ntwo\n\n[t2]\nthree"
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 3
    assert services.cron_run_advance(run_pk=run.pk) is None  # an ended run: a late step does nothing


def test_the_after_turn_hook_queues_the_next_step_for_every_end(tcast, cron_toml, no_enqueue):
    job(cron_toml, "script:answer=one", "script:answer=two")
    run = services.cron_run_manual(job_name="work")
    assert no_enqueue == [run.pk]  # the claim's step
    services.cron_run_advance(run_pk=run.pk)  # submits t0; its turn runs and ends as the step commits
    assert no_enqueue == [run.pk, run.pk]  # the turn's end queued the next step
    assert CronRun.objects.get(pk=run.pk).outputs[0]["state"] in ("accepted", "completed")


def test_the_sweep_resumes_a_run_whose_step_was_lost_and_requeues_a_lost_claim(tcast, cron_toml, no_enqueue):
    job(cron_toml, "script:answer=one", "script:answer=two", extra='overlap = "allow"\nmax_concurrent_runs = 2')
    run = services.cron_run_manual(job_name="work")
    services.cron_run_advance(run_pk=run.pk)  # t0 done; the step its end queued is lost
    other = services.cron_run_manual(job_name="work")  # its first step is lost too
    CronRun.objects.filter(pk=other.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    del no_enqueue[:]
    out = services.cron_runs_sweep()
    assert (out["resumed"], out["requeued"]) == (1, 1) and sorted(no_enqueue) == sorted([run.pk, other.pk])
    run = run_to_end(run.pk)
    assert run.state == "completed"
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 2


def test_the_sweep_cuts_off_a_task_past_its_deadline(tcast, cron_toml, monkeypatch):
    workers = _worker_threads(monkeypatch)
    job(cron_toml, "script:sleep=30|answer=too late")
    run = services.cron_run_manual(job_name="work")
    deadline = datetime.fromisoformat(CronRun.objects.get(pk=run.pk).outputs[0]["deadline"])
    assert services.cron_runs_sweep(now=deadline)["cut_off"] == 1
    run.refresh_from_db()
    assert run.state == "timed_out"
    for t in workers:
        t.join(10)
    assert Turn.objects.get(conversation_id=run.conversation_id).state == "cancelled"


def test_a_step_the_celery_limit_cuts_off_is_recorded_timed_out(tcast, cron_toml, no_enqueue):
    job(cron_toml, "hi")
    run = services.cron_run_manual(job_name="work")
    CronRun.objects.filter(pk=run.pk).update(state="running")
    services.cron_run_time_out(run_pk=run.pk)
    run.refresh_from_db()
    assert run.state == "timed_out" and "ran out of time" in run.error


def test_a_run_whose_turn_a_stopped_process_lost_resumes_on_start(tcast, cron_toml, monkeypatch):
    """Embedded restart: the in-process broker lost the turn's task; the hub runs the accepted turn
    again at start-up, and the run goes on from there to its end."""
    from cron_app.apps import CronStartup
    lost = []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lost.append)
    job(cron_toml, "script:answer=one", "script:answer=two")
    run = services.cron_run_manual(job_name="work")
    assert CronRun.objects.get(pk=run.pk).state == "running" and len(lost) == 1
    monkeypatch.undo()
    CronStartup().start()
    runner.turns_requeue_accepted()
    run.refresh_from_db()
    assert run.state == "completed" and run.result == "[t0]\none\n\n[t1]\ntwo"
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 2


def test_a_run_whose_turn_died_with_its_process_ends_failed_with_the_turns_reason(tcast, cron_toml, monkeypatch):
    lost = []
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lost.append)
    job(cron_toml, "script:answer=one", "script:answer=two")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    Turn.objects.filter(conversation_id=run.conversation_id).update(state="running")  # died mid-turn
    runner.turns_recover_interrupted()  # the hub ends it; its after-turn hook moves the run
    run.refresh_from_db()
    assert (run.state, run.error) == ("failed", "task 't0' interrupted: the process running it stopped")
    assert Turn.objects.filter(conversation_id=run.conversation_id).count() == 1


def test_a_queued_run_lost_with_the_in_process_broker_is_queued_again_on_start(tcast, cron_toml, no_enqueue):
    from cron_app.apps import CronStartup
    job(cron_toml, "hi")
    run = services.cron_run_manual(job_name="work")
    assert no_enqueue == [run.pk]
    CronStartup().start()
    assert no_enqueue == [run.pk, run.pk]


def test_running_an_unknown_job_is_refused(tcast):
    with pytest.raises(services.CronError, match="there is no cron job 'nope'"):
        services.cron_run_manual(job_name="nope")
