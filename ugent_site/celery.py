"""The Celery app: memory:// in embedded mode, Redis in servers mode (settings decide)."""
import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
app = Celery("ugent_site")
# The CELERY_* settings, copied once under Celery's names (see ugent_site/celery_conf.py).
app.config_from_object("ugent_site.celery_conf")
app.autodiscover_tasks()


@signals.worker_init.connect
def _worker_enforces_rules(**_kwargs):
    """A worker submits messages (cron's tasks): it enforces the rules and records them as the daemon."""
    from rules_app.runtime import enforce_here
    enforce_here()


@signals.setup_logging.connect
def _the_daemons_logging(**_kwargs):
    """A worker logs as every other process does (settings.LOGGING: plain or JSON lines, no secrets,
    repeats throttled, UGENT_LOG_LEVEL) instead of Celery's own format: a receiver here tells Celery
    to leave logging alone, so its -l flag no longer hides the turn-end lines."""
    import logging.config

    from django.conf import settings
    logging.config.dictConfig(settings.LOGGING)


@signals.worker_ready.connect
def _warm_engines(sender=None, **_kwargs):
    """A worker (servers mode) warms engine discovery and the notes index at start. Only one that takes the
    turn queue says so in Redis for GET /v1/health: a worker started with `-Q <queue>-background` alone
    runs no turn."""
    from django.conf import settings

    from plugins_app.agent.warm import warm_start
    consumed = sender.app.amqp.queues.consume_from if sender is not None else None
    warm_start(mark=consumed is None or settings.CELERY_TASK_DEFAULT_QUEUE in consumed)
