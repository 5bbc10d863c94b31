"""The offline default agent engine: answers questions from a folder of notes.

Three OPM plugins, composed as the OPM guide's worked example suggests:

* ``NotesIndexEngine`` (a ``DocumentIndexerEngine``) ranks passages with BM25
  (the ``bm25s`` library) and, in folder mode, keeps itself in step with the
  folder's ``*.md`` / ``*.txt`` files.
* ``SentenceExtractor`` (an ``ExtractiveQAEngine``) cuts the answering
  sentences out of a passage.
* ``NotesChatEngine`` (a ``ChatEngine``) answers the last user message by
  quoting those sentences and naming the note they came from.

No network, no model download, nothing imported from Django.
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import bm25s
from ovos_plugin_manager.templates.agents import (AgentMessage, ChatEngine,
                                                  DocumentIndexerEngine,
                                                  ExtractiveQAEngine,
                                                  MessageRole)

from plugins_app.agent.engines.base import (ANSWER, CITATIONS, StopCheck, StreamItem,
                                      never_stop)

NOTHING_FOUND = "I found nothing about that in the notes."
NOTE_SUFFIXES = (".md", ".txt")
CITATION_PREFIX = "notes/"

# --------------------------------------------------------------------------
# Text analysis shared by the index and the extractor
# --------------------------------------------------------------------------

STOPWORDS = frozenset("""
a about above after again against all am an and any are aren as at be because
been before being below between both but by can cannot could couldn did didn do
does doesn doing don down during each else etc ever few for from further get gets
got had hadn has hasn have haven having he her here hers herself him himself his
how however i if in into is isn it its itself just let lets like me more most much
must my myself need no nor not now of off on once only or other our ours
ourselves out over own please same shall she should shouldn so some such tell
than that the their theirs them themselves then there these they this those
through to too under until up us use using very want was wasn we were weren
what when where which while who whom why will with won would wouldn yes yet you
your yours yourself yourselves
""".split())

_WORD = re.compile(r"[a-z0-9]+")
# Tried in order; the first that leaves a stem of 3+ letters is stripped.
_SUFFIXES: Tuple[Tuple[str, str], ...] = (
    ("ations", ""), ("ation", ""), ("ings", ""), ("ing", ""), ("ies", "y"),
    ("ied", "y"), ("ed", ""), ("es", ""), ("s", ""), ("e", ""),
)


def stem(word: str) -> str:
    """A light, deterministic suffix stripper ("configured" -> "configur")."""
    if len(word) <= 3 or word.isdigit() or word.endswith(("ss", "us", "is")):
        return word
    for suffix, replacement in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: len(word) - len(suffix)] + replacement
            break
    # "running" -> "runn" -> "run", so both spellings meet.
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiouls":
        word = word[:-1]
    return word


def terms(text: str) -> List[str]:
    """Lower-cased, stop-word-free, stemmed terms; identifiers split on punctuation."""
    return [stem(w) for w in _WORD.findall(text.lower())
            if len(w) > 1 and w not in STOPWORDS]


# --------------------------------------------------------------------------
# Passages
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    """One searchable unit: a note section (or an ingested document)."""

    text: str
    source: str = ""  # relative path inside the notes folder; "" when ingested
    heading: str = ""

    def index_text(self) -> str:
        # The file name and heading say what a section is about, so they count twice.
        name = Path(self.source).stem.replace("-", " ").replace("_", " ")
        title = " ".join(part for part in (name, self.heading) if part)
        return " ".join(part for part in (title, title, self.text) if part)


@dataclass(frozen=True)
class ScoredPassage:
    """A passage returned by a query, with its BM25 score."""

    text: str
    score: float
    source: str = ""
    heading: str = ""


_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_MAX_PASSAGE_CHARS = 1200


def split_markdown(text: str, source: str = "") -> List[Passage]:
    """Split a note into one passage per heading section (long sections by paragraph)."""
    passages: List[Passage] = []
    heading, body, in_fence = "", [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        match = None if in_fence else _HEADING.match(line)
        if match:
            passages.extend(_section_passages(heading, body, source))
            heading, body = match.group(2), []
        else:
            body.append(line)
    passages.extend(_section_passages(heading, body, source))
    return passages


def _section_passages(heading: str, lines: List[str], source: str) -> List[Passage]:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", "\n".join(lines)) if p.strip()]
    chunks: List[str] = []
    for paragraph in paragraphs:
        if chunks and len(chunks[-1]) + len(paragraph) + 2 <= _MAX_PASSAGE_CHARS:
            chunks[-1] += "\n\n" + paragraph
        else:
            chunks.append(paragraph)
    return [Passage(text=chunk, source=source, heading=heading) for chunk in chunks]


def _folder_signature(root: Path) -> Tuple[Tuple[str, int, int], ...]:
    """(relative path, mtime_ns, size) of every note: cheap to compute, changes on any edit."""
    if not root.is_dir():
        return ()
    signature = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.suffix.lower() not in NOTE_SUFFIXES or _hidden(relative):
            continue
        try:
            stat = path.stat()
        except OSError:  # deleted between listing and stat
            continue
        if path.is_file():
            signature.append((relative.as_posix(), stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(signature))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _read_folder(root: Path, signature: Sequence[Tuple[str, int, int]]) -> List[Passage]:
    passages: List[Passage] = []
    for relative, _mtime, _size in signature:
        try:
            text = (root / relative).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        passages.extend(split_markdown(text, source=relative))
    return passages


# --------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Snapshot:
    """An immutable built index; queries read one snapshot, rebuilds swap it whole."""

    passages: Tuple[Passage, ...]
    retriever: Optional[bm25s.BM25]
    vocabulary: frozenset
    signature: Tuple[Tuple[str, int, int], ...]


_EMPTY = _Snapshot((), None, frozenset(), ())


def _build_snapshot(passages: Sequence[Passage], signature) -> _Snapshot:
    tokenized = [terms(p.index_text()) for p in passages]
    if not any(tokenized):
        return _Snapshot(tuple(passages), None, frozenset(), tuple(signature))
    retriever = bm25s.BM25()
    retriever.index(tokenized, show_progress=False)
    vocabulary = frozenset(t for tokens in tokenized for t in tokens)
    return _Snapshot(tuple(passages), retriever, vocabulary, tuple(signature))


class NotesIndexEngine(DocumentIndexerEngine):
    """BM25 over ingested documents and, with ``config["path"]``, over a notes folder.

    Folder mode indexes every ``*.md`` / ``*.txt`` file below the folder (hidden
    files and folders skipped), one passage per heading section, and re-indexes
    when a file is added, changed or removed: the (path, mtime, size) signatures
    are checked at most every ``config["rescan_interval"]`` seconds (default 1)
    and the index is rebuilt only when they differ. Safe to share between threads.
    """

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        super().__init__(config)
        self._lock = threading.Lock()
        self._extra: List[Passage] = []
        self._snapshot: _Snapshot = _EMPTY
        self._built = False
        self._checked_at = float("-inf")

    @property
    def folder(self) -> Optional[Path]:
        path = self.config.get("path")
        return Path(path).expanduser() if path else None

    @property
    def rescan_interval(self) -> float:
        return float(self.config.get("rescan_interval", 1.0))

    # -- OPM contract ------------------------------------------------------

    def ingest_corpus(self, corpus: List[str]):
        """Add whole documents to the index (beside the folder's notes, if any)."""
        with self._lock:
            self._extra.extend(Passage(text=str(doc)) for doc in corpus)
            self._rebuild(self._current_signature())

    def query(self, query: str, lang: Optional[str] = None, k: int = 3) -> List[Tuple[str, float]]:
        """Up to ``k`` (content, score) pairs, best first; only passages sharing a term."""
        return [(hit.text, hit.score) for hit in self.query_passages(query, k=k, lang=lang)]

    # -- richer API for the chat engine ------------------------------------

    def query_passages(self, query: str, k: int = 3,
                       lang: Optional[str] = None) -> List[ScoredPassage]:
        """Like ``query`` but each hit keeps its source file and heading."""
        snapshot = self.refresh()
        query_terms = [t for t in terms(query) if t in snapshot.vocabulary]
        if k <= 0 or not query_terms or snapshot.retriever is None:
            return []
        count = min(k, len(snapshot.passages))
        ids, scores = snapshot.retriever.retrieve([query_terms], k=count, show_progress=False)
        ranked = sorted(((float(s), int(i)) for i, s in zip(ids[0], scores[0]) if s > 0),
                        key=lambda pair: (-pair[0], pair[1]))
        return [self._scored(snapshot.passages[i], score) for score, i in ranked]

    def refresh(self, force: bool = False) -> _Snapshot:
        """Re-index if the folder changed (checked at most once per rescan interval)."""
        now = time.monotonic()
        if self._built and not force and now - self._checked_at < self.rescan_interval:
            return self._snapshot
        with self._lock:
            signature = self._current_signature()
            self._checked_at = time.monotonic()
            snapshot = self._snapshot
            if force or not self._built or signature != snapshot.signature:
                self._rebuild(signature)
            return self._snapshot

    # -- internals -----------------------------------------------------------

    def _current_signature(self):
        return _folder_signature(self.folder) if self.folder else ()

    def _rebuild(self, signature) -> None:
        # Caller holds self._lock.
        folder_passages = _read_folder(self.folder, signature) if self.folder else []
        self._snapshot = _build_snapshot(folder_passages + self._extra, signature)
        self._built = True

    @staticmethod
    def _scored(passage: Passage, score: float) -> ScoredPassage:
        return ScoredPassage(text=passage.text, score=score, source=passage.source,
                             heading=passage.heading)


# --------------------------------------------------------------------------
# The extractor
# --------------------------------------------------------------------------

_NEXT_STARTS = r"(?=[\"'(\[`*_]*[A-Z0-9])"
# Two fixed-width look-behinds because re has no variable-width one: "end." and "end.)".
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+" + _NEXT_STARTS)
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_REFERRING_START = re.compile(r"(?i)^(?:it|its|this|that|these|those|they|their|then)\b")


def split_sentences(evidence: str) -> List[str]:
    """Sentences of a (Markdown) text; headings dropped, list items and code blocks kept whole."""
    sentences: List[str] = []
    for block in _blocks(evidence):
        if _is_code(block):
            sentences.append(block)
            continue
        for piece in _SENTENCE_END.split(block):
            piece = " ".join(piece.split())
            if piece:
                sentences.append(piece)
    return sentences


def _blocks(evidence: str) -> List[str]:
    blocks: List[str] = []
    current: List[str] = []
    fence: List[str] = []

    def flush():
        if current:
            blocks.append(" ".join(current))
            current.clear()

    for line in evidence.splitlines():
        if fence or _FENCE.match(line):
            if not fence:
                flush()
            fence.append(line)
            if len(fence) > 1 and _FENCE.match(line):
                blocks.append("\n".join(fence))
                fence = []
            continue
        if not line.strip() or _HEADING.match(line):
            flush()
        elif _LIST_ITEM.match(line):
            flush()
            current.append(_LIST_ITEM.sub("", line).strip())
        else:
            current.append(line.strip())
    flush()
    if fence:  # an unclosed fence is still text
        blocks.append("\n".join(fence))
    return blocks


class SentenceExtractor(ExtractiveQAEngine):
    """Picks the one or two contiguous sentences of the evidence that best answer a question.

    Sentences are scored by the question terms they share (lower-cased, stemmed,
    stop words ignored), each term weighted by how rare it is in the evidence.
    A neighbouring sentence is added when the best one starts with a pronoun
    ("It ..."), ends with a colon (the code block it introduces follows), or
    when the neighbour brings question terms the best one lacks. Returns ""
    when no sentence shares a term. Deterministic. Config: ``max_sentences``
    (1 or 2, default 2).
    """

    def get_best_passage(self, evidence: str, question: str,
                         lang: Optional[str] = None) -> str:
        sentences = split_sentences(evidence)
        wanted = set(terms(question))
        if not sentences or not wanted:
            return ""
        found = [set(terms(s)) & wanted for s in sentences]
        weights = _rarity_weights(found)
        # A code block only ever follows the sentence that introduces it.
        scores = [0.0 if _is_code(s) else sum(weights[t] for t in hit)
                  for s, hit in zip(sentences, found)]
        best = max(range(len(sentences)), key=lambda i: (scores[i], -i))
        if scores[best] <= 0:
            return ""
        start, end = self._extend(best, sentences, found, weights)
        spans = _locate(evidence, sentences)
        if spans is None:  # (never seen: every sentence is the evidence's words with its spacing collapsed)
            return _join(sentences[start:end + 1])
        return evidence[spans[start][0]:spans[end][1]]

    def _extend(self, best: int, sentences: List[str], found: List[set],
                weights: Dict[str, float]) -> Tuple[int, int]:
        if int(self.config.get("max_sentences", 2)) < 2:
            return best, best
        # "It starts the workers." means nothing without the sentence naming "it".
        if best > 0 and _REFERRING_START.match(sentences[best]):
            return best - 1, best
        if sentences[best].endswith(":") and best + 1 < len(sentences):
            return best, best + 1

        def gain(i: int) -> float:
            if 0 <= i < len(found) and not _is_code(sentences[i]):
                return sum(weights[t] for t in found[i] - found[best])
            return 0.0

        after, before = gain(best + 1), gain(best - 1)
        if after > 0 and after >= before:
            return best, best + 1
        if before > 0:
            return best - 1, best
        return best, best


def _locate(evidence: str, sentences: List[str]) -> Optional[List[Tuple[int, int]]]:
    """Where each sentence lies in the evidence, in order: the contract's answer is a span *inside* the
    evidence, as written (its line breaks and spacing), not the sentences as split_sentences tidied them."""
    spans: List[Tuple[int, int]] = []
    at = 0
    for sentence in sentences:
        pattern = r"\s+".join(re.escape(word) for word in sentence.split())
        found = re.compile(pattern).search(evidence, at)
        if found is None:
            return None
        spans.append(found.span())
        at = found.end()
    return spans


def _join(sentences: List[str]) -> str:
    # A code block keeps its own lines, so it must start on one.
    text = sentences[0]
    for sentence in sentences[1:]:
        text += ("\n" if _is_code(sentence) else " ") + sentence
    return text


def _is_code(sentence: str) -> bool:
    return sentence.startswith(("```", "~~~"))


def _rarity_weights(found: List[set]) -> Dict[str, float]:
    total = len(found)
    counts: Dict[str, int] = {}
    for hit in found:
        for term in hit:
            counts[term] = counts.get(term, 0) + 1
    return {t: 1.0 + math.log(total / n) for t, n in counts.items()}


# --------------------------------------------------------------------------
# The chat engine
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class NotesAnswer:
    """What the chat engine says, and which notes it quoted."""

    text: str
    citations: Tuple[str, ...] = ()


def default_notes_folder() -> Path:
    """$UGENT_WORKSPACE/notes, else the project's workspace/notes."""
    workspace = os.environ.get("UGENT_WORKSPACE")
    if workspace:
        return Path(workspace).expanduser() / "notes"
    return Path(__file__).resolve().parents[3] / "workspace" / "notes"


def tokenize_answer(text: str) -> List[str]:
    """Words with their trailing whitespace, so ``"".join(tokens) == text``."""
    return re.findall(r"\S+\s*|\s+", text)


def _content_text(content: Any) -> str:
    # OpenAI-style content may be a list of parts; only the text parts count here.
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content
                        if isinstance(p, dict) and p.get("type", "text") == "text")
    return "" if content is None else str(content)


