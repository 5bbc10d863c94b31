"""Code context: a RetrievalEngine over a workspace folder's source files (issue #16, item 5).

``CodeRetrievalEngine`` (``opm.agents.retrieval``) ranks chunks of the folder's text files for a
message with BM25 (the ``bm25s`` library). It is a RetrievalEngine, not a DocumentIndexerEngine: the
files are the workspace's, which the engine does not manage; its index is a cache of them, refreshed
when a file's (mtime, size) changes, re-reading only the files that changed.

Chunks follow symbols where it can tell them: Python's top-level ``def``/``class`` (methods of a
long class on their own) through ``ast``; in other languages a line that starts a function, class,
struct or the like (a regex per language); anything else, or a symbol too long, in line windows.

Confinement is the workspace toolbox's: nothing whose real path (symbolic links followed) leaves the
root is listed or read, symlinked folders are not walked, hidden files and folders and the usual
build/vendor folders are skipped, and so are binary files and files over ``max_file_bytes``.

It sees what git sees: the root's ``.git/info/exclude``, the root's ``.gitignore`` and every
``.gitignore`` in a walked folder (relative to its own folder, the deepest that matches deciding, as in
git) are applied through ``pathspec.GitIgnoreSpec``; an ignored folder is not walked. An ignore file
that cannot be read is skipped, and a line pathspec cannot compile is dropped, each with a warning.
The rules are read again at every look at the folder, so a changed ``.gitignore`` changes the listing,
which is the index's signature. No Django here.
"""
from __future__ import annotations

import ast
import codecs
import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import bm25s
from ovos_plugin_manager.templates.agents import RetrievalEngine
from pathspec import GitIgnoreSpec
from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

from plugins_app.agent.embedding import DIM, EmbeddingStopped, embed, model_name
from plugins_app.agent.engines.notes import STOPWORDS, stem
from plugins_app.agent.ranking import rrf
from ugent_common.filelock import file_locked

DEFAULT_MAX_FILE_BYTES = 256 * 1024
DEFAULT_MAX_FILES = 5000
DEFAULT_RESCAN_SECONDS = 2.0
WINDOW_LINES = 40  # a line window's length, and the longest chunk a symbol keeps whole
SKIP_DIRS = frozenset({"node_modules", "__pycache__", "venv", "env", "dist", "build", "target", "vendor",
                       "site-packages"})
BINARY_SNIFF_BYTES = 8192
EMBED_MIN_SIMILARITY = 0.80  # with embeddings on: no chunk below this counts for a message
EMBED_MARGIN = 0.04  # ... nor one less than this above the median chunk's similarity to it
EMBED_BATCH = 8  # chunks embedded per call
EMBED_MAX_CHARS = 1200  # a chunk's first characters embedded (a symbol's head says what it is about)
EMBED_SAVE_EVERY = 200  # chunks embedded between two writes of the vector cache
CACHE_WRITE_SECS = 30.0  # after a pass of fewer chunks, the file is written at most this often
MAX_WARNED = 1024  # distinct ignore-file warnings remembered, so a bad file is not logged at every look

log = logging.getLogger("ugent.code_context")

# A line that starts a symbol, per file suffix (Python goes through ast instead).
_C_LIKE = re.compile(r"^\s*(?:export\s+)?(?:default\s+)?(?:public\s+|private\s+|protected\s+|static\s+|async\s+|"
                     r"abstract\s+|final\s+)*(?:function\*?|class|interface|enum|struct|trait|impl|fn|func|"
                     r"def|module|type|const\s+\w+\s*=\s*(?:async\s*)?\()\b")
_SYMBOL_START = {
    ".js": _C_LIKE, ".jsx": _C_LIKE, ".ts": _C_LIKE, ".tsx": _C_LIKE, ".mjs": _C_LIKE, ".cjs": _C_LIKE,
    ".go": re.compile(r"^(?:func|type)\b"),
    ".rs": re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+)?(?:fn|struct|enum|trait|impl|mod)\b"),
    ".rb": re.compile(r"^\s*(?:def|class|module)\b"),
    ".java": _C_LIKE, ".kt": re.compile(r"^\s*(?:\w+\s+)*(?:fun|class|object|interface)\b"),
    ".php": re.compile(r"^\s*(?:\w+\s+)*(?:function|class|interface|trait)\b"),
    ".swift": re.compile(r"^\s*(?:\w+\s+)*(?:func|class|struct|enum|protocol|extension)\b"),
    ".sh": re.compile(r"^\s*(?:function\s+\w+|\w+\s*\(\)\s*\{)"),
}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def code_terms(text: str) -> List[str]:
    """Search terms of code or prose: each identifier whole (lower-cased) and its snake_case and
    camelCase parts, stemmed as the notes index stems; stop words dropped."""
    out: List[str] = []
    for ident in _IDENT.findall(text):
        out.extend(_ident_terms(ident))
    return out


