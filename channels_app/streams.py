"""The durable event log read back: who sees what, events after a cursor, gaps, snapshots, stop and steering.

The event log (channels_app.events) is the record; a stream's history is the
query "visible events with id > cursor", and its live events are the same rows,
read once per process by its stream's reader (channels_app.fanout) and filtered
per subscriber in memory by row_visible, the same test the query makes. A cursor the log no longer holds is answered with one
`ugent.gap` event carrying the conversation's snapshot, and the stream goes
on from the cursor that snapshot was read at.

Who sees what ("Keys and callers") is decided in channels_app.access, for
every object type: an operator key that names nobody is the operator and sees
everything; anyone else sees the conversations their actor owns, and of those
only events addressed to everyone (audience []) or to their own actor key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max, Q
from django.utils import timezone

from channels_app import access, harness, notify
from channels_app.access import Viewer
from channels_app.errors import ApplicationError
from channels_app.events import event_append
from channels_app.models import (LIVE_TURN_STATES, Caller, Conversation, Event, EventLogMark, Message,
                                 Receipt, Steering, Turn)
from ugent_common.digits import ascii_int

# How old an event may get before the retention job prunes it (seconds).
EVENT_RETENTION_SECS = settings.UGENT_EVENT_RETENTION_SECS
# How often the retention job runs (seconds).
EVENT_PRUNE_EVERY_SECS = settings.UGENT_EVENT_PRUNE_EVERY_SECS
# Milliseconds an EventSource waits before it reconnects (the SSE `retry:` field).
SSE_RETRY_MS = settings.UGENT_SSE_RETRY_MS

READ_BATCH = 500
SNAPSHOT_RECEIPTS = 50
PAGE_DEFAULT, PAGE_MAX = 50, 200
PRUNE_CHUNK = 5000
RETENTION_TASK_NAME = "ugent: prune the event log"

GAP_PRUNED, GAP_OTHER_STORE, GAP_UNKNOWN = "pruned", "other_store", "unknown"
NO_CONVERSATION = "No such conversation."
NO_TURN = "No such turn in this conversation."
NO_RUNNING_TURN = "No turn is running in this conversation."
STOP, STEER = "stop", "steer"

# The activity feed: tools, questions, compaction, and what was done to a running turn.
ACTIVITY_TYPES = ("turn.steered", "turn.stop_requested", "turn.steering_dropped")
ACTIVITY_PREFIXES = ("interaction.", "compaction.", "tool.", "ugent.tool", "activity.")


# --- who ---------------------------------------------------------------------

def viewer_resolve(*, caller: Caller, user: str | None = None, federation_issuer: str | None = None,
                   federation_subject: str | None = None, identity=None) -> Viewer:
    from channels_app.services import viewer_resolve
    return viewer_resolve(caller=caller, user=user, federation_issuer=federation_issuer,
                          federation_subject=federation_subject, identity=identity)


def conversation_lookup(*, conversation_id: str, client_id: str = "", channel: str = "web") -> Conversation | None:
    return (Conversation.objects.select_related("owner")
            .filter(channel=channel, client_id=client_id or "", external_id=conversation_id).first())


def conversation_for_viewer(*, viewer: Viewer, conversation_id: str, client_id: str = "",
                            channel: str = "web") -> Conversation:
    """The conversation if the viewer may read it; 404 otherwise, as for a missing one."""
    conv = conversation_lookup(conversation_id=conversation_id, client_id=client_id, channel=channel)
    if conv is None or not access.conversation_readable(viewer, conv):
        raise ApplicationError(NO_CONVERSATION, status=404, code="conversation_not_found",
                               param="conversation_id")
    return conv


# --- the log -----------------------------------------------------------------

def log_head() -> int:
    """The newest cursor the log has held: never below what retention pruned, even when it is empty."""
    return max(log_newest_id(), log_pruned_through())


def log_newest_id() -> int:
    """The newest event id visible now. Ids are visible in commit order (events_append takes the log's
    lock; SQLite has one writer), so every event at or below it has committed: a read of "id > N" made
    after this one sees all of them, and a reader that read them all may stand here."""
    return Event.objects.aggregate(m=Max("id"))["m"] or 0


def log_pruned_through() -> int:
    """Retention deleted every event with an id at or below this."""
    return EventLogMark.objects.filter(name=EventLogMark.PRUNED_THROUGH).values_list("value", flat=True).first() or 0


def cursor_parse(raw) -> int | None:
    """A cursor as sent (Last-Event-ID or ?cursor=); None when it is no cursor at all."""
    if raw is None:
        return None
    return ascii_int(str(raw).strip(), max_digits=19)


def activity_q() -> Q:
    q = Q(type__in=ACTIVITY_TYPES) | Q(type="turn.delta", data__segment="tool")
    for prefix in ACTIVITY_PREFIXES:
        q |= Q(type__startswith=prefix)
    return q


def activity_match(event_type: str, data) -> bool:
    """activity_q() for one row in memory (the fan-out hub filters each subscriber's rows itself)."""
    if event_type in ACTIVITY_TYPES or event_type.startswith(ACTIVITY_PREFIXES):
        return True
    return event_type == "turn.delta" and isinstance(data, dict) and data.get("segment") == "tool"


def _iso(dt) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


def event_payload(row: dict) -> dict:
    """What a stream sends for one event: its cursor, type, where it belongs, its time and data."""
    return {"id": row["id"], "type": row["type"], "conversation_id": row["conversation__external_id"],
            "client_id": row["conversation__client_id"], "channel": row["conversation__channel"],
            "turn_id": row["turn__turn_id"], "ts": _iso(row["created_at"]), "data": row["data"]}


def sse_frame(cursor: int, event_type: str, payload: dict) -> bytes:
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)
    return f"id: {cursor}\nevent: {event_type}\ndata: {body}\n\n".encode()