def last_user_text(messages: Sequence[Any]) -> str:
    """The content of the last USER message (AgentMessage or OpenAI-style dict)."""
    for message in reversed(list(messages or [])):
        if isinstance(message, dict):
            role, content = message.get("role"), message.get("content")
        else:
            role, content = getattr(message, "role", None), getattr(message, "content", None)
        if role == MessageRole.USER:
            return _content_text(content).strip()
    return ""


class NotesChatEngine(ChatEngine):
    """Answers from a notes folder by quoting the best-matching sentences, offline.

    Config: ``path`` (default ``$UGENT_WORKSPACE/notes``, else the project's
    ``workspace/notes``), ``k`` passages to consider (default 3), ``min_score``
    a passage's BM25 score must exceed (default 0), and ``rescan_interval``
    (seconds between folder checks, default 1). Stateless: the answer depends
    only on the last user message and the notes.
    """

    supports_tools = False
    # it quotes the notes whatever it is asked: /refine and translation do not ask it (registry.profile_follows_prompts)
    follows_prompts = False

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        super().__init__(config)
        self._index: Optional[NotesIndexEngine] = None
        self._index_lock = threading.Lock()
        self._extractor = SentenceExtractor(self.config)

    @property
    def notes_folder(self) -> Path:
        path = self.config.get("path")
        return Path(path).expanduser() if path else default_notes_folder()

    @property
    def index(self) -> NotesIndexEngine:
        """The folder index, built lazily on first use."""
        with self._index_lock:
            if self._index is None:
                config = {"path": str(self.notes_folder),
                          "rescan_interval": self.config.get("rescan_interval", 1.0)}
                self._index = NotesIndexEngine(config)
            return self._index

    def warm(self) -> None:
        """Build the folder index now (rundaemon calls this at start), so the first question finds it built."""
        self.index.refresh()

    def answer(self, messages: Sequence[Any]) -> NotesAnswer:
        """The reply to the last user message, with the notes it quotes."""
        question = last_user_text(messages)
        if not question:
            return NotesAnswer(NOTHING_FOUND)
        best = self._best_quote(question)
        if best is None:
            return NotesAnswer(NOTHING_FOUND)
        hit, quote = best
        citations = (CITATION_PREFIX + hit.source,) if hit.source else ()
        return NotesAnswer(f"From {hit.source or 'the notes'}: {quote}", citations)

    def _best_quote(self, question: str) -> Optional[Tuple[ScoredPassage, str]]:
        """Of the top-k passages, the quote covering most question terms (ties: BM25 order)."""
        min_score = float(self.config.get("min_score", 0.0))
        k = int(self.config.get("k", 3))
        wanted = set(terms(question))
        best, best_coverage = None, 0
        for hit in self.index.query_passages(question, k=k):
            if hit.score <= min_score:
                break
            quote = self._extractor.get_best_passage(hit.text, question)
            coverage = len(set(terms(quote)) & wanted)
            if coverage > best_coverage:
                best, best_coverage = (hit, quote), coverage
        return best

    def continue_chat(self, messages: List[AgentMessage],
                      session_id: str = "default",
                      lang: Optional[str] = None,
                      units: Optional[str] = None,
                      tools: Any = None) -> AgentMessage:
        return AgentMessage(role=MessageRole.ASSISTANT, content=self.answer(messages).text)

    def stream_tokens(self, messages: List[AgentMessage],
                      session_id: str = "default",
                      lang: Optional[str] = None,
                      units: Optional[str] = None) -> Iterator[str]:
        """The answer word by word, spaces kept: the tokens join to ``continue_chat``'s content."""
        yield from tokenize_answer(self.answer(messages).text)

    def stream_events(self, messages: List[AgentMessage], *,
                      session_id: str = "default",
                      lang: Optional[str] = None,
                      tools: Any = None,
                      should_stop: StopCheck = never_stop) -> Iterator[StreamItem]:
        """ANSWER tokens, then one CITATIONS item naming the quoted notes (unless stopped)."""
        result = self.answer(messages)
        for token in tokenize_answer(result.text):
            if should_stop():
                return
            yield StreamItem(ANSWER, token)
        if result.citations and not should_stop():
            yield StreamItem(CITATIONS, data={"ids": list(result.citations)})