@lru_cache(maxsize=65536)
def _ident_terms(ident: str) -> Tuple[str, ...]:
    # identifiers repeat a great deal in code: each is split and stemmed once
    whole = ident.lower()
    parts = [p.lower() for piece in ident.split("_") for p in _CAMEL.findall(piece)]
    return tuple(stem(w) for w in dict.fromkeys([whole, *parts]) if len(w) > 1 and w not in STOPWORDS)


@dataclass(frozen=True)
class CodeChunk:
    """Lines start..end (1-based, inclusive) of one file, relative to the root."""

    path: str
    start: int
    end: int
    text: str
    symbol: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.start}-{self.end}"

    def index_terms(self) -> List[str]:
        # The path and the symbol's name say what a chunk is about, so they count twice.
        name = " ".join(p for p in (self.path.replace("/", " ").replace(".", " "), self.symbol) if p)
        return code_terms(f"{name} {name} {self.text}")


@dataclass(frozen=True)
class CodeHit:
    chunk: CodeChunk
    score: float


# --- chunking ------------------------------------------------------------------------------------

def _windows(path: str, lines: List[str], start: int, end: int, symbol: str = "") -> List[CodeChunk]:
    """Lines start..end in windows of WINDOW_LINES (blank-only windows dropped)."""
    chunks = []
    for s in range(start, end + 1, WINDOW_LINES):
        e = min(end, s + WINDOW_LINES - 1)
        text = "\n".join(lines[s - 1:e])
        if text.strip():
            chunks.append(CodeChunk(path, s, e, text, symbol))
    return chunks


def _spans_chunks(path: str, lines: List[str], spans: List[Tuple[int, int, str]]) -> List[CodeChunk]:
    """Symbol spans (start, end, name), with the lines between them as windows of their own."""
    chunks: List[CodeChunk] = []
    at = 1
    for start, end, name in sorted(spans):
        if start < at:
            continue
        if start > at:
            chunks.extend(_windows(path, lines, at, start - 1))
        if end - start + 1 <= WINDOW_LINES:
            chunks.append(CodeChunk(path, start, end, "\n".join(lines[start - 1:end]), name))
        else:
            chunks.extend(_windows(path, lines, start, end, name))
        at = end + 1
    if at <= len(lines):
        chunks.extend(_windows(path, lines, at, len(lines)))
    return chunks


