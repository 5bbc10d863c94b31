"""lance_embedded as facts are saved one by one: search and save latency with the maintenance a save
asks for (plugins_app/agent/memory/lance.py: compaction once MAX_SMALL_FRAGMENTS small fragments
stand), beside the same saves with none (as before it), in one run.

    python bench/memory_saves.py [--base 3000] [--saves 300] [--every 50]

Each side starts from `--base` vectors written in one batch (one fragment, as a rebuild leaves the
table), then saves `--saves` more one at a time through LanceStore.upsert (a delete and an add, as a
saved fact does) and measures a user's search (15 queries, p50) every `--every` saves. The
maintained side runs vector_index_refresh() where a save asked for it, in the saving thread (the
Celery task does it in a worker); its time is printed apart. The vectors are random unit vectors: the
figures are the table's, not the embedding model's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def search_p50(store, rng, dim: int) -> float:
    import numpy as np
    times = []
    for _ in range(15):
        v = rng.standard_normal(dim).astype(np.float32)
        t0 = time.perf_counter()
        store.search(actor_key="web:alice", vector=v / np.linalg.norm(v), limit=8)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def run(maintained: bool, base: int, saves: int, every: int, dim: int = 384) -> list[dict]:
    import lancedb
    import numpy as np

    from plugins_app.agent.memory import lance
    rng = np.random.default_rng(7)
    store = lance.LanceStore(tempfile.mkdtemp(prefix="ugent-bench-lance-"), dim)
    db = lancedb.connect(store.uri, read_consistency_interval=lance.timedelta(0))
    store._table = db.create_table(lance.TABLE, schema=store.schema(), mode="overwrite")
    vectors = rng.standard_normal((base + saves, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    store._add(store._table, [(i, "web:alice" if i % 10 else "web:bob", vectors[i].tobytes()) for i in range(base)])
    out, save_times, maint = [], [], []
    for i in range(base, base + saves):
        t0 = time.perf_counter()
        wanted = store.upsert(fact_id=i, actor_key="web:alice", vector=vectors[i].tobytes())
        save_times.append(time.perf_counter() - t0)
        if maintained and wanted:
            t0 = time.perf_counter()
            store.vector_index_refresh()
            maint.append(time.perf_counter() - t0)
        done = i - base + 1
        if done % every == 0:
            out.append({"saves": done, "search": search_p50(store, rng, dim),
                        "save": statistics.median(save_times[-every:]) * 1000,
                        "fragments": store.small_fragments(), "maint": list(maint)})
            print(f"  {'maintained' if maintained else 'as before'}: {done}/{saves} saves", file=sys.stderr,
                  flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=int, default=3000)
    ap.add_argument("--saves", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    os.environ.setdefault("RUST_LOG", "error")
    from bridge_throughput import django_ready
    django_ready()
    before = run(False, args.base, args.saves, args.every)
    after = run(True, args.base, args.saves, args.every)
    print(f"\nlance_embedded: {args.base} vectors in one batch, then {args.saves} saved one by one; a user's "
          f"search p50 (15 queries) and a save's p50 over the last {args.every}")
    print(f"{'saves':>6} {'search, as before':>18} {'maintained':>11} {'ratio':>7}   {'save, as before':>16} "
          f"{'maintained':>11}   {'small fragments':>16}")
    for b, a in zip(before, after):
        print(f"{b['saves']:>6} {b['search']:>16.1f}ms {a['search']:>9.1f}ms {a['search'] / b['search']:>6.2f}x   "
              f"{b['save']:>14.1f}ms {a['save']:>9.1f}ms   {b['fragments']:>7} / {a['fragments']:<7}")
    maint = after[-1]["maint"] if after else []
    if maint:
        print(f"maintenance: {len(maint)} compactions, p50 {statistics.median(maint) * 1000:.0f} ms, "
              f"max {max(maint) * 1000:.0f} ms (in a Celery worker, off the turn)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
