"""lance_embedded's vector store: one LanceDB table in an embedded dataset under the var dir.

The MemoryFact rows are the source of truth (the admin edits them; each row keeps its own vector in
`embedding`); the table `memory_facts` (id, actor_key, vector) follows them: a fact saved, re-texted,
moved to another user or deleted is written here in the same call, and a table that is missing, of
another `embedding_dim`, or not holding the rows' vectors when this process first opens it is rebuilt
from the rows. Facts without a vector (saved under another backend) are embedded by the Celery task
plugins_app.tasks.memory_vector_backfill, which a search enqueues (`backfill_ask`), never in a
recall. Every search is filtered to one actor key before ranking (a prefilter), so bob never
sees alice's vectors. From UGENT_MEMORY_LANCE_INDEX_MIN_ROWS vectors on, `vector_index_refresh()`
gives the table an IVF_PQ index and later folds new rows into it: the Celery task
plugins_app.tasks.memory_vector_index, enqueued by a save that finds the index wanted (its build takes
minutes; never on a turn).

Each save writes a fragment of its own (and a deletion file for the vector it replaces), and a search
reads every fragment: on the 2-core VM 50 single saves doubled a 3,000-vector search (13.6 to 27 ms)
and 200 made it 84 ms; 2,000 made it 760 ms. So a save that finds MAX_SMALL_FRAGMENTS small fragments
enqueues the same task, which compacts the table (`optimize`: the fragments merged, the index brought
up to date, versions older than KEEP_VERSIONS deleted): once, until it has run or MAINTAIN_EVERY_SECS
have passed. Within a process the compaction holds the store's lock, so a save waits for it rather than
conflicting with it. UGENT_MEMORY_LANCE_DIR may be a local dir or a LanceDB URI (s3://…), which
several hosts in servers mode must share.

lancedb and pyarrow are imported here only, and this module only by the lance_embedded backend, so a
daemon on another backend never loads them.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings

from ugent_common import dblock
from ugent_common.filelock import file_locked

log = logging.getLogger("ugent.memory")

TABLE = "memory_facts"
NPROBES = 16  # IVF partitions searched; with REFINE the exact cosine re-ranks what PQ found
REFINE = 4
#: Small fragments (one per save since the last compaction) from which a save asks for maintenance.
MAX_SMALL_FRAGMENTS = 16
#: Once it asked, a process asks again after this long, or once the maintenance ran in it (embedded
#: mode's worker is in the process): a burst of saves enqueues one task, not one each.
MAINTAIN_EVERY_SECS = 10.0
#: Versions the compaction keeps: a reader in another process may still be reading one this old.
KEEP_VERSIONS = timedelta(minutes=10)
#: Facts the backfill embeds and writes at a time (one LanceDB fragment each).
BACKFILL_BATCH = 64
#: A process looks for facts without a vector (and asks for the backfill) at most this often.
BACKFILL_ASK_SECS = 300.0
#: The next look when a request was made inside a transaction that has not committed yet (it may roll back).
BACKFILL_REASK_SECS = 5.0
#: What PostgreSQL's advisory lock of a remote dataset's backfill is named by (with the dataset's URI).
BACKFILL_LOCK_NAME = "ugent memory backfill "


def _ids_in(fact_ids) -> str:
    """LanceDB's SQL filter for these fact ids."""
    return "id IN (" + ", ".join(str(int(i)) for i in fact_ids) + ")"


def _quoted(value: str) -> str:
    """A string literal for LanceDB's SQL filter."""
    return "'" + value.replace("'", "''") + "'"