def _python_spans(text: str) -> Optional[List[Tuple[int, int, str]]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    spans: List[Tuple[int, int, str]] = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.end_lineno or node.lineno
        if isinstance(node, ast.ClassDef) and end - start + 1 > WINDOW_LINES:
            # a long class: its head, then each method on its own
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if methods:
                first = min([methods[0].lineno] + [d.lineno for d in methods[0].decorator_list])
                spans.append((start, first - 1, node.name))
                for m in methods:
                    ms = min([m.lineno] + [d.lineno for d in m.decorator_list])
                    spans.append((ms, m.end_lineno or m.lineno, f"{node.name}.{m.name}"))
                continue
        spans.append((start, end, node.name))
    return spans


def _regex_spans(lines: List[str], pattern: re.Pattern) -> List[Tuple[int, int, str]]:
    starts = [i + 1 for i, line in enumerate(lines) if pattern.match(line)]
    spans = []
    for n, start in enumerate(starts):
        end = (starts[n + 1] - 1) if n + 1 < len(starts) else len(lines)
        while end > start and not lines[end - 1].strip():
            end -= 1
        name = _IDENT.findall(lines[start - 1])
        spans.append((start, end, " ".join(name[:4])))
    return spans


def chunk_file(path: str, text: str) -> List[CodeChunk]:
    """One file's chunks: by symbol where the language is known, else line windows."""
    lines = text.splitlines()
    if not lines:
        return []
    suffix = os.path.splitext(path)[1].lower()
    spans = None
    if suffix in (".py", ".pyi"):
        spans = _python_spans(text)
    elif suffix in _SYMBOL_START:
        spans = _regex_spans(lines, _SYMBOL_START[suffix])
    if not spans:
        return _windows(path, lines, 1, len(lines))
    return _spans_chunks(path, lines, spans)


# --- .gitignore ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _IgnoreRules:
    """One ignore file's rules and the folder (relative to the root, "" for the root) they are relative to."""

    base: str
    spec: GitIgnoreSpec


_warned: set = set()


def _warn_once(text: str) -> None:
    if text in _warned:
        return
    if len(_warned) >= MAX_WARNED:
        _warned.clear()
    _warned.add(text)
    log.warning("%s", text)


@lru_cache(maxsize=512)
def _compile_rules(where: str, text: str) -> GitIgnoreSpec:
    # Cached on the text: a folder is looked at every rescan_interval, its ignore files seldom change,
    # and a bad line is logged once per content rather than at every look.
    patterns = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            patterns.append(GitIgnoreSpecPattern(line))
        except (ValueError, re.error) as exc:
            _warn_once(f"{where}:{number}: {line!r} is not a gitignore pattern ({exc}); line skipped")
    return GitIgnoreSpec(patterns)


def _read_rules(real_root: Path, path: str, base: str) -> Optional[_IgnoreRules]:
    """The rules of the ignore file at `path`, or None when there is none or it cannot be read (logged).
    A symbolic link is not followed (git does not follow a symlinked .gitignore either), and nothing
    outside the root is read."""
    folder = Path(os.path.realpath(os.path.dirname(path)))
    if folder != real_root and real_root not in folder.parents:
        return None  # .git or .git/info is a link out of the root
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _warn_once(f"{path}: cannot be read ({exc.strerror or exc}); its ignore rules are not applied")
        return None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]  # git skips a BOM too
    # decoded as os.walk decodes names, so a pattern in any encoding meets the names it was written for
    return _IgnoreRules(base, _compile_rules(path, os.fsdecode(data)))


def _ignored(layers: Tuple[_IgnoreRules, ...], relative: str, is_dir: bool) -> bool:
    """Git's answer for a path below every layer's folder: the deepest layer with a matching line
    decides, and within it the last matching line (so ``!pattern`` brings a path back)."""
    for rules in reversed(layers):
        sub = relative[len(rules.base) + 1:] if rules.base else relative
        result = rules.spec.check_file(sub + "/" if is_dir else sub)
        if result.include is not None:
            return result.include
    return False


# --- the folder ------------------------------------------------------------------------------------

def _is_binary(data: bytes) -> bool:
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return True
    try:
        data[:BINARY_SNIFF_BYTES].decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < BINARY_SNIFF_BYTES - 4  # a character cut at the sniff's end is not binary
    return False


