"""The turn runner: composes the agent from its profile's engine, streams the answer as events.

Runs inside the `run_turn` Celery task in both run modes. Deltas are coalesced
into events a few milliseconds apart, so a fast engine does not turn every
token into a database write; the first delta is written at once.
"""
from __future__ import annotations

import functools
import logging
import time

from django.db import connection, transaction
from django.utils import timezone

from channels_app import hooks, rows
from channels_app.events import events_append
from channels_app.models import (Actor, Conversation, Message, Receipt, ReceiptState, Steering, SteeringState,
                                 Turn, TurnState)
from plugins_app.engines.base import (ANSWER, ANSWER_RESET, CITATIONS, ERROR, THINKING, TOOL, EngineError,
                                      stream_items)

log = logging.getLogger("ugent.turns")
COALESCE_SECONDS = 0.015
STOP_CHECK_SECONDS = 0.1
ACCEPTED_REQUEUE_SECONDS = 60


class DeltaWriter:
    """Buffers answer/thinking text and writes it as turn.delta events."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.segment = None
        self.buffer: list[str] = []
        self.last_flush = 0.0

    def add(self, segment: str, text: str) -> None:
        if self.segment not in (None, segment):
            self.flush()
        self.segment = segment
        self.buffer.append(text)
        if time.monotonic() - self.last_flush >= COALESCE_SECONDS:
            self.flush()

    def pending(self) -> list[tuple[str, dict, list]]:
        if not self.buffer:
            return []
        item = ("turn.delta", {"turn_id": self.turn.turn_id, "segment": self.segment,
                               "text": "".join(self.buffer)}, [])
        self.buffer, self.segment = [], None
        return [item]

    def flush(self, extra: list | None = None) -> None:
        items = self.pending() + (extra or [])
        if items:
            events_append(conversation_id=self.turn.conversation_id, turn_pk=self.turn.pk, items=items)
        self.last_flush = time.monotonic()


def build_messages(turn: Turn):
    """The engine's view: the conversation's recent history, injected context, then this turn's text."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
    profile = turn.profile
    limit = profile.history_turns if profile else 20
    m = rows.table(Message)
    past = rows.fetchall(
        f"SELECT {m.col('role')}, {m.col('content')} FROM {m.name} WHERE {m.col('conversation')} = %s "
        f"AND {m.col('hidden')} = %s AND {m.col('role')} IN (%s, %s) AND {m.col('turn')} < %s "
        f"ORDER BY id DESC LIMIT %s",
        [turn.conversation_id, False, Message.Role.USER, Message.Role.ASSISTANT, turn.pk, limit])
    past.reverse()
    messages = [AgentMessage(role=MessageRole(role), content=content) for role, content in past]
    # The summary a compaction left stands for the history it hid.
    summary = rows.fetchone(
        f"SELECT {m.col('content')} FROM {m.name} WHERE {m.col('conversation')} = %s AND {m.col('hidden')} = %s "
        f"AND {m.col('role')} = %s ORDER BY id DESC LIMIT 1", [turn.conversation_id, False, Message.Role.SYSTEM])
    if summary:
        messages.insert(0, AgentMessage(role=MessageRole.SYSTEM, content=summary[0]))
    for block in (turn.context or {}).get("injected_context", []):
        messages.append(AgentMessage(role=MessageRole.SYSTEM, content=block))
    messages.append(AgentMessage(role=MessageRole.USER, content=(turn.context or {}).get("text", "")))
    return messages


_TURN_COLUMNS = ["id", "turn_id", "conversation_id", "actor_id", "receipt_id", "state", "model", "profile_id",
                 "allowed_tools", "denied_tools", "disable_memory_recall", "disable_code_context",
                 "disable_memory_write", "input_mode", "include_thinking", "citation_ids", "context",
                 "cancel_requested", "started_at"]
_CONVERSATION_COLUMNS = ["id", "channel", "client_id", "external_id", "owner_id"]
_ACTOR_COLUMNS = ["id", "key", "channel", "user_id"]


def _pending_steering_sql(turn_column: str) -> str:
    s = rows.table(Steering)
    return (f"EXISTS (SELECT 1 FROM {s.name} WHERE {s.col('state')} = %s AND "
            f"{s.col('turn')} = {turn_column})")


@functools.cache
def _stop_check_sql() -> str:
    t = rows.table(Turn)
    return f"SELECT {t.col('cancel_requested')}, {_pending_steering_sql('t.id')} FROM {t.name} t WHERE t.id = %s"


