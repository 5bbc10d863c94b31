"""Servers mode: cron runs on a real Celery worker (threads pool, 2 threads) over Redis and PostgreSQL.

No step of a run waits for its turn, so runs cannot hold every worker slot while their own turns
queue behind them; a worker killed with -9 mid-run leaves nothing that waits either.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from channels_app import runner
from channels_app.models import Turn
from cron_app import services
from cron_app.models import FINAL_RUN_STATES, CronRun

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="servers mode (REDIS_URL) only")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def broker():
    """The test process publishes to the worker's queue for real (not eagerly)."""
    from ugent_site.celery import app
    app.conf.task_always_eager = False
    app.control.purge()
    yield app
    app.control.purge()
    app.conf.task_always_eager = True


class Worker:
    def __init__(self, tmp: Path):
        db = connection.settings_dict
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
        self.env.update({
            "DJANGO_SETTINGS_MODULE": "ugent_site.settings", "PYTHONPATH": str(ROOT),
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
            "UGENT_CELERY_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE, "UGENT_VAR_DIR": str(tmp / "var"),
            "UGENT_EXTRA_ENGINES": "scripted=tests.support.scripted:ScriptedEngine"})
        self.log = tmp / "worker.log"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "ugent_site", "worker", "-P", "threads", "-c", "2",
             "-l", "WARNING", "--without-heartbeat", "--without-mingle", "--without-gossip",
             "-n", f"cron{os.getpid()}-{time.monotonic_ns()}@%h"],
            cwd=ROOT, env=self.env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill9(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def worker(tmp_path, broker):
    w = Worker(tmp_path)
    yield w
    w.stop()


def wait_for(predicate, what: str, timeout: float = 120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def job(cron_toml, *prompts):
    tasks = "".join(f'\n[[jobs.tasks]]\nid = "t{i}"\nprompt = "{p}"\n' for i, p in enumerate(prompts))
    cron_toml(f'enabled = true\n[[jobs]]\nid = "work"\noverlap = "allow"\nmax_concurrent_runs = 4\n{tasks}')


def test_four_runs_on_two_worker_threads_all_finish_with_each_turn_once(tcast, cron_toml, worker):
    job(cron_toml, "script:sleep=0.5|answer=first", "script:sleep=0.5|answer=second")
    worker.start()
    runs = [services.cron_run_manual(job_name="work") for _ in range(4)]
    wait_for(lambda: CronRun.objects.filter(state__in=FINAL_RUN_STATES).count() == 4, "the four runs to end")
    for run in runs:
        run.refresh_from_db()
        assert (run.state, run.result) == ("completed", "[t0]\nfirst\n\n[t1]\nsecond"), run.error
        turns = list(Turn.objects.filter(conversation_id=run.conversation_id).order_by("id"))
        assert [t.state for t in turns] == ["completed", "completed"]  # each task's turn, once
        assert turns[0].finished_at <= turns[1].started_at


def test_a_worker_killed_mid_run_leaves_nothing_waiting_and_the_runs_go_on_on_the_next(tcast, cron_toml, worker):
    """Four runs, two threads, kill -9 while two turns run: after a restart the two runs whose steps
    were still queued finish, each task's turn once; the two whose turns died with the worker end
    failed with their turn's reason as soon as the hub ends those turns."""
    job(cron_toml, "script:sleep=5|answer=first", "script:answer=second")
    worker.start()
    runs = [services.cron_run_manual(job_name="work") for _ in range(4)]
    wait_for(lambda: Turn.objects.filter(state="running").count() == 2, "two turns to run")
    worker.kill9()
    dead = set(Turn.objects.filter(state="running").values_list("conversation_id", flat=True))
    # the hub ends the turns the dead worker held (its sweep, as beat runs it once their leases have
    # lapsed: a lease's length from now); their after-turn hook queues the runs' steps, which the
    # next worker takes
    lapsed = timezone.now() + timedelta(seconds=settings.UGENT_TURN_LEASE_SECONDS + 1)
    assert runner.turns_recover_interrupted(lapsed_before=lapsed) == 2
    worker.start()
    wait_for(lambda: CronRun.objects.filter(state__in=FINAL_RUN_STATES).count() == 4, "the four runs to end")
    for run in runs:
        run.refresh_from_db()
        turns = list(Turn.objects.filter(conversation_id=run.conversation_id).order_by("id"))
        if run.conversation_id in dead:
            assert (run.state, run.error) == ("failed", "task 't0' interrupted: the process running it stopped")
            assert [t.state for t in turns] == ["interrupted"]  # t1 never started
        else:
            assert (run.state, run.result) == ("completed", "[t0]\nfirst\n\n[t1]\nsecond"), run.error
            assert [t.state for t in turns] == ["completed", "completed"]  # each task's turn, once
