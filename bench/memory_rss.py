"""The embedded daemon's resident memory: idle, and as turns go by (issue #17, item 5).

Starts the embedded daemon (one process: uvicorn, turn threads, the in-process Celery worker, beat and
the supervisor) with an `openai-compatible` profile in front of the stub upstream, reads its RSS from
/proc when idle, then sends --turns non-stream turns (a new conversation every --per-conversation
turns, so the conversation and event tables grow as in real use) from --concurrency clients and reads
the RSS again every --every turns. The baseline, measured in the same run, is a bare Python process
that imports and sets up Django with the same settings (what any Django daemon costs before it does
anything).

RSS alone cannot tell a leak from a cache filling up or the allocator keeping freed memory, so the
daemon runs with its memory hook on (UGENT_MEMSTATS, ugent_site/memstats.py): at each checkpoint the
bench signals it and prints, beside RSS, its anonymous part, the bytes pymalloc (Python's objects)
and malloc have in use and hold free, SQLite's own allocations and the objects the garbage collector
tracks; then growth from turn 5,000 to 10,000 and from 10,000 to 15,000, what the hub still holds
once the turns are done (each should be 0), and its caches keyed by a thing. A leak grows what is in
use, turn after turn; fragmentation grows only what is free. `--tracemalloc N` has the daemon trace
Python's allocations from turn 1,000 on (N frames; several times slower) and prints the lines whose
allocations grew most between checkpoints. After the last turn the daemon is asked to
malloc_trim(0): the RSS it falls to is what the allocator held but did not use. `--settle` also reads
each checkpoint at rest (clients paused, a full collection, malloc_trim(0)), with RSS by kind of mapping
and each SQLite connection's prepared statements (how many, and which SQL is new since the last one).

Usage: python bench/memory_rss.py [--turns 15000] [--every 1000] [--concurrency 4] [--stream]
       [--tracemalloc 8] [--malloc-arena-max 2] [--settle] [--warm 75]
The daemon inherits the environment: `UGENT_SQLITE_CACHE_KIB=2000 python bench/memory_rss.py` runs
it with SQLite's default page cache a connection (the figure before it was bounded at 128 KiB).
Prints figures; asserts nothing. Targets: at most 250 MB idle, and no growth between the 5,000th and
the 10,000th turn.
"""
from __future__ import annotations