@functools.cache
def _fetch_parts():
    from plugins_app.models import AgentProfile
    p = rows.table(AgentProfile)
    return ((rows.table(Turn), _TURN_COLUMNS), (rows.table(Conversation), _CONVERSATION_COLUMNS),
            (rows.table(Actor), _ACTOR_COLUMNS), (p, p.attnames))


@functools.cache
def _fetch_sql() -> str:
    (t, _), (c, _), (a, _), (p, _) = parts = _fetch_parts()
    columns = ", ".join(table.select_list(names, alias) for (table, names), alias in zip(parts, "tcap"))
    return (f"SELECT {columns}, {_pending_steering_sql('t.id')} "
            f"FROM {t.name} t JOIN {c.name} c ON c.id = t.{t.col('conversation')} "
            f"JOIN {a.name} a ON a.id = t.{t.col('actor')} "
            f"LEFT JOIN {p.name} p ON p.id = t.{t.col('profile')} WHERE t.id = %s")


def turn_fetch(turn_pk: int) -> Turn:
    """The turn with its conversation, actor and profile, and whether steering waits: one statement."""
    row = rows.fetchone(_fetch_sql(), [SteeringState.PENDING, turn_pk])
    if row is None:
        raise Turn.DoesNotExist(turn_pk)
    objects, i = [], 0
    for table, names in _fetch_parts():
        values = row[i:i + len(names)]
        objects.append(table.from_row(names, values) if values[0] is not None else None)  # no profile: None
        i += len(names)
    turn, turn.conversation, turn.actor, turn.profile = objects[0], objects[1], objects[2], objects[3]
    turn.pending_steering = bool(row[i])
    return turn


def turn_run(turn_pk: int) -> None:
    """Run one accepted turn to its end. A redelivered task finds the turn moved on and does nothing.

    Between engine steps the runner looks (every STOP_CHECK_SECONDS) for a stop and for steering:
    a stop ends the turn keeping what it answered; steering cuts the engine's step short and runs
    it again with the answer so far and the steered message(s) appended as the newest user turn.
    """
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
    now = timezone.now()
    with transaction.atomic():  # the claim, the read and the receipt's "running": one commit
        if rows.table(Turn).update({"id": turn_pk, "state": TurnState.ACCEPTED},
                                   state=TurnState.RUNNING, started_at=now) != 1:
            return  # a redelivered task: the turn has moved on
        turn = turn_fetch(turn_pk)
        rows.table(Receipt).update({"id": turn.receipt_id}, state=ReceiptState.RUNNING, started_at=now)
    writer = DeltaWriter(turn)
    answer: list[str] = []
    segment: list[str] = []  # the answer since the last steering, handed back to the engine with it
    thinking: list[str] = []
    citations: list[str] = []
    # What the claim read stands for the first check: a stop or steering sent before the turn
    # started is seen at once, and the next look at the database is one interval away.
    last_check = [time.monotonic()]
    cancelled = [turn.cancel_requested]
    steered = [False]
    steering_waits = turn.pending_steering

    def should_stop() -> bool:
        if cancelled[0] or steered[0]:
            return True
        if time.monotonic() - last_check[0] >= STOP_CHECK_SECONDS:
            last_check[0] = time.monotonic()
            row = rows.fetchone(_stop_check_sql(), [SteeringState.PENDING, turn.pk])
            cancelled[0], steered[0] = bool(row and row[0]), bool(row and row[1])
        return cancelled[0] or steered[0]

    try:
        if turn.profile is None:
            raise EngineError("The turn has no agent profile.", code="no_profile")
        from plugins_app.engines.registry import engine_for_profile
        try:
            engine = engine_for_profile(turn.profile)
        except LookupError as exc:
            raise EngineError(str(exc), code="engine_not_installed")
        messages = build_messages(turn)
        while True:
            steered[0] = False
            if should_stop() and cancelled[0]:
                break
            taken = steerings_take(turn=turn, writer=writer) if steering_waits else []
            steering_waits = True  # after the first step, only a steering brings us back here
            if taken:
                if "".join(segment):
                    messages.append(AgentMessage(role=MessageRole.ASSISTANT, content="".join(segment)))
                messages.extend(AgentMessage(role=MessageRole.USER, content=s.text) for s in taken)
                segment.clear()
            steered[0] = False
            for item in stream_items(engine, list(messages), session_id=turn.conversation.external_id,
                                     tools=None, should_stop=should_stop):
                if item.kind == ANSWER:
                    answer.append(item.text)
                    segment.append(item.text)
                    writer.add(ANSWER, item.text)
                elif item.kind == THINKING:
                    thinking.append(item.text)
                    if turn.include_thinking:
                        writer.add(THINKING, item.text)
                elif item.kind == ANSWER_RESET:
                    answer.clear()
                    segment.clear()
                    writer.flush([("turn.delta", {"turn_id": turn.turn_id, "segment": ANSWER_RESET, "text": ""},
                                   [])])
                elif item.kind == TOOL:
                    writer.flush([("turn.delta", {"turn_id": turn.turn_id, "segment": TOOL, "text": item.text,
                                                  "tool": item.data or {}}, [])])
                elif item.kind == CITATIONS:
                    citations.extend(i for i in (item.data or {}).get("ids", []) if i not in citations)
                elif item.kind == ERROR:
                    raise EngineError(item.text or "The engine reported an error.")
                if should_stop():
                    break
            if cancelled[0]:
                break
            if steered[0]:
                continue
            if turn_complete(turn=turn, writer=writer, answer="".join(answer), citations=citations):
                return
            # steering committed between the engine's last step and completion: run it
    except EngineError as exc:
        turn_fail(turn=turn, writer=writer, answer="".join(answer), reason=exc.message, code=exc.code)
        return
    except Exception as exc:  # a plugin bug fails its turn, never the worker
        log.exception("turn failed (turn=%s)", turn.turn_id)
        turn_fail(turn=turn, writer=writer, answer="".join(answer),
                  reason=f"The agent failed: {type(exc).__name__}: {exc}", code="engine_crashed")
        return
    turn_cancel_finish(turn=turn, writer=writer, answer="".join(answer))


