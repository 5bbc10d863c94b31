"""Fan-out of one conversation's events to N SSE subscribers, beside a bare Redis pub/sub relay,
and the wake-up transports compared: channels_app.notify against the Django Channels layer.

    .venv/bin/python bench/events_fanout.py [--subscribers 100 1000] [--words 200] [--budget 90]
                                            [--events 200] [--pace 0.005] [--only daemon|transports]
                                            [--clients lean|library] [--profile DIR]

Starts the real daemon (embedded; servers mode when REDIS_URL is set, as the tests do), opens N
subscribers on /v1/ugent/events for one conversation, runs one scripted turn that streams --words
answer tokens, and reports events per second delivered and the p50/p99 delay from the event's commit
(its `ts`) to its arrival at a client. The same N subscribers on a bare Redis pub/sub channel, fed the
same number of messages, of the same size, on the schedule the turn's events committed on (each
message when its event was written, from the first: the turn's bursts included), are measured in the
same run. Subscribers on both sides stay connected until the run ends.

Both sides' clients run in this one process, so they must cost alike or the comparison measures
the clients. `--clients lean` (the default): each SSE subscriber and each relay subscriber is an
asyncio.Protocol on its own socket, parsing what arrives in data_received (HTTP/1.1 chunked framing
and SSE frames on one side, RESP on the other), then the same json.loads and ISO timestamp parse
per message on both sides, with no task per subscriber. `--clients library`: httpx streams
(aiter_lines) and redis-py pub/sub (listen), a task per subscriber, as this bench used before; the
relay's redis-py client then cost about twice the CPU per message of the httpx one, so that
baseline was slower than Redis. `--profile DIR` records the daemon's processes with py-spy
(`--gil`, raw collapsed stacks, one file per process) while the turn runs, and prints where their
samples went.

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
# This folder leaves the path (a bench module must never stand in for a package), the checkout comes first.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.daemon import Daemon  # noqa: E402
from ugent_common.digits import ascii_int  # noqa: E402


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def ts_of(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def sse_subscriber(client, url, params, headers, ready, done_type, tally, idx):
    """--clients library: one httpx stream, read line by line in its own task."""
    async with client.stream("GET", url, params=params, headers=headers) as resp:
        ready.release()
        data = None
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
            elif line == "" and data is not None:
                now = time.time()
                ev = json.loads(data)
                tally.got(idx, ts_of(ev["ts"]), now, len(data))
                data = None
                if ev["type"] == done_type:
                    return


class Tally:
    """What the subscribers of one run received: delays, counts, and the first subscriber's events'
    commit times and sizes (the relay is fed at that pace, with messages of that size)."""

    def __init__(self, n: int):
        self.delays: list[float] = []
        self.counts = [0] * n
        self.ts: list[float] = []
        self.sizes: list[int] = []
        self.first: dict[float, float] = {}  # per event (by its ts): its first and last arrival
        self.last: dict[float, float] = {}
        self.kinds: dict[float, str] = {}  # per event (by its ts): its type, as the first subscriber saw it

    def got(self, idx: int, ts: float, now: float, size: int = 0, kind: str = "") -> None:
        self.delays.append(now - ts)
        self.counts[idx] += 1
        if ts not in self.first:
            self.first[ts] = now
        self.last[ts] = now
        if idx == 0:
            self.ts.append(ts)
            self.sizes.append(size)
            self.kinds[ts] = kind


class LeanSse(asyncio.Protocol):
    """One SSE subscriber on its own socket, parsed in data_received: HTTP/1.1 head, chunked framing,
    SSE frames; per event one json.loads and one ISO timestamp parse, as the relay's client does."""

    def __init__(self, request: bytes, tally: Tally, idx: int, done_type: str):
        loop = asyncio.get_running_loop()
        self.request, self.tally, self.idx, self.done_type = request, tally, idx, done_type.encode()
        self.ready, self.done = loop.create_future(), loop.create_future()
        self.head, self.chunked, self.raw, self.text = True, False, b"", b""

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc):
        for f in (self.ready, self.done):
            if not f.done():
                f.set_exception(ConnectionError(f"stream closed ({exc})"))

    def data_received(self, data: bytes) -> None:
        buf = self.raw + data
        if self.head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.raw = buf
                return
            head = buf[:end].lower()
            if not head.startswith((b"http/1.1 200", b"http/1.0 200")):
                self.ready.set_exception(RuntimeError(buf[:end].decode(errors="replace")))
                self.transport.close()
                return
            self.chunked = b"transfer-encoding: chunked" in head
            self.head, buf = False, buf[end + 4:]
            self.ready.set_result(None)
        if self.chunked:
            parts, pos = [], 0
            while True:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(buf[pos:nl].split(b";", 1)[0], 16)
                if len(buf) < nl + 4 + size:
                    break
                parts.append(buf[nl + 2:nl + 2 + size])
                pos = nl + 4 + size
            self.raw = buf[pos:]
            text = self.text + b"".join(parts)
        else:
            self.raw, text = b"", self.text + buf
        *frames, self.text = text.split(b"\n\n")
        if not frames:
            return
        now = time.time()
        for frame in frames:
            at = frame.find(b"data: ")
            if at < 0:
                continue  # retry: or a keep-alive
            end = frame.find(b"\n", at)
            data = frame[at + 6:] if end < 0 else frame[at + 6:end]
            ev = json.loads(data)
            self.tally.got(self.idx, ts_of(ev["ts"]), now, len(frame) + 2, ev["type"])
            if ev["type"].encode() == self.done_type and not self.done.done():
                # stay connected, as a relay subscriber does after its last message: every
                # subscriber is closed after the run, so the server's share of the run is the fan-out
                # and not a thousand disconnects while the last event is still on its way to others
                self.done.set_result(None)


