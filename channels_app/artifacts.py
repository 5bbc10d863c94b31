"""A turn's artifacts: the files its tools return, stored as files of the conversation (/v1/files).

A tool result may carry `artifacts: [...]`, each one of:

- `{name, content_base64, mime?}`: the bytes themselves;
- `{name, path}`: a file in the conversation's working directory (inside the workspace: no `..`, no
  symbolic link out), which the hub copies;
- `{name, pending: true, artifact_id?}`: a file still on its way, finished later by `artifact_finish`;
- `{name, url}`: a link the tool made elsewhere, passed on as it is (it is no /v1/files link);
- `{id}` (or `file_id`): a file of this conversation already stored (a delegated task's artifact).

An MCP tool's image, audio and embedded-resource blocks (ovos-tool-adapters keeps them in `raw`) are
artifacts too, named `image-N.png`, or by the resource's URI.

Each storable artifact is announced while the turn runs: `ugent.artifacts_pending` when the tool
returns it, then, once its bytes are stored as a `File` of the conversation (owner: the turn's user,
kept UGENT_PLUGIN_MEDIA_TTL_SECS), `ugent.artifacts` with its `id` and `url` (/v1/files/<id>, which opens
for the conversation's owner and the operator only). The turn's `artifacts` and the receipt's `files`
list them as they stand at the end; an artifact finished after its turn ended updates both and is
announced on the conversation's event log (the chat stream has ended by then: read the receipt). The
engine is shown each artifact without its bytes.
"""
from __future__ import annotations

import base64
import datetime as dt
import binascii
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from channels_app import file_parts, sandbox, statements
from channels_app.errors import ApplicationError
from channels_app.events import events_append
from channels_app.models import Conversation, Event, File, Receipt, Turn, TurnState
from ugent_common.digits import ascii_int

log = logging.getLogger("ugent.files")

#: Artifacts one tool result may carry; the rest are left out (logged).
MAX_PER_RESULT = 20
LIVE_STATES = (TurnState.ACCEPTED, TurnState.RUNNING)


class ArtifactError(Exception):
    """An artifact whose bytes cannot be had: the reason is logged and shown on its entry."""


def _events_of(turn_pk: int, event_type: str) -> list[dict]:
    # Off the hot path (only where an artifact is pending): the ORM, not a pinned statement.
    return list(Event.objects.filter(turn_id=turn_pk, type=event_type).order_by("id").values_list("data", flat=True))


def _new_id() -> str:
    return f"art-{uuid.uuid4().hex[:16]}"


def entry_of(f: File, *, artifact_id: str, name: str = "") -> dict:
    """A stored artifact as events, the receipt and the engine see it."""
    return {"artifact_id": artifact_id, "id": f.file_id, "name": name or f.filename, "mime": f.mime,
            "bytes": f.size, "url": f"/v1/files/{f.file_id}", "expires_at": int(f.expires_at.timestamp())}


def _path_bytes(conversation: Conversation, raw: str) -> bytes:
    """The bytes of a file the tool named in the conversation's working directory, confined as the
    workspace toolboxes are."""
    if "\x00" in raw or ".." in Path(raw).parts or os.path.isabs(raw):
        raise ArtifactError(f"{raw} is not a path inside the working directory")
    root = sandbox.workspace_root(conversation)
    target = (sandbox.directory_path(conversation) / raw).resolve()
    if target != root and root not in target.parents:
        raise ArtifactError(f"{raw} leads outside the workspace")
    if not target.is_file():
        raise ArtifactError(f"{raw} is not a file")
    if target.stat().st_size > settings.UGENT_FILES_MAX_BYTES:
        raise ArtifactError(f"{raw} is larger than UGENT_FILES_MAX_BYTES")
    return target.read_bytes()


def _b64_bytes(text: str) -> bytes:
    if len(text) > settings.UGENT_FILES_MAX_BYTES * 4 // 3 + 8:
        raise ArtifactError("the content is larger than UGENT_FILES_MAX_BYTES")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ArtifactError("content_base64 is not base64")