def steerings_take(*, turn: Turn, writer: DeltaWriter) -> list[Steering]:
    """Apply the turn's pending steering: each becomes a user message of the turn and a turn.steered event."""
    with transaction.atomic():
        taken = list(Steering.objects.select_for_update().filter(turn_id=turn.pk, state=SteeringState.PENDING)
                     .select_related("actor").order_by("id"))
        if not taken:
            return []
        now = timezone.now()
        Steering.objects.filter(pk__in=[r.pk for r in taken]).update(state=SteeringState.APPLIED, applied_at=now)
        for r in taken:
            Message.objects.create(conversation_id=turn.conversation_id, role=Message.Role.USER, content=r.text,
                                   actor=r.actor, turn=turn)
        writer.flush([("turn.steered", {"turn_id": turn.turn_id, "steering_id": r.pk, "message": r.text,
                                        "actor": r.actor.key}, []) for r in taken])
    return taken


def _steerings_drop(turn: Turn) -> list:
    """A turn that ends otherwise than completed drops its pending steering, and says so."""
    ids = list(Steering.objects.filter(turn_id=turn.pk, state=SteeringState.PENDING).values_list("pk", flat=True))
    if not ids:
        return []
    Steering.objects.filter(pk__in=ids).update(state=SteeringState.DROPPED)
    return [("turn.steering_dropped", {"turn_id": turn.turn_id, "steering_ids": ids}, [])]


def _requested_citations(turn: Turn, answer: str) -> list[str]:
    return [cid for cid in (turn.citation_ids or []) if cid and cid in answer]


def _end(turn: Turn, state: str, **fields) -> bool:
    """Move a running turn to its end state; False when it has already ended (only one end wins)."""
    return rows.table(Turn).update({"id": turn.pk, "state": TurnState.RUNNING}, state=state, **fields) == 1


def _lock_turn(turn: Turn) -> None:
    """Hold the turn's row (FOR NO KEY UPDATE, see channels_app.events) until the transaction ends.
    SQLite's transactions here begin IMMEDIATE: the write lock is already held."""
    if connection.vendor == "postgresql":
        t = rows.table(Turn)
        rows.fetchone(f"SELECT id FROM {t.name} WHERE id = %s FOR NO KEY UPDATE", [turn.pk])


def _steering_pending(turn: Turn) -> bool:
    s = rows.table(Steering)
    return rows.fetchone(f"SELECT 1 FROM {s.name} WHERE {s.col('turn')} = %s AND {s.col('state')} = %s LIMIT 1",
                         [turn.pk, SteeringState.PENDING]) is not None


def _answer_message(turn: Turn, answer: str) -> None:
    rows.table(Message).insert(conversation_id=turn.conversation_id, role=Message.Role.ASSISTANT, content=answer,
                               turn_id=turn.pk)