@dataclass
class Subscription:
    """One open stream: whose, over what, and how far it has read."""

    viewer: Viewer
    cursor: int
    conversation: Conversation | None = None
    activity: bool = False
    pending_gap: str | None = None
    scanned: int = field(default=0)
    #: Whether what opened the stream (its key, its identity token, its caller's role) still holds:
    #: called now and then while the stream is open (channels_app.api_streams); None: never asked.
    auth_check: Callable[[], ApplicationError | None] | None = None
    #: Unix time the identity token that opened it expires (its exp plus leeway), as the last check read it;
    #: the stream asks again then. None: no token.
    auth_expires_at: float | None = None


def subscription_open(*, viewer: Viewer, raw_cursor, conversation: Conversation | None = None,
                      activity: bool = False) -> Subscription:
    """Where a new stream starts: after its cursor, or at the log's head when it sent none.

    A cursor that is no number is `unknown`, one beyond the log's head came from `other_store`;
    both start at the head behind one ugent.gap. A pruned one is found by the first read.
    """
    head = log_head()
    sub = Subscription(viewer=viewer, cursor=head, conversation=conversation, activity=activity)
    if raw_cursor is None or str(raw_cursor).strip() == "":
        return sub
    cursor = cursor_parse(raw_cursor)
    if cursor is None:
        sub.pending_gap = GAP_UNKNOWN
    elif cursor > head:
        sub.pending_gap = GAP_OTHER_STORE
    else:
        sub.cursor = cursor
    return sub


def gap_frame(sub: Subscription, reason: str, *, resume: int | None = None) -> bytes:
    """One ugent.gap: the snapshot to take up in place of what is gone; the stream resumes after its cursor.

    `resume`: where what is gone ends (a pruned gap on the whole log's stream, which has no snapshot: the
    pruned-through mark; the log still holds every event after it, and the stream sends them). None: the
    snapshot's cursor (the snapshot stands for every event up to it), or the log's head without a
    conversation (a cursor that is no position in this log: nothing after it can be told apart)."""
    snapshot = None
    if sub.conversation is not None:
        snapshot = conversation_snapshot(viewer=sub.viewer, conversation=sub.conversation)
    if resume is None:
        resume = snapshot["cursor"] if snapshot is not None else log_head()
    payload = {"id": resume, "type": "ugent.gap", "reason": reason,
               "conversation_id": sub.conversation.external_id if sub.conversation else None,
               "cursor": resume, "ts": _iso(timezone.now()), "snapshot": snapshot}
    sub.cursor = resume
    return sse_frame(resume, "ugent.gap", payload)