def _store(turn: Turn, *, name: str, content: bytes, artifact_id: str) -> dict:
    try:
        f = file_parts.file_from_bytes(conversation=turn.conversation, actor=turn.actor, caller=turn.caller,
                                  filename=name, content=content)
    except ApplicationError as exc:
        raise ArtifactError(exc.message)
    return entry_of(f, artifact_id=artifact_id, name=name)


def _failed(artifact_id: str, name: str, reason: str) -> dict:
    log.warning("artifact not stored (name=%s, reason=%s)", name, reason)
    return {"artifact_id": artifact_id, "name": name, "error": reason}


def artifacts_take(*, turn: Turn, result: Any, emit: Callable[[list], None]) -> tuple[Any, list]:
    """A tool result's artifacts, stored and announced (the module's rules): the result as the engine
    is shown it (each artifact its entry, no bytes) and the entries the turn lists."""
    if not isinstance(result, dict):
        return result, []
    result, from_mcp = _mcp_blocks_taken(result)
    if not from_mcp and not isinstance(result.get("artifacts"), list):
        return result, []
    raw = [a for a in (result.get("artifacts") or []) if isinstance(a, dict)] + from_mcp
    if len(raw) > MAX_PER_RESULT:
        log.warning("a tool returned %s artifacts; the first %s are kept", len(raw), MAX_PER_RESULT)
        raw = raw[:MAX_PER_RESULT]
    entries: list[dict] = []
    to_store: list[tuple[int, bytes]] = []
    passed_on: set[int] = set()  # entries a delegated task's call already announced
    for a in raw:
        known = str(a.get("id") or a.get("file_id") or "")
        if known:  # already stored (a delegated task's): only a file of this conversation is taken
            f = File.objects.filter(file_id=known, conversation_id=turn.conversation_id).first()
            if f is not None:
                passed_on.add(len(entries))
                entries.append(entry_of(f, artifact_id=str(a.get("artifact_id") or _new_id()),
                                        name=str(a.get("name") or "")))
                continue
        name = str(a.get("name") or "")[:255]
        if not name:
            continue
        if a.get("error") and a.get("artifact_id"):  # a delegated task's refusal, already announced
            passed_on.add(len(entries))
            entries.append({"artifact_id": str(a["artifact_id"])[:100], "name": name, "error": str(a["error"])})
            continue
        artifact_id = str(a.get("artifact_id") or "")[:100] or _new_id()
        mime = str(a.get("mime") or "application/octet-stream")[:100]
        try:
            if a.get("content_base64"):
                content = _b64_bytes(str(a["content_base64"]))
            elif a.get("path"):
                content = _path_bytes(turn.conversation, str(a["path"]))
            elif a.get("pending"):
                entries.append({"artifact_id": artifact_id, "name": name, "mime": mime, "pending": True})
                continue
            elif a.get("url"):
                entries.append({"artifact_id": artifact_id, "name": name, "mime": mime, "url": str(a["url"]),
                                "bytes": ascii_int(str(a.get("bytes") or "0")) or 0})
                continue
            else:
                raise ArtifactError("it carries no content_base64, path, url or pending")
        except ArtifactError as exc:
            entries.append(_failed(artifact_id, name, str(exc)))
            continue
        to_store.append((len(entries), content))
        entries.append({"artifact_id": artifact_id, "name": name, "mime": mime, "bytes": len(content),
                        "pending": True})
    announced = [e for e in entries if e.get("pending")]
    if announced:
        emit([("ugent.artifacts_pending", {"turn_id": turn.turn_id, "artifacts": announced}, [])])
    for at, content in to_store:
        pending = entries[at]
        try:
            entries[at] = _store(turn, name=pending["name"], content=content, artifact_id=pending["artifact_id"])
        except ArtifactError as exc:
            entries[at] = _failed(pending["artifact_id"], pending["name"], str(exc))
    ready = [e for i, e in enumerate(entries) if not e.get("pending") and i not in passed_on]
    if ready:
        emit([("ugent.artifacts", {"turn_id": turn.turn_id, "artifacts": ready}, [])])
    shown = {**result, "artifacts": entries}
    return shown, entries