def turn_complete(*, turn: Turn, writer: DeltaWriter, answer: str, citations: list[str]) -> bool:
    """Complete the turn; False (and nothing written) when steering waits, which the runner then runs.

    The turn's row lock orders this against streams.turn_steer: a steering is applied or refused."""
    citations = citations + [c for c in _requested_citations(turn, answer) if c not in citations]
    now = timezone.now()
    with transaction.atomic():
        _lock_turn(turn)
        if _steering_pending(turn):
            return False
        if not _end(turn, TurnState.COMPLETED, finished_at=now):
            return True  # already ended elsewhere (swept as interrupted): write nothing over it
        _answer_message(turn, answer)
        rows.table(Receipt).update({"id": turn.receipt_id}, state=ReceiptState.COMPLETED, answer=answer,
                                   citations=citations, finished_at=now)
        extra = []
        if citations:
            extra.append(("ugent.citations", {"turn_id": turn.turn_id, "citations": citations}, []))
        hooks.run_after_turn(turn=turn, state="completed", answer=answer)
        extra.append(("turn.completed", {"turn_id": turn.turn_id, "state": "completed", "answer": answer,
                                         "citations": citations}, [turn.actor.key]))
        writer.flush(extra)
    return True


def turn_fail(*, turn: Turn, writer: DeltaWriter, answer: str, reason: str, code: str) -> None:
    now = timezone.now()
    with transaction.atomic():
        if not _end(turn, TurnState.FAILED, error=reason, finished_at=now):
            return
        if answer:
            _answer_message(turn, answer)
        rows.table(Receipt).update({"id": turn.receipt_id}, state=ReceiptState.FAILED, answer=answer,
                                   reason=reason, finished_at=now)
        hooks.run_after_turn(turn=turn, state="failed", answer=answer)
        writer.flush(_steerings_drop(turn) + [
            ("turn.failed", {"turn_id": turn.turn_id, "state": "failed", "reason": reason, "code": code,
                             "answer": answer}, [turn.actor.key])])


def turn_cancel_finish(*, turn: Turn, writer: DeltaWriter, answer: str) -> None:
    """A stopped turn keeps what it already answered, marked as cut short."""
    now = timezone.now()
    with transaction.atomic():
        if not _end(turn, TurnState.CANCELLED, finished_at=now):
            return
        if answer:
            _answer_message(turn, answer)
        rows.table(Receipt).update({"id": turn.receipt_id}, state=ReceiptState.CANCELLED, answer=answer,
                                   reason="stopped", finished_at=now)
        hooks.run_after_turn(turn=turn, state="cancelled", answer=answer)
        writer.flush(_steerings_drop(turn) + [
            ("turn.cancelled", {"turn_id": turn.turn_id, "state": "cancelled", "answer": answer, "partial": True},
             [turn.actor.key])])


def turns_recover_interrupted(*, started_before=None) -> int:
    """Turns a crashed process left running become interrupted (receipt too), with an event.

    At start-up of the embedded daemon every running turn is such a turn; in servers mode the
    beat sweep passes `started_before`, past which no live worker can still hold a turn.
    """
    reason = "the process running it stopped"
    qs = Turn.objects.filter(state=TurnState.RUNNING).select_related("actor")
    if started_before is not None:
        qs = qs.filter(started_at__lt=started_before)
    count = 0
    for turn in qs:
        now = timezone.now()
        with transaction.atomic():
            if not _end(turn, TurnState.INTERRUPTED, finished_at=now, error=reason):
                continue
            Receipt.objects.filter(pk=turn.receipt_id).update(state=ReceiptState.INTERRUPTED, finished_at=now,
                                                              reason=reason)
            hooks.run_after_turn(turn=turn, state="interrupted", answer="")
            events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, items=[
                ("turn.failed", {"turn_id": turn.turn_id, "state": "interrupted", "reason": reason,
                                 "code": "interrupted"}, [turn.actor.key])])
        count += 1
    return count


def turns_sweep_stale() -> int:
    """Beat: a turn running longer than its hard time limit (plus a grace) has lost its worker."""
    from datetime import timedelta

    from django.conf import settings
    cutoff = timezone.now() - timedelta(seconds=settings.CELERY_TASK_TIME_LIMIT + 60)
    ended = turns_recover_interrupted(started_before=cutoff)
    # An accepted turn whose task never reached a worker (the broker failed after the commit) is
    # queued again; the claim in turn_run keeps a task that was only slow from running it twice.
    from channels_app.tasks import turn_dispatch
    stale = timezone.now() - timedelta(seconds=ACCEPTED_REQUEUE_SECONDS)
    for pk in Turn.objects.filter(state=TurnState.ACCEPTED, created_at__lt=stale).values_list("pk", flat=True):
        turn_dispatch(pk)
    return ended


def turns_requeue_accepted() -> int:
    """At start-up: accepted turns whose task was lost with an in-process broker run now."""
    from channels_app.tasks import turn_dispatch
    pks = list(Turn.objects.filter(state=TurnState.ACCEPTED).values_list("pk", flat=True))
    for pk in pks:
        turn_dispatch(pk)
    return len(pks)