def refused_frame(exc: ApplicationError) -> bytes:
    """The last frame of a stream whose key or identity token no longer holds (Subscription.auth_check):
    `ugent.error` with the body the API answers that refusal with. No `id:`: the client's
    Last-Event-ID stays its last event's, and a reconnect with valid credentials goes on from it."""
    body = json.dumps(exc.body(), ensure_ascii=False, separators=(",", ":"), default=str)
    return f"event: ugent.error\ndata: {body}\n\n".encode()


def gap_frame_cut_loose(sub: Subscription) -> bytes:
    """The ugent.gap of a subscriber the fan-out hub cut loose (channels_app.fanout): it fell more than
    its queue behind. Reason `pruned`, the closest the seed names (pruned, other_store, unknown): the
    events after its cursor were pruned from its queue, not from the log. So there is nothing to take
    up (`snapshot` null): the id is its own cursor, and a reconnect with it as Last-Event-ID reads the
    rest from the log, each event once."""
    payload = {"id": sub.cursor, "type": "ugent.gap", "reason": GAP_PRUNED,
               "conversation_id": sub.conversation.external_id if sub.conversation else None,
               "cursor": sub.cursor, "ts": _iso(timezone.now()), "snapshot": None}
    return sse_frame(sub.cursor, "ugent.gap", payload)


ROW_FIELDS = notify.ROW_FIELDS


def log_rows_after(cursor: int, *, conversation_pk: int | None = None, viewer: Viewer | None = None,
                   activity: bool = False, limit: int = READ_BATCH) -> list[dict]:
    """The log's rows after `cursor` (one conversation's, or the whole log's as far as `viewer` owns
    them; no viewer: all of them), oldest first, before the per-event audience check."""
    qs = Event.objects.filter(id__gt=cursor)
    if conversation_pk is not None:
        qs = qs.filter(conversation_id=conversation_pk)
    elif viewer is not None:
        qs = access.events_scope(viewer, qs)
    if activity:
        qs = qs.filter(activity_q())
    return list(qs.order_by("id").values(*ROW_FIELDS)[:limit])


def row_visible(sub: Subscription, row: dict) -> bool:
    """Whether this subscription shows this row: its viewer may read it (and, for the activity feed,
    it is activity). The same test subscription_read's query and audience check make, in memory.
    It depends on the viewer's operator flag and actor and on the feed alone: the fan-out hub shares
    one answer among subscribers alike in those (fanout.Tap.filter_key)."""
    if sub.activity and not activity_match(row["type"], row["data"]):
        return False
    return access.event_readable(sub.viewer, owner_id=row["conversation__owner_id"], audience=row["audience"] or [])


def row_frame(row: dict) -> bytes:
    return sse_frame(row["id"], row["type"], event_payload(row))


#: What `by` of turn.stop_requested says to a reader the stop is not theirs (docs/streams.md).
STOPPED_BY_SOMEONE_ELSE = "someone else"


def event_data_for(viewer: Viewer, event_type: str, data):
    """An event's data as this viewer may read it. Who asked a turn to stop (turn.stop_requested's `by`, an
    actor key: another application's end user may stop a turn by its exact turn_id) is the stopper's and
    the operator's to read; the turn's own user reads "someone else" (nobody reads what is not theirs)."""
    if (event_type == "turn.stop_requested" and isinstance(data, dict) and "by" in data
            and not viewer.is_operator and data["by"] != viewer.actor.key):
        return {**data, "by": STOPPED_BY_SOMEONE_ELSE}
    return data


def row_frame_for(viewer: Viewer, row: dict, frame: bytes | None = None) -> bytes:
    """The row's frame for this viewer: `frame` (row_frame's, shared by every reader) unless
    event_data_for shows this viewer less of it. Depends on the viewer's operator flag and actor key
    alone, as row_visible does (fanout.Tap.filter_key)."""
    data = event_data_for(viewer, row["type"], row["data"])
    if data is row["data"]:
        return frame if frame is not None else row_frame(row)
    return sse_frame(row["id"], row["type"], {**event_payload(row), "data": data})


