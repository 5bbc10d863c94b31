"""Re-derive a conversation's turn states and receipts from its rows (POST /v1/ugent/conversations/repair).

The turn's end is one transaction (channels_app.runner.turn_end), so these mismatches come from
outside it: a database restored from a copy, rows edited by hand, a crash inside a migration. Each
fix moves a row with a conditional update from the state it was found in, so the repair is
idempotent (a second run finds nothing) and never answers twice: a turn whose terminal event is
already in the log is moved to the state that event says, writing no second event and no second
answer; only a live turn with no terminal event is ended, through runner.turn_end, once.

| found | fixed to |
|---|---|
| a live turn whose terminal event is in the log | the event's state (turn and receipt), nothing written to the log |
| a running turn whose lease lapsed | interrupted, keeping what it streamed (turn_end) |
| an accepted turn past its queue deadline | abandoned (turn_end) |
| a receipt whose state differs from its ended turn's | the turn's state, answer and reason |
| a live receipt with no turn | abandoned (never started) or interrupted (started) |
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from channels_app.models import (FINAL_STATES, Conversation, Event, Message, Receipt,
                                 ReceiptState, Turn, TurnState)
from channels_app.runner import END_STATES, QUEUE_TIMEOUT_REASON, EndOutcome, turn_end

TERMINAL_EVENTS = {"turn.completed": TurnState.COMPLETED, "turn.failed": TurnState.FAILED,
                   "turn.cancelled": TurnState.CANCELLED}
TURN_MISSING = "Its turn is missing: send it as a new message."


def _fix(kind: str, *, turn: Turn | None = None, receipt: Receipt | None = None, was: str, now: str) -> dict:
    return {"kind": kind, "turn_id": turn.turn_id if turn else None,
            "client_message_id": receipt.client_message_id if receipt else (
                turn.receipt.client_message_id if turn else None),
            "from": was, "to": now}


def _terminal_event(turn: Turn):
    return (Event.objects.filter(turn_id=turn.pk, type__in=list(TERMINAL_EVENTS)).order_by("id")
            .values("type", "data", "created_at").first())


def _live_turns_with_an_end(conversation: Conversation) -> list[dict]:
    fixed = []
    live = Turn.objects.live().filter(conversation=conversation).select_related("receipt")
    for turn in live:
        event = _terminal_event(turn)
        if event is None:
            continue
        state = (event["data"] or {}).get("state")
        if state not in END_STATES:  # an event that names no state: its type says which end it was
            state = TERMINAL_EVENTS[event["type"]]
        ended = event["created_at"] or timezone.now()
        with transaction.atomic():
            if Turn.objects.filter(pk=turn.pk, state=turn.state).update(
                    state=state, finished_at=ended, lease_expires_at=None, updated_at=timezone.now()) != 1:
                continue
            answer = (event["data"] or {}).get("answer") or ""
            Receipt.objects.filter(pk=turn.receipt_id).exclude(state__in=FINAL_STATES).update(
                state=state, answer=answer, reason=(event["data"] or {}).get("reason") or "", finished_at=ended,
                updated_at=timezone.now())
        fixed.append(_fix("turn_ended_in_log", turn=turn, was=turn.state, now=state))
    return fixed


def _lapsed_and_expired(conversation: Conversation) -> list[dict]:
    now = timezone.now()
    fixed = []
    lapsed = Q(lease_expires_at__lt=now) | Q(
        lease_expires_at__isnull=True,
        started_at__lt=now - timedelta(seconds=settings.UGENT_TURN_LEASE_SECONDS))
    for turn in (Turn.objects.live().filter(lapsed, conversation=conversation, state=TurnState.RUNNING)
                 .select_related("actor", "receipt")):
        if turn_end(turn=turn, state=TurnState.INTERRUPTED, answer_streamed=True, where=lapsed) is EndOutcome.ENDED:
            fixed.append(_fix("lease_lapsed", turn=turn, was=TurnState.RUNNING, now=TurnState.INTERRUPTED))
    cutoff = now - timedelta(seconds=settings.UGENT_TURN_QUEUE_TIMEOUT)
    for turn in (Turn.objects.live().filter(conversation=conversation, state=TurnState.ACCEPTED,
                                            created_at__lt=cutoff)
                 .select_related("actor", "receipt")):
        if turn_end(turn=turn, state=TurnState.ABANDONED, reason=QUEUE_TIMEOUT_REASON,
                    from_state=TurnState.ACCEPTED) is EndOutcome.ENDED:
            fixed.append(_fix("queue_deadline_passed", turn=turn, was=TurnState.ACCEPTED, now=TurnState.ABANDONED))
    return fixed


def _receipts_behind_their_turn(conversation: Conversation) -> list[dict]:
    fixed = []
    qs = (Receipt.objects.filter(conversation=conversation, turn__state__in=list(FINAL_STATES))
          .exclude(state=F("turn__state")).select_related("turn"))
    for receipt in qs:
        turn = receipt.turn
        answer = (Message.objects.filter(turn_id=turn.pk, role=Message.Role.ASSISTANT).order_by("-id")
                  .values_list("content", flat=True).first()) or ""
        moved = Receipt.objects.filter(pk=receipt.pk, state=receipt.state).update(
            state=turn.state, answer=answer, reason=turn.error or END_STATES[turn.state].reason,
            finished_at=receipt.finished_at or turn.finished_at or timezone.now(),
            started_at=receipt.started_at or turn.started_at, updated_at=timezone.now())
        if moved == 1:
            fixed.append(_fix("receipt_behind_turn", turn=turn, receipt=receipt, was=receipt.state, now=turn.state))
    return fixed


def _receipts_without_turn(conversation: Conversation) -> list[dict]:
    fixed = []
    for receipt in Receipt.objects.filter(conversation=conversation, turn__isnull=True).exclude(
            state__in=FINAL_STATES):
        state = ReceiptState.INTERRUPTED if receipt.started_at else ReceiptState.ABANDONED
        moved = Receipt.objects.filter(pk=receipt.pk, state=receipt.state).update(
            state=state, reason=TURN_MISSING, finished_at=timezone.now(), updated_at=timezone.now())
        if moved == 1:
            fixed.append(_fix("receipt_without_turn", receipt=receipt, was=receipt.state, now=state))
    return fixed


def conversation_repair(*, conversation: Conversation) -> dict:
    """Re-derive the conversation's turn states and receipts from its rows; what was fixed (docstring above)."""
    fixed = (_live_turns_with_an_end(conversation) + _lapsed_and_expired(conversation)
             + _receipts_behind_their_turn(conversation) + _receipts_without_turn(conversation))
    return {"object": "ugent.repair", "conversation_id": conversation.external_id,
            "client_id": conversation.client_id, "channel": conversation.channel,
            "fixed": fixed, "fixed_count": len(fixed)}
