"""Overlap and max_concurrent_runs hold when many senders start a job at the same instant."""
from __future__ import annotations

import threading

import pytest
from django.db import close_old_connections, connection

from cron_app import services
from cron_app.models import CronJob, CronRun
from cron_app.messages import WORKFLOW_ALREADY_RUNNING, WORKFLOW_STARTED_WEB, WORKFLOW_TOO_MANY
from tests.cron_app.conftest import run_to_end, submit, web_actor

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8


def start_at_once(cast, rule, n: int) -> list[str]:
    """n senders send the trigger message at the same instant, each in its own thread and connection.

    On PostgreSQL they also reach the claim together, inside their open transactions (SQLite's
    IMMEDIATE transactions let only one in at a time, so there the race is at the door).
    """
    actors = [web_actor(cast, f"user{i}") for i in range(n)]
    # one message first: the rule engine records its rule set's status on the first message after a flush
    submit(actors[0], "hello", caller=cast.operator)
    barrier = threading.Barrier(n)
    if connection.vendor == "postgresql":
        rule.barrier = threading.Barrier(n)
    answers: list = [None] * n
    errors: list = []

    def one(i):
        try:
            barrier.wait()
            r = submit(actors[i], f"digest {i}", caller=cast.operator)
            r.receipt.refresh_from_db()
            answers[i] = r.receipt.answer
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return answers


def test_overlap_skip_starts_exactly_one_run_under_concurrency(seed_job, start_rule, no_enqueue):
    start_rule.add("digest", "digest")
    answers = start_at_once(seed_job, start_rule, THREADS)
    assert answers.count(WORKFLOW_STARTED_WEB.format(workflow="digest")) == 1
    assert answers.count(WORKFLOW_ALREADY_RUNNING.format(workflow="digest")) == THREADS - 1
    assert CronRun.objects.count() == 1 and len(no_enqueue) == 1


def test_max_concurrent_runs_holds_under_concurrency(seed_job, start_rule, no_enqueue):
    CronJob.objects.filter(name="digest").update(overlap="allow", max_concurrent_runs=3)
    start_rule.add("digest", "digest")
    answers = start_at_once(seed_job, start_rule, THREADS)
    assert answers.count(WORKFLOW_STARTED_WEB.format(workflow="digest")) == 3
    assert answers.count(WORKFLOW_TOO_MANY.format(workflow="digest")) == THREADS - 3
    assert CronRun.objects.filter(state="queued").count() == 3


def test_a_finished_run_frees_its_place(seed_job, start_rule, no_enqueue):
    start_rule.add("digest", "digest")
    alice = web_actor(seed_job)
    submit(alice, "digest 1", caller=seed_job.operator)
    assert run_to_end(no_enqueue[0]).state == "completed"
    r = submit(alice, "digest 2", caller=seed_job.operator)
    r.receipt.refresh_from_db()
    assert r.receipt.answer == WORKFLOW_STARTED_WEB.format(workflow="digest")


def test_overlap_queue_waits_then_runs_when_the_place_frees(seed_job, start_rule, no_enqueue):
    CronJob.objects.filter(name="digest").update(overlap="queue", max_concurrent_runs=1)
    start_rule.add("digest", "digest")
    alice = web_actor(seed_job)
    answers = []
    for i in range(3):
        r = submit(alice, f"digest {i}", caller=seed_job.operator)
        r.receipt.refresh_from_db()
        answers.append(r.receipt.answer)
    # one runs, one waits (both are told it started), the third finds the queue full
    assert answers == [WORKFLOW_STARTED_WEB.format(workflow="digest")] * 2 + [
        WORKFLOW_TOO_MANY.format(workflow="digest")]
    first, second = CronRun.objects.order_by("id")
    assert (first.state, second.state) == ("queued", "waiting") and no_enqueue == [first.pk]
    run_to_end(first.pk)
    second.refresh_from_db()
    assert second.state == "queued" and no_enqueue[-1] == second.pk and second.pk not in no_enqueue[:-1]


def test_a_redelivered_run_task_runs_nothing_twice(seed_job, start_rule, no_enqueue):
    start_rule.add("digest", "digest")
    submit(web_actor(seed_job), "digest", caller=seed_job.operator)
    run_to_end(no_enqueue[0])
    assert services.cron_run_advance(run_pk=no_enqueue[0]) is None
    run = CronRun.objects.get()
    from channels_app.models import Turn
    assert run.state == "completed" and Turn.objects.filter(conversation_id=run.conversation_id).count() == 1
