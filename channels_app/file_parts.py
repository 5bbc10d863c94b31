"""Uploaded files as parts of a chat turn, and what the parts below the services share about files.

- the storage the bytes live in (`STORAGES["ugent_files"]`), and the content type sniffed from bytes;
- the check that a turn's file parts name files of its own conversation and user (message_submit);
- what the engine is shown (the runner's compose): a MultimodalChatEngine gets the bytes (base64 in
  `MultimodalAgentMessage`'s image, audio and file lists); any other engine gets the text read out of
  each file (PDF, DOCX, plain text) in front of the user's message.

The upload and download services are in channels_app/files.py, above the message services; the
upload limit, the kept name and `file_from_bytes` (a tool's artifact stored as a file) are here, where
the runner's parts can reach them.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import io
import logging
import re
import uuid

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.utils import timezone

from channels_app.errors import ApplicationError
from channels_app.models import Actor, Conversation, File, Turn

log = logging.getLogger("ugent.files")

STORAGE_ALIAS = "ugent_files"
#: How much of a file is read to sniff its type (filetype needs at most 8 KB; text is judged on this much).
SNIFF_BYTES = 8192
#: The most text read out of one file for a text engine (characters); the rest is cut with a note.
TEXT_LIMIT = 100_000
FILE_NOT_IN_CONVERSATION = ("No such file in this conversation: {file_id}. A file part names a file uploaded "
                            "to the same conversation by the same user (POST /v1/files).")
TOO_LARGE = ("The file is larger than this daemon takes: at most {limit} bytes (UGENT_FILES_MAX_BYTES).")
PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
#: filetype's names where browsers and engines know another one better
MIME_ALIASES = {"audio/x-wav": "audio/wav", "audio/x-flac": "audio/flac"}


def file_storage():
    """The storage that holds uploaded files (settings.STORAGES["ugent_files"])."""
    return storages[STORAGE_ALIAS]


def upload_too_large(size: int | None) -> ApplicationError | None:
    """A 413 for an upload past UGENT_FILES_MAX_BYTES, or None."""
    limit = settings.UGENT_FILES_MAX_BYTES
    if size is not None and size > limit:
        return ApplicationError(TOO_LARGE.format(limit=limit), status=413, code="file_too_large", param="file")
    return None


def filename_clean(name: str) -> str:
    """The client's name for the file, as it gave it, without a path and within the column."""
    name = re.split(r"[\\/]", name or "")[-1].replace("\x00", "").strip() or "file"
    return name[-255:]


def file_from_bytes(*, conversation: Conversation, actor: Actor, caller, filename: str, content: bytes,
                    purpose: str = "assistants_output") -> File:
    """Store bytes the hub made (a tool's artifact, channels_app.artifacts) as a file of `conversation`,
    owned as an upload of `actor` would be, so its /v1/files link opens for the conversation's owner
    alone. Raises ApplicationError (413) past UGENT_FILES_MAX_BYTES, having stored nothing."""
    problem = upload_too_large(len(content))
    if problem is not None:
        raise problem
    file_id = f"file-{uuid.uuid4().hex}"
    storage = file_storage()
    stored_name = storage.save(file_id, ContentFile(content))
    try:
        return File.objects.create(
            file_id=file_id, conversation=conversation, actor=actor, caller=caller,
            filename=filename_clean(filename), purpose=purpose, mime=mime_sniff(content[:SNIFF_BYTES]),
            size=len(content), sha256=hashlib.sha256(content).hexdigest(), storage_name=stored_name,
            expires_at=timezone.now() + dt.timedelta(seconds=settings.UGENT_PLUGIN_MEDIA_TTL_SECS))
    except BaseException:
        try:
            storage.delete(stored_name)
        except Exception:
            log.warning("could not delete the bytes of an unstored artifact %s", stored_name, exc_info=True)
        raise


