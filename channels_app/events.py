"""Appending to the durable event log.

The cursor is the row id. Ids must be visible in commit order so that
"everything after cursor N" never skips an event that commits late: on
PostgreSQL each append takes a transaction-scoped advisory lock, so appends
commit one after another; SQLite already serialises writers.

An append's foreign keys take KEY SHARE locks on its turn and conversation
rows while it holds the advisory lock, so a transaction that locks a turn row
and then appends must lock it FOR NO KEY UPDATE (no_key=True); FOR UPDATE
would wait on the appender while the appender waits on it: a deadlock.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from channels_app import notify, statements

from ugent_common import rows
from channels_app.models import Event

EVENT_LOG_LOCK = statements.EVENT_LOG_LOCK  # "UGNT"
log = logging.getLogger("ugent.events")


# Every commit wakes the all-conversations stream too.
LOG_TOPIC = "log"

# The types the hub appends to the log (a type is a string each caller names, never a column's choices); other
# rooms add theirs with event_types_add (cron_app.services). The admin's type filter offers these without
# reading the log.
EVENT_TYPES = {
    "ugent.user_message", "turn.delta", "turn.completed", "turn.failed", "turn.cancelled", "ugent.citations",
    "turn.stop_requested", "turn.steered", "turn.steering_dropped", "interaction.requested", "interaction.resolved",
    "compaction.completed", "ugent.artifacts_pending", "ugent.artifacts",
}


def event_types_add(*types: str) -> None:
    EVENT_TYPES.update(types)


_UNLISTED_SEEN: set[str] = set()


def _event_type_unlisted(event_type: str) -> None:
    """A type the code appends must be in EVENT_TYPES (the admin's filter offers those without reading the log):
    the tests refuse one that is not (UGENT_EVENT_TYPES_STRICT), a daemon logs it once and appends it."""
    if getattr(settings, "UGENT_EVENT_TYPES_STRICT", False):
        raise ValueError(f"event type {event_type!r} is not in channels_app.events.EVENT_TYPES: add it there "
                         f"(or with event_types_add in its room)")
    if event_type not in _UNLISTED_SEEN:
        _UNLISTED_SEEN.add(event_type)
        log.warning("event type %s is not in channels_app.events.EVENT_TYPES: the admin's type filter offers it "
                    "only while it is among the newest events", event_type)


def conversation_topic(conversation_id: int) -> str:
    return f"conv:{conversation_id}"


def turn_topic(turn_pk: int) -> str:
    return f"turn:{turn_pk}"


def _lock_log() -> None:
    statements.event_log_lock()


def event_append(*, conversation_id: int, type: str, data: dict, turn_pk: int | None = None,
                 audience: list[str] | None = None, new_turn: bool = False, before: list | None = None) -> int:
    """Append one event; readers are woken when the transaction commits. Returns its cursor."""
    return events_append(conversation_id=conversation_id, turn_pk=turn_pk,
                         items=[(type, data, audience or [])], new_turn=new_turn, before=before)[0]


def events_append(*, conversation_id: int, turn_pk: int | None,
                  items: list[tuple[str, dict, list[str]]], new_turn: bool = False, before: list | None = None,
                  guard=None) -> list[int]:
    """Append events in order; their cursors. `new_turn`: the turn was created in this transaction
    and has no events yet.

    One round trip on PostgreSQL (`rows.batch`): the log's lock, the turn's previous event id, the
    inserts. `before`: statements (rows.Step) of the same transaction sent ahead of them in that
    trip, whose results nobody reads. `guard`: (step, check), a statement run under the log's lock
    before the inserts and `check(its result)`, which raises to undo the append (and its transaction)."""
    table = rows.table(Event)
    # No savepoint of its own: an append inside a caller's transaction commits or fails with it.
    with transaction.atomic(savepoint=False):
        steps = list(before or []) + [statements.event_log_lock_step()]
        at_guard = len(steps)
        if guard is not None:
            steps.append(guard[0])
        # Under the log's lock (SQLite: the one writer) every event of the turn has committed, and none
        # can be added before our inserts: the turn's newest event now is the one before our first.
        at_prev = len(steps)
        with_prev = turn_pk is not None and bool(items) and not new_turn
        if with_prev:
            steps.append(statements.turn_event_latest_step(turn_pk))
        # The conversation's newest event and the fields a stream's rows carry, for its fan-out readers
        # (one may listen: servers mode, or a waiter here): they take the rows without reading them.
        at_head = None
        if items and (settings.REDIS_URL or notify.listening(conversation_topic(conversation_id))):
            at_head = len(steps)
            steps.append(statements.conversation_event_head_step(conversation_id, turn_pk))
        at_ids = len(steps)
        now = timezone.now()
        for event_type, _data, _audience in items:
            if event_type not in EVENT_TYPES:  # (a set lookup an event on the hot path; a call only when unlisted)
                _event_type_unlisted(event_type)
        steps += [table.insert_step(conversation_id=conversation_id, turn_id=turn_pk, type=t, data=d, audience=a,
                                    created_at=now) for t, d, a in items]
        results = rows.batch(steps)
        if guard is not None:
            guard[1](results[at_guard])
        ids = results[at_ids:]
        topics = [LOG_TOPIC, conversation_topic(conversation_id)]
        batch = None
        if turn_pk is not None and ids:
            topics.append(turn_topic(turn_pk))
            # `prev` is exact: a reader at that cursor can take these rows as they are.
            prev = results[at_prev] if with_prev else 0
            batch = (turn_topic(turn_pk), notify.TurnBatch(prev=prev, rows=tuple(
                (i, t, d) for i, (t, d, _a) in zip(ids, items))))
        more = ()
        head = results[at_head] if at_head is not None else None
        if head is not None and ids:
            conv_prev, *fields = head
            more = ((conversation_topic(conversation_id), notify.ConversationBatch(prev=conv_prev, rows=tuple(
                dict(zip(notify.ROW_FIELDS, (i, t, a, d, now, *fields))) for i, (t, d, a) in zip(ids, items)))),)
        transaction.on_commit(lambda: notify.publish(*topics, batch=batch, batches=more))
    return ids
