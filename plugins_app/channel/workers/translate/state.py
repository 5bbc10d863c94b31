"""channel-translate's own record beside the SDK's outbox: the documents taken and each chunk's answer.

One append-only journal per document content, ``<state dir>/<plugin id>.translate/<sha256>.jsonl``: a
JSON line per event (a name taken, the chunks planned for a language, a chunk submitted, answered,
retried or failed, a name settled), each written with ``fsync`` before the worker acts on it, so an
answer recorded survives ``kill -9`` and a power cut. The state is the journal replayed; a last line
cut short by a crash was never acted on and is skipped. Appending keeps the cost of an answer the
size of the answer, however long the document.

Documents are keyed by their content's SHA-256 and the name they were dropped under; chunks by the
content, the target language and their index, so the same content dropped again (under any name)
finds its answers here and runs no turn. Journals whose documents all settled more than KEEP_SECS ago
are deleted at start; settled documents are read from disk again only when asked for.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

#: How long a finished document's answers are kept to recognise the same file dropped again.
KEEP_SECS = 180 * 86400

NEW, SUBMITTED, ANSWERED, FAILED = "new", "submitted", "answered", "failed"
WORKING, DONE, REPLAN, SUPERSEDED = "working", "done", "replan", "superseded"


def conversation_id_for(digest: str, lang: str) -> str:
    """One conversation per document and target language: the engine sees the earlier chunks."""
    return f"doc:{digest[:24]}:{lang}"


def message_id_for(digest: str, lang: str, index: int, prompt: str, attempt: int = 1, nonce: str = "") -> str:
    """A chunk's idempotency key: the document, the language, the chunk, what it asks, the plan's nonce
    (and the attempt, after a failed turn), so a restart or a second drop of the same file never runs a
    chunk twice, while a plan made afresh (its journal deleted after KEEP_SECS) never reuses an id the hub
    would answer as a duplicate."""
    base = f"{digest[:16]}.{lang}.{index:04d}.{hashlib.sha256(prompt.encode()).hexdigest()[:10]}"
    if nonce:
        base = f"{base}.{nonce}"
    return base if attempt == 1 else f"{base}.try{attempt}"


@dataclass
class ChunkRow:
    digest: str
    lang: str
    index: int
    total: int
    conversation_id: str
    message_id: str
    attempt: int
    prompt: str
    source: dict
    state: str = NEW
    answer: str | None = None
    reason: str | None = None
    submitted_at: float | None = None  # when the current attempt was handed to the SDK (wall clock)
    nonce: str = ""  # the plan's own (none in plans recorded before it)

    def copy(self) -> "ChunkRow":
        return ChunkRow(**self.__dict__)


@dataclass
class DocumentRow:
    digest: str
    name: str
    form: str
    langs: list[str]
    trailing_newline: bool
    state: str
    reason: str | None = None
    at: float = 0.0
    planned: dict[str, int] | None = None  # chunks per language when taken (None in journals before it)


@dataclass
class _Content:
    """One journal: a content's names and the chunks of each language."""

    digest: str
    path: Path
    documents: dict[str, DocumentRow] = field(default_factory=dict)
    chunks: dict[str, list[ChunkRow]] = field(default_factory=dict)

    def at_work(self) -> bool:
        return any(d.state == WORKING for d in self.documents.values())

    def apply(self, e: dict) -> None:
        kind = e["e"]
        if kind == "doc":
            self.documents[e["name"]] = DocumentRow(self.digest, e["name"], e["form"], list(e["langs"]),
                                                    bool(e["trailing_newline"]), WORKING, None, e["at"],
                                                    e.get("planned"))
        elif kind == "settle":
            doc = self.documents.get(e["name"])
            if doc is not None:
                doc.state, doc.reason, doc.at = e["state"], e.get("reason"), e["at"]
        elif kind == "chunks":
            lang, parts, nonce = e["lang"], e["parts"], e.get("nonce", "")
            if lang not in self.chunks:
                self.chunks[lang] = [
                    ChunkRow(self.digest, lang, i, len(parts), conversation_id_for(self.digest, lang),
                             message_id_for(self.digest, lang, i, p["prompt"], nonce=nonce), 1, p["prompt"],
                             p["source"], nonce=nonce)
                    for i, p in enumerate(parts)]
        else:
            c = self.chunks[e["lang"]][e["idx"]]
            if kind == "retry":
                c.attempt, c.state, c.reason, c.submitted_at = e["attempt"], NEW, e.get("reason"), None
                c.message_id = message_id_for(self.digest, c.lang, c.index, c.prompt, c.attempt, c.nonce)
            elif e.get("message_id") != c.message_id:
                return  # an event of an attempt since replaced
            elif kind == "submitted" and c.state == NEW:
                c.state, c.submitted_at = SUBMITTED, e.get("at", 0.0)
            elif kind == "answered" and c.state in (NEW, SUBMITTED):
                c.state, c.answer = ANSWERED, e["answer"]
            elif kind == "failed":
                c.state, c.reason = FAILED, e.get("reason")


