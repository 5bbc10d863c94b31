"""Files: POST /v1/files uploads one into a conversation, GET /v1/files/{id} downloads it, with ranges.

An upload follows a message's ownership rule (the seed: "A conversation belongs to whoever first sends
a message in it, uploads a file to it or starts a call on it"): the same actor and conversation
resolution as `message_submit` (channels_app.services), so a first upload creates and owns the
conversation and an upload into someone else's is a 403 that stores nothing. The bytes go to the
`ugent_files` storage (the file system under the var dir, or S3 through django-storages), the row
names them; both last UGENT_PLUGIN_MEDIA_TTL_SECS, after which the link is a 404 and the beat job
(`files_prune`) deletes them. A link opens only for its conversation's owner and the operator.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from channels_app import access, services
from channels_app.errors import ApplicationError
# The upload limit and the kept name live with the parts below (file_parts), which a tool's artifacts
# share; upload_too_large is named here too for the views.
from channels_app.file_parts import SNIFF_BYTES, file_storage, mime_sniff, upload_too_large
from channels_app.file_parts import filename_clean as _filename
from channels_app.models import Actor, Caller, File

log = logging.getLogger("ugent.files")

NO_SUCH_FILE = "No such file."
RANGE_PAST_END = "The range starts past the end of the file ({size} bytes)."
PURPOSES = ("user_data", "assistants", "vision", "voice")
#: What a file id may be (file_upload makes file-<32 hex>); /v1/files/<id> links are read with it too.
FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: How many expired files one prune deletes per batch.
PRUNE_BATCH = 500
FILES_PRUNE_TASK_NAME = "ugent: delete expired files"
ARTIFACTS_EXPIRY_TASK_NAME = "ugent: expire pending artifacts"


def file_object(f: File) -> dict:
    """The OpenAI file object, with UGENT's sniffed `mime`, its link `url` and when it expires."""
    return {"id": f.file_id, "object": "file", "bytes": f.size, "created_at": int(f.created_at.timestamp()),
            "filename": f.filename, "purpose": f.purpose, "mime": f.mime, "url": f"/v1/files/{f.file_id}",
            "expires_at": int(f.expires_at.timestamp()),
            "conversation_id": f.conversation.external_id}


def file_upload(*, actor: Actor, caller: Caller | None, upload, conversation_id: str, client_id: str = "",
                purpose: str = "user_data") -> File:
    """Store one upload in a conversation, created for `actor` if it is new. Raises ApplicationError
    (413 too large, 403 someone else's conversation) having stored nothing."""
    problem = upload_too_large(upload.size)
    if problem is not None:
        raise problem
    file_id = f"file-{uuid.uuid4().hex}"
    storage = file_storage()
    stored_name = None
    try:
        with transaction.atomic():
            if actor.pk is None:  # a user's first upload: their row comes and goes with it (a 403 keeps none)
                actor = services.actor_kept(actor)
            conversation, _created = services.conversation_resolve(
                channel="web", client_id=client_id, external_id=conversation_id, actor=actor, caller=caller)
            digest, head = hashlib.sha256(), b""
            upload.seek(0)
            for chunk in upload.chunks():
                digest.update(chunk)
                if len(head) < SNIFF_BYTES:
                    head += chunk[:SNIFF_BYTES - len(head)]
            upload.seek(0)
            stored_name = storage.save(file_id, upload)
            now = timezone.now()
            f = File.objects.create(
                file_id=file_id, conversation=conversation, actor=actor, caller=caller,
                filename=_filename(upload.name), purpose=purpose, mime=mime_sniff(head), size=upload.size,
                sha256=digest.hexdigest(), storage_name=stored_name,
                expires_at=now + dt.timedelta(seconds=settings.UGENT_PLUGIN_MEDIA_TTL_SECS))
        return f
    except BaseException:
        if stored_name is not None:  # the row was not committed: its bytes go too
            try:
                storage.delete(stored_name)
            except Exception:
                log.warning("could not delete the bytes of a refused upload %s", stored_name, exc_info=True)
        raise


def file_for_download(*, viewer: access.Viewer, file_id: str) -> File:
    """The file behind a /v1/files/<id> link, for its conversation's owner and the operator; a 404 to
    anyone else, as for a missing or expired one, and for an id no file could have (a NUL in it was a 500
    on PostgreSQL) before the database is asked."""
    if not FILE_ID.fullmatch(file_id):
        raise ApplicationError(NO_SUCH_FILE, status=404, code="file_not_found")
    f = File.objects.select_related("conversation").filter(file_id=file_id).first()
    if f is None or f.expires_at <= timezone.now() or not access.file_readable(viewer, f):
        raise ApplicationError(NO_SUCH_FILE, status=404, code="file_not_found")
    return f