def subscription_read(sub: Subscription, *, limit: int = READ_BATCH) -> tuple[list[bytes], bool]:
    """The frames after the subscription's cursor that its viewer may see; True when more wait."""
    frames: list[bytes] = []
    if sub.pending_gap:
        reason, sub.pending_gap = sub.pending_gap, None
        frames.append(gap_frame(sub, reason))
    # Read before the events: every event up to it has committed, so the query below sees all of them.
    newest = log_newest_id()
    rows = log_rows_after(sub.cursor, conversation_pk=sub.conversation.pk if sub.conversation is not None else None,
                          viewer=sub.viewer, activity=sub.activity, limit=limit)
    more = len(rows) >= limit
    # Read after the events: a prune that deleted any of them committed before this read sees it.
    pruned = log_pruned_through()
    if pruned > sub.cursor:
        # With a snapshot (a conversation's stream) the stream goes on after the snapshot's cursor: it stands
        # for every event up to it, and an event it holds sent again would be taken up twice. Without one (the
        # whole log's stream) the gap stands for what was pruned alone, and the log's rows after the mark follow.
        frames.append(gap_frame(sub, GAP_PRUNED, resume=None if sub.conversation is not None else pruned))
        rows = [row for row in rows if row["id"] > sub.cursor]
    for row in rows:
        if access.event_readable(sub.viewer, owner_id=row["conversation__owner_id"], audience=row["audience"] or []):
            frames.append(row_frame_for(sub.viewer, row))
    if rows:
        sub.cursor = rows[-1]["id"]
    if not more:
        # it read everything up to `newest` this stream may see: it stands there, not at its own last row, or
        # every later batch of its reader would start beyond it and send it back to the database
        sub.cursor = max(sub.cursor, newest)
    return frames, more


def db_ready() -> None:
    """Drop a broken connection of this (executor) thread; keep a working one between reads."""
    if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
        connection.close()


# --- snapshots and history ---------------------------------------------------

def message_payload(m: Message) -> dict:
    return {"id": m.id, "role": m.role, "content": m.content, "turn_id": m.turn.turn_id if m.turn_id else None,
            "actor": m.actor.key if m.actor_id else None, "created_at": _iso(m.created_at)}


def conversation_snapshot(*, viewer: Viewer, conversation: Conversation) -> dict:
    """Where a conversation stands for this viewer; `cursor` is read first, so nothing after it is missed."""
    from channels_app.services import receipt_summary
    cursor = log_head()
    as_of = timezone.now()
    qs = access.receipts_scope(viewer, Receipt.objects.filter(conversation=conversation)
                               .select_related("conversation", "turn"))
    receipts = list(qs.order_by("-id")[:SNAPSHOT_RECEIPTS])
    receipts.reverse()
    return {"object": "ugent.conversation.snapshot", "conversation_id": conversation.external_id,
            "client_id": conversation.client_id, "channel": conversation.channel,
            "as_of": _iso(as_of), "cursor": cursor,
            "receipts": [receipt_summary(r) for r in receipts],
            "question": _question_for_viewer(viewer, conversation),
            "verifications": harness.harness_items(conversation=conversation)}


def _question_for_viewer(viewer: Viewer, conversation: Conversation) -> dict | None:
    """The question waiting for the user it asked; nobody else sees it (the operator acting as itself included)."""
    from channels_app.questions import question_payload, question_waiting_for
    question = question_waiting_for(actor=viewer.actor, conversation=conversation)
    return question_payload(question) if question is not None else None


def session_tail(*, viewer: Viewer, conversation: Conversation, limit: int = PAGE_DEFAULT) -> dict:
    """The newest messages compaction left visible, oldest first."""
    cursor = log_head()
    qs = (Message.objects.filter(conversation=conversation, hidden=False)
          .select_related("turn", "actor").order_by("-id"))
    rows = list(qs[:limit])
    rows.reverse()
    return {"object": "ugent.snapshot", "conversation_id": conversation.external_id,
            "client_id": conversation.client_id, "as_of": _iso(timezone.now()), "cursor": cursor,
            "messages": [message_payload(m) for m in rows],
            "has_older": qs.filter(id__lt=rows[0].id).exists() if rows else False,
            "hidden_count": Conversation.objects.filter(pk=conversation.pk).values_list(
                "hidden_messages", flat=True).first() or 0}