_MCP_EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
                   "audio/wav": ".wav", "audio/mpeg": ".mp3", "audio/ogg": ".ogg", "application/pdf": ".pdf"}


def _mcp_blocks_taken(result: dict) -> tuple[dict, list]:
    """An MCP tool's result (ovos-tool-adapters' output: content, is_error, raw blocks): its image,
    audio and embedded-resource blocks as artifacts, and the result with those blocks' bytes left out."""
    blocks = result.get("raw")
    if "is_error" not in result or not isinstance(blocks, list):
        return result, []
    found, kept = [], []
    for n, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "audio") and block.get("data"):
            mime = str(block.get("mimeType") or "application/octet-stream")
            name = f"{kind}-{n + 1}{_MCP_EXTENSIONS.get(mime, '')}"
        elif kind == "resource" and isinstance(block.get("resource"), dict) and (
                block["resource"].get("blob") or block["resource"].get("text")):
            res = block["resource"]
            mime = str(res.get("mimeType") or "application/octet-stream")
            name = str(res.get("uri") or "").rstrip("/").rsplit("/", 1)[-1] or f"resource-{n + 1}"
            data = res.get("blob") or base64.b64encode(str(res["text"]).encode()).decode()
            block = {"type": kind, "data": data}
        else:
            kept.append(block)
            continue
        artifact_id = _new_id()
        found.append({"name": name, "mime": mime, "content_base64": block["data"], "artifact_id": artifact_id})
        kept.append({"type": kind, "artifact_id": artifact_id, "name": name})
    return ({**result, "raw": kept} if found else result), found


def artifacts_at_end(turn: Turn, artifacts: list) -> list:
    """The turn's artifacts as its end records them: a pending one finished meanwhile (its
    ugent.artifacts event is in the log) is listed finished. Called under the turn's row lock."""
    if not any(a.get("pending") for a in artifacts):
        return artifacts
    finished = {}
    for data in _events_of(turn.pk, "ugent.artifacts"):
        for a in data.get("artifacts", []):
            if a.get("artifact_id"):
                finished[a["artifact_id"]] = a
    return [finished.get(a.get("artifact_id"), a) if a.get("pending") else a for a in artifacts]


def artifact_finish(*, turn_id: str, artifact_id: str, content: bytes, name: str = "") -> dict | None:
    """Finish a pending artifact of a turn: its bytes stored as a file of the conversation, the
    turn's artifacts and the receipt's files updated (once the turn has ended; a running turn's end
    picks it up from the log), and `ugent.artifacts` appended. Returns its entry; None when the turn
    has no such pending artifact (already finished, or never announced): nothing is stored then.
    Raises ApplicationError (413) for bytes past UGENT_FILES_MAX_BYTES."""
    turn = Turn.objects.select_related("conversation", "actor", "caller").filter(turn_id=turn_id).first()
    if turn is None or not _pending_in(turn, artifact_id):
        return None
    f = file_parts.file_from_bytes(conversation=turn.conversation, actor=turn.actor, caller=turn.caller,
                              filename=name or _pending_name(turn, artifact_id), content=content)
    entry = entry_of(f, artifact_id=artifact_id, name=name or _pending_name(turn, artifact_id))
    with transaction.atomic():
        statements.turn_lock(turn.pk)
        state, listed = Turn.objects.filter(pk=turn.pk).values_list("state", "artifacts").get()
        if state in LIVE_STATES:
            done = artifact_id in {a.get("artifact_id") for data in
                                   _events_of(turn.pk, "ugent.artifacts")
                                   for a in data.get("artifacts", [])}
        else:
            done = not any(a.get("artifact_id") == artifact_id and a.get("pending") for a in listed or [])
        if done:  # another finisher won: this copy goes
            f.delete()
            transaction.on_commit(lambda: file_parts.file_storage().delete(f.storage_name))
            return None
        if state not in LIVE_STATES:
            updated = [entry if a.get("artifact_id") == artifact_id else a for a in listed]
            Turn.objects.filter(pk=turn.pk).update(artifacts=updated)
            Receipt.objects.filter(pk=turn.receipt_id).update(files=updated)
        events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                      items=[("ugent.artifacts", {"turn_id": turn.turn_id, "artifacts": [entry]}, [])])
    return entry


