"""Fan-out of one conversation's events to N SSE subscribers, beside a bare Redis pub/sub relay,
and the wake-up transports compared: channels_app.notify against the Django Channels layer.

    .venv/bin/python bench/events_fanout.py [--subscribers 100 1000] [--words 200] [--budget 90]
                                            [--events 200] [--pace 0.005] [--only daemon|transports]

Starts the real daemon (embedded; servers mode when REDIS_URL is set, as the tests do), opens N
subscribers on /v1/ugent/events for one conversation, runs one scripted turn that streams --words
answer tokens, and reports events per second delivered and the p50/p99 delay from the event's commit
(its `ts`) to its arrival at a client. The same N subscribers on a bare Redis pub/sub channel, fed the
same number of messages at the same pace, are measured in the same run.

Then, for the same N, the transports alone (no HTTP, no database): N subscribers on one topic in
this process's event loop, as one web process holds them, woken by --events events sent --pace
seconds apart, each carrying one event row as the turn's appends do:

* notify: `notify.register` + `Waiter.wait/take`, fed by `notify.publish(topic, batch=...)`;
* the Channels layer: `new_channel` + `group_add` + `receive`, fed by `group_send`:
  servers mode `channels_redis.core.RedisChannelLayer` and `channels_redis.pubsub.RedisPubSubChannelLayer`,
  embedded `channels.layers.InMemoryChannelLayer` (default settings, capacity 100).

Servers mode publishes from a second process, so every event crosses Redis as notify's do between a
worker and a web process; embedded mode publishes from a second thread, as the daemon's turn threads
do (the in-memory layer is bound to one event loop, so that thread hands each group_send to it).
Each line gives events/s delivered, p50/p99 publish-to-receipt delay, the publisher's CPU per event,
the subscribers' process CPU per delivery (embedded: less the publisher thread's), Redis' own CPU per
event (servers; Redis is shared, so noisy), and the ratios against notify in the same run.
Each run is bounded by --budget seconds; figures are printed, nothing is asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.daemon import Daemon  # noqa: E402


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def ts_of(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def sse_subscriber(client, url, params, headers, ready, done_type, delays, counts, idx):
    async with client.stream("GET", url, params=params, headers=headers) as resp:
        ready.release()
        data = None
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
            elif line == "" and data is not None:
                now = time.time()
                ev = json.loads(data)
                delays.append(now - ts_of(ev["ts"]))
                counts[idx] += 1
                data = None
                if ev["type"] == done_type:
                    return


def procs_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes have used, from /proc."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


async def run_daemon(d: Daemon, n: int, words: int, budget: float) -> dict:
    conv = f"bench-{n}-{int(time.time())}"
    headers = {"x-api-key": d.key}
    async with httpx.AsyncClient(timeout=httpx.Timeout(budget, connect=30),
                                 limits=httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)) as c:
        # the conversation must exist before anyone subscribes to it
        await c.post(d.base + "/v1/chat/completions", headers=headers,
                     json={"messages": [{"role": "user", "content": "hello"}], "conversation_id": conv,
                           "user": "alice"})
        snap = (await c.get(d.base + "/v1/ugent/conversation/snapshot", headers=headers,
                            params={"conversation_id": conv, "user": "alice"})).json()
        params = {"conversation_id": conv, "user": "alice", "cursor": str(snap["cursor"])}
        delays: list[float] = []
        counts = [0] * n
        ready = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(sse_subscriber(c, d.base + "/v1/ugent/events", params, headers, ready,
                                                    "turn.completed", delays, counts, i)) for i in range(n)]
        t0 = time.monotonic()
        for i in range(n):
            await asyncio.wait_for(ready.acquire(), timeout=budget)
            if (i + 1) % max(1, n // 5) == 0:
                print(f"    {i + 1}/{n} subscribers connected", flush=True)
        print(f"    all connected in {time.monotonic() - t0:.1f}s; running the turn", flush=True)
        start = time.time()
        cpu0, client0 = procs_cpu([p.pid for p in d.procs]), time.process_time()

        async def progress():
            while True:
                await asyncio.sleep(5)
                done = sum(1 for t in tasks if t.done())
                print(f"    {time.time() - start:5.0f}s: {sum(counts):,} events delivered, {done}/{n} "
                      f"subscribers finished", flush=True)
        ticker = asyncio.create_task(progress())
        text = "script:slow=0.005|answer=" + " ".join(f"w{i}" for i in range(words))
        await c.post(d.base + "/v1/chat/completions", headers=headers,
                     json={"messages": [{"role": "user", "content": text}], "conversation_id": conv,
                           "user": "alice", "stream": True})
        _done, pending = await asyncio.wait(tasks, timeout=budget)
        ticker.cancel()
        for t in pending:
            t.cancel()
        elapsed = time.time() - start
        server_cpu, client_cpu = procs_cpu([p.pid for p in d.procs]) - cpu0, time.process_time() - client0
    per_sub = max(counts) if counts else 0
    return {"delivered": sum(counts), "per_subscriber": per_sub, "complete": sum(1 for x in counts if x == per_sub),
            "elapsed": elapsed, "delays": delays, "timed_out": len(pending), "server_cpu": server_cpu,
            "client_cpu": client_cpu}


async def run_redis(redis_url: str, n: int, messages: int, pace: float, budget: float) -> dict:
    import redis.asyncio as aioredis
    channel = f"bench:fanout:{os.getpid()}:{n}"
    delays: list[float] = []
    counts = [0] * n
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(n)]
    pubsubs = []
    for cl in clients:
        ps = cl.pubsub()
        await ps.subscribe(channel)
        pubsubs.append(ps)

    async def consume(i, ps):
        async for msg in ps.listen():
            if msg["type"] != "message":
                continue
            body = json.loads(msg["data"])
            delays.append(time.time() - body["ts"])
            counts[i] += 1
            if body["last"]:
                return
    tasks = [asyncio.create_task(consume(i, ps)) for i, ps in enumerate(pubsubs)]
    pub = aioredis.Redis.from_url(redis_url)
    start = time.time()
    cpu0, client0 = redis_cpu(redis_url), time.process_time()
    for k in range(messages):
        await pub.publish(channel, json.dumps({"ts": time.time(), "last": k == messages - 1, "n": k}))
        await asyncio.sleep(pace)
    _done, pending = await asyncio.wait(tasks, timeout=budget)
    for t in pending:
        t.cancel()
    elapsed = time.time() - start
    server_cpu, client_cpu = redis_cpu(redis_url) - cpu0, time.process_time() - client0
    for ps in pubsubs:
        await ps.aclose()
    for cl in clients + [pub]:
        await cl.aclose()
    return {"delivered": sum(counts), "per_subscriber": messages, "complete": sum(1 for x in counts if x == messages),
            "elapsed": elapsed, "delays": delays, "timed_out": len(pending), "server_cpu": server_cpu,
            "client_cpu": client_cpu}


def report(label: str, n: int, r: dict) -> None:
    ms = [x * 1000 for x in r["delays"]]
    print(f"  {label:<22} N={n:<5} events/client={r['per_subscriber']:<4} complete={r['complete']}/{n} "
          f"delivered={r['delivered']:<7} {r['delivered'] / max(r['elapsed'], 1e-9):>9.0f} ev/s  "
          f"p50={pct(ms, 50):7.1f} ms  p99={pct(ms, 99):7.1f} ms"
          + (f"  server CPU={r['server_cpu'] / max(r['delivered'], 1) * 1e6:5.1f} µs/delivery"
             f"  clients' CPU={r['client_cpu'] / max(r['delivered'], 1) * 1e6:5.1f} µs/delivery"
             if "server_cpu" in r else "")
          + (f"  ({r['timed_out']} timed out)" if r["timed_out"] else ""), flush=True)


def report_ratio(n: int, ugent: dict, relay: dict) -> None:
    """UGENT's commit-to-client delay over the bare relay's, same run (the issue's target: p99 within 2x)."""
    a = [x * 1000 for x in ugent["delays"]]
    b = [x * 1000 for x in relay["delays"]]
    p50, p99 = pct(a, 50) / max(pct(b, 50), 1e-9), pct(a, 99) / max(pct(b, 99), 1e-9)
    print(f"  {'UGENT / bare relay':<22} N={n:<5} p50 {p50:.2f}x  p99 {p99:.2f}x"
          f"  (target: p99 within 2x: {'met' if p99 <= 2 else 'not met'})", flush=True)


# --- the wake-up transports alone ------------------------------------------------------------

def transports_for(servers: bool) -> list[str]:
    if not servers:
        return ["notify", "InMemoryChannelLayer"]
    names = ["notify", "RedisChannelLayer"]
    try:
        import channels_redis.pubsub  # noqa: F401
        names.append("RedisPubSubChannelLayer")
    except ImportError:
        pass
    return names


def django_configure(redis_url: str, queue: str) -> None:
    """What channels_app.notify reads from settings; no database is touched."""
    from django.conf import settings
    if not settings.configured:
        settings.configure(REDIS_URL=redis_url, CELERY_TASK_DEFAULT_QUEUE=queue, USE_TZ=True)


def notify_queue() -> str:
    """This bench's notify channels (one per process: notify's listener thread subscribes once)."""
    from django.conf import settings
    return settings.CELERY_TASK_DEFAULT_QUEUE


def layer_make(kind: str, redis_url: str, prefix: str):
    if kind == "InMemoryChannelLayer":
        from channels.layers import InMemoryChannelLayer
        return InMemoryChannelLayer()
    if kind == "RedisChannelLayer":
        from channels_redis.core import RedisChannelLayer
        return RedisChannelLayer(hosts=[redis_url], prefix=prefix)
    from channels_redis.pubsub import RedisPubSubChannelLayer
    return RedisPubSubChannelLayer(hosts=[redis_url], prefix=prefix)


def event_row(k: int) -> list:
    """One event row as a turn's append carries it: (id, type, data)."""
    return [k + 1, "turn.delta", {"ts": time.time(), "k": k, "text": f"w{k} "}]


def publish_paced(send, events: int, pace: float) -> float:
    """Send `events` rows `pace` seconds apart; the CPU this thread spent sending them."""
    cpu = 0.0
    for k in range(events):
        c0 = time.thread_time()
        send(k, event_row(k))
        cpu += time.thread_time() - c0
        time.sleep(pace)
    return cpu


def publisher_process(spec: dict) -> None:
    """The second process of a servers-mode transport run: publish, then print the CPU it took."""
    kind, name, events, pace = spec["kind"], spec["name"], spec["events"], spec["pace"]
    if kind == "notify":
        django_configure(spec["redis_url"], spec["queue"])
        from channels_app import notify
        notify.publish("bench:warm")  # the Redis connection, outside the figures

        def send(k, row):
            notify.publish(name, batch=(name, notify.TurnBatch(prev=k, rows=(tuple(row),))))
        cpu = publish_paced(send, events, pace)
    else:
        loop = asyncio.new_event_loop()
        layer = layer_make(kind, spec["redis_url"], spec["prefix"])
        loop.run_until_complete(layer.group_send(name + "-warm", {"type": "warm"}))

        def send(k, row):
            loop.run_until_complete(layer.group_send(name, {"type": "turn.event", "rows": [row]}))
        cpu = publish_paced(send, events, pace)
    print(json.dumps({"cpu": cpu}), flush=True)
    os._exit(0)  # the layer's and notify's connections go with the process


def redis_cpu(redis_url: str) -> float:
    import redis
    info = redis.Redis.from_url(redis_url).info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def run_transport(kind: str, servers: bool, redis_url: str, n: int, events: int, pace: float,
                        budget: float) -> dict:
    uid = f"{os.getpid()}-{n}-{int(time.time() * 1000) % 10**8}"
    name = f"bench-fanout-{kind.lower()}-{uid}"
    prefix = f"bench-fanout-{uid}"
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + budget
    delays: list[float] = []
    counts = [0] * n
    fallbacks = [0]  # notify: wake-ups without rows, where a reader would read the database
    remaining = [n]
    all_done = asyncio.Event()

    window = [float("inf"), 0.0]  # first event sent, last one received: what ev/s divides by

    def got(i: int, rows, now: float) -> None:
        for row in rows:
            delays.append(now - row[2]["ts"])
            counts[i] += 1
            window[0] = min(window[0], row[2]["ts"])
        window[1] = now
        if counts[i] >= events:
            remaining[0] -= 1
            if remaining[0] == 0:
                all_done.set()

    if kind == "notify":
        from channels_app import notify
        waiters = [notify.register(name, loop) for _ in range(n)]
        if servers:  # the listener thread is up once a raw Redis publish wakes a probe waiter
            import redis
            probe = notify.register(name + "-probe", loop)
            raw = redis.Redis.from_url(redis_url)
            while not probe.event.is_set() and time.monotonic() < deadline:
                raw.publish(notify.channel_prefix() + name + "-probe", b"1")
                await asyncio.sleep(0.05)
            probe.close()

        async def consume(i):
            w = waiters[i]
            while counts[i] < events:
                await w.wait(1.0)
                batches, now = w.take(), time.time()
                if batches is None:
                    fallbacks[0] += 1
                    continue
                for b in batches:
                    got(i, b.rows, now)
        layer = None
    else:
        layer = layer_make(kind, redis_url, prefix)
        chans = [await layer.new_channel() for _ in range(n)]
        for c in chans:
            await layer.group_add(name, c)
        # ready once a probe sent through the layer reaches every subscriber
        await layer.group_send(name, {"type": "probe"})
        for c in chans:
            msg = await asyncio.wait_for(layer.receive(c), timeout=max(1.0, deadline - time.monotonic()))
            assert msg["type"] == "probe", msg

        async def consume(i):
            c = chans[i]
            while counts[i] < events:
                msg = await layer.receive(c)
                got(i, msg["rows"], time.time())
        waiters = []

    tasks = [asyncio.create_task(consume(i)) for i in range(n)]
    spec = {"kind": kind, "name": name, "events": events, "pace": pace, "redis_url": redis_url,
            "queue": notify_queue(), "prefix": prefix}
    rcpu0 = redis_cpu(redis_url) if servers else 0.0
    cpu0, start = time.process_time(), time.time()
    pub_thread_cpu = [0.0]
    if servers:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--publish", json.dumps(spec),
            stdout=asyncio.subprocess.PIPE, cwd=str(ROOT))
        publishing = asyncio.create_task(proc.communicate())
    else:
        if kind == "notify":
            def send(k, row):
                notify.publish(name, batch=(name, notify.TurnBatch(prev=k, rows=(tuple(row),))))
        else:
            def send(k, row):  # the in-memory layer lives on the subscribers' loop
                asyncio.run_coroutine_threadsafe(
                    layer.group_send(name, {"type": "turn.event", "rows": [row]}), loop).result()

        def run_thread():
            pub_thread_cpu[0] = publish_paced(send, events, pace)
        publishing = asyncio.create_task(asyncio.to_thread(run_thread))

    async def progress():
        while True:
            await asyncio.sleep(5)
            print(f"    … {kind}: {sum(counts)}/{n * events} delivered", flush=True)
    ticker = asyncio.create_task(progress())
    try:
        await asyncio.wait_for(asyncio.shield(publishing), timeout=max(0.1, deadline - time.monotonic()))
        await asyncio.wait_for(all_done.wait(), timeout=max(0.1, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        pass
    end = time.time()
    cpu = time.process_time() - cpu0
    rcpu = (redis_cpu(redis_url) - rcpu0) if servers else 0.0
    ticker.cancel()
    pending = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for w in waiters:
        w.close()
    if servers:
        if publishing.done():
            out, _ = publishing.result()
            pub_cpu = json.loads(out.decode().strip().splitlines()[-1])["cpu"] if out else float("nan")
        else:
            proc.kill()
            await publishing
            pub_cpu = float("nan")
    else:
        await publishing  # the thread ends by itself after its events
        pub_cpu = pub_thread_cpu[0]
        cpu -= pub_cpu
    if layer is not None:
        try:
            await layer.flush()
        except Exception:
            pass
    delivered = sum(counts)
    return {"delivered": delivered, "per_subscriber": events,
            "complete": sum(1 for x in counts if x >= events),
            "elapsed": (window[1] - window[0]) if delivered else end - start, "delays": delays,
            "timed_out": len(pending), "pub_cpu": pub_cpu / events, "sub_cpu": cpu / max(1, delivered),
            "redis_cpu": rcpu / events, "fallbacks": fallbacks[0]}


def report_transport(label: str, n: int, r: dict, base: dict | None, servers: bool) -> None:
    ms = [x * 1000 for x in r["delays"]]
    rate = r["delivered"] / max(r["elapsed"], 1e-9)
    line = (f"  {label:<24} N={n:<5} complete={r['complete']}/{n} delivered={r['delivered']:<7} "
            f"{rate:>9.0f} ev/s  p50={pct(ms, 50):7.1f} ms  p99={pct(ms, 99):7.1f} ms  "
            f"pub CPU={r['pub_cpu'] * 1e6:7.0f} µs/ev  subscribers' CPU={r['sub_cpu'] * 1e6:5.1f} µs/delivery")
    if servers:
        line += f"  Redis CPU={r['redis_cpu'] * 1e6:6.0f} µs/ev"
    if r["fallbacks"]:
        line += f"  ({r['fallbacks']} wake-ups without rows)"
    if r["timed_out"]:
        line += f"  ({r['timed_out']} subscribers short at the budget)"
    print(line, flush=True)
    if base is not None:
        bms = [x * 1000 for x in base["delays"]]
        brate = base["delivered"] / max(base["elapsed"], 1e-9)

        def ratio(a, b):
            return f"{a / b:.2f}x" if b and b == b and a == a else "n/a"
        print(f"  {'':<24} against notify: ev/s {ratio(rate, brate)}  p50 {ratio(pct(ms, 50), pct(bms, 50))}  "
              f"p99 {ratio(pct(ms, 99), pct(bms, 99))}  pub CPU {ratio(r['pub_cpu'], base['pub_cpu'])}  "
              f"subscribers' CPU {ratio(r['sub_cpu'], base['sub_cpu'])}", flush=True)


def run_transports(servers: bool, redis_url: str, n: int, events: int, pace: float, budget: float) -> None:
    print(f"\n== wake-up transports, {n} subscribers on one topic, {events} events {pace * 1000:.1f} ms apart "
          f"({'servers: publisher in a second process, over Redis' if servers else 'embedded: publisher thread'})",
          flush=True)
    base = None
    for kind in transports_for(servers):
        try:
            r = asyncio.run(run_transport(kind, servers, redis_url, n, events, pace, budget))
        except Exception as exc:  # one transport failing keeps the others' figures
            print(f"  {kind:<24} failed ({type(exc).__name__}: {exc})", flush=True)
            continue
        report_transport(kind, n, r, base, servers)
        if kind == "notify":
            base = r


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--publish":
        return publisher_process(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subscribers", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--words", type=int, default=200, help="answer tokens the scripted turn streams")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds each run may take at most")
    ap.add_argument("--events", type=int, default=200, help="events each transport run sends")
    ap.add_argument("--pace", type=float, default=0.005, help="seconds between a transport run's events")
    ap.add_argument("--only", choices=["daemon", "transports"], help="run one half of the bench")
    args = ap.parse_args()
    redis_url = os.environ.get("REDIS_URL") or os.environ.get("UGENT_BENCH_REDIS", "redis://127.0.0.1:6379/15")
    servers = bool(os.environ.get("REDIS_URL"))
    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {os.cpu_count()} cores, "
          f"{'servers' if servers else 'embedded'} mode", flush=True)
    if args.only != "daemon":
        django_configure(redis_url if servers else "", f"bench-fanout-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="ugent-bench-") as tmp:
        d = Daemon(Path(tmp))
        if args.only != "transports":
            print(f"starting the daemon ({'servers' if d.servers else 'embedded'} mode)…", flush=True)
            d.start()
        try:
            for n in args.subscribers:
                if args.only != "transports":
                    print(f"\n== {n} subscribers on one conversation", flush=True)
                    r = asyncio.run(run_daemon(d, n, args.words, args.budget))
                    report("UGENT /v1/ugent/events", n, r)
                    msgs = max(1, r["per_subscriber"])
                    try:
                        print("    the bare Redis pub/sub relay, same N and message count…", flush=True)
                        rr = asyncio.run(run_redis(redis_url, n, msgs, r["elapsed"] / msgs / 2, args.budget))
                        report("bare Redis pub/sub", n, rr)
                        report_ratio(n, r, rr)
                    except Exception as exc:  # no Redis here: say so, keep the daemon's figures
                        print(f"  bare Redis pub/sub     skipped ({type(exc).__name__}: {exc})", flush=True)
                if args.only != "daemon":
                    run_transports(servers, redis_url, n, args.events, args.pace, args.budget)
        finally:
            if args.only != "transports":
                d.close()

if __name__ == "__main__":
    main()