def session_history(*, viewer: Viewer, conversation: Conversation, before: int | None = None,
                    limit: int = PAGE_DEFAULT) -> dict:
    """Messages compaction hid, newest page first, each page oldest first; page on with `next_before`."""
    qs = (Message.objects.filter(conversation=conversation, hidden=True)
          .select_related("turn", "actor").order_by("-id"))
    if before is not None:
        qs = qs.filter(id__lt=before)
    rows = list(qs[:limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    rows.reverse()
    return {"object": "list", "conversation_id": conversation.external_id,
            "data": [message_payload(m) for m in rows], "has_more": more,
            "next_before": rows[0].id if more and rows else None}


# --- stop and steering -------------------------------------------------------

def turn_for_action(*, viewer: Viewer, conversation_id: str, client_id: str = "", channel: str = "web",
                    turn_id: str | None = None, action: str = STOP) -> Turn:
    """The turn a stop or steering names: by its exact turn_id, or the conversation's live turn, as
    channels_app.access allows the action (an exact turn_id is enough to stop a turn, never to steer
    another user's). Anything refused is the 404 of a missing turn or conversation: it reveals nothing."""
    conv = conversation_lookup(conversation_id=conversation_id, client_id=client_id, channel=channel)
    if turn_id:
        turn = (Turn.objects.select_related("actor", "conversation").filter(turn_id=turn_id, conversation=conv)
                .first() if conv else None)
        allowed = turn is not None and (access.turn_stoppable(viewer, turn, by_exact_turn_id=True)
                                        if action == STOP else access.turn_steerable(viewer, turn))
        if not allowed:
            raise ApplicationError(NO_TURN, status=404, code="turn_not_found", param="turn_id")
        return turn
    if conv is None or not access.conversation_readable(viewer, conv):
        raise ApplicationError(NO_CONVERSATION, status=404, code="conversation_not_found", param="conversation_id")
    # through the partial index of live turns (Turn.objects.live()): a bound `state IN` walked every turn
    # the conversation ever ran on SQLite when none was live
    turn = (Turn.objects.live().select_related("actor", "conversation").filter(conversation=conv)
            .order_by("-id").first())
    if turn is None or not access.turn_is_theirs(viewer, turn):
        raise ApplicationError(NO_RUNNING_TURN, status=409, code="no_running_turn", param="conversation_id")
    return turn


def _finished(turn: Turn, what: str) -> ApplicationError:
    return ApplicationError(f"This turn already finished ({turn.state}): {what}", status=409,
                            code="turn_finished", param="turn_id", extra={"turn_id": turn.turn_id,
                                                                           "state": turn.state})


def turn_stop(*, viewer: Viewer, turn: Turn) -> dict:
    """Ask a live turn to stop; the runner stops it within one engine step and keeps what it answered."""
    by = viewer.actor.key
    with transaction.atomic():
        locked = Turn.objects.select_for_update(no_key=True).get(pk=turn.pk)
        if locked.state not in LIVE_TURN_STATES:
            raise _finished(locked, "there is nothing to stop.")
        first = not locked.cancel_requested
        if first:
            Turn.objects.filter(pk=turn.pk, state__in=LIVE_TURN_STATES).update(cancel_requested=True,
                                                                                stop_requested_by=by)
            event_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, type="turn.stop_requested",
                         data={"turn_id": turn.turn_id, "by": by})
    return {"object": "ugent.stop", "conversation_id": turn.conversation.external_id, "turn_id": turn.turn_id,
            "state": "stopping", "already_requested": not first}


def turn_stop_request(*, turn_pk: int, by: str) -> bool:
    """Ask a live turn to stop on behalf of the daemon's own work (a cron task's time limit), with
    no viewer: the same conditional update and event as turn_stop. False if it had already ended
    or been asked to stop."""
    with transaction.atomic():
        turn = Turn.objects.select_for_update(no_key=True).filter(pk=turn_pk).first()
        if turn is None or turn.state not in LIVE_TURN_STATES or turn.cancel_requested:
            return False
        if Turn.objects.filter(pk=turn_pk, state__in=LIVE_TURN_STATES, cancel_requested=False).update(
                cancel_requested=True, stop_requested_by=by) != 1:
            return False
        event_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, type="turn.stop_requested",
                     data={"turn_id": turn.turn_id, "by": by})
    return True


STEERING_KEY_REUSED = ("This client_message_id already steered this conversation with other words: send the new "
                       "words under a new client_message_id.")