class LanceStore:
    """The table for one (dataset dir, embedding_dim); methods are safe from several threads."""

    CHECK_EVERY = 1000  # upserts between two looks at whether the vector index wants (re)building

    def __init__(self, uri: str, dim: int):
        self.uri, self.dim = str(uri), dim
        self.lock = threading.Lock()
        self._table = None
        self._upserts = 0
        self._next_maintenance = 0.0  # time.monotonic() before which no save asks for maintenance again
        self._next_backfill_ask = 0.0  # time.monotonic() before which this process asks for no backfill again

    # --- opening, rebuilding -----------------------------------------------------------------

    def schema(self):
        import pyarrow as pa
        return pa.schema([pa.field("id", pa.int64()), pa.field("actor_key", pa.string()),
                          pa.field("vector", pa.list_(pa.float32(), self.dim))])

    def table(self):
        """The open table, rebuilt from the rows first when it is missing or out of step."""
        if self._table is not None:
            return self._table
        with self.lock:
            if self._table is None:
                import lancedb
                # every read checks for other processes' writes (the web process reads what a worker saved)
                db = lancedb.connect(self.uri, read_consistency_interval=timedelta(0))
                table = db.open_table(TABLE) if TABLE in _table_names(db) else None
                if table is None or not self._in_step(table):
                    table = self._rebuild(db)
                self._table = table
        return self._table

    def _in_step(self, table) -> bool:
        from plugins_app.agent.memory.models import MemoryFact
        field = table.schema.field("vector")
        if getattr(field.type, "list_size", None) != self.dim:
            log.warning("memory: the LanceDB table holds %s-dimension vectors, embedding_dim is %d: rebuilding",
                        getattr(field.type, "list_size", "?"), self.dim)
            return False
        rows = MemoryFact.objects.exclude(embedding__isnull=True).count()
        held = table.count_rows()
        if held == rows:
            return True
        if rows < held <= rows + BACKFILL_BATCH and self._backfill_running():
            # a backfill has written a batch to the table and not yet to the rows: the table is ahead, not
            # wrong (a rebuild now would drop the batch from it)
            log.info("memory: the LanceDB table holds %d vectors for %d facts with one while a backfill writes "
                     "them: kept", held, rows)
            return True
        log.warning("memory: the LanceDB table holds %d vectors for %d facts with one: rebuilding", held, rows)
        return False

    def _rebuild(self, db):
        """The table made anew from the rows' stored vectors. Facts without one (saved while another
        backend was in force) are embedded by the backfill task, not here: this runs in the first recall
        or save of a process, which would wait minutes for thousands of them (backfill_ask)."""
        from plugins_app.agent.memory.models import MemoryFact
        table = db.create_table(TABLE, schema=self.schema(), mode="overwrite")
        batch: list[tuple[int, str, bytes]] = []
        rows = MemoryFact.objects.exclude(embedding__isnull=True).values_list("id", "actor_key", "embedding")
        for row in rows.iterator(chunk_size=5000):
            batch.append((row[0], row[1], bytes(row[2])))
            if len(batch) == 5000:
                self._add(table, batch)
                batch = []
        self._add(table, batch)
        log.info("memory: LanceDB table %s rebuilt from the rows (%d vectors)", f"{self.uri}/{TABLE}",
                 table.count_rows())
        return table

    # --- facts without a vector -----------------------------------------------------------------

    def backfill_ask(self) -> bool:
        """When facts have no vector (saved while another backend was in force), enqueue the backfill
        task (plugins_app.tasks.memory_vector_backfill). Asked at each search, looking at most once every
        BACKFILL_ASK_SECS: a backfill cut short (its worker killed) is asked for again. Until it has run,
        recall finds those facts only when pinned or core."""
        from plugins_app.agent.memory.conf import memory_conf
        from plugins_app.agent.memory.models import MemoryFact
        from django.db import transaction
        if time.monotonic() < self._next_backfill_ask:
            return False
        self._next_backfill_ask = time.monotonic() + BACKFILL_ASK_SECS
        if memory_conf().backend != "lance_embedded" or \
                not MemoryFact.objects.filter(embedding__isnull=True).exists():
            return False  # (another backend opens the table only to delete forgotten facts)
        from ugent_common.tasks import task_named

        def ask():
            self._next_backfill_ask = time.monotonic() + BACKFILL_ASK_SECS
            task_named("plugins_app.tasks.memory_vector_backfill").delay()
        if transaction.get_connection().in_atomic_block:
            # asked once the transaction commits; one rolled back drops the request (Django runs no
            # callback for it), so until the commit the next look is due again soon, not in 5 minutes
            self._next_backfill_ask = time.monotonic() + BACKFILL_REASK_SECS
        transaction.on_commit(ask)
        return True

    def backfill(self) -> int:
        """Facts without a vector embedded (on the bulk embedding thread: one core, and no query waits
        behind it) and written to the table and their rows, BACKFILL_BATCH at a time, once over them in
        id order; how many. A fact that changed meanwhile keeps what its row says (its text's own vector
        when an edit embedded it; none when it was forgotten, or edited under another backend, which the
        next backfill embeds)."""
        for _ in range(3):  # (a process looking at the lock holds it for an instant: _backfill_running)
            with self._backfill_locked() as mine:
                if mine:
                    return self._backfill()
            time.sleep(0.05)
        log.info("memory: a backfill of facts without a vector is running already")
        return 0

    def _backfill_running(self) -> bool:
        """Whether another backfill of this dataset holds its lock now (never for a remote dataset on SQLite)."""
        with self._backfill_locked() as free:
            return not free

    @contextlib.contextmanager
    def _backfill_locked(self):
        """One backfill at a time per dataset (whether this one got it): a lock file beside a local dataset;
        for a remote one (s3://…, which several hosts may share) PostgreSQL's advisory lock on the dataset's
        name, held by this thread's connection (released when it ends, or its process dies). A remote
        dataset on SQLite has none (one host), and a second backfill there only repeats work."""
        if "://" in self.uri:
            if not dblock.available():
                yield True
                return
            with dblock.db_locked(BACKFILL_LOCK_NAME + self.uri) as mine:
                yield mine
            return
        with file_locked(f"{self.uri.rstrip('/')}.backfill.lock", wait=False) as mine:
            yield mine

    def _backfill(self) -> int:
        from plugins_app.agent import embedding
        from plugins_app.agent.memory.models import MemoryFact
        table = self.table()  # opened (and checked against the rows) before this changes any row
        started, done, after, written = time.monotonic(), 0, 0, []
        todo = MemoryFact.objects.filter(embedding__isnull=True).count()
        if todo:
            log.info("memory: embedding %d facts saved without a vector", todo)
        try:
            while True:
                chunk = list(MemoryFact.objects.filter(embedding__isnull=True, id__gt=after).order_by("id")
                             .values_list("id", "actor_key", "text")[:BACKFILL_BATCH])
                if not chunk:
                    break
                after = chunk[-1][0]
                vectors = embedding.embed([text for _, _, text in chunk], kind="passage", bulk=True)
                batch = [(fid, actor, vector.tobytes()) for (fid, actor, _), vector in zip(chunk, vectors)]
                # The table first, then the rows: a crash between the two leaves vectors in the table for rows
                # still without one, which the next backfill embeds and replaces (the other way round, rows
                # with a vector the table lacks, no backfill would look at again).
                self._replace(table, [fid for fid, _, _ in batch], batch)  # one fragment a batch, not one a fact
                lost = []
                for (fid, actor, text), (_, _, raw) in zip(chunk, batch):
                    if MemoryFact.objects.filter(pk=fid, actor_key=actor, text=text,
                                                 embedding__isnull=True).update(embedding=raw):
                        done += 1
                        written.append(fid)
                    else:
                        lost.append(fid)
                if lost:
                    self._settle(lost)
                log.info("memory: embedded %d of %d facts saved without a vector", done, todo)
        finally:  # a backfill cut short (the process exiting) still mends what it wrote: no backfill looks again
            self._restore(table, written)
        if done and (self.small_fragments() >= MAX_SMALL_FRAGMENTS or self.index_wanted()):
            from ugent_common.tasks import task_named
            task_named("plugins_app.tasks.memory_vector_index").delay()
        if done:
            log.info("memory: %d facts embedded in %.1f s", done, time.monotonic() - started)
        return done

    def _restore(self, table, fact_ids: list[int]) -> None:
        """The backfill's facts put back in the table where it lacks them: another process that rebuilt the
        table from the rows between a batch's table write and its rows' writes left that batch out."""
        for at in range(0, len(fact_ids), 1000):
            part = fact_ids[at:at + 1000]
            held = table.search().where(_ids_in(part)).select(["id"]).limit(2 * len(part) + 1).to_arrow()
            counted = collections.Counter(held.column("id").to_pylist())
            wrong = [fid for fid in part if counted.get(fid) != 1]  # missing, or twice (a rebuild read its row)
            if wrong:
                log.warning("memory: %d vectors the backfill wrote were missing from the LanceDB table or in it "
                            "twice (it was rebuilt meanwhile): written again", len(wrong))
                self._settle(wrong)

    def _settle(self, fact_ids: list[int]) -> None:
        """Facts the backfill embedded but did not write, because they changed meanwhile (forgotten, edited,
        moved, or embedded by their own save): the table takes what their rows hold now, or drops them."""
        from plugins_app.agent.memory.models import MemoryFact
        now = [(fid, actor, bytes(raw)) for fid, actor, raw in
               MemoryFact.objects.filter(pk__in=fact_ids, embedding__isnull=False)
               .values_list("id", "actor_key", "embedding")]
        self._replace(self.table(), fact_ids, now)

    def _replace(self, table, fact_ids: list[int], rows: list[tuple[int, str, bytes]]) -> None:
        """The table's vectors for `fact_ids` dropped and `rows` added, under the store's lock."""
        with self.lock:
            table.delete(_ids_in(fact_ids))
            self._add(table, rows)

    def _add(self, table, rows: list[tuple[int, str, bytes]]) -> None:
        import numpy as np
        import pyarrow as pa
        rows = [r for r in rows if len(r[2]) == 4 * self.dim]  # a vector of another size waits for re-embedding
        if not rows:
            return
        flat = np.frombuffer(b"".join(r[2] for r in rows), dtype=np.float32)
        table.add(pa.table({
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "actor_key": pa.array([r[1] for r in rows], pa.string()),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), self.dim),
        }, schema=self.schema()))

    # --- keeping in step with the rows ----------------------------------------------------------

    def upsert(self, *, fact_id: int, actor_key: str, vector: bytes) -> bool:
        """The fact's vector, replacing any the table held for that id. True when the vector index
        wants building or refreshing now (the caller enqueues memory_vector_index)."""
        table = self.table()
        with self.lock:
            table.delete(f"id = {int(fact_id)}")
            self._add(table, [(int(fact_id), actor_key, vector)])
            self._upserts += 1
            index_look = self._upserts % self.CHECK_EVERY == 1 or self.CHECK_EVERY <= 1
        if time.monotonic() < self._next_maintenance:
            return False
        wanted = self.small_fragments() >= MAX_SMALL_FRAGMENTS or (index_look and self.index_wanted())
        if wanted:
            self._next_maintenance = time.monotonic() + MAINTAIN_EVERY_SECS
        return wanted

    def small_fragments(self) -> int:
        """The table's small fragments: one per save since the last compaction (under a millisecond)."""
        return int(self.table().stats()["fragment_stats"]["num_small_fragments"])

    def index_wanted(self) -> bool:
        """No vector index and enough rows for one; or one that leaves a tenth of the rows unindexed."""
        table = self.table()
        vector = [ix for ix in table.list_indices() if ix.name == "vector_idx"]
        if not vector:
            return table.count_rows() >= settings.UGENT_MEMORY_LANCE_INDEX_MIN_ROWS
        stats = table.index_stats("vector_idx")
        return bool(stats and stats.num_unindexed_rows > max(1000, stats.num_indexed_rows // 10))

    def delete(self, fact_ids: list[int]) -> None:
        if not fact_ids:
            return
        table = self.table()
        with self.lock:
            table.delete(_ids_in(fact_ids))

    # --- searching ------------------------------------------------------------------------------

    def search(self, *, actor_key: str, vector, limit: int) -> list[tuple[int, float]]:
        """(fact id, cosine similarity), best first, over `actor_key`'s vectors only."""
        table = self.table()
        self.backfill_ask()
        query = (table.search(vector, vector_column_name="vector").distance_type("cosine")
                 .where(f"actor_key = {_quoted(actor_key)}", prefilter=True)
                 .nprobes(NPROBES).refine_factor(REFINE).limit(limit).select(["id", "_distance"]))
        found = query.to_arrow()
        return [(int(i), 1.0 - float(d)) for i, d in zip(found.column("id").to_pylist(),
                                                         found.column("_distance").to_pylist())]

    def vector_index_refresh(self) -> str:
        """IVF_PQ over the vectors once there are enough of them, the actor_key bitmap, then the
        unindexed rows folded in and the saves' small fragments merged (`optimize`). Minutes on a large
        table: call it off any turn."""
        from lancedb.index import IvfPq
        table = self.table()
        rows = table.count_rows()
        names = {ix.name for ix in table.list_indices()}
        done = []
        if "actor_key_idx" not in names and rows:
            table.create_scalar_index("actor_key", index_type="BITMAP", name="actor_key_idx")
            done.append("actor_key bitmap")
        if "vector_idx" not in names and rows >= settings.UGENT_MEMORY_LANCE_INDEX_MIN_ROWS:
            partitions = max(1, min(256, int(rows ** 0.5) // 4))
            table.create_index("vector", name="vector_idx",
                               config=IvfPq(distance_type="cosine", num_partitions=partitions,
                                            num_sub_vectors=self.dim // 8))
            done.append(f"IVF_PQ ({partitions} partitions)")
        elif names or self.small_fragments() > 1:
            with self.lock:  # this process's saves wait for the compaction instead of conflicting with it
                table.optimize(cleanup_older_than=KEEP_VERSIONS)
            done.append("optimized")
        self._next_maintenance = 0.0  # done here: the next save that finds fragments may ask again
        return ", ".join(done) or "nothing to do"


def _table_names(db) -> list[str]:
    return list(db.list_tables().tables)


_stores: dict[tuple[str, int], LanceStore] = {}  # (dataset uri, embedding_dim) -> its store
_stores_lock = threading.Lock()


def store(dim: int) -> LanceStore:
    """The process's store for the configured dataset dir and embedding_dim."""
    key = (str(settings.UGENT_MEMORY_LANCE_DIR), int(dim))
    found = _stores.get(key)
    if found is None:
        with _stores_lock:
            found = _stores.setdefault(key, LanceStore(key[0], key[1]))
    return found


def dataset_exists() -> bool:
    """Whether this install has a LanceDB dataset (deletes reach it whatever backend is in force). A
    remote dataset (s3://…, shared by several hosts) is taken to exist."""
    uri = str(settings.UGENT_MEMORY_LANCE_DIR)
    return "://" in uri or Path(uri).exists()
