"""Celery tasks of the plugin room: they take ids, fetch rows, call a service."""
from celery import shared_task
from celery.signals import beat_init
from django.db import close_old_connections

from ugent_common.dbconn import with_fresh_connections

MEDIA_PRUNE_TASK_NAME = "ugent: prune expired plugin media"
DELIVERY_PRUNE_TASK_NAME = "ugent: prune settled outbound deliveries"
MEMORY_PRUNE_TASK_NAME = "ugent: prune expired memory facts"
#: How often expired media and settled deliveries are deleted (seconds).
PRUNE_EVERY_SECS = 3600


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def prune_media() -> int:
    """Beat: delete media uploaded through the bridge once it has expired (UGENT_PLUGIN_MEDIA_TTL_SECS)."""
    from plugins_app.channel import services
    return services.media_prune()


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def prune_deliveries() -> int:
    """Beat: delete outbound deliveries settled longer than UGENT_PLUGIN_DELIVERY_RETENTION_SECS ago."""
    from plugins_app.channel import services
    return services.deliveries_prune()


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def prune_memory() -> int:
    """Beat: delete memory facts expired more than UGENT_MEMORY_EXPIRED_KEEP_SECS ago."""
    from plugins_app.agent.memory import services
    return services.facts_expired_prune()


#: (beat entry name, task, description) of each retention job of the plugin room.
RETENTION_JOBS = (
    (MEDIA_PRUNE_TASK_NAME, "plugins_app.tasks.prune_media", "Deletes plugin media past its expiry."),
    (DELIVERY_PRUNE_TASK_NAME, "plugins_app.tasks.prune_deliveries",
     "Deletes delivered and discarded outbound deliveries past UGENT_PLUGIN_DELIVERY_RETENTION_SECS."),
    (MEMORY_PRUNE_TASK_NAME, "plugins_app.tasks.prune_memory",
     "Deletes memory facts expired more than UGENT_MEMORY_EXPIRED_KEEP_SECS ago (pinned facts never)."),
)


def retention_schedules_ensure() -> None:
    """Create or update the beat entries that run the plugin room's retention jobs (django-celery-beat)."""
    from ugent_common.tasks import beat_every
    for name, task, description in RETENTION_JOBS:
        beat_every(name, task, PRUNE_EVERY_SECS, description)


@beat_init.connect
def _retention_schedules(sender=None, **kwargs) -> None:
    """Every beat process (embedded or `celery beat`) makes sure the retention jobs are scheduled."""
    try:
        retention_schedules_ensure()
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


@shared_task(ignore_result=True, soft_time_limit=3600, time_limit=3660)
@with_fresh_connections
def memory_vector_backfill() -> int:
    """lance_embedded: facts saved while another backend was in force (no vector yet) embedded and added to
    the table, off any turn. Run twice or redelivered, it finds fewer or none left (a row takes a vector
    only while it has none)."""
    from plugins_app.agent.memory import services
    return services.vector_backfill()


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)
@with_fresh_connections
def memory_extract_turn(actor_key: str, text: str, turn_id: str, profile_id: int | None = None) -> int:
    """After a turn: save the facts its message states into its user's memory (duplicates merge, and a
    fact is seen once per turn, so a redelivered task adds and counts nothing). Takes the text: the memory room does not read the hub's rows.
    `profile_id`: the turn's agent profile, whose server the model extractor asks (none for a task
    enqueued before it was passed: UGENT_LLM_*)."""
    import logging
    from plugins_app.agent.memory import services
    try:
        return services.facts_extract_save(actor_key=actor_key, texts=[text], source="turn", source_ref=turn_id,
                                           seen_in=[turn_id], profile_id=profile_id)
    except services.MemoryUnavailable:
        return 0  # the backend was switched to none since the turn ended
    except Exception:
        logging.getLogger("ugent.memory").exception("memory extraction failed (turn=%s)", turn_id)
        raise


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
@with_fresh_connections
def channel_command_answer(delivery_id: str, name: str, args: str, actor_id: int, conversation_id: int,
                           remote_control: bool) -> bool:
    """A command typed on a chat channel that asks the engine (/btw, /refine): run it and put its answer
    into its held delivery (plugins_app.channel.services._command_take). On the turn queue: the sender
    waits for it. Run twice (redelivered after a crash), the second finds the answer in and does nothing."""
    from plugins_app.channel import services
    return services.command_answer_fill(delivery_id=delivery_id, name=name, args=args, actor_id=actor_id,
                                       conversation_id=conversation_id, remote_control=remote_control)