def resp_command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class LeanRedisSub(asyncio.Protocol):
    """One relay subscriber: SUBSCRIBE on its own socket, RESP parsed in data_received; per message the
    same json.loads and ISO timestamp parse as an SSE subscriber's."""

    def __init__(self, channel: bytes, tally: Tally, idx: int):
        loop = asyncio.get_running_loop()
        self.channel, self.tally, self.idx = channel, tally, idx
        self.ready, self.done = loop.create_future(), loop.create_future()
        self.buf = b""

    def connection_made(self, transport):
        self.transport = transport
        transport.write(resp_command(b"SUBSCRIBE", self.channel))

    def connection_lost(self, exc):
        for f in (self.ready, self.done):
            if not f.done():
                f.set_exception(ConnectionError(f"relay connection closed ({exc})"))

    def data_received(self, data: bytes) -> None:
        buf, pos, now = self.buf + data, 0, None
        while True:
            msg, end = resp_array(buf, pos)
            if msg is None:
                break
            pos = end
            if msg[0] == b"subscribe" and not self.ready.done():
                self.ready.set_result(None)
            elif msg[0] == b"message":
                now = now or time.time()
                body = json.loads(msg[2])
                self.tally.got(self.idx, ts_of(body["ts"]), now)
                if body["last"] and not self.done.done():
                    self.done.set_result(None)
        self.buf = buf[pos:]