def file_read(f: File, start: int, length: int) -> bytes:
    """`length` bytes of a file from `start`; a 404 when retention took its bytes meanwhile."""
    try:
        with file_storage().open(f.storage_name, "rb") as fh:
            if start:
                fh.seek(start)
            return fh.read(length)
    except FileNotFoundError:
        raise ApplicationError(NO_SUCH_FILE, status=404, code="file_not_found")


# --- ranges and validators (RFC 9110) -----------------------------------------

@dataclass(frozen=True)
class ByteRange:
    """What a Range header asks of a file of `size` bytes: the whole file, one part, or nothing it has."""

    whole: bool = True
    start: int = 0
    end: int = 0  # inclusive
    unsatisfiable: bool = False


WHOLE = ByteRange()
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def range_parse(header: str | None, size: int) -> ByteRange:
    """One byte range of a Range header (RFC 9110 §14). A header this server does not honour (another
    unit, several ranges, bad syntax, last before first) is ignored: the whole file, 200. A range
    whose first byte is at or past the end, or a zero suffix, cannot be satisfied: 416."""
    if not header or "," in header or len(header) > 200:
        return WHOLE
    m = _RANGE.match(header)
    if m is None:
        return WHOLE
    first, last = m.groups()
    if not first and not last:
        return WHOLE
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            return ByteRange(whole=False, unsatisfiable=True)
        return ByteRange(whole=False, start=max(0, size - n), end=size - 1)
    start = int(first)
    end = int(last) if last else size - 1
    if last and end < start:
        return WHOLE
    if start >= size:
        return ByteRange(whole=False, unsatisfiable=True)
    return ByteRange(whole=False, start=start, end=min(end, size - 1))


def etag(f: File) -> str:
    return f'"{f.sha256}"'


def _tags(header: str) -> list[str]:
    return [t.strip().removeprefix("W/") for t in header.split(",") if t.strip()]


def not_modified(f: File, if_none_match: str | None) -> bool:
    """If-None-Match names this file's ETag (weak comparison) or is *: answer 304."""
    if not if_none_match:
        return False
    tags = _tags(if_none_match)
    return "*" in tags or etag(f) in tags


def range_applies(f: File, if_range: str | None) -> bool:
    """If-Range: the range is served only while the file is the one named (a strong ETag; a date is
    never taken, as the ETag is this server's only validator)."""
    return not if_range or if_range.strip() == etag(f)


# --- retention ---------------------------------------------------------------

def files_prune(*, now: dt.datetime | None = None) -> int:
    """The retention job (beat): delete the bytes and rows of files past expires_at. Returns how many."""
    now = now or timezone.now()
    storage, deleted = file_storage(), 0
    while True:
        batch = list(File.objects.filter(expires_at__lte=now).values_list("pk", "storage_name")[:PRUNE_BATCH])
        if not batch:
            return deleted
        for _pk, name in batch:
            try:
                storage.delete(name)
            except Exception:  # a missing object is fine; anything else is retried by the next run
                log.warning("could not delete the bytes of expired file %s", name, exc_info=True)
        deleted += File.objects.filter(pk__in=[pk for pk, _ in batch]).delete()[0]


def files_prune_schedule_ensure() -> None:
    """Create or update the beat entry that runs the retention job (django-celery-beat)."""
    from ugent_common.tasks import beat_every
    every = settings.UGENT_FILES_PRUNE_EVERY_SECS
    beat_every(FILES_PRUNE_TASK_NAME, "channels_app.tasks.prune_files", every,
               "Deletes uploaded files past UGENT_PLUGIN_MEDIA_TTL_SECS.")
    beat_every(ARTIFACTS_EXPIRY_TASK_NAME, "channels_app.tasks.expire_pending_artifacts", every,
               "Lists a tool's artifacts still pending after UGENT_ARTIFACT_PENDING_SECS as not arrived.")


def files_status() -> dict:
    """The `files` section of GET /v1/ugent/status: what is kept, how much, and for how long."""
    now = timezone.now()
    live = File.objects.filter(expires_at__gt=now).aggregate(count=Count("id"), bytes=Sum("size"))
    backend = settings.STORAGES["ugent_files"]["BACKEND"].rsplit(".", 1)[-1]
    return {"count": live["count"] or 0, "bytes": live["bytes"] or 0,
            "expired_awaiting_prune": File.objects.filter(expires_at__lte=now).count(),
            "retention_secs": settings.UGENT_PLUGIN_MEDIA_TTL_SECS, "max_bytes": settings.UGENT_FILES_MAX_BYTES,
            "storage": backend}
