"""Celery's configuration: the CELERY_* Django settings under Celery's own names, read once.

With `config_from_object("django.conf:settings", namespace="CELERY")` Celery looks every key
up under several spellings through Django's LazySettings each time it is used: publishing one
task made about twenty such lookups, a quarter of its 0.65 ms (cProfile). The settings are
fixed for the life of a process, so they are copied here once, when Celery first reads its
configuration. (Tests change app.conf directly, which still works.)
"""
from django.conf import settings

_PREFIX = "CELERY_"
for _name in dir(settings):
    if _name.startswith(_PREFIX):
        globals()[_name[len(_PREFIX):].lower()] = getattr(settings, _name)
# Celery's Django fixup asks for this one by its Django name.
CELERY_DB_REUSE_MAX = getattr(settings, "CELERY_DB_REUSE_MAX", None)
