"""Celery tasks of the plugin room: they take ids, fetch rows, call a service."""
from celery import shared_task
from celery.signals import beat_init
from django.db import close_old_connections

from ugent_common.dbconn import with_fresh_connections

MEDIA_PRUNE_TASK_NAME = "ugent: prune expired plugin media"
#: How often expired media is deleted (seconds).
MEDIA_PRUNE_EVERY_SECS = 3600


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def prune_media() -> int:
    """Beat: delete media uploaded through the bridge once it has expired (UGENT_PLUGIN_MEDIA_TTL_SECS)."""
    from plugins_app.channel import services
    return services.media_prune()


def media_prune_schedule_ensure() -> None:
    """Create or update the beat entry that runs prune_media (django-celery-beat)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    schedule, _ = IntervalSchedule.objects.get_or_create(every=MEDIA_PRUNE_EVERY_SECS,
                                                         period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(
        name=MEDIA_PRUNE_TASK_NAME,
        defaults={"task": "plugins_app.tasks.prune_media", "interval": schedule, "enabled": True,
                  "description": "Deletes plugin media past its expiry."})


@beat_init.connect
def _media_prune_schedule(sender=None, **kwargs) -> None:
    """Every beat process (embedded or `celery beat`) makes sure the media prune job is scheduled."""
    try:
        media_prune_schedule_ensure()
    finally:
        close_old_connections()


@shared_task(ignore_result=True, soft_time_limit=3600, time_limit=3660)
@with_fresh_connections
def memory_vector_index() -> str:
    """lance_embedded's IVF_PQ index built, or refreshed with the rows added since, and the table's
    fragments compacted (minutes on a large table: never on a turn). Redelivered or run twice, it finds
    the index there and only folds rows in."""
    from plugins_app.agent.memory import services
    return services.vector_index_refresh()


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)
@with_fresh_connections
def memory_extract_turn(actor_key: str, text: str, turn_id: str) -> int:
    """After a turn: save the facts its message states into its user's memory (duplicates merge, so a
    redelivered task adds nothing new). Takes the text: the memory room does not read the hub's rows."""
    import logging
    from plugins_app.agent.memory import services
    try:
        return services.facts_extract_save(actor_key=actor_key, texts=[text], source="turn", source_ref=turn_id)
    except services.MemoryUnavailable:
        return 0  # the backend was switched to none since the turn ended
    except Exception:
        logging.getLogger("ugent.memory").exception("memory extraction failed (turn=%s)", turn_id)
        raise
