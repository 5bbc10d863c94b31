"""Runs end in a recorded state: completed with each task's output, failed or timed out with the reason
and an event, and never stuck."""
from __future__ import annotations

import threading

import pytest
from django.db import close_old_connections

from channels_app import runner
from channels_app.models import Event, Turn
from cron_app import services
from cron_app.models import CronRun

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


def test_a_hung_task_is_cut_off_by_the_time_limit_and_recorded_as_such(tcast, cron_toml, monkeypatch):
    monkeypatch.setattr("cron_app.conf.TASK_TIME_LIMIT", 0.5)
    workers = []

    def worker_runs_it(turn_pk):  # a worker picks the turn up, in its own thread, as in production
        def body():
            try:
                runner.turn_run(turn_pk)
            finally:
                close_old_connections()
        t = threading.Thread(target=body)
        t.start()
        workers.append(t)

    monkeypatch.setattr("channels_app.tasks.run_turn.delay", worker_runs_it)
    job(cron_toml, "script:sleep=30|answer=too late")
    run = services.cron_run_manual(job_name="work")
    run.refresh_from_db()
    assert run.state == "timed_out"
    assert run.error == "task 't0' ran out of time (UGENT_CRON_TASK_TIME_LIMIT = 0.5 s)"
    assert run.outputs[0]["state"] == "timed_out"
    assert Event.objects.get(conversation_id=run.conversation_id, type="cron.run.failed").data["state"] == "timed_out"
    for t in workers:
        t.join(10)
    turn = Turn.objects.get(conversation_id=run.conversation_id)
    assert turn.cancel_requested and turn.state == "cancelled"  # the hung turn was stopped too


def test_a_run_the_celery_limit_cuts_off_is_recorded_timed_out(tcast, cron_toml, no_enqueue):
    job(cron_toml, "hi")
    run = services.cron_run_manual(job_name="work")
    CronRun.objects.filter(pk=run.pk).update(state="running")
    services.cron_run_time_out(run_pk=run.pk)
    run.refresh_from_db()
    assert run.state == "timed_out" and "ran out of time" in run.error


def test_a_run_left_running_by_a_stopped_process_is_interrupted_on_start(tcast, cron_toml, no_enqueue):
    from cron_app.apps import CronStartup
    job(cron_toml, "hi")
    stuck = services.cron_run_manual(job_name="work")
    CronRun.objects.filter(pk=stuck.pk).update(state="running")
    CronStartup().start()
    stuck.refresh_from_db()
    assert stuck.state == "interrupted" and stuck.error == "the process running it stopped"


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
