"""What the chat API adds on top of a plain upstream call.

Starts a stub OpenAI-compatible upstream (its own process) and the embedded
daemon with an `openai-compatible` profile pointed at it, then measures the
same requests against both in this one run:

  * non-stream latency p50/p99 with one client,
  * stream time to first token and to [DONE] with one client, and the gap
    between the last token and [DONE],
  * turns per second with sixteen clients.

Also prints the daemon's CPU time per turn (all its processes), the figure
that bounds turns per second on a small machine.

Usage: python bench/chat_latency.py [--requests 1000] [--concurrency 16] [--servers]
                                     [--servers-baseline DIR] [--embedded-baseline DIR]
                                     [--rounds N] [--only CASES]
                                     [--against litellm] [--sqlite-writers] [--sqlite-cache-kib N]
                                     [--embedded-env VAR=VALUE ...]
  --embedded-baseline DIR
             also an embedded daemon running the checkout in DIR, interleaved with this one's
             (before/after in one run; `git worktree add DIR <commit>`, and DIR/.venv linked to this one's)
  --servers-baseline DIR
             with --servers: a second layout running the checkout in DIR (say `git worktree
             add DIR <commit>`), measured beside this checkout's: before and after in one run
  --rounds N each case in N rounds, every target once per round, so that a machine whose
             speed drifts loads both sides of a comparison alike
  --only     the cases to run, comma-separated: non-stream-1, stream-1, non-stream-N, stream-N
  --sqlite-writers
             also an embedded daemon on Django's own SQLite backend, whose writers wait
             in SQLite's sleeping busy handler, measured beside the writer queue
  --sqlite-cache-kib N
             also an embedded daemon whose SQLite connections keep N KiB of pages each
             (UGENT_SQLITE_CACHE_KIB; 2000 is SQLite's default), measured beside this
             checkout's setting
  --embedded-env VAR=VALUE ...
             also an embedded daemon with these variables set (UGENT_GC_FREEZE=false, say),
             measured beside this checkout's defaults; --sqlite-cache-kib N is
             UGENT_SQLITE_CACHE_KIB=N
  --servers  also the servers-mode layout of docs/deploy.md (tests/support/layout.py:
             HAProxy, two uvicorn web processes, two Celery workers, beat and the
             supervisor over a private PostgreSQL on 5441 and Redis on 6391),
             measured through the proxy beside the stub and the embedded daemon
  --against litellm
             also start LiteLLM's proxy (bench/requirements-litellm.txt, in a
             venv of its own under var/bench-litellm, made on first use; one
             worker, no database) in front of the same stub, and measure it
             interleaved with the embedded daemon and the stub: a new conversation
             per request, and follow-ups in one conversation (UGENT keeps the
             history; LiteLLM's client sends it, as a LiteLLM client must)
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.daemon import PY, Daemon  # noqa: E402


def pct(values, p):
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))
    return values[k]


def start_stub() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PY, str(ROOT / "tests" / "fakes" / "upstream.py"), "--port", "0", "--no-record"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.startswith("READY "), line
    return proc, line.split(" ", 1)[1]


def one_request(client: httpx.Client, url: str, headers: dict, model: str, stream: bool):
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url, json=body, headers=headers)
        r.raise_for_status()
        return time.perf_counter() - t0, None, None
    first = last_token = None
    with client.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = time.perf_counter()
                return done - t0, (first or done) - t0, done - (last_token or done)
            if '"content":"' in line and '"content":""' not in line:
                now = time.perf_counter()
                first = first or now
                last_token = now
    raise RuntimeError("stream ended without [DONE]")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (a gateway that forks its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            pass
    return out


def process_cpu_seconds(pids) -> float:
    """User + system CPU of these processes so far (Linux /proc), with their waited-for children's; a process
    that has ended since it was listed counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def run(label, url, headers, model, *, n, concurrency, stream, progress=True, pids=()):
    lat, ttft, tail = [], [], []
    lock = threading.Lock()
    # One client per concurrent request, made and connected before the clock starts: making an
    # httpx.Client costs milliseconds of the bench's own CPU, which is not what is measured here.
    clients = queue.Queue()
    for _ in range(concurrency):
        c = httpx.Client(timeout=60)
        for _ in range(max(1, 20 // concurrency)):  # warm-up: connections, imports, the engine's pool
            one_request(c, url, headers, model, stream)
        clients.put(c)

    def work(_):
        c = clients.get()
        try:
            out = one_request(c, url, headers, model, stream)
        finally:
            clients.put(c)
        with lock:
            lat.append(out[0])
            if out[1] is not None:
                ttft.append(out[1])
                tail.append(out[2])
            if progress and len(lat) % max(1, n // 5) == 0:
                print(f"  {label}: {len(lat)}/{n}", file=sys.stderr, flush=True)
    t0, cpu0 = time.perf_counter(), process_cpu_seconds(pids)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(work, range(n)))
    wall = time.perf_counter() - t0
    cpu_s = process_cpu_seconds(pids) - cpu0 if pids else None
    while not clients.empty():
        clients.get().close()
    return summary({"lat": lat, "ttft": ttft, "tail": tail, "wall": wall, "n": n, "cpu_s": cpu_s})


def summary(raw: dict) -> dict:
    """Percentiles, turns/s and CPU per turn of one run, or of several runs' raw figures merged."""
    lat, ttft, tail, n = raw["lat"], raw["ttft"], raw["tail"], raw["n"]
    return {"p50": pct(lat, 50) * 1000, "p99": pct(lat, 99) * 1000, "rps": n / raw["wall"],
            "cpu": raw["cpu_s"] / n * 1000 if raw["cpu_s"] is not None else None,
            "ttft50": pct(ttft, 50) * 1000 if ttft else None, "tail50": pct(tail, 50) * 1000 if tail else None,
            "tail99": pct(tail, 99) * 1000 if tail else None, "raw": raw}


def merged(runs: list[dict]) -> dict:
    raws = [r["raw"] for r in runs]
    cpu = [r["cpu_s"] for r in raws]
    return summary({"lat": [x for r in raws for x in r["lat"]], "ttft": [x for r in raws for x in r["ttft"]],
                    "tail": [x for r in raws for x in r["tail"]], "wall": sum(r["wall"] for r in raws),
                    "n": sum(r["n"] for r in raws), "cpu_s": None if None in cpu else sum(cpu)})


def cpu_ratio(a: dict, b: dict) -> str:
    return f"{a['cpu'] / b['cpu']:>8.2f}x" if a["cpu"] and b["cpu"] else ""


def bench_profile(stub_url: str) -> str:
    return ("from plugins_app.models import AgentProfile as P; "
            f"P.objects.create(name='bench', provider='openai-compatible', is_default=True, "
            f"config={{'base_url': '{stub_url}', 'model': 'stub-model'}})")


def start_embedded(stub_url: str, extra_env: dict | None = None, daemon_class=None) -> Daemon:
    tmp = Path(tempfile.mkdtemp(prefix="ugent-bench-"))
    d = (daemon_class or Daemon)(tmp, servers=False, extra_env=extra_env)
    (tmp / "workspace").mkdir(parents=True)
    d.manage("migrate", "--noinput")
    d.manage("shell", "-c", bench_profile(stub_url))
    d.spawn()
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--servers", action="store_true",
                    help="also the servers-mode layout of docs/deploy.md, measured through its proxy")
    ap.add_argument("--servers-baseline", metavar="DIR",
                    help="also a second servers layout running the checkout in DIR (e.g. `git worktree add DIR "
                         "<commit>`), beside this one: before/after in one run")
    ap.add_argument("--embedded-baseline", metavar="DIR",
                    help="also an embedded daemon running the checkout in DIR (e.g. `git worktree add DIR <commit>`), "
                         "beside this one: before/after in one run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="split each case into this many rounds, every target once per round (interleaved A/B)")
    ap.add_argument("--only", help="comma-separated cases to run (non-stream-1, stream-1, non-stream-N, stream-N)")
    ap.add_argument("--against", choices=["litellm"], help="measure another gateway interleaved with UGENT")
    ap.add_argument("--sqlite-writers", action="store_true",
                    help="also an embedded daemon on Django's own SQLite backend (UGENT_SQLITE_WRITER_QUEUE="
                         "false: writers wait in SQLite's busy handler), beside the writer queue")
    ap.add_argument("--sqlite-cache-kib", type=int, metavar="N",
                    help="also an embedded daemon with UGENT_SQLITE_CACHE_KIB=N (2000: SQLite's default), beside")
    ap.add_argument("--embedded-env", nargs="+", metavar="VAR=VALUE", default=[],
                    help="also an embedded daemon with these variables set, beside this checkout's defaults")
    args = ap.parse_args()
    if args.sqlite_cache_kib:
        args.embedded_env.append(f"UGENT_SQLITE_CACHE_KIB={args.sqlite_cache_kib}")
    other_env = dict(v.split("=", 1) for v in args.embedded_env)
    other_label = " ".join(args.embedded_env)
    stub, stub_url = start_stub()
    started = []  # (name, object with .close(), (url, headers, model), pids)
    try:
        d = start_embedded(stub_url)
        started.append(("embedded", d, (d.base + "/v1/chat/completions", {"x-api-key": d.key}, "bench"),
                        [p.pid for p in d.procs]))
        if args.sqlite_writers:
            b = start_embedded(stub_url, {"UGENT_SQLITE_WRITER_QUEUE": "false"})
            started.append(("busywait", b, (b.base + "/v1/chat/completions", {"x-api-key": b.key}, "bench"),
                            [p.pid for p in b.procs]))
        if args.embedded_baseline:
            e = start_embedded(stub_url, daemon_class=baseline_class(Path(args.embedded_baseline), "daemon",
                                                                     "Daemon"))
            started.append(("emb-base", e, (e.base + "/v1/chat/completions", {"x-api-key": e.key}, "bench"),
                            [p.pid for p in e.procs]))
        if other_env:
            c = start_embedded(stub_url, other_env)
            started.append(("cache", c, (c.base + "/v1/chat/completions", {"x-api-key": c.key}, "bench"),
                            [p.pid for p in c.procs]))
        if args.servers:
            from tests.support.layout import Layout
            lay = Layout(Path(tempfile.mkdtemp(prefix="ugent-bench-layout-")))
            started.append(("servers", lay, (lay.base + "/v1/chat/completions", {"x-api-key": lay.key}, "bench"),
                            None))
            lay.start(profiles_shell=bench_profile(stub_url))
            started[-1] = started[-1][:3] + (lay.pids(),)
        if args.servers_baseline:
            base_layout = baseline_class(Path(args.servers_baseline), "layout", "Layout")
            blay = base_layout(Path(tempfile.mkdtemp(prefix="ugent-bench-layout-base-")))
            started.append(("srv-base", blay, (blay.base + "/v1/chat/completions", {"x-api-key": blay.key}, "bench"),
                            None))
            blay.start(profiles_shell=bench_profile(stub_url))
            started[-1] = started[-1][:3] + (blay.pids(),)
        direct = (stub_url + "/chat/completions", {}, "stub-model")
        n = args.requests
        if args.against == "litellm":
            return against_litellm(d, stub_url, Path(tempfile.mkdtemp(prefix="ugent-bench-litellm-")), n=n,
                                   concurrency=args.concurrency, servers=False)
        targets = " and ".join({"embedded": "the embedded daemon",
                                "busywait": "an embedded daemon on Django's SQLite backend (busy handler)",
                                "cache": f"an embedded daemon with {other_label}",
                                "servers": "the servers layout through HAProxy (2 web, 2 workers, PostgreSQL, "
                                           "Redis)",
                                "srv-base": f"the same layout running {args.servers_baseline}",
                                "emb-base": f"an embedded daemon running {args.embedded_baseline}"}[name]
                           for name, *_ in started)
        rounds = max(1, args.rounds)
        print(f"chat API added latency: {n} requests each, stub upstream, {targets}"
              + (f"; interleaved in {rounds} rounds" if rounds > 1 else ""), flush=True)
        rows = []
        cases = [("non-stream-1", "non-stream c=1", False, 1), ("stream-1", "stream c=1", True, 1),
                 ("non-stream-N", f"non-stream c={args.concurrency}", False, args.concurrency),
                 ("stream-N", f"stream c={args.concurrency}", True, args.concurrency)]
        only = set(args.only.split(",")) if args.only else None
        for key, name, stream, conc in cases:
            if only is not None and key not in only:
                continue
            chunk = max(conc, n // rounds)
            runs: dict[str, list] = {"direct": [], **{who: [] for who, *_ in started}}
            for rnd in range(rounds):
                progress = rounds == 1
                runs["direct"].append(run("direct " + name, *direct, n=chunk, concurrency=conc, stream=stream,
                                          progress=progress))
                for who, _, target, pids in started:
                    runs[who].append(run(f"{who} " + name, *target, n=chunk, concurrency=conc, stream=stream,
                                         pids=pids, progress=progress))
                if not progress:
                    print(f"  {name}: round {rnd + 1}/{rounds}", file=sys.stderr, flush=True)
            base = merged(runs["direct"])
            mine = [(who, merged(runs[who])) for who, *_ in started]
            rows.append((name, base, mine))
        print(f"\n{'case':<18}{'':>9}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'ttft50':>9}{'[DONE]-last p50/p99':>22}"
              f"{'cpu ms/turn':>13}")
        for name, base, mine in rows:
            for who, r in (("direct", base), *mine):
                tail = f"{r['tail50']:.2f}/{r['tail99']:.2f}" if r["tail50"] is not None else "-"
                ttft = f"{r['ttft50']:.2f}" if r["ttft50"] is not None else "-"
                cpu = f"{r['cpu']:.2f}" if r["cpu"] is not None else "-"
                print(f"{name:<18}{who:>9}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['rps']:>9.1f}{ttft:>9}{tail:>22}{cpu:>13}")
            for who, r in mine:
                print(f"{'':<18}{'+' + who[:8]:>9}{r['p50'] - base['p50']:>9.2f}{r['p99'] - base['p99']:>9.2f}"
                      f"{r['rps'] / base['rps']:>8.2f}x  (added over direct; req/s ratio)")
            by = dict(mine)
            for who, r in mine:
                print(f"{'':<18}{'p99/p50':>9}{r['p99'] / r['p50']:>8.2f}x  ({who})")
            if "servers" in by:
                e, srv = by["embedded"], by["servers"]
                print(f"{'':<18}{'srv/emb':>9}{srv['p50'] / e['p50']:>8.2f}x{srv['p99'] / e['p99']:>8.2f}x"
                      f"{srv['rps'] / e['rps']:>8.2f}x  (servers over embedded)")
            if "srv-base" in by:
                a, b = by["servers"], by["srv-base"]
                added = lambda r: r["p50"] - base["p50"]  # noqa: E731
                cpu = f"{a['cpu'] / b['cpu']:>8.2f}x" if a["cpu"] and b["cpu"] else ""
                print(f"{'':<18}{'srv/base':>9}{a['p50'] / b['p50']:>8.2f}x{a['p99'] / b['p99']:>8.2f}x"
                      f"{a['rps'] / b['rps']:>8.2f}x{cpu}  (this checkout over the baseline: p50, p99, req/s, cpu; "
                      f"added p50 {added(a):.2f} against {added(b):.2f} ms, {added(a) / added(b):.2f}x)")
            if "emb-base" in by:
                a, b = by["embedded"], by["emb-base"]
                added = lambda r: r["p50"] - base["p50"]  # noqa: E731
                print(f"{'':<18}{'emb/base':>9}{a['p50'] / b['p50']:>8.2f}x{a['p99'] / b['p99']:>8.2f}x"
                      f"{a['rps'] / b['rps']:>8.2f}x{cpu_ratio(a, b)}  (this checkout over the baseline: p50, p99, "
                      f"req/s, cpu; added p50 {added(a):.2f} against {added(b):.2f} ms, {added(a) / added(b):.2f}x)")
            if "cache" in by:
                e, c = by["embedded"], by["cache"]
                print(f"{'':<18}{'emb/other':>9}{e['p50'] / c['p50']:>8.2f}x{e['p99'] / c['p99']:>8.2f}x"
                      f"{e['rps'] / c['rps']:>8.2f}x{cpu_ratio(e, c)}  (this checkout's defaults over {other_label}: "
                      "p50, p99, req/s, cpu)")
            if "busywait" in by:
                e, bw = by["embedded"], by["busywait"]
                print(f"{'':<18}{'emb/busy':>9}{e['p50'] / bw['p50']:>8.2f}x{e['p99'] / bw['p99']:>8.2f}x"
                      f"{e['rps'] / bw['rps']:>8.2f}x  (writer queue over busy handler)")
        print("\ntargets (2 cores): <= 8 ms added p50 at c=1; >= 160 turns/s at c=16; [DONE] within 2 ms of the last token;"
              " embedded p99 <= 3x p50 at c=16")
    finally:
        for _, obj, _, _ in started:
            obj.close()
        stub.terminate()


def baseline_class(root: Path, module_name: str, class_name: str):
    """tests/support/<module_name>.py's class from another checkout (layout's Layout, daemon's Daemon): its
    processes run that checkout's code (the class finds its tree from its own file); a layout runs over the
    same private PostgreSQL and Redis."""
    import importlib.util
    path = root / "tests" / "support" / f"{module_name}.py"
    spec = importlib.util.spec_from_file_location(f"baseline_{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:  # it puts its tree first on sys.path: this process keeps importing its own
        sys.path[:] = saved
    return getattr(module, class_name)


# --- against LiteLLM's proxy -------------------------------------------------------------------------

LITELLM_VENV = ROOT / "var" / "bench-litellm"
LITELLM_REQS = ROOT / "bench" / "requirements-litellm.txt"
LITELLM_KEY = "sk-bench-" + os.urandom(16).hex()


def litellm_ensure() -> Path:
    """LiteLLM's proxy in a venv of its own (never the project's), made once per requirements file."""
    marker = LITELLM_VENV / ".installed"
    if not marker.exists() or marker.read_text() != LITELLM_REQS.read_text():
        print(f"installing LiteLLM's proxy into {LITELLM_VENV} (once; a few minutes) ...", file=sys.stderr, flush=True)
        subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "-r", str(LITELLM_REQS)], check=True)
        marker.write_text(LITELLM_REQS.read_text())
    return LITELLM_VENV / "bin" / "litellm"


def start_litellm(stub_url: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    from tests.support.daemon import free_port
    exe = litellm_ensure()
    port = free_port()
    cfg = tmp / "litellm.yaml"
    cfg.write_text("model_list:\n  - model_name: stub-model\n    litellm_params:\n      model: openai/stub-model\n"
                   f"      api_base: {stub_url}\n      api_key: sk-stub\n"
                   "litellm_settings:\n  telemetry: false\n  turn_off_message_logging: true\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False", NO_DOCS="True", DISABLE_ADMIN_UI="True",
               LITELLM_MASTER_KEY=LITELLM_KEY)  # it refuses to start without one (and checks it per request)
    log = open(tmp / "litellm.log", "w")
    proc = subprocess.Popen([str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("LiteLLM exited: " + (tmp / "litellm.log").read_text()[-3000:])
        try:
            if httpx.get(base + "/health/liveliness", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("LiteLLM did not come up: " + (tmp / "litellm.log").read_text()[-3000:])


class Target:
    """One gateway under test: how a client of it sends a new conversation's message or a follow-up."""

    def __init__(self, name, url, headers, model, keeps_history: bool, pids=()):
        self.name, self.url, self.headers, self.model, self.keeps_history = name, url, headers, model, keeps_history
        self.pids = list(pids)  # the gateway's processes, whose CPU per turn is printed

    def body(self, conv: str, history: list, follow_up: bool) -> dict:
        if self.keeps_history:  # UGENT: the conversation is server-side; only the new message is sent
            return {"model": self.model, "conversation_id": conv, "messages": [history[-1]]}
        return {"model": self.model, "messages": list(history[-20:] if follow_up else history[-1:])}


def run_conversations(target: Target, *, n: int, concurrency: int, follow_up: bool, tag: str) -> dict:
    """n turns from `concurrency` clients; each client's turns are follow-ups in its own conversation,
    or each turn opens a new conversation. Latency per turn, the wall time, and the CPU the target's
    processes spent meanwhile (None without pids)."""
    lat: list[float] = []
    lock = threading.Lock()
    ready = threading.Barrier(concurrency + 1)  # the clock starts when every client is made, not before
    ends: list[float] = []

    def client_loop(ci: int):
        with httpx.Client(timeout=60) as c:
            ready.wait()
            history: list = []
            for i in range(ci, n, concurrency):
                conv = f"{tag}-c{ci}" if follow_up else f"{tag}-{ci}-{i}"
                if not follow_up:
                    history = []
                history.append({"role": "user", "content": f"hello {i}"})
                t0 = time.perf_counter()
                r = c.post(target.url, json=target.body(conv, history, follow_up), headers=target.headers)
                r.raise_for_status()
                took = time.perf_counter() - t0
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                with lock:
                    lat.append(took)
            with lock:
                ends.append(time.perf_counter())

    pids = [p for root in target.pids for p in process_tree(root)] if target.pids else []
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(client_loop, ci) for ci in range(concurrency)]
        ready.wait()
        cpu0 = process_cpu_seconds(pids)
        t0 = time.perf_counter()
        for f in futures:
            f.result()
        cpu = process_cpu_seconds(pids) - cpu0 if pids else None
    # the wall time of the turns alone: from the moment every client was ready to the last answer
    # (before, each round's threads and clients were made on the clock, which at 16 clients and a few
    # turns each flattened every gateway's turns/s toward the same figure)
    return {"lat": lat, "wall": max(ends) - t0, "cpu": cpu}


def against_litellm(d, stub_url: str, tmp: Path, *, n: int, concurrency: int, servers: bool, chunks: int = 5):
    lite, lite_base = start_litellm(stub_url, tmp)
    try:
        targets = [Target("direct", stub_url + "/chat/completions", {}, "stub-model", keeps_history=False),
                   Target("ugent", d.base + "/v1/chat/completions", {"x-api-key": d.key}, "bench", keeps_history=True,
                          pids=[p.pid for p in d.procs]),
                   Target("litellm", lite_base + "/v1/chat/completions", {"Authorization": "Bearer " + LITELLM_KEY},
                          "stub-model", keeps_history=False, pids=[lite.pid])]
        for t in targets:  # warm-up: connections, imports, pools
            run_conversations(t, n=20, concurrency=2, follow_up=False, tag=f"warm-{t.name}")
        mode = "servers mode" if servers else "embedded daemon"
        print(f"UGENT ({mode}) against LiteLLM's proxy (1 worker, no database), the same stub upstream, "
              f"{n} turns per case, interleaved in {chunks} rounds", flush=True)
        cases = [("new conversation, 1 client", 1, False), ("follow-ups, 1 client", 1, True),
                 (f"new conversation, {concurrency} clients", concurrency, False),
                 (f"follow-ups, {concurrency} clients", concurrency, True)]
        results = []
        for ci, (label, conc, follow) in enumerate(cases):
            acc = {t.name: {"lat": [], "wall": 0.0, "cpu": 0.0} for t in targets}
            for rnd in range(chunks):
                for t in targets:
                    r = run_conversations(t, n=max(conc, n // chunks), concurrency=conc, follow_up=follow,
                                          tag=f"b{ci}-{rnd}-{t.name}")
                    acc[t.name]["lat"] += r["lat"]
                    acc[t.name]["wall"] += r["wall"]
                    acc[t.name]["cpu"] = None if r["cpu"] is None or acc[t.name]["cpu"] is None \
                        else acc[t.name]["cpu"] + r["cpu"]
                print(f"  {label}: round {rnd + 1}/{chunks}", file=sys.stderr, flush=True)
            results.append((label, acc))
        print(f"\n{'case':<34}{'who':>9}{'p50 ms':>9}{'p99 ms':>9}{'turns/s':>9}{'added p50':>11}{'cpu ms/turn':>13}")
        summary = []
        for label, acc in results:
            base50 = pct(acc["direct"]["lat"], 50) * 1000
            row = {}
            for name in ("direct", "ugent", "litellm"):
                lat = acc[name]["lat"]
                p50, p99 = pct(lat, 50) * 1000, pct(lat, 99) * 1000
                rps = len(lat) / acc[name]["wall"]
                cpu = acc[name]["cpu"] / len(lat) * 1000 if acc[name]["cpu"] is not None and name != "direct" else None
                row[name] = (p50 - base50, rps, cpu)
                added = f"{p50 - base50:.2f}" if name != "direct" else "-"
                cpu_text = f"{cpu:.2f}" if cpu is not None else "-"
                print(f"{label:<34}{name:>9}{p50:>9.2f}{p99:>9.2f}{rps:>9.1f}{added:>11}{cpu_text:>13}")
            lat_ratio = row["litellm"][0] / row["ugent"][0] if row["ugent"][0] > 0 else float("inf")
            rps_ratio = row["ugent"][1] / row["litellm"][1]
            cpu_ratio_ = row["litellm"][2] / row["ugent"][2] if row["ugent"][2] and row["litellm"][2] else None
            summary.append((label, lat_ratio, rps_ratio, cpu_ratio_))
        print(f"\n{'case':<34}{'LiteLLM added / UGENT added':>30}{'UGENT turns/s / LiteLLM':>26}"
              f"{'LiteLLM cpu / UGENT cpu':>26}")
        for label, lat_ratio, rps_ratio, cpu_r in summary:
            cpu_text = f"{cpu_r:.2f}x" if cpu_r else "-"
            print(f"{label:<34}{lat_ratio:>29.2f}x{rps_ratio:>25.2f}x{cpu_text:>26}")
        print("\ntarget: 3x less added latency than LiteLLM (one client) and 4x its throughput (sixteen clients)")
    finally:
        os.killpg(lite.pid, 15)
        try:
            lite.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(lite.pid, 9)


if __name__ == "__main__":
    main()
