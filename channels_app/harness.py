"""The harness: a conversation's goals and tasks, and the checks that verify them (/harness).

An item is a goal or a task with its text, its state (open, done, dropped) and a check:

- `phrase:TEXT`: the conversation's latest answer contains TEXT (case-insensitive);
- `file:PATH`: PATH exists inside the conversation's working directory (channels_app.sandbox), with
  no `..` and no symbolic link out.

A check runs when `/harness verify` asks, and after every completed turn of the conversation (the
after-turn hook `harness_after_turn`, inside the transaction that records the turn's end), so a
verification is committed with the answer it read. No check runs a command: a remote channel could
otherwise run programs on the host.
"""
from __future__ import annotations

import os
from pathlib import Path

from django.db import transaction

from channels_app import sandbox, statements
from channels_app.errors import ApplicationError
from channels_app.models import (Actor, Conversation, HarnessItem, HarnessKind, HarnessState,
                                 HarnessVerification, Message, Turn)
from ugent_common.digits import ascii_int

CHECK_KINDS = ("phrase", "file")
BAD_CHECK = "A check is phrase:TEXT (the latest answer contains TEXT) or file:PATH (PATH exists in the working directory)."
NO_ITEM = "No goal or task #{id} in this conversation."
EMPTY_TEXT = "Say what the {kind} is: /harness {kind} TEXT."
ITEMS_MAX = 200


def check_parse(spec: str) -> tuple[str, str]:
    """(kind, argument) of a check, or a 400 with BAD_CHECK."""
    kind, sep, arg = spec.strip().partition(":")
    kind, arg = kind.strip().lower(), arg.strip()
    if not sep or kind not in CHECK_KINDS or not arg:
        raise ApplicationError(BAD_CHECK, status=400, code="invalid_check", param="command")
    return kind, arg


def _latest_answer(conversation: Conversation) -> str:
    row = (Message.objects.filter(conversation=conversation, role=Message.Role.ASSISTANT)
           .order_by("-id").values_list("content", flat=True).first())
    return row or ""


def check_run(item: HarnessItem, *, answer: str | None = None) -> tuple[bool, str]:
    """Run an item's check: (passed, what it found)."""
    kind, arg = check_parse(item.check_spec)
    if kind == "phrase":
        text = _latest_answer(item.conversation) if answer is None else answer
        found = arg.lower() in text.lower()
        return found, (f"the latest answer contains {arg!r}" if found
                       else f"the latest answer does not contain {arg!r}")
    base = sandbox.directory_path(item.conversation).resolve()
    root = sandbox.workspace_root(item.conversation)
    if ".." in Path(arg).parts or os.path.isabs(arg):
        return False, f"{arg} is not a path inside the working directory"
    target = (base / arg).resolve()
    if target != root and root not in target.parents:
        return False, f"{arg} leads outside the workspace"
    return (True, f"{arg} exists") if target.exists() else (False, f"{arg} does not exist")


def verification_record(item: HarnessItem, *, turn: Turn | None = None, answer: str | None = None) -> HarnessVerification:
    passed, detail = check_run(item, answer=answer)
    return HarnessVerification.objects.create(item=item, turn=turn, check_spec=item.check_spec, passed=passed,
                                              detail=detail)


def verification_payload(v: HarnessVerification | None) -> dict | None:
    if v is None:
        return None
    return {"id": v.pk, "check": v.check_spec, "passed": v.passed, "detail": v.detail,
            "turn_id": v.turn.turn_id if v.turn_id else None,
            "verified_at": v.created_at.isoformat().replace("+00:00", "Z") if v.created_at else None}


def item_payload(item: HarnessItem, latest: HarnessVerification | None) -> dict:
    return {"id": item.pk, "kind": item.kind, "text": item.text, "state": item.state,
            "check": item.check_spec or None, "verification": verification_payload(latest)}


def harness_items(*, conversation: Conversation) -> list[dict]:
    """The conversation's goals and tasks in order, each with its latest committed verification."""
    items = list(HarnessItem.objects.filter(conversation=conversation).order_by("id")[:ITEMS_MAX])
    latest: dict[int, HarnessVerification] = {}
    for v in (HarnessVerification.objects.filter(item__in=items).select_related("turn").order_by("id")):
        latest[v.item_id] = v  # ascending: the last one wins
    return [item_payload(i, latest.get(i.pk)) for i in items]


def item_add(*, conversation: Conversation, actor: Actor, kind: str, text: str) -> HarnessItem:
    if kind not in HarnessKind.values:
        raise ApplicationError(BAD_CHECK, status=400, code="invalid_request", param="command")
    if not text.strip():
        raise ApplicationError(EMPTY_TEXT.format(kind=kind), status=400, code="invalid_request", param="command")
    return HarnessItem.objects.create(conversation=conversation, kind=kind, text=text.strip(), created_by=actor)


def item_get(*, conversation: Conversation, raw_id: str) -> HarnessItem:
    number = ascii_int(raw_id.strip().lstrip("#"), max_digits=17)
    item = (HarnessItem.objects.filter(conversation=conversation, pk=number).select_related("conversation").first()
            if number is not None else None)
    if item is None:
        raise ApplicationError(NO_ITEM.format(id=raw_id.strip()), status=404, code="harness_item_not_found",
                               param="command")
    return item


def item_check_set(*, item: HarnessItem, spec: str) -> HarnessItem:
    check_parse(spec)
    item.check_spec = spec.strip()
    item.save(update_fields=["check_spec", "updated_at"])
    return item


def item_state_set(*, item: HarnessItem, state: str) -> bool:
    """Move an item to `state`; False when it already was there (nothing written)."""
    moved = HarnessItem.objects.filter(pk=item.pk).exclude(state=state).update(state=state)
    item.state = state
    return moved == 1


@transaction.atomic
def items_verify(*, conversation: Conversation, item: HarnessItem | None = None) -> list[HarnessVerification]:
    """Run the check of one item, or of every open item that has one."""
    items = [item] if item is not None else list(
        HarnessItem.objects.filter(conversation=conversation, state=HarnessState.OPEN).exclude(check_spec="")
        .select_related("conversation").order_by("id"))
    return [verification_record(i) for i in items if i.check_spec]


def harness_after_turn(*, turn, state: str, answer: str, probed: bool | None = None) -> None:
    """After a completed turn: verify the conversation's open items against its answer, in the same
    transaction as the turn's end, so the verification commits with the answer it read. `probed`: what
    `harness_probe`'s statement found, sent with the end's first round trip (None: not sent)."""
    if state != "completed":
        return
    if not (statements.harness_open_exists(turn.conversation_id) if probed is None else probed):
        return  # most conversations have no harness: one indexed probe, not an ORM query, per turn
    items = list(HarnessItem.objects.filter(conversation_id=turn.conversation_id, state=HarnessState.OPEN)
                 .exclude(check_spec="").select_related("conversation").order_by("id"))
    for item in items:
        try:
            verification_record(item, turn=turn, answer=answer)
        except ApplicationError:  # a check stored before its shape was checked: skip it, never break the end
            continue


def harness_probe(*, turn, state: str):
    """The statement harness_after_turn needs first, for the end's first round trip (hooks.after_turn_probes)."""
    return statements.harness_open_step(turn.conversation_id) if state == "completed" else None
