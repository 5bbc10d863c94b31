"""The Celery app: memory:// in embedded mode, Redis in servers mode (settings decide)."""
import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
app = Celery("ugent_site")
# The CELERY_* settings, copied once under Celery's names (see ugent_site/celery_conf.py).
app.config_from_object("ugent_site.celery_conf")
app.autodiscover_tasks()


@signals.worker_ready.connect
def _warm_engines(**_kwargs):
    """A worker that runs turns (servers mode) warms engine discovery and the notes index at start."""
    from plugins_app.agent.warm import warm_start
    warm_start()