import argparse
import json
import signal
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from chat_latency import start_stub  # noqa: E402
from tests.support.daemon import PY, Daemon  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def tree_rss_mb(pid: int) -> float:
    """The process and its children (channel workers, if any are configured)."""
    total = rss_mb(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in (children.read_text().split() if children.exists() else []):
        try:
            total += tree_rss_mb(int(child))
        except (FileNotFoundError, RuntimeError, ProcessLookupError):
            pass
    return total


def bare_django_rss(env: dict) -> float:
    """A process that only sets Django up with the daemon's settings, measured the same way."""
    code = ("import django, os, sys, time; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'ugent_site.settings');"
            "django.setup(); print('up', flush=True); sys.stdin.readline()")
    p = subprocess.Popen([PY, "-c", code], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        time.sleep(0.5)
        return rss_mb(p.pid)
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)


#: --tracemalloc: the turn from which the daemon traces (warm by then; tracing slows it down).
TRACE_FROM = 1000
#: The checkpoints at which a traced daemon dumps a tracemalloc snapshot (each holds the GIL a while).
SNAPSHOT_AT = (5000, 10000, 15000)


class Hook:
    """The daemon's memory reports (ugent_site/memstats.py): one per SIGUSR2, numbered from 1."""

    def __init__(self, var: Path, pid: int):
        self.dir, self.pid, self.n = var / "memstats", pid, 0

    def report(self, *, trim: bool = False, snapshot: bool = False, trace: int = 0, collect: bool = False,
               connections: bool = True, maps: bool = False, statements: bool = False) -> dict:
        (self.dir / "request.json").write_text(json.dumps({"trim": trim, "snapshot": snapshot, "tracemalloc": trace,
                                                           "collect": collect, "connections": connections,
                                                           "maps": maps, "statements": statements}))
        self.n += 1
        path = self.dir / f"{self.pid}-{self.n}.json"
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 120
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no memory report {path}")
            time.sleep(0.05)
        return json.loads(path.read_text())


def _mb(rep: dict, *path: str) -> float:
    value = rep
    for key in path:
        value = value.get(key, {}) if isinstance(value, dict) else {}
    return value / 1024 if isinstance(value, (int, float)) else 0.0


#: The columns: title, unit line, where in a report (a path of keys, in kB unless noted).
COLUMNS = [("RSS", "MB", ("rss_kb",)), ("anon", "MB", ("rss_anon_kb",)),
           ("pymalloc", "in use", ("pymalloc", "in_use_kb")), ("pymalloc", "free", ("pymalloc", "free_kb")),
           ("malloc", "in use", ("malloc", "in_use_kb")), ("malloc", "free", ("malloc", "free_kb")),
           ("sqlite", "MB", ("sqlite", "memory_used_kb")), ("sqlite", "pages", ("sqlite", "page_cache_kb")),
           ("traced", "MB", ("python", "traced_kb"))]


def header() -> str:
    top = f"{'turns':>9}" + "".join(f"{t:>10}" for t, _u, _p in COLUMNS) + f"{'gc':>11}{'threads':>8}"
    sub = f"{'':>9}" + "".join(f"{u:>10}" for _t, u, _p in COLUMNS) + f"{'objects':>11}{'':>8}"
    return top + "\n" + sub + "   (MB)"


def row(n, rep: dict) -> str:
    return (f"{n!s:>9}" + "".join(f"{_mb(rep, *p):>10.1f}" if p != ("python", "traced_kb") or "traced_kb" in
                                  rep["python"] else f"{'-':>10}" for _t, _u, p in COLUMNS)
            + f"{rep['gc_objects']:>11,}{rep['threads']:>8}")


def growth(ra: dict, rb: dict) -> str:
    parts = [f"{t} {u.replace('MB', '').strip()}".strip() + f" {_mb(rb, *p) - _mb(ra, *p):+.1f}"
             for t, u, p in COLUMNS if p != ("python", "traced_kb") or "traced_kb" in rb["python"]]
    return ", ".join(parts) + f" MB; gc objects {rb['gc_objects'] - ra['gc_objects']:+,}"


def _kib_cell(c: dict | None) -> str:
    """One connection's page cache / schema / statements, KiB (a dash: no connection then)."""
    return f"{c['cache_kb']:>5} / {c['schema_kb']:>4} / {c['stmt_kb']:>5}" if c else f"{'-':>19}"


def _conns(rep: dict) -> dict:
    by = rep.get("sqlite", {}).get("by_connection", [])
    return {c["thread"]: c for c in by if isinstance(c, dict)} if isinstance(by, list) else {}


def _shape(sql: str) -> str:
    """A statement's SQL with its runs of placeholders folded and cut short: what varies between them."""
    import re
    folded = re.sub(r"\?(\s*,\s*\?)+", "?..", sql)
    folded = re.sub(r"\((\?\.\.|\?)\)(\s*,\s*\((\?\.\.|\?)\))+", "(?..)..", folded)
    return folded[:90]


def statements_grown(ra: dict, rb: dict) -> str:
    """SQLite at rest, from one checkpoint to the next: statements prepared and their bytes, and the new SQL."""
    ca, cb = _conns(ra), _conns(rb)
    if not cb:
        return "SQLite statements: no by-connection figures"
    import collections
    new = collections.Counter()
    for name, c in cb.items():
        before = set(ca.get(name, {}).get("sql", []))
        new.update(_shape(q) for q in c.get("sql", []) if q not in before)
    stmt = sum(c["stmt_kb"] for c in cb.values()) - sum(c["stmt_kb"] for c in ca.values())
    count = sum(c["stmts"] for c in cb.values()) - sum(c["stmts"] for c in ca.values())
    pages = sum(c["cache_kb"] for c in cb.values()) - sum(c["cache_kb"] for c in ca.values())
    schema = sum(c["schema_kb"] for c in cb.values()) - sum(c["schema_kb"] for c in ca.values())
    return (f"SQLite by connection: statements {count:+} ({stmt:+,} KiB), page caches {pages:+,} KiB, schemas "
            f"{schema:+,} KiB, connections {len(cb) - len(ca):+}; statements new since (by shape, all "
            f"connections): " + ("; ".join(f"{n}x {q}" for q, n in new.most_common(6)) or "none"))


def statements_table(settled: list) -> list[str]:
    names = sorted({n for _t, rep in settled for n in _conns(rep)},
                   key=lambda n: -_conns(settled[-1][1]).get(n, {}).get("stmt_kb", 0))
    out = [f"{'thread':<24}" + "".join(f"{t:>12}" for t, _r in settled)]
    for name in names:
        cells = [_conns(rep).get(name) for _t, rep in settled]
        out.append(f"{name:<24}" + "".join(f"{c['stmts']:>5} /{c['stmt_kb']:>5}" if c else f"{'-':>12}"
                                          for c in cells))
    totals = [(sum(c["stmts"] for c in _conns(rep).values()), sum(c["stmt_kb"] for c in _conns(rep).values()))
              for _t, rep in settled]
    out.append(f"{'all':<24}" + "".join(f"{n:>5} /{k:>5}" for n, k in totals))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=15000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--per-conversation", type=int, default=10)
    ap.add_argument("--stream", action="store_true", help="stream every turn (SSE) instead of non-stream")
    ap.add_argument("--tracemalloc", type=int, default=0, help="frames per trace (0: off)")
    ap.add_argument("--trace-from", type=int, default=TRACE_FROM, help="the turn from which the daemon traces")
    ap.add_argument("--malloc-arena-max", default="", help="MALLOC_ARENA_MAX for the daemon")
    ap.add_argument("--warm", type=float, default=75.0, help=(
        "seconds the daemon runs before its idle figure and the first turn, so that its periodic jobs (the "
        "60-s ones: usage rollup, cron sweep; the sweep of stale turns; the rules' heartbeat) have each run once "
        "and opened what they keep. The bench sends 10,000 turns in under two minutes: without it their first "
        "runs fall between the 5,000th and the 10,000th turn, where a real daemon passed them long before"))
    ap.add_argument("--settle", action="store_true",
                    help="at each checkpoint also pause the clients, let the daemon finish what is in flight, and "
                         "read RSS again after a full garbage collection and malloc_trim(0): what the daemon holds")
    args = ap.parse_args()
    os.environ.pop("REDIS_URL", None)
    os.environ.pop("DATABASE_URL", None)
    stub, stub_url = start_stub()
    tmp = Path(tempfile.mkdtemp(prefix="ugent-rss-"))
    extra = {"UGENT_CPU_AFFINITY": "off", "UGENT_MEMSTATS": "true"}
    if args.malloc_arena_max:
        extra["MALLOC_ARENA_MAX"] = args.malloc_arena_max
    d = Daemon(tmp, servers=False, extra_env=extra)
    try:
        (tmp / "workspace").mkdir(parents=True)
        d.manage("migrate", "--noinput")
        d.manage("shell", "-c", "from plugins_app.models import AgentProfile as P; "
                 f"P.objects.create(name='bench', provider='openai-compatible', is_default=True, "
                 f"config={{'base_url': '{stub_url}', 'model': 'stub-model'}})")
        baseline = bare_django_rss(d.env)
        d.spawn()
        pid = d.procs[0].pid
        hook = Hook(tmp / "var", pid)
        warm_until = time.monotonic() + max(3.0, args.warm)  # warming, and every periodic job once
        while time.monotonic() < warm_until:
            left = warm_until - time.monotonic()
            print(f"  warming: {left:.0f} s left (--warm)", file=sys.stderr, flush=True)
            time.sleep(min(15.0, max(0.0, left)))
        idle = tree_rss_mb(pid)
        idle_rep = hook.report()
        print(f"embedded daemon RSS: bare Django process {baseline:.1f} MB (baseline, same run); "
              f"daemon idle {idle:.1f} MB ({idle / baseline:.2f}x)"
              + (f"; tracemalloc from turn {args.trace_from} ({args.tracemalloc} frames)" if args.tracemalloc else "")
              + (f"; MALLOC_ARENA_MAX={args.malloc_arena_max}" if args.malloc_arena_max else "")
              + ("; stream turns" if args.stream else "; non-stream turns")
              + f"; SQLite cache_size {idle_rep.get('sqlite', {}).get('cache_size_kb', '?')} KiB a connection"
              + f"; idle read after {max(3.0, args.warm):g} s (--warm)",
              flush=True)
        reports: list[tuple[int, dict]] = [(0, idle_rep)]
        settled: list[tuple[int, dict]] = []
        if args.settle:
            settled.append((0, hook.report(collect=True, trim=True, connections=True, maps=True, statements=True)))
        done = 0
        lock = threading.Lock()
        go = threading.Event()  # --settle: cleared while a checkpoint reads the daemon at rest
        go.set()
        in_flight = 0
        idle_now = threading.Condition()
        headers = {"x-api-key": d.key}
        t0 = time.perf_counter()

        def one(i: int, client: httpx.Client):
            body = {"model": "bench", "conversation_id": f"rss-{i // args.per_conversation}", "stream": args.stream,
                    "client_message_id": f"m-{i}", "messages": [{"role": "user", "content": f"hello {i}"}]}
            r = client.post(d.base + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            r.raise_for_status()
            if args.stream and not r.text.rstrip().endswith("data: [DONE]"):
                raise RuntimeError(f"a stream without [DONE]: {r.text[-200:]}")

        def at_rest() -> dict:
            """The clients paused and nothing in flight: a report after a full collection and a malloc_trim(0)."""
            go.clear()
            with idle_now:
                idle_now.wait_for(lambda: in_flight == 0, timeout=60)
            time.sleep(0.5)  # what a turn's end hands to other threads (wake-ups, the fan-out) is done by then
            try:
                return hook.report(collect=True, trim=True, connections=True, maps=True, statements=True)
            finally:
                go.set()

        def worker(start: int):
            nonlocal done, in_flight
            with httpx.Client() as client:
                for i in range(start, args.turns, args.concurrency):
                    while True:
                        go.wait()
                        with idle_now:
                            if go.is_set():
                                in_flight += 1
                                break
                    try:
                        one(i, client)
                    finally:
                        with idle_now:
                            in_flight -= 1
                            idle_now.notify_all()
                    with lock:
                        done += 1
                        if done % args.every == 0:
                            rep = hook.report(snapshot=bool(args.tracemalloc) and done in SNAPSHOT_AT,
                                              trace=args.tracemalloc if done == args.trace_from else 0)
                            reports.append((done, rep))
                            if args.settle:
                                settled.append((done, at_rest()))
                            rate = done / (time.perf_counter() - t0)
                            m = rep.get("malloc", {})
                            print(f"  {done:>6} turns: RSS {rep['rss_kb'] / 1024:.1f} MB, malloc in use "
                                  f"{m.get('in_use_kb', 0) / 1024:.1f} MB, free {m.get('free_kb', 0) / 1024:.1f} MB"
                                  f" ({rate:.0f} turns/s)", file=sys.stderr, flush=True)

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for f in [pool.submit(worker, s) for s in range(args.concurrency)]:
                f.result()
        time.sleep(2.0)
        after = hook.report(snapshot=bool(args.tracemalloc))
        trimmed = hook.report(trim=True)
        print("\n" + header())
        for n, rep in reports + [(f"{args.turns}+2s", after)]:
            print(row(n, rep))
        print(f"after malloc_trim(0): RSS {trimmed['rss_after_trim_kb'] / 1024:.1f} MB "
              f"(from {trimmed['rss_kb'] / 1024:.1f} MB)")
        t = after.get("malloc_trims") or {}
        if t.get("count"):
            print(f"periodic malloc_trim(0) (UGENT_MALLOC_TRIM_SECS): {t['count']} in the run, "
                  f"{t['secs'] / t['count'] * 1000:.2f} ms each on average, the last {t['last_secs'] * 1000:.2f} ms")

        def at(n: int) -> dict:
            return min(reports, key=lambda r: abs(r[0] - n))[1]

        if settled:
            print("\nat rest (clients paused, nothing in flight, a full collection, then malloc_trim(0)), MB:")
            print(f"{'turns':>9}{'RSS':>10}{'trimmed':>10}{'of it':>10}{'pymalloc':>10}{'pymalloc':>10}{'malloc':>10}"
                  f"{'sqlite':>10}{'gc':>11}{'threads':>8}{'SQLite':>8}")
            print(f"{'':>9}{'':>10}{'RSS':>10}{'anon':>10}{'arenas':>10}{'in use':>10}{'in use':>10}{'':>10}"
                  f"{'objects':>11}{'':>8}{'conns':>8}")
            for n, rep in settled:
                print(f"{n:>9}{_mb(rep, 'rss_kb'):>10.1f}{_mb(rep, 'rss_after_trim_kb'):>10.1f}"
                      f"{_mb(rep, 'rss_after_trim_anon_kb'):>10.1f}{_mb(rep, 'pymalloc', 'arenas_kb'):>10.1f}"
                      f"{_mb(rep, 'pymalloc', 'in_use_kb'):>10.1f}{_mb(rep, 'malloc', 'in_use_kb'):>10.1f}"
                      f"{_mb(rep, 'sqlite', 'memory_used_kb'):>10.1f}{rep['gc_objects']:>11,}{rep['threads']:>8}"
                      f"{len(_conns(rep)):>8}")
            rest = dict(settled)
            marks = [m for m in (500, 1000, 5000, 10000, 15000, 20000, 25000, 30000) if m in rest]
            for a, b in zip(marks, marks[1:]):
                ra, rb = rest[a], rest[b]
                print(f"at rest, turn {a} to {b}: trimmed RSS "
                      f"{_mb(rb, 'rss_after_trim_kb') - _mb(ra, 'rss_after_trim_kb'):+.2f} MB, pymalloc in use "
                      f"{_mb(rb, 'pymalloc', 'in_use_kb') - _mb(ra, 'pymalloc', 'in_use_kb'):+.2f}, malloc in use "
                      f"{_mb(rb, 'malloc', 'in_use_kb') - _mb(ra, 'malloc', 'in_use_kb'):+.2f}, sqlite "
                      f"{_mb(rb, 'sqlite', 'memory_used_kb') - _mb(ra, 'sqlite', 'memory_used_kb'):+.2f}, gc objects "
                      f"{rb['gc_objects'] - ra['gc_objects']:+,}, threads {rb['threads'] - ra['threads']:+}")
                ma, mb = ra.get("mappings", {}), rb.get("mappings", {})
                print("  trimmed RSS by mapping, KiB (of it anonymous): " + ", ".join(
                    f"{k} {mb[k]['rss'] - ma.get(k, {}).get('rss', 0):+,} "
                    f"({mb[k]['anonymous'] - ma.get(k, {}).get('anonymous', 0):+,})" for k in sorted(mb))
                    + f"; anonymous in all {_mb(rb, 'rss_after_trim_anon_kb') - _mb(ra, 'rss_after_trim_anon_kb'):+.2f} MB")
                grown = sorted(((rb["gc_types"].get(t, 0) - ra["gc_types"].get(t, 0), t) for t in rb["gc_types"]),
                               reverse=True)[:8]
                print("  live objects grown most: " + (", ".join(f"{t} {g:+,}" for g, t in grown if g > 0) or "none"))
                wa, wb = ra.get("weakref_referents", {}), rb.get("weakref_referents", {})
                grown = sorted(((wb.get(t, 0) - wa.get(t, 0), t) for t in set(wa) | set(wb)), reverse=True)[:6]
                print("  weak references grown most, by what they point at: "
                      + (", ".join(f"{t} {g:+,}" for g, t in grown if g > 0) or "none"))
                print("  " + statements_grown(ra, rb))
            print("\nat rest, SQLite's prepared statements by connection (statements / KiB), at each checkpoint:")
            for line in statements_table(settled):
                print("  " + line)

        print()
        marks = [m for m in (5000, 10000, 15000) if m < args.turns] + [args.turns]
        for a, b in zip(marks, marks[1:]):
            ra, rb = at(a), (after if b == args.turns else at(b))
            print(f"turn {a} to {b}: RSS {_mb(rb, 'rss_kb') - _mb(ra, 'rss_kb'):+.1f} MB "
                  f"({(rb['rss_kb'] - ra['rss_kb']) / ra['rss_kb'] * 100:+.1f}%); {growth(ra, rb)}")
            grown = sorted(((rb["gc_types"].get(t, 0) - ra["gc_types"].get(t, 0), t) for t in rb["gc_types"]),
                           reverse=True)[:8]
            print("  gc types grown most: " + ", ".join(f"{t} {g:+,}" for g, t in grown if g > 0))
            changed = {k: f"{ra['caches'].get(k)}->{v}" for k, v in rb.get("caches", {}).items()
                       if ra.get("caches", {}).get(k) != v}
            print(f"  caches keyed by a thing (not a turn) that changed: {changed or 'none'}")
            if "tracemalloc_snapshot" in ra and "tracemalloc_snapshot" in rb:
                import tracemalloc
                old = tracemalloc.Snapshot.load(ra["tracemalloc_snapshot"])
                new = tracemalloc.Snapshot.load(rb["tracemalloc_snapshot"])
                print("  tracemalloc, the lines whose allocations grew most:")
                for stat in new.compare_to(old, "lineno")[:12]:
                    print(f"    {stat}")
        by_thread = lambda rep: {c["thread"]: c for c in rep.get("sqlite", {}).get("by_connection", [])  # noqa: E731
                                 if isinstance(c, dict)}
        first, last = by_thread(at(5000) if args.turns > 5000 else idle_rep), by_thread(after)
        if last:
            print(f"\nSQLite by connection, KiB (page cache / schema / statements): at turn "
                  f"{5000 if args.turns > 5000 else 0} -> after the last")
            for name in sorted(set(first) | set(last), key=lambda n: -sum(last.get(n, {}).get(k, 0) for k in
                                                                           ("cache_kb", "schema_kb", "stmt_kb"))):
                print(f"  {name:<28} {_kib_cell(first.get(name))}  ->  {_kib_cell(last.get(name))}")
        print(f"\nheld 2 s after the last turn (each should be 0): {after.get('held')}")
        print(f"caches: {after.get('caches')}")
        sq = after.get("sqlite", {})
        if "connections" in sq:
            print(f"SQLite: {sq['memory_used_kb'] / 1024:.1f} MB allocated, of it "
                  f"{sq.get('page_cache_kb', 0) / 1024:.1f} MB in page caches (at most "
                  f"{sq.get('page_cache_highwater_kb', 0) / 1024:.1f} MB at a time); "
                  f"{sq['connections']} connections whose page caches may hold {sq['page_cache_bound_kb'] / 1024:.1f} "
                  f"MB at most ({sq.get('cache_size_kb', '?')} KiB each: UGENT_SQLITE_CACHE_KIB)")
        end = after["rss_kb"] / 1024
        print(f"\nafter {args.turns} turns: RSS {end:.1f} MB, {end / idle:.2f}x idle, {end / baseline:.2f}x the bare "
              f"Django process ({baseline:.1f} MB)")
        print(f"idle {idle:.1f} MB; targets: at most 250 MB idle; no growth between the 5,000th and the "
              f"10,000th turn")
    finally:
        d.close()
        stub.terminate()


if __name__ == "__main__":
    main()