def resp_array(buf: bytes, pos: int):
    """One RESP array of bulk strings and integers at `pos` (what pub/sub sends), or (None, pos)."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        return None, pos
    count, at, items = int(buf[pos + 1:nl]), nl + 2, []
    for _ in range(count):
        nl = buf.find(b"\r\n", at)
        if nl < 0:
            return None, pos
        if buf[at:at + 1] == b":":
            items.append(int(buf[at + 1:nl]))
            at = nl + 2
            continue
        size = int(buf[at + 1:nl])
        if len(buf) < nl + 4 + size:
            return None, pos
        items.append(buf[nl + 2:nl + 2 + size])
        at = nl + 4 + size
    return items, at


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


class Profiler:
    """py-spy on the daemon's processes while the turn runs (--profile DIR): raw collapsed stacks."""

    def __init__(self, out_dir: str | None, pids: list[int], label: str):
        self.procs, self.files = [], []
        if not out_dir:
            return
        spy = Path(sys.executable).with_name("py-spy")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for pid in pids:
            out = Path(out_dir) / f"{label}-{pid}.txt"
            self.files.append(out)
            self.procs.append(subprocess.Popen(
                [str(spy), "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking", "--rate", "250",
                 "--format", "raw", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.files:
            if f.exists():
                profile_summary(f)


def profile_summary(path: Path, top: int = 22) -> None:
    """Samples per thread, and the functions most often on the stack (inclusive) and on top (self)."""
    threads: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    leaf: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        k = ascii_int(count)
        if not stack or k is None:
            continue
        frames = stack.split(";")
        total += k
        threads[frames[0]] = threads.get(frames[0], 0) + k
        names = [f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if " (" in f else f for f in frames[1:]]
        for name in set(names):
            inclusive[name] = inclusive.get(name, 0) + k
        if names:
            leaf[names[-1]] = leaf.get(names[-1], 0) + k
    print(f"    profile {path.name}: {total} samples holding the GIL", flush=True)
    for name, k in sorted(threads.items(), key=lambda x: -x[1])[:6]:
        print(f"      thread {name[:60]:<60} {100 * k / max(total, 1):5.1f}%", flush=True)
    print("      on the stack (inclusive):", flush=True)
    for name, k in sorted(inclusive.items(), key=lambda x: -x[1])[:top]:
        print(f"        {100 * k / max(total, 1):5.1f}%  {name[:110]}", flush=True)
    print("      on top (self):", flush=True)
    for name, k in sorted(leaf.items(), key=lambda x: -x[1])[:top]:
        print(f"        {100 * k / max(total, 1):5.1f}%  {name[:110]}", flush=True)


async def run_daemon(d: Daemon, n: int, words: int, budget: float, clients: str = "lean",
                     profile: str | None = None) -> dict:
    conv = f"bench-{n}-{int(time.time())}"
    headers = {"x-api-key": d.key}
    loop = asyncio.get_running_loop()
    tally = Tally(n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(budget, connect=30),
                                 limits=httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)) as c:
        # the conversation must exist before anyone subscribes to it
        await c.post(d.base + "/v1/chat/completions", headers=headers,
                     json={"messages": [{"role": "user", "content": "hello"}], "conversation_id": conv,
                           "user": "alice"})
        snap = (await c.get(d.base + "/v1/ugent/conversation/snapshot", headers=headers,
                            params={"conversation_id": conv, "user": "alice"})).json()
        params = {"conversation_id": conv, "user": "alice", "cursor": str(snap["cursor"])}
        t0 = time.monotonic()
        if clients == "lean":
            host = "127.0.0.1"
            # a layout's subscribers may go straight to its web processes, in turn (--layout direct)
            ports = getattr(d, "subscriber_ports", None) or [d.port]
            query = httpx.QueryParams(params)
            protos = []

            async def connect(i):
                port = ports[i % len(ports)]
                request = (f"GET /v1/ugent/events?{query} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                           f"x-api-key: {d.key}\r\nAccept: text/event-stream\r\n\r\n").encode()
                _t, proto = await loop.create_connection(lambda: LeanSse(request, tally, i, "turn.completed"),
                                                         host, port)
                await asyncio.wait_for(proto.ready, timeout=budget)
                return proto
            for lo in range(0, n, 50):  # fifty at a time: the server's backlog and the bench's patience
                protos += await asyncio.gather(*(connect(i) for i in range(lo, min(n, lo + 50))))
                if len(protos) % max(1, n // 5) < 50:
                    print(f"    {len(protos)}/{n} subscribers connected", flush=True)
            tasks = [asyncio.ensure_future(p.done) for p in protos]
        else:
            ready = asyncio.Semaphore(0)
            tasks = [asyncio.create_task(sse_subscriber(c, d.base + "/v1/ugent/events", params, headers, ready,
                                                        "turn.completed", tally, i)) for i in range(n)]
            for i in range(n):
                await asyncio.wait_for(ready.acquire(), timeout=budget)
                if (i + 1) % max(1, n // 5) == 0:
                    print(f"    {i + 1}/{n} subscribers connected", flush=True)
        print(f"    all connected in {time.monotonic() - t0:.1f}s; running the turn", flush=True)
        await asyncio.sleep(0.5)  # the streams have read their (empty) history and wait on the reader
        spy = Profiler(profile, [p.pid for p in d.procs], f"{'servers' if d.servers else 'embedded'}-{n}")
        start = time.time()
        cpu0, client0 = procs_cpu([p.pid for p in d.procs]), time.process_time()

        async def progress():
            while True:
                await asyncio.sleep(5)
                done = sum(1 for t in tasks if t.done())
                print(f"    {time.time() - start:5.0f}s: {sum(tally.counts):,} events delivered, {done}/{n} "
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
        spy.stop()
        if clients == "lean":
            for p in protos:
                p.transport.close()
    counts = tally.counts
    per_sub = max(counts) if counts else 0
    pace = (tally.ts[-1] - tally.ts[0]) / max(1, len(tally.ts) - 1) if len(tally.ts) > 1 else 0.005
    size = int(statistics.mean(tally.sizes)) if tally.sizes else 300
    return {"delivered": sum(counts), "per_subscriber": per_sub, "complete": sum(1 for x in counts if x == per_sub),
            "elapsed": elapsed, "delays": tally.delays, "timed_out": len(pending), "server_cpu": server_cpu,
            "client_cpu": client_cpu, "pace": pace, "size": size,
            "offsets": [t - tally.ts[0] for t in tally.ts] if tally.ts else [], **spread(tally)}


def relay_message(k: int, last: bool, size: int) -> bytes:
    """A relay message shaped as an event's data line (an ISO `ts`), padded to the SSE frame's size."""
    body = {"id": k, "type": "turn.delta", "ts": datetime.now().astimezone().isoformat(), "last": last, "pad": ""}
    raw = json.dumps(body, separators=(",", ":"))
    body["pad"] = "x" * max(0, size - len(raw))
    return json.dumps(body, separators=(",", ":")).encode()


async def run_redis(redis_url: str, n: int, messages: int, pace: float, budget: float, clients: str = "lean",
                    size: int = 300, offsets: list[float] | None = None) -> dict:
    """`offsets` (seconds from the first): when each message is published, the turn's own schedule, so
    the relay gets the same bursts (an accept's event and the first delta a few ms apart, the last delta
    and the end in one commit); without them, one message every `pace` seconds."""
    import redis.asyncio as aioredis
    channel = f"bench:fanout:{os.getpid()}:{n}"
    tally = Tally(n)
    loop = asyncio.get_running_loop()
    clients_list, pubsubs, protos = [], [], []
    if clients == "lean":
        url = urlparse(redis_url)
        async def connect(i):
            _t, proto = await loop.create_connection(lambda: LeanRedisSub(channel.encode(), tally, i),
                                                     url.hostname or "127.0.0.1", url.port or 6379)
            await asyncio.wait_for(proto.ready, timeout=budget)
            return proto
        for lo in range(0, n, 50):
            protos += await asyncio.gather(*(connect(i) for i in range(lo, min(n, lo + 50))))
        tasks = [asyncio.ensure_future(p.done) for p in protos]
    else:
        clients_list = [aioredis.Redis.from_url(redis_url) for _ in range(n)]
        for cl in clients_list:
            ps = cl.pubsub()
            await ps.subscribe(channel)
            pubsubs.append(ps)

        async def consume(i, ps):
            async for msg in ps.listen():
                if msg["type"] != "message":
                    continue
                body = json.loads(msg["data"])
                tally.got(i, ts_of(body["ts"]), time.time())
                if body["last"]:
                    return
        tasks = [asyncio.create_task(consume(i, ps)) for i, ps in enumerate(pubsubs)]
    pub = aioredis.Redis.from_url(redis_url)
    await pub.ping()
    start = time.time()
    cpu0, client0 = redis_cpu(redis_url), time.process_time()
    for k in range(messages):
        if offsets and len(offsets) == messages:
            due = start + offsets[k] - time.time()
            if due > 0.0005:
                await asyncio.sleep(due)
        await pub.publish(channel, relay_message(k, k == messages - 1, size))
        if not (offsets and len(offsets) == messages):
            await asyncio.sleep(pace)
    _done, pending = await asyncio.wait(tasks, timeout=budget)
    for t in pending:
        t.cancel()
    elapsed = time.time() - start
    server_cpu, client_cpu = redis_cpu(redis_url) - cpu0, time.process_time() - client0
    for ps in pubsubs:
        await ps.aclose()
    for cl in clients_list + [pub]:
        await cl.aclose()
    for p in protos:
        p.transport.close()
    return {"delivered": sum(tally.counts), "per_subscriber": messages,
            "complete": sum(1 for x in tally.counts if x == messages), "elapsed": elapsed, "delays": tally.delays,
            "timed_out": len(pending), "server_cpu": server_cpu, "client_cpu": client_cpu, **spread(tally)}


def spread(tally: Tally) -> dict:
    """Per event: commit to its first client (the path before the fan-out), and first to last client
    (the fan-out itself)."""
    order = {ts: k for k, ts in enumerate(sorted(tally.first))}
    # the events whose last subscriber waited longest: p99 of all deliveries is about the worst event's
    # (N deliveries each), so these say where it comes from
    worst = sorted(tally.first, key=lambda ts: tally.last[ts] - ts, reverse=True)[:3]
    return {"to_first": [first - ts for ts, first in tally.first.items()],
            "spread": [tally.last[ts] - first for ts, first in tally.first.items()],
            "worst": [(order[ts], len(order), tally.kinds.get(ts, ""), tally.first[ts] - ts, tally.last[ts] - ts)
                      for ts in worst]}


def report(label: str, n: int, r: dict) -> None:
    ms = [x * 1000 for x in r["delays"]]
    print(f"  {label:<22} N={n:<5} events/client={r['per_subscriber']:<4} complete={r['complete']}/{n} "
          f"delivered={r['delivered']:<7} {r['delivered'] / max(r['elapsed'], 1e-9):>9.0f} ev/s  "
          f"p50={pct(ms, 50):7.1f} ms  p99={pct(ms, 99):7.1f} ms"
          + (f"  server CPU={r['server_cpu'] / max(r['delivered'], 1) * 1e6:5.1f} µs/delivery"
             f"  clients' CPU={r['client_cpu'] / max(r['delivered'], 1) * 1e6:5.1f} µs/delivery"
             if "server_cpu" in r else "")
          + (f"  ({r['timed_out']} timed out)" if r["timed_out"] else ""), flush=True)
    if r.get("to_first"):
        first, spread_ms = [x * 1000 for x in r["to_first"]], [x * 1000 for x in r["spread"]]
        print(f"  {'':<22} per event: to its first client p50={pct(first, 50):7.1f} ms p99={pct(first, 99):7.1f} ms;"
              f" first to last client p50={pct(spread_ms, 50):7.1f} ms p99={pct(spread_ms, 99):7.1f} ms", flush=True)
    if r.get("worst"):
        print(f"  {'':<22} slowest events (first / last client): " + "; ".join(
            f"#{k + 1}/{of}{' ' + kind if kind else ''} {a * 1000:.1f} / {b * 1000:.1f} ms"
            for k, of, kind, a, b in r["worst"]), flush=True)


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


def daemon_at(root: str | None, tmp: Path) -> Daemon:
    """A daemon of this checkout, or (--baseline-root) of another one: the same bench, the other code."""
    import tests.support.daemon as support
    saved = support.ROOT
    if root:
        support.ROOT = Path(root).resolve()
    try:
        d = Daemon(tmp)
        d.env["UGENT_STATIC_ROOT"] = str(saved / "var" / "test-static")  # collectstatic writes only here
        d.start()
    finally:
        support.ROOT = saved
    return d


class LayoutDaemon:
    """The servers layout of docs/deploy.md (tests/support/layout.py: HAProxy, two web processes, two
    workers, beat, the supervisor, over a private PostgreSQL and Redis) as run_daemon uses a daemon. Its
    server CPU is every process of the layout, the proxy's included. `direct`: the subscribers connect to
    the two web processes in turn, past the proxy (what the proxy costs, by difference)."""

    servers = True

    def __init__(self, tmp: Path, how: str):
        from tests.support.layout import Layout
        self.layout = Layout(tmp)
        self.how = how
        self.layout.start()
        self.base, self.key, self.port = self.layout.base, self.layout.key, self.layout.proxy_port
        self.subscriber_ports = list(self.layout.web_ports.values()) if how == "direct" else None
        self.redis_url = self.layout.redis.url(15)

    @property
    def procs(self):
        return list(self.layout.procs.values())

    def close(self):
        self.layout.close()


def run_pair(label: str, d: Daemon, n: int, args, redis_url: str) -> dict | None:
    """UGENT's subscribers, then the bare relay with the same N, message count, size and pace."""
    r = asyncio.run(run_daemon(d, n, args.words, args.budget, args.clients, args.profile))
    report(label, n, r)
    msgs = max(1, r["per_subscriber"])
    try:
        print(f"    the bare Redis pub/sub relay: {msgs} messages of {r['size']} bytes, "
              f"{r['pace'] * 1000:.2f} ms apart on average, on the turn's own schedule…", flush=True)
        rr = asyncio.run(run_redis(getattr(d, "redis_url", redis_url), n, msgs, r["pace"], args.budget, args.clients,
                                   r["size"], offsets=r["offsets"]))
        report("bare Redis pub/sub", n, rr)
        report_ratio(n, r, rr)
        return {"ugent": r, "relay": rr}
    except Exception as exc:  # no Redis here: say so, keep the daemon's figures
        print(f"  bare Redis pub/sub     skipped ({type(exc).__name__}: {exc})", flush=True)
        return None


def summary(n: int, label: str, pairs: list[dict]) -> None:
    if len(pairs) < 2:
        return
    p99 = [pct([x * 1000 for x in p["ugent"]["delays"]], 99) / max(pct([x * 1000 for x in p["relay"]["delays"]], 99),
                                                                    1e-9) for p in pairs]
    p50 = [pct([x * 1000 for x in p["ugent"]["delays"]], 50) / max(pct([x * 1000 for x in p["relay"]["delays"]], 50),
                                                                    1e-9) for p in pairs]
    print(f"  {label} / relay, N={n}, {len(pairs)} rounds: p50 " + ", ".join(f"{x:.2f}x" for x in p50)
          + f" (median {statistics.median(p50):.2f}x); p99 " + ", ".join(f"{x:.2f}x" for x in p99)
          + f" (median {statistics.median(p99):.2f}x)", flush=True)


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
    ap.add_argument("--clients", choices=["lean", "library"], default="lean",
                    help="the subscribers' clients, both sides alike (module docstring)")
    ap.add_argument("--rounds", type=int, default=1, help="UGENT-then-relay pairs per N")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the daemon's processes while each turn runs")
    ap.add_argument("--layout", choices=["proxy", "direct"],
                    help="the servers layout of docs/deploy.md instead of one daemon: subscribers through its "
                         "HAProxy (proxy) or straight to its two web processes in turn (direct); the relay "
                         "runs on the layout's Redis")
    ap.add_argument("--baseline-root", metavar="CHECKOUT",
                    help="also run another checkout's daemon (the code before a change), interleaved")
    args = ap.parse_args()
    redis_url = os.environ.get("REDIS_URL") or os.environ.get("UGENT_BENCH_REDIS", "redis://127.0.0.1:6379/15")
    servers = bool(os.environ.get("REDIS_URL")) or bool(args.layout)
    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {os.cpu_count()} cores, "
          f"{'servers' if servers else 'embedded'} mode, {args.clients} clients, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if args.only != "daemon":
        django_configure(redis_url if servers else "", f"bench-fanout-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="ugent-bench-") as tmp:
        daemons: list[tuple[str, Daemon]] = []
        try:
            if args.only != "transports":
                if args.layout:
                    print(f"starting the servers layout (subscribers: {args.layout})…", flush=True)
                    daemons.append((f"UGENT layout ({args.layout})", LayoutDaemon(Path(tmp) / "layout", args.layout)))
                else:
                    print(f"starting the daemon ({'servers' if servers else 'embedded'} mode)…", flush=True)
                    daemons.append(("UGENT /v1/ugent/events", daemon_at(None, Path(tmp) / "new")))
                if args.baseline_root:
                    print(f"starting the baseline daemon from {args.baseline_root}…", flush=True)
                    daemons.append(("baseline checkout", daemon_at(args.baseline_root, Path(tmp) / "base")))
            for n in args.subscribers:
                if args.only != "transports":
                    print(f"\n== {n} subscribers on one conversation", flush=True)
                    pairs: dict[str, list] = {label: [] for label, _ in daemons}
                    for k in range(args.rounds):
                        # alternate which daemon goes first, so a drift in the load falls on both
                        order = daemons if k % 2 == 0 else daemons[::-1]
                        for label, d in order:
                            print(f"  -- round {k + 1}/{args.rounds}: {label}", flush=True)
                            pair = run_pair(label, d, n, args, redis_url)
                            if pair:
                                pairs[label].append(pair)
                    for label, got in pairs.items():
                        summary(n, label, got)
                if args.only != "daemon":
                    run_transports(servers, redis_url, n, args.events, args.pace, args.budget)
        finally:
            for _label, d in daemons:
                d.close()


if __name__ == "__main__":
    main()