class TranslateState:
    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = path
        self._lock = threading.RLock()
        self._loaded: dict[str, _Content] = {}  # contents with a document at work (or asked for since)
        self._closed = False
        self._latest: dict[str, tuple[float, str]] = {}  # name -> (taken at, digest) of its newest content
        for journal in sorted(path.glob("*.jsonl")):
            content = self._read(journal)
            for d in content.documents.values():
                self._note(d)
            if content.at_work():
                self._loaded[content.digest] = content
            elif all(d.at < time.time() - KEEP_SECS for d in content.documents.values()):
                journal.unlink(missing_ok=True)

    def _note(self, d: DocumentRow) -> None:
        latest = self._latest.get(d.name)
        if latest is None or d.at >= latest[0]:
            self._latest[d.name] = (d.at, d.digest)

    def superseded(self, doc: DocumentRow) -> bool:
        """Whether another content was taken under this document's name after it (the file was edited or
        replaced while at work): its translation must not overwrite the newer one's."""
        with self._lock:
            latest = self._latest.get(doc.name)
            return latest is not None and latest[1] != doc.digest and latest[0] > doc.at

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._loaded.clear()

    # ------------------------------------------------------------------ the journal

    def _read(self, path: Path) -> _Content:
        content = _Content(path.stem, path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return content
        if data and not data.endswith(b"\n"):
            # a last line cut short by a crash: never acted on; cut it off so the next event starts a line
            data = data[:data.rfind(b"\n") + 1]
            with open(path, "r+b") as fh:
                fh.truncate(len(data))
                os.fsync(fh.fileno())
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                content.apply(json.loads(line))
            except (ValueError, KeyError, IndexError, TypeError):
                continue  # not a line this version wrote
        return content

    def _content(self, digest: str) -> _Content:
        content = self._loaded.get(digest)
        if content is None:
            content = self._read(self.dir / f"{digest}.jsonl")
            self._loaded[digest] = content
        return content

    def _write(self, content: _Content, *events: dict) -> None:
        """Append events durably, then apply them: what the worker acts on is on disk first."""
        if self._closed:
            raise RuntimeError("the state is closed")
        data = b"".join(json.dumps(e, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for e in events)
        new = not content.path.exists()
        fd = os.open(content.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            _fsync_dir(self.dir)
        for e in events:
            content.apply(e)

    def _find(self, conversation_id: str) -> _Content | None:
        prefix = conversation_id.split(":")[1] if conversation_id.count(":") == 2 else ""
        if len(prefix) != 24:
            return None
        for digest, content in self._loaded.items():
            if digest.startswith(prefix):
                return content
        for journal in self.dir.glob(f"{prefix}*.jsonl"):
            return self._content(journal.stem)
        return None

    # ------------------------------------------------------------------ documents

    def take(self, *, digest: str, name: str, form: str, trailing_newline: bool,
             chunks: dict[str, list[tuple[str, dict]]], stale_before: float | None = None) -> None:
        """Record a dropped file (again): its document working, and the chunks of each language that has
        none yet ((prompt, source) each, in order). A language already recorded keeps its chunks: the plan
        made at the first drop stands, so no chunk is ever asked twice in two shapes. Chunks a failed run
        gave up on are tried again (a new attempt), and so are chunks submitted before ``stale_before``
        that never got an answer."""
        with self._lock:
            content = self._content(digest)
            # The plan first, the document last: a crash (or a power cut tearing the write) before the
            # document's line leaves no document at work, and the file, still in the inbox, is taken
            # again. The document's line names each language's chunk count, so a plan line lost in the
            # middle is seen (plan_lost) rather than taken for a language with nothing left to do.
            events: list[dict] = []
            for lang, parts in chunks.items():
                if lang not in content.chunks:
                    events.append({"e": "chunks", "lang": lang, "nonce": secrets.token_hex(3),
                                   "parts": [{"prompt": p, "source": s} for p, s in parts]})
            for rows in content.chunks.values():
                events.extend({"e": "retry", "lang": c.lang, "idx": c.index, "attempt": c.attempt + 1}
                              for c in rows if c.state == FAILED or (
                                  c.state == SUBMITTED and stale_before is not None
                                  and (c.submitted_at or 0.0) < stale_before))
            planned = {lang: len(content.chunks[lang]) if lang in content.chunks else len(parts)
                       for lang, parts in chunks.items()}
            events.append({"e": "doc", "name": name, "form": form, "trailing_newline": trailing_newline,
                           "langs": sorted(chunks), "planned": planned, "at": time.time()})
            self._write(content, *events)
            self._note(content.documents[name])

    def plan_lost(self, doc: DocumentRow) -> list[str]:
        """The languages of a document at work whose chunks are not all in the journal (a plan line lost
        to a crash): such a document is not complete, it needs its file taken again."""
        with self._lock:
            have = self._content(doc.digest).chunks
            return [lang for lang in doc.langs
                    if not have.get(lang) or (doc.planned is not None and len(have[lang]) != doc.planned.get(lang))]

    def document(self, digest: str, name: str) -> DocumentRow | None:
        with self._lock:
            doc = self._content(digest).documents.get(name)
            return None if doc is None else DocumentRow(**doc.__dict__)

    def working(self) -> list[DocumentRow]:
        with self._lock:
            docs = [DocumentRow(**d.__dict__) for c in self._loaded.values() for d in c.documents.values()
                    if d.state == WORKING]
        return sorted(docs, key=lambda d: d.at)

    def settle(self, digest: str, name: str, state: str, reason: str | None = None) -> None:
        with self._lock:
            content = self._content(digest)
            self._write(content, {"e": "settle", "name": name, "state": state, "reason": reason, "at": time.time()})
            if not content.at_work():
                self._loaded.pop(digest, None)

    def counts(self) -> dict:
        with self._lock:
            chunks: dict[str, int] = {}
            for content in self._loaded.values():
                for rows in content.chunks.values():
                    for c in rows:
                        chunks[c.state] = chunks.get(c.state, 0) + 1
            return {"documents_at_work": len(self.working()), "chunks": chunks}

    # ------------------------------------------------------------------ chunks

    def chunks(self, digest: str, lang: str) -> list[ChunkRow]:
        with self._lock:
            return [c.copy() for c in self._content(digest).chunks.get(lang, [])]

    def chunk_of(self, conversation_id: str, message_id: str | None) -> ChunkRow | None:
        """The chunk whose current attempt is this message; None for any other message."""
        if not message_id:
            return None
        with self._lock:
            content = self._find(conversation_id)
            if content is None:
                return None
            lang = conversation_id.split(":")[2]
            for c in content.chunks.get(lang, []):
                if c.message_id == message_id:
                    return c.copy()
        return None

    def _event(self, c: ChunkRow, kind: str, **more) -> None:
        self._write(self._content(c.digest), {"e": kind, "lang": c.lang, "idx": c.index, "message_id": c.message_id,
                                              **more})

    def _current(self, c: ChunkRow) -> ChunkRow:
        return self._content(c.digest).chunks[c.lang][c.index]

    def submitted(self, c: ChunkRow) -> None:
        with self._lock:
            now = self._current(c)
            if now.message_id == c.message_id and now.state == NEW:
                self._event(c, "submitted", at=time.time())

    def answered(self, c: ChunkRow, answer: str) -> bool:
        """Record the answer to the chunk's current attempt; False when it already had one (a redelivery)."""
        with self._lock:
            now = self._current(c)
            if now.message_id != c.message_id or now.state not in (NEW, SUBMITTED):
                return False
            self._event(c, "answered", answer=answer)
            return True

    def turn_failed(self, c: ChunkRow, reason: str, *, max_attempts: int) -> bool:
        """The chunk's turn ended without a translation: a new attempt (a new message id), or, past
        ``max_attempts``, the chunk failed. Returns True when it failed for good."""
        with self._lock:
            now = self._current(c)
            if now.message_id != c.message_id or now.state not in (NEW, SUBMITTED):
                return now.state == FAILED
            if c.attempt < max_attempts:
                self._write(self._content(c.digest), {"e": "retry", "lang": c.lang, "idx": c.index,
                                                      "attempt": c.attempt + 1, "reason": reason})
                return False
            self._event(c, "failed", reason=reason)
            return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
