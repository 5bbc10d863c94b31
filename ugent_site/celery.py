"""The Celery app: memory:// in embedded mode, Redis in servers mode (settings decide)."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
app = Celery("ugent_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