def folder_files(root: Path, *, max_file_bytes: int, max_files: int) -> Dict[str, Tuple[int, int]]:
    """{relative path: (mtime_ns, size)} of the files the index may read: inside root's real path
    (symbolic links followed for files, never walked for folders), not hidden, not ignored by git's
    rules (an ignored folder is not walked), under the size cap."""
    real_root = root.resolve()
    if not real_root.is_dir():
        return {}
    found: Dict[str, Tuple[int, int]] = {}
    exclude = _read_rules(real_root, os.path.join(real_root, ".git", "info", "exclude"), "")
    # each walked folder's rules: its parent's, then its own .gitignore's (top-down, so a parent comes first)
    layers: Dict[str, Tuple[_IgnoreRules, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        here = Path(dirpath).relative_to(real_root).as_posix()
        prefix = "" if here == "." else here + "/"
        rules = layers.pop(dirpath, (exclude,) if exclude else ())
        if ".gitignore" in filenames:
            own = _read_rules(real_root, os.path.join(dirpath, ".gitignore"), prefix.rstrip("/"))
            rules = rules + (own,) if own else rules
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not os.path.islink(os.path.join(dirpath, d))
                             and not _ignored(rules, prefix + d, is_dir=True))  # pruned: never walked
        layers.update((os.path.join(dirpath, d), rules) for d in dirnames)
        for name in sorted(filenames):
            if name.startswith(".") or _ignored(rules, prefix + name, is_dir=False):
                continue
            path = Path(dirpath) / name
            try:
                real = path.resolve()
                if real_root not in real.parents or not real.is_file():
                    continue  # a link out of the root (or to something that is no file)
                stat = real.stat()
            except (OSError, RuntimeError):
                continue
            if stat.st_size == 0 or stat.st_size > max_file_bytes:
                continue
            found[path.relative_to(real_root).as_posix()] = (stat.st_mtime_ns, stat.st_size)
            if len(found) >= max_files:
                return found
    return found


def _read_chunks(root: Path, relative: str, max_file_bytes: int) -> List[CodeChunk]:
    real_root = root.resolve()
    real = (real_root / relative).resolve()
    if real_root not in real.parents:  # the link changed since the listing
        return []
    try:
        with open(real, "rb") as fh:
            data = fh.read(max_file_bytes + 1)
    except OSError:
        return []
    if len(data) > max_file_bytes or _is_binary(data):
        return []
    return chunk_file(relative, data.decode("utf-8", "replace"))


@dataclass(frozen=True)
class _Index:
    chunks: Tuple[CodeChunk, ...]
    retriever: Optional[bm25s.BM25]
    vocabulary: frozenset
    signature: Tuple[Tuple[str, int, int], ...]
    vectors: Optional[object] = None  # numpy (len(chunks), 384): each chunk's embedding, once all are made


_EMPTY = _Index((), None, frozenset(), ())


class _Closed(Exception):
    """The engine was closed while it embedded its chunks."""


class CodeRetrievalEngine(RetrievalEngine):
    """BM25 over the source files below ``config["root"]``.

    config: ``root`` (required), ``max_file_bytes`` (256 KiB), ``max_files`` (5000),
    ``rescan_interval`` seconds between looks at the folder (2), ``embeddings`` (false: BM25 alone; true:
    each chunk's e5 embedding too, made in a thread of its own, and the chunks that stand out for a query
    fused by rank with BM25's, plugins_app.agent.embedding), ``vector_cache`` (a file that keeps the
    vectors across restarts; none: made again in each process). ``query`` returns
    ``("path:start-end\\n<lines>", score)`` pairs; ``query_chunks`` the chunks themselves.
    Safe to share between threads: a query reads one built index, a rebuild swaps it whole.

    Only the first build happens in a query. After it, a query that finds the last look older than
    ``rescan_interval`` starts the next look (the walk, and a rebuild if a file changed) in a thread of
    its own and answers from the index it has: a turn never waits for a walk over the folder or a
    rebuild after an edit (a 5,000-file tree takes tens of milliseconds to walk and seconds to index).
    A ``rescan_interval`` of 0 looks in every query, in the query's own thread.
    """

    def __init__(self, config: Optional[dict] = None):
        super().__init__(config)
        self._lock = threading.Lock()  # guards starting a background look
        self._build_lock = threading.Lock()  # one look (walk and rebuild) at a time
        self._index: _Index = _EMPTY
        self._files: Dict[str, Tuple[Tuple[int, int], List[CodeChunk]]] = {}
        self._built = False
        self._checked_at = float("-inf")
        self._looking: Optional[threading.Thread] = None  # the background look under way, if any
        self._embedding: Optional[threading.Thread] = None  # the thread embedding the chunks, if any
        self._embed_wanted = False  # an index without its vectors waits for that thread
        self._embed_failed = None  # the signature of the index whose embedding failed: not tried again
        self._vectors: Dict[str, object] = {}  # sha256 of what was embedded -> its vector (that thread's)
        self._cache_dirty = False  # vectors made or dropped since the file was last written
        self._cache_written_at = float("-inf")  # time.monotonic() of that write
        self._cache_seen = None  # (mtime_ns, size) of the file as this process last read or wrote it
        self._closed = False  # dropped by its owner: an embedding under way stops after its batch
        self.builds = 0  # how many times the index was built (a test reads it)

    @property
    def root(self) -> Path:
        return Path(self.config["root"])

    def _int(self, name: str, default: int) -> int:
        return int(self.config.get(name, default))

    # -- OPM contract --
    def query(self, query: str, lang: Optional[str] = None, k: int = 3) -> List[Tuple[str, float]]:
        """Up to ``k`` (content, score) pairs, best first; content is "path:start-end" and the lines."""
        return [(f"{h.chunk.where}\n{h.chunk.text}", h.score) for h in self.query_chunks(query, k=k)]

    def query_chunks(self, query: str, k: int = 3) -> List[CodeHit]:
        """The ``k`` best chunks for ``query``, best first: by BM25 (a term shared with it), and with
        embeddings on, fused by rank with the chunks whose embedding stands out for it."""
        index = self.refresh()
        if k <= 0 or not index.chunks:
            return []
        lexical = self._lexical(index, query, k * 3)
        semantic = []
        if index.vectors is not None:
            try:
                semantic = self._semantic(index, query, k * 3)
            except Exception:  # the embeddings are a help: BM25 still answers
                log.exception("code index: embedding the query failed; BM25 alone ranks the chunks of %s",
                              self.root)
        if not semantic:
            return [CodeHit(index.chunks[i], score) for i, score in lexical[:k]]
        fused = rrf([[i for i, _ in lexical], [i for i, _ in semantic]])
        return [CodeHit(index.chunks[i], score) for i, score in fused[:k]]

    @staticmethod
    def _lexical(index: _Index, query: str, k: int) -> List[Tuple[int, float]]:
        wanted = [t for t in dict.fromkeys(code_terms(query)) if t in index.vocabulary]
        if not wanted or index.retriever is None:
            return []
        ids, scores = index.retriever.retrieve([wanted], k=min(k, len(index.chunks)), show_progress=False)
        ranked = sorted(((float(s), int(i)) for i, s in zip(ids[0], scores[0]) if s > 0),
                        key=lambda pair: (-pair[0], pair[1]))
        return [(i, score) for score, i in ranked]

    @staticmethod
    def _semantic(index: _Index, query: str, k: int) -> List[Tuple[int, float]]:
        """Chunks whose cosine similarity to the query is at least EMBED_MIN_SIMILARITY and stands
        EMBED_MARGIN above the median chunk's: e5's similarities sit close together (0.75-0.81 for
        chunks that have nothing to do with a message), so a chunk counts by how far it stands out."""
        import numpy as np
        if not query.strip():
            return []
        sims = index.vectors @ embed([query], kind="query")[0]
        floor = max(EMBED_MIN_SIMILARITY, float(np.median(sims)) + EMBED_MARGIN)
        best = np.argsort(-sims, kind="stable")[:k]
        return [(int(i), float(sims[i])) for i in best if sims[i] >= floor]

    # -- the cache --
    def refresh(self, force: bool = False) -> _Index:
        """The index to answer from. The first call (or `force`) builds it here; later, once the last
        look is older than rescan_interval, a background thread looks again and rebuilds if a file was
        added, changed or removed, and this call returns the index as it stands."""
        interval = float(self.config.get("rescan_interval", DEFAULT_RESCAN_SECONDS))
        if self._built and not force and interval > 0:
            if time.monotonic() - self._checked_at >= interval:
                self._look_in_background()
            return self._index
        return self._look(force)

    def _look_in_background(self) -> None:
        with self._lock:
            if self._looking is not None and self._looking.is_alive():
                return
            self._checked_at = time.monotonic()  # one look per interval, however many queries come
            self._looking = threading.Thread(target=self._look_logged, name="ugent-code-index", daemon=True)
            self._looking.start()

    def _look_logged(self) -> None:
        try:
            self._look()
        except Exception:  # the index in hand stays; the next interval looks again
            log.exception("code index: looking at %s failed", self.root)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait for a background look under way; whether none is running now (tests, the bench)."""
        looking = self._looking
        if looking is not None:
            looking.join(timeout)
        return looking is None or not looking.is_alive()

    def _look(self, force: bool = False) -> _Index:
        with self._build_lock:
            max_bytes = self._int("max_file_bytes", DEFAULT_MAX_FILE_BYTES)
            listing = folder_files(self.root, max_file_bytes=max_bytes,
                                   max_files=self._int("max_files", DEFAULT_MAX_FILES))
            self._checked_at = time.monotonic()
            signature = tuple(sorted((p, m, s) for p, (m, s) in listing.items()))
            if force or not self._built or signature != self._index.signature:
                files = {}
                for relative, stamp in listing.items():
                    cached = self._files.get(relative)
                    chunks = cached[1] if cached and cached[0] == stamp else _read_chunks(self.root, relative,
                                                                                           max_bytes)
                    files[relative] = (stamp, chunks)
                self._files = files
                self._index = _build(tuple(c for _, (_, cs) in sorted(files.items()) for c in cs), signature)
                self._built = True
                self.builds += 1
            if (self.config.get("embeddings") and self._index.vectors is None and self._index.chunks
                    and self._embed_failed != self._index.signature):
                self._embed_in_background()
            return self._index

    def close(self) -> None:
        """The index is no longer used (its folder dropped from the process's): an embedding of its chunks
        under way stops after the batch in hand, and the vectors it made are kept in the ``vector_cache``
        file for the next index of that folder."""
        with self._lock:
            self._closed = True
            self._embed_wanted = False

    # -- embeddings (config "embeddings": true) --
    def _embed_in_background(self) -> None:
        """The chunks' embeddings are made in a thread of their own, never in a query: until they are, and
        while a changed folder's new chunks are embedded, BM25 alone answers."""
        with self._lock:
            if self._closed:  # (a turn may still hold a dropped index)
                return
            self._embed_wanted = True
            if self._embedding is None or not self._embedding.is_alive():  # (a forked child's is its parent's)
                self._embedding_start()

    def _embedding_start(self) -> None:
        self._embedding = threading.Thread(target=self._embed_chunks, name="ugent-code-embed", daemon=True)
        self._embedding.start()

    def _embed_chunks(self) -> None:
        try:
            while True:
                with self._lock:
                    wanted, self._embed_wanted = self._embed_wanted, False
                    if not wanted or self._closed:
                        return
                index = self._index
                if index.vectors is not None or not index.chunks:
                    continue
                try:
                    vectors = self._vectors_of(index.chunks)
                except (_Closed, EmbeddingStopped) as exc:  # dropped, or the process is exiting: not a failure
                    log.info("code index: embedding the chunks of %s stopped (%s)", self.root,
                             "the index was dropped" if isinstance(exc, _Closed) else "the process is exiting")
                    with self._lock:
                        self._embed_wanted = False
                    return
                except Exception:
                    self._embed_failed = index.signature
                    raise
                with self._build_lock:
                    if self._index is index:  # else a newer index came meanwhile, and asked again
                        self._index = replace(index, vectors=vectors)
        except Exception:  # BM25 alone answers; a changed folder's next index asks again
            log.exception("code index: embedding the chunks of %s failed; BM25 alone ranks them", self.root)
            with self._lock:
                self._embed_wanted = False
        finally:
            with self._lock:
                if self._embed_wanted and not self._closed:  # asked after this thread's last look: a new one answers
                    self._embedding_start()
                else:
                    self._embedding = None

    def _vectors_of(self, chunks: Tuple[CodeChunk, ...]):
        """Each chunk's vector (its path and first EMBED_MAX_CHARS embedded as a passage, on the bulk
        embedding thread): those of unchanged chunks kept from before (and from the ``vector_cache`` file,
        which a restart or another process left), the others made EMBED_BATCH at a time. With a file, one
        process at a time embeds the folder (a lock beside the file; the others then read what it made),
        and the file is written every EMBED_SAVE_EVERY chunks and after a pass, at most every
        CACHE_WRITE_SECS for a few chunks (an agent editing files would rewrite it every look). Then the
        cache holds these chunks' only."""
        import numpy as np
        started = time.monotonic()
        texts: Dict[str, str] = {}
        keys = []
        for c in chunks:
            text = f"{c.path}\n{c.text[:EMBED_MAX_CHARS]}"
            key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
            texts[key] = text
            keys.append(key)
        with self._cache_locked():
            if any(key not in self._vectors for key in texts):
                for key, vector in self._cache_read().items():  # what another process or an earlier start made
                    self._vectors.setdefault(key, vector)
            missing = [key for key in texts if key not in self._vectors]
            if missing:
                log.info("code index: embedding %d chunks of %s (%d kept from before)", len(missing), self.root,
                         len(texts) - len(missing))
            for at in range(0, len(missing), EMBED_BATCH):
                if self._closed:
                    break  # what was made is written below: it serves the folder's next index
                part = missing[at:at + EMBED_BATCH]
                for key, vector in zip(part, embed([texts[k] for k in part], kind="passage", bulk=True)):
                    self._vectors[key] = vector
                self._cache_dirty = True
                if (at // EMBED_BATCH + 1) % max(1, EMBED_SAVE_EVERY // EMBED_BATCH) == 0:
                    self._cache_write()  # a restart mid-way keeps what was made
            if len(self._vectors) != len(texts):  # chunks gone since (or, closed, some not made yet)
                self._vectors = {key: self._vectors[key] for key in texts if key in self._vectors}
                self._cache_dirty = True
            if self._cache_dirty and (len(missing) >= EMBED_SAVE_EVERY or self._closed or
                                      time.monotonic() - self._cache_written_at >= CACHE_WRITE_SECS):
                self._cache_write()
        if any(key not in self._vectors for key in keys):
            raise _Closed()  # stopped before every chunk had its vector
        if missing:
            log.info("code index: embedded %d chunks of %s in %.1f s", len(missing), self.root,
                     time.monotonic() - started)
        return np.stack([self._vectors[key] for key in keys]).astype(np.float32)

    @contextlib.contextmanager
    def _cache_locked(self):
        """An exclusive lock on ``<vector_cache>.lock`` (none without a file, or where it cannot be made)."""
        path = self.config.get("vector_cache")
        with contextlib.ExitStack() as held:
            if path:
                try:
                    held.enter_context(file_locked(f"{path}.lock"))
                except OSError as exc:
                    log.warning("code index: the vector cache's lock %s.lock cannot be taken (%s); embedding "
                                "without it", path, exc)
            yield

    def _cache_read(self) -> dict:
        """The vectors the ``vector_cache`` file holds, by key, when it changed since this process last read
        or wrote it; none when it is missing, unchanged, unreadable or of another model (logged)."""
        import numpy as np
        path = self.config.get("vector_cache")
        try:
            stamp = os.stat(path) if path else None
        except OSError:
            stamp = None
        if stamp is None or (stamp.st_mtime_ns, stamp.st_size) == self._cache_seen:
            return {}
        try:
            with np.load(path, allow_pickle=False) as saved:
                self._cache_seen = (stamp.st_mtime_ns, stamp.st_size)
                if str(saved["model"]) != model_name() or saved["vectors"].shape[1:] != (DIM,):
                    return {}
                return dict(zip((str(k) for k in saved["keys"]), saved["vectors"]))
        except Exception as exc:  # a damaged file costs its vectors, which are made again
            log.warning("code index: the vector cache %s cannot be read (%s: %s); its chunks are embedded again",
                        path, type(exc).__name__, exc)
            return {}

    def _cache_write(self) -> None:
        """The vectors to the ``vector_cache`` file, whole or not at all; a failure (a full or read-only
        disk) is logged and costs only a restart's re-embedding."""
        import numpy as np
        path = self.config.get("vector_cache")
        self._cache_dirty = False
        self._cache_written_at = time.monotonic()
        if not path:
            return
        keys = list(self._vectors)
        vectors = np.stack([self._vectors[k] for k in keys]) if keys else np.zeros((0, DIM), np.float32)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp.npz"
        try:
            np.savez(tmp, model=np.array(model_name()), keys=np.array(keys, dtype="U64"), vectors=vectors)
            os.replace(tmp, path)
            stamp = os.stat(path)
            self._cache_seen = (stamp.st_mtime_ns, stamp.st_size)
        except OSError as exc:
            log.warning("code index: the vector cache %s cannot be written (%s); a restart embeds these chunks again",
                        path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def wait_embedded(self, timeout: Optional[float] = None) -> bool:
        """Wait for the chunks' embeddings under way; whether none is being made now (tests, the bench)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            embedding = self._embedding
            if embedding is None or not embedding.is_alive() and embedding is self._embedding:
                return True
            embedding.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if deadline is not None and time.monotonic() >= deadline:
                return self._embedding is None


def _build(chunks: Tuple[CodeChunk, ...], signature) -> _Index:
    tokenized = [c.index_terms() for c in chunks]
    if not any(tokenized):
        return _Index(chunks, None, frozenset(), signature)
    retriever = bm25s.BM25()
    retriever.index(tokenized, show_progress=False)
    return _Index(chunks, retriever, frozenset(t for ts in tokenized for t in ts), signature)