def mime_sniff(head: bytes) -> str:
    """The content type of a file from its first bytes: a known signature (package filetype), else
    text/plain when they read as UTF-8, else application/octet-stream. The client's word is never taken."""
    import filetype
    kind = filetype.guess(head) if head else None
    if kind is not None:
        return MIME_ALIASES.get(kind.mime, kind.mime)
    if head and b"\x00" not in head:
        try:
            head.decode("utf-8")
            return "text/plain"
        except UnicodeDecodeError as exc:
            if exc.start >= len(head) - 3:  # a character cut by the sample's end
                return "text/plain"
    return "application/octet-stream"


def files_for_submission(*, actor: Actor, conversation: Conversation, file_ids: list[str]) -> list[File]:
    """The files a turn's parts name, each of this conversation and uploaded by this actor, and not
    expired; a 400 naming the first one that is not (the same answer whether it is missing or another's)."""
    from channels_app import access
    if not file_ids:
        return []
    found = {f.file_id: f for f in File.objects.filter(file_id__in=file_ids, expires_at__gt=timezone.now())}
    for file_id in file_ids:
        f = found.get(file_id)
        if f is None or not access.file_attachable(actor, f, conversation):
            raise ApplicationError(FILE_NOT_IN_CONVERSATION.format(file_id=file_id), status=400,
                                   code="file_not_found", param="messages")
    return [found[i] for i in file_ids]


# --- what the engine is shown ------------------------------------------------

def file_bytes(f: File) -> bytes:
    with file_storage().open(f.storage_name, "rb") as fh:
        return fh.read()


def text_extract(mime: str, data: bytes) -> str | None:
    """The text of a PDF (pypdf), a DOCX (python-docx) or a plain text file; None for anything else or
    for a file that cannot be read as its type claims."""
    try:
        if mime == PDF:
            from pypdf import PdfReader
            reader = PdfReader(io.BytesIO(data))
            return "\n".join((page.extract_text() or "") for page in reader.pages).strip()
        if mime == DOCX:
            import docx
            document = docx.Document(io.BytesIO(data))
            return "\n".join(p.text for p in document.paragraphs).strip()
        if mime.startswith("text/"):
            return data.decode("utf-8", errors="replace")
    except Exception as exc:  # a damaged file is described, not a failed turn
        log.info("could not read text from a %s file: %s", mime, exc)
    return None


def file_as_text(f: File) -> str:
    """One file for a text engine: its name and type, then its text (or why there is none)."""
    head = f"[file {f.filename!r} ({f.mime}, {f.size} bytes)]"
    try:
        text = text_extract(f.mime, file_bytes(f))
    except FileNotFoundError:
        return f"{head}\n(its bytes are gone: retention deleted them)"
    if text is None:
        return f"{head}\n(no text can be read from this kind of file)"
    if len(text) > TEXT_LIMIT:
        text = text[:TEXT_LIMIT] + f"\n(cut at {TEXT_LIMIT} characters)"
    return f"{head}\n{text}"


def turn_files(turn: Turn) -> list[File]:
    ids = (turn.context or {}).get("files") or []
    if not ids:
        return []
    found = {f.file_id: f for f in File.objects.filter(file_id__in=ids)}
    return [found[i] for i in ids if i in found]


def messages_with_files(turn: Turn, messages: list, engine) -> list:
    """The runner's messages with the turn's files in its last (user) message: as bytes for a
    MultimodalChatEngine, as extracted text in front of the words for any other engine."""
    files = turn_files(turn)
    if not files or not messages:
        return messages
    from ovos_plugin_manager.templates.agents import AgentMessage, MultimodalAgentMessage, MultimodalChatEngine
    last = messages[-1]
    if isinstance(engine, MultimodalChatEngine):
        images, audio, other = [], [], []
        for f in files:
            try:
                encoded = base64.b64encode(file_bytes(f)).decode("ascii")
            except FileNotFoundError:
                continue
            (images if f.mime.startswith("image/") else audio if f.mime.startswith("audio/") else other).append(encoded)
        return messages[:-1] + [MultimodalAgentMessage(role=last.role, content=last.content, image_content=images,
                                                       audio_content=audio, file_content=other)]
    blocks = "\n\n".join(file_as_text(f) for f in files)
    return messages[:-1] + [AgentMessage(role=last.role, content=f"{blocks}\n\n{last.content}")]