def steering_repeat(*, conversation: Conversation, client_message_id: str, message: str) -> Steering | None:
    """The steering a client sent before under this idempotency key in this conversation (its resend after a
    lost answer, whether or not its turn still runs); a 409 if the key carried other words."""
    first = (Steering.objects.select_related("turn")
             .filter(turn__conversation=conversation, client_message_id=client_message_id).first())
    if first is not None and first.text != message:
        raise ApplicationError(STEERING_KEY_REUSED, status=409, code="steering_key_reused",
                               param="client_message_id")
    return first


def turn_steer(*, viewer: Viewer, turn: Turn, message: str, client_message_id: str = "") -> tuple[Steering, bool]:
    """Queue a message for a live turn; the runner hands it to the engine before its next step. Returns the
    steering and whether it is new (False: a keyed copy found the first one).

    Taken under the turn's row lock, as the runner's completion is, so a steering is either
    applied or refused here, never silently lost to a turn that finished meanwhile. Two copies of one
    keyed steering racing here meet on the lock: the second finds the first (steering_repeat)."""
    with transaction.atomic():
        locked = Turn.objects.select_for_update(no_key=True).get(pk=turn.pk)
        if client_message_id:
            first = steering_repeat(conversation=turn.conversation, client_message_id=client_message_id,
                                    message=message)
            if first is not None:
                return first, False
        if locked.state not in LIVE_TURN_STATES:
            raise _finished(locked, "steering reaches only a running turn. Send the message as a new turn.")
        if locked.cancel_requested:
            raise ApplicationError("This turn is stopping: send the message as a new turn.", status=409,
                                   code="turn_stopping", param="turn_id", extra={"turn_id": turn.turn_id})
        return Steering.objects.create(turn=locked, actor=viewer.actor, text=message,
                                       client_message_id=client_message_id), True


# --- retention ---------------------------------------------------------------

def events_prune(*, older_than_seconds: int | None = None) -> int:
    """Delete events older than the retention age; cursors at or below the boundary then get ugent.gap."""
    age = EVENT_RETENTION_SECS if older_than_seconds is None else older_than_seconds
    cutoff = timezone.now() - timezone.timedelta(seconds=age)
    boundary = _log_last_old_id(cutoff)
    if not boundary:
        return 0
    # The mark commits before any delete: a reader may see a gap early, never miss one.
    with transaction.atomic():
        mark, _ = EventLogMark.objects.select_for_update().get_or_create(name=EventLogMark.PRUNED_THROUGH)
        if boundary > mark.value:
            mark.value = boundary
            mark.save(update_fields=["value", "updated_at"])
    deleted = 0
    while True:
        ids = list(Event.objects.filter(id__lte=boundary).order_by("id").values_list("id", flat=True)[:PRUNE_CHUNK])
        if not ids:
            return deleted
        deleted += Event.objects.filter(id__in=ids).delete()[0]


def _log_last_old_id(cutoff) -> int | None:
    """The last event written before `cutoff`. Events are written in id order, so the first young one is
    found walking the log from its oldest end: the walk reads what is to be pruned, not the week the log
    keeps (`MAX(id) WHERE created_at < cutoff` read every retained event's row each hour: there is no
    index on created_at, and one would cost every append). The last old id is then one step back on the
    primary key, a real id: a cursor at it missed nothing."""
    first_young = Event.objects.filter(created_at__gte=cutoff).order_by("id").values_list("id", flat=True).first()
    older = Event.objects if first_young is None else Event.objects.filter(id__lt=first_young)
    return older.order_by("-id").values_list("id", flat=True).first()


def retention_schedule_ensure(*, every_seconds: int | None = None) -> None:
    """Create or update the beat entry that runs the retention job (django-celery-beat)."""
    from django.conf import settings

    from ugent_common.tasks import beat_every
    beat_every(RETENTION_TASK_NAME, "channels_app.tasks.prune_events", every_seconds or EVENT_PRUNE_EVERY_SECS,
               "Deletes events older than UGENT_EVENT_RETENTION_SECS.")
    beat_every("ugent: sweep turns whose worker died", "channels_app.tasks.sweep_stale_turns",
               settings.UGENT_TURN_SWEEP_SECONDS,
               "Ends turns whose lease lapsed (interrupted) or whose queue deadline passed (abandoned), and "
               "dispatches again turns the broker lost.")
