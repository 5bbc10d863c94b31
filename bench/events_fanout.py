"""Fan-out of one conversation's events to N SSE subscribers, beside a bare Redis pub/sub relay.

    .venv/bin/python bench/events_fanout.py [--subscribers 100 1000] [--words 200] [--budget 90]

Starts the real daemon (embedded; servers mode when REDIS_URL is set, as the tests do), opens N
subscribers on /v1/ugent/events for one conversation, runs one scripted turn that streams --words
answer tokens, and reports events per second delivered and the p50/p99 delay from the event's commit
(its `ts`) to its arrival at a client. The same N subscribers on a bare Redis pub/sub channel, fed the
same number of messages at the same pace, are measured in the same run. Each run is bounded by
--budget seconds; figures are printed, nothing is asserted.
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
        text = "script:slow=0.005|answer=" + " ".join(f"w{i}" for i in range(words))
        await c.post(d.base + "/v1/chat/completions", headers=headers,
                     json={"messages": [{"role": "user", "content": text}], "conversation_id": conv,
                           "user": "alice", "stream": True})
        _done, pending = await asyncio.wait(tasks, timeout=budget)
        for t in pending:
            t.cancel()
        elapsed = time.time() - start
    per_sub = max(counts) if counts else 0
    return {"delivered": sum(counts), "per_subscriber": per_sub, "complete": sum(1 for x in counts if x == per_sub),
            "elapsed": elapsed, "delays": delays, "timed_out": len(pending)}


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
    for k in range(messages):
        await pub.publish(channel, json.dumps({"ts": time.time(), "last": k == messages - 1, "n": k}))
        await asyncio.sleep(pace)
    _done, pending = await asyncio.wait(tasks, timeout=budget)
    for t in pending:
        t.cancel()
    elapsed = time.time() - start
    for ps in pubsubs:
        await ps.aclose()
    for cl in clients + [pub]:
        await cl.aclose()
    return {"delivered": sum(counts), "per_subscriber": messages, "complete": sum(1 for x in counts if x == messages),
            "elapsed": elapsed, "delays": delays, "timed_out": len(pending)}


def report(label: str, n: int, r: dict) -> None:
    ms = [x * 1000 for x in r["delays"]]
    print(f"  {label:<22} N={n:<5} events/client={r['per_subscriber']:<4} complete={r['complete']}/{n} "
          f"delivered={r['delivered']:<7} {r['delivered'] / max(r['elapsed'], 1e-9):>9.0f} ev/s  "
          f"p50={pct(ms, 50):7.1f} ms  p99={pct(ms, 99):7.1f} ms"
          + (f"  ({r['timed_out']} timed out)" if r["timed_out"] else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subscribers", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--words", type=int, default=200, help="answer tokens the scripted turn streams")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds each run may take at most")
    args = ap.parse_args()
    redis_url = os.environ.get("REDIS_URL") or os.environ.get("UGENT_BENCH_REDIS", "redis://127.0.0.1:6379/15")
    with tempfile.TemporaryDirectory(prefix="ugent-bench-") as tmp:
        d = Daemon(Path(tmp))
        print(f"starting the daemon ({'servers' if d.servers else 'embedded'} mode)…", flush=True)
        d.start()
        try:
            for n in args.subscribers:
                print(f"\n== {n} subscribers on one conversation", flush=True)
                r = asyncio.run(run_daemon(d, n, args.words, args.budget))
                report("UGENT /v1/ugent/events", n, r)
                msgs = max(1, r["per_subscriber"])
                try:
                    rr = asyncio.run(run_redis(redis_url, n, msgs, r["elapsed"] / msgs / 2, args.budget))
                    report("bare Redis pub/sub", n, rr)
                except Exception as exc:  # no Redis here: say so, keep the daemon's figures
                    print(f"  bare Redis pub/sub     skipped ({type(exc).__name__}: {exc})", flush=True)
        finally:
            d.close()


if __name__ == "__main__":
    main()
