"""The Celery app: memory:// in embedded mode, Redis in servers mode (settings decide)."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
app = Celery("ugent_site")
# The CELERY_* settings, copied once under Celery's names (see ugent_site/celery_conf.py).
app.config_from_object("ugent_site.celery_conf")
app.autodiscover_tasks()
