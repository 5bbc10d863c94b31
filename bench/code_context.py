"""Code context (issue #16, item 5): the index's build time over a real source tree, a query's time, and what
code context adds to a plain turn, beside that plain turn measured in the same run.

The tree is a scratch copy of this repository's tracked files by default (its var/ and .venv are no
source), or --root. Figures:

* index: a cold build (list, read, chunk, BM25), and the look for changed files that a turn pays once its
  rescan interval has passed, with nothing changed;
* query: `code_context_fetch` as a turn calls it (the query, then the budget), over messages built from
  identifiers found in the tree;
* turn: the chat endpoint in-process (Django's AsyncClient on one event loop, bench/scratch.py's
  LoopClient, the scripted engine, turns eager) with code context off, then on with the default
  rescan interval (2 s: the index mostly cached), then on with a rescan at every turn; the three
  interleaved in rounds. Beside each, the time of the runner's own code-context step
  (TurnRun.code_context, timed by wrapping it): on a shared box the whole turn's figures move by more
  than that step costs.

With --embeddings (`[code_context] embeddings = true`), also: the time to embed every chunk (on the bulk
embedding thread, one core, progress printed) and the chunks a second beside the same sample embedded on
the query thread (both cores) in the same run; a restart's load of the kept vectors; a fetch with
embeddings beside one without, interleaved; and a fourth turn case, on with embeddings. Embedding is about
270 ms a chunk on the 2-core VM: give it a smaller --root (a copy of plugins_app/agent: a few minutes).

Usage: python bench/code_context.py [--root PATH] [--turns 150] [--queries 200] [--embeddings]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scratch import LoopClient, scratch_install  # noqa: E402

_CONFIG = scratch_install("ugent-code-context-")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))]


def ms(values) -> str:
    return f"p50 {statistics.median(values) * 1000:8.2f} ms  p99 {pct(values, 99) * 1000:8.2f} ms"


def messages_from(chunks, n: int, rng: random.Random) -> list[str]:
    """Questions naming identifiers of the tree, as a user asking about its code would."""
    idents = sorted({w for c in chunks for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{5,}", c.text)})
    return [f"How does {rng.choice(idents)} work with {rng.choice(idents)}?" for _ in range(n)]


def tracked_copy() -> Path:
    """The repository's tracked files (git ls-files), copied beside the scratch install."""
    import shutil
    import subprocess
    dest = _CONFIG.parent / "tree"
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / name)
    return dest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="", help="the tree to index (default: a copy of this repository's files)")
    ap.add_argument("--turns", type=int, default=150)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--embeddings", action="store_true", help="also measure code context with embeddings on")
    args = ap.parse_args()
    copied = not args.root
    if copied:
        args.root = str(tracked_copy())
    try:
        run(args)
    finally:
        if copied:
            import shutil
            shutil.rmtree(args.root, ignore_errors=True)