def not_arrived_reason() -> str:
    return f"the file did not arrive within {settings.UGENT_ARTIFACT_PENDING_SECS} s"


def artifacts_expire_pending(*, now=None) -> int:
    """The beat job: each artifact announced pending more than UGENT_ARTIFACT_PENDING_SECS ago and still not
    finished, of a turn that has ended, is listed failed (`error`: it did not arrive) in the turn's artifacts
    and the receipt's files, and announced so in `ugent.artifacts` on the conversation's log; a finish that
    comes later stores nothing. A running turn's are left to its end, then to the next run. Returns how
    many artifacts were expired."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.UGENT_ARTIFACT_PENDING_SECS)
    # Announced since the window's start: a turn ends within its run limit of its announcement, and the
    # job runs every UGENT_FILES_PRUNE_EVERY_SECS, so a day's slack beyond both covers a beat that was
    # down a while, without each run reading every artifact of the events' retention (every stored
    # artifact is announced pending first).
    window = max(86400, settings.UGENT_TURN_RUN_LIMIT + 2 * settings.UGENT_FILES_PRUNE_EVERY_SECS)
    turn_pks = sorted(set(Event.objects.filter(type="ugent.artifacts_pending", created_at__lte=cutoff,
                                               created_at__gt=cutoff - dt.timedelta(seconds=window),
                                               turn__isnull=False).values_list("turn_id", flat=True)))
    expired = 0
    for at in range(0, len(turn_pks), 500):  # the cheap look first, 500 turns a read: most have none pending
        ended = Turn.objects.filter(pk__in=turn_pks[at:at + 500]).exclude(state__in=LIVE_STATES)
        for turn_pk, listed in ended.values_list("pk", "artifacts"):
            if any(a.get("pending") for a in listed or []):
                expired += _expire_pending_of(turn_pk, cutoff)
    return expired


def _expire_pending_of(turn_pk: int, cutoff) -> int:
    with transaction.atomic():
        statements.turn_lock(turn_pk)
        turn = Turn.objects.select_related("conversation").get(pk=turn_pk)
        if turn.state in LIVE_STATES:
            return 0
        announced_before = {a.get("artifact_id") for data in Event.objects.filter(
            turn_id=turn_pk, type="ugent.artifacts_pending", created_at__lte=cutoff).values_list("data", flat=True)
            for a in data.get("artifacts", [])}
        failed, updated = [], []
        for a in turn.artifacts or []:
            if a.get("pending") and a.get("artifact_id") in announced_before:
                a = _failed(a["artifact_id"], a.get("name") or "file", not_arrived_reason())
                failed.append(a)
            updated.append(a)
        if not failed:
            return 0
        Turn.objects.filter(pk=turn_pk).update(artifacts=updated)
        Receipt.objects.filter(pk=turn.receipt_id).update(files=updated)
        events_append(conversation_id=turn.conversation_id, turn_pk=turn_pk,
                      items=[("ugent.artifacts", {"turn_id": turn.turn_id, "artifacts": failed}, [])])
    log.info("pending artifacts expired (turn=%s, count=%d)", turn.turn_id, len(failed))
    return len(failed)


def _pending_in(turn: Turn, artifact_id: str) -> bool:
    for data in _events_of(turn.pk, "ugent.artifacts_pending"):
        if any(a.get("artifact_id") == artifact_id for a in data.get("artifacts", [])):
            return True
    return False


def _pending_name(turn: Turn, artifact_id: str) -> str:
    for data in _events_of(turn.pk, "ugent.artifacts_pending"):
        for a in data.get("artifacts", []):
            if a.get("artifact_id") == artifact_id:
                return str(a.get("name") or "file")
    return "file"
