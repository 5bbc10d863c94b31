"""The deployment's two Celery queues (ugent_site/settings.py): turns and what a sender waits for on the turn
queue; memory extraction, lance's index and backfill and the retention jobs on the background queue. A
worker without -Q takes both; one that takes the background queue alone never says it is warm for turns."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.conf import settings

from ugent_site.celery import app

#: Tasks a sender or a run waits for: they stay on the turn queue.
TURN_QUEUE_TASKS = ("channels_app.tasks.run_turn", "channels_app.tasks.sweep_stale_turns",
                    "channels_app.tasks.expire_pending_artifacts")


@pytest.fixture(autouse=True, scope="module")
def _tasks_imported():
    app.loader.import_default_modules()  # as a worker does at its start (autodiscovery is lazy)


def routed(name: str) -> str:
    return app.amqp.router.route({}, name)["queue"].name


@pytest.mark.mode_free
def test_each_background_task_exists_and_goes_to_the_background_queue():
    assert settings.UGENT_BACKGROUND_QUEUE == settings.CELERY_TASK_DEFAULT_QUEUE + "-background"
    for name in settings.UGENT_BACKGROUND_TASKS:
        assert name in app.tasks, name  # a misspelt name would route nothing
        assert routed(name) == settings.UGENT_BACKGROUND_QUEUE, name


@pytest.mark.mode_free
def test_turns_sweeps_and_cron_stay_on_the_turn_queue():
    cron = [n for n in app.tasks if n.startswith("cron_app.")]
    assert cron
    for name in (*TURN_QUEUE_TASKS, *cron):
        assert name in app.tasks, name
        assert routed(name) == settings.CELERY_TASK_DEFAULT_QUEUE, name


@pytest.mark.mode_free
def test_the_turn_queue_keeps_celerys_own_exchange_and_key_and_a_worker_takes_both_queues():
    queues = app.amqp.queues
    turn = queues[settings.CELERY_TASK_DEFAULT_QUEUE]
    assert (turn.exchange.name, turn.exchange.type, turn.routing_key) == (turn.name, "direct", turn.name)
    assert set(queues.consume_from) == {settings.CELERY_TASK_DEFAULT_QUEUE, settings.UGENT_BACKGROUND_QUEUE}


@pytest.mark.mode_free
@pytest.mark.parametrize("consumed, marks", [
    (None, True),  # every queue: no -Q
    (("turn",), True),
    (("turn", "background"), True),
    (("background",), False),  # -Q <queue>-background alone: runs no turn, so health must not wait on it
])
def test_only_a_worker_taking_the_turn_queue_marks_itself_warm(monkeypatch, consumed, marks):
    from plugins_app.agent import warm
    from ugent_site import celery as celery_module
    names = {"turn": settings.CELERY_TASK_DEFAULT_QUEUE, "background": settings.UGENT_BACKGROUND_QUEUE}
    consume_from = {names[k]: object() for k in (consumed or names)}
    sender = SimpleNamespace(app=SimpleNamespace(amqp=SimpleNamespace(queues=SimpleNamespace(
        consume_from=consume_from))))
    asked = []
    monkeypatch.setattr(warm, "warm_start", lambda *, mark=True: asked.append(mark))
    celery_module._warm_engines(sender=sender)
    assert asked == [marks]


@pytest.mark.django_db
def test_the_status_reports_each_queue_and_what_waits_in_it(client, tcast):
    """A background queue no worker takes only grows: GET /v1/ugent/status's queues section shows it. Servers
    mode counts the Redis list (a background task published here, where no worker takes this test's queue);
    embedded mode's in-process broker holds nothing across a restart and reports 0."""
    import os
    servers = bool(os.environ.get("REDIS_URL"))
    eager, app.conf.task_always_eager = app.conf.task_always_eager, False  # (the test process runs tasks eagerly)
    try:
        if servers:
            import redis
            r = redis.Redis.from_url(settings.CELERY_BROKER_URL)
            r.delete(settings.UGENT_BACKGROUND_QUEUE)
            app.send_task("plugins_app.tasks.prune_media")
        body = client.get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["queues"]
    finally:
        app.conf.task_always_eager = eager
        if servers:
            r.delete(settings.UGENT_BACKGROUND_QUEUE)
    assert body["turn"]["name"] == settings.CELERY_TASK_DEFAULT_QUEUE
    assert body["background"] == {"name": settings.UGENT_BACKGROUND_QUEUE, "waiting": 1 if servers else 0}