def run(args):
    import os
    os.environ["UGENT_WORKSPACE"] = str(Path(args.root).resolve())
    from bridge_throughput import django_ready
    django_ready()
    from plugins_app.agent import code_context
    from plugins_app.agent.engines.code import CodeRetrievalEngine
    from ugent_common import config
    rng = random.Random(16)

    # -- the index --
    builds = []
    for _ in range(3):
        engine = CodeRetrievalEngine({"root": args.root, "rescan_interval": 0})
        t0 = time.perf_counter()
        index = engine.refresh()
        builds.append(time.perf_counter() - t0)
    files = len({c.path for c in index.chunks})
    looks = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.refresh()
        looks.append(time.perf_counter() - t0)
    assert engine.builds == 1  # nothing changed: no rebuild (a figure that lies would be worse than none)

    # -- the query --
    questions = messages_from(index.chunks, args.queries, rng)
    conf = code_context.CodeContextSpec(enabled=True, rescan_interval_secs=3600)
    code_context.code_context_fetch(root=Path(args.root), text=questions[0], conf=conf)  # builds it once
    fetches, injected = [], []
    for q in questions:
        t0 = time.perf_counter()
        found = code_context.code_context_fetch(root=Path(args.root), text=q, conf=conf)
        fetches.append(time.perf_counter() - t0)
        injected.append(found.tokens_est)

    embedded = embedding_figures(args, questions) if args.embeddings else None

    # -- the turn --
    from channels_app.models import ApiKey, Caller
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.filter(name="scripted").update(is_default=True)
    caller = Caller.objects.create(name="bench-code", role="operator")
    key = ApiKey(caller=caller)
    key.set_key("ugk_bench_code")
    key.save()
    client = LoopClient(headers={"x-api-key": "ugk_bench_code"})
    seq = [0]
    from channels_app import runner
    step_times: dict[str, list] = {}
    label_now = [""]
    plain_step = runner.TurnRun.code_context

    def timed_step(self, messages):  # the runner's own code-context step, apart from the turn's noise
        t0 = time.perf_counter()
        out = plain_step(self, messages)
        step_times.setdefault(label_now[0], []).append(time.perf_counter() - t0)
        return out

    runner.TurnRun.code_context = timed_step

    from plugins_app.agent.embedding import _query_cached

    def turn() -> float:
        seq[0] += 1
        _query_cached.cache_clear()  # the questions repeat; each turn's text is embedded as a new message's is
        body = {"messages": [{"role": "user", "content": rng.choice(questions)}],
                "conversation_id": f"c-{seq[0]}", "user": "bench-alice"}
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json")
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.content[:300]
        return took

    settings_for = {"off": "[code_context]\nenabled = false\n", "on (rescan 2 s)": "[code_context]\nenabled = true\n",
                    "on (rescan every turn)": "[code_context]\nenabled = true\nrescan_interval_secs = 0.0\n"}
    if args.embeddings:
        settings_for["on, embeddings (rescan 2 s)"] = "[code_context]\nenabled = true\nembeddings = true\n"

    def use(label: str):
        label_now[0] = label
        _CONFIG.write_text(settings_for[label])
        config.reset_caches()

    out = {label: [] for label in settings_for}
    for label in out:  # warm-up (the first "on" builds the index)
        use(label)
        for _ in range(10):
            turn()
    step_times.clear()
    rounds = 5
    for rnd in range(rounds):
        for label in out:
            use(label)
            out[label] += [turn() for _ in range(max(1, args.turns // rounds))]
        print(f"  turns: round {rnd + 1}/{rounds}", file=sys.stderr, flush=True)

    rebuilt = {k[3]: e.builds for k, e in code_context._Engines.by_folder.items()}
    print(f"code context over {args.root}: {files} files, {len(index.chunks)} chunks "
          f"(builds per rescan interval during the run: {rebuilt})")
    print(f"  index, cold build           min {min(builds) * 1000:8.1f} ms  (of {len(builds)})")
    print(f"  look for changes, none      {ms(looks)}")
    print(f"  fetch (query + budget)      {ms(fetches)}  ({statistics.mean(injected):.0f} tokens injected "
          f"on average, budget {conf.max_injected_tokens_est})")
    if embedded:
        print(f"  embeddings: every chunk in {embedded['build_s']:.1f} s on the bulk thread "
              f"({embedded['rate']:.2f} chunks/s over the whole tree); a sample of {embedded['sample']} chunks: "
              f"bulk thread (one core) {embedded['bulk_rate']:.2f} chunks/s, query thread (both cores, the "
              f"baseline) {embedded['query_rate']:.2f} chunks/s: {embedded['bulk_rate'] / embedded['query_rate']:.2f}x")
        print(f"  embeddings: a restart's load of the kept vectors {embedded['reload_s'] * 1000:.0f} ms, "
              f"{embedded['remade']} chunks embedded again")
        print(f"  fetch with embeddings       {ms(embedded['fetch_on'])}  against {ms(embedded['fetch_off'])} "
              f"without (interleaved): {statistics.median(embedded['fetch_on']) / statistics.median(embedded['fetch_off']):.2f}x at p50")
    base = statistics.median(out["off"]) * 1000
    for label, values in out.items():
        p50 = statistics.median(values) * 1000
        print(f"  turn, code context {label:<24}{ms(values)}  {p50 - base:+.2f} ms at p50 vs off; "
              f"the runner's code-context step {ms(step_times.get(label, [0.0]))}")


def embedding_figures(args, questions) -> dict:
    """Every chunk embedded (progress on stderr), a sample's rate on each embedding thread, a restart's
    load of the kept vectors, and a fetch with and without embeddings, interleaved."""
    from plugins_app.agent import code_context
    from plugins_app.agent.embedding import embed
    from plugins_app.agent.engines.code import EMBED_MAX_CHARS, CodeRetrievalEngine
    root = Path(args.root).resolve()
    cache = code_context.vector_cache_path(root)  # where the turns' engine will find them
    cache.unlink(missing_ok=True)  # an earlier run's: every chunk is embedded here
    engine = CodeRetrievalEngine({"root": str(root), "rescan_interval": 3600, "embeddings": True,
                                  "vector_cache": str(cache)})
    t0 = time.perf_counter()
    chunks = engine.refresh().chunks
    while not engine.wait_embedded(10):
        print(f"  embedding: {len(engine._vectors)}/{len(chunks)} chunks, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    build_s = time.perf_counter() - t0
    sample = [f"{c.path}\n{c.text[:EMBED_MAX_CHARS]}" for c in chunks[:24]]
    rates = {}
    for bulk in (True, False):
        t1 = time.perf_counter()
        for i in range(0, len(sample), 8):
            embed(sample[i:i + 8], kind="passage", bulk=bulk)
        rates[bulk] = len(sample) / (time.perf_counter() - t1)
    from plugins_app.agent.engines import code
    remade, real_embed = [], code.embed

    def counted(texts, **kw):
        remade.extend(texts)
        return real_embed(texts, **kw)
    code.embed = counted
    try:
        again = CodeRetrievalEngine({"root": str(root), "rescan_interval": 3600, "embeddings": True,
                                     "vector_cache": str(cache)})
        t1 = time.perf_counter()
        again.refresh()
        again.wait_embedded(600)
        reload_s = time.perf_counter() - t1
    finally:
        code.embed = real_embed
    plain = CodeRetrievalEngine({"root": str(root), "rescan_interval": 3600})
    plain.refresh()
    fetch_on, fetch_off = [], []
    from plugins_app.agent.embedding import _query_cached
    for q in questions:
        for eng, out in ((again, fetch_on), (plain, fetch_off)):
            _query_cached.cache_clear()  # each fetch embeds its message, as a new message's is
            t1 = time.perf_counter()
            eng.query_chunks(q, k=12)
            out.append(time.perf_counter() - t1)
    return {"build_s": build_s, "rate": len(chunks) / build_s, "sample": len(sample), "bulk_rate": rates[True],
            "query_rate": rates[False], "reload_s": reload_s, "remade": len(remade), "fetch_on": fetch_on,
            "fetch_off": fetch_off}


if __name__ == "__main__":
    main()
