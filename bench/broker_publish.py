"""Servers mode's broker: CPU per Celery publish and per delivery-and-ack, kombu's Redis transport
against ugent_site.broker's (one client kept per channel), interleaved in one run.

    python bench/broker_publish.py [--messages 2000] [--rounds 4]

REDIS_URL (default redis://127.0.0.1:6379/13) names the Redis; DATABASE_URL is not used. Each round
publishes `--messages` task messages (the turn task's shape: one id argument) through Celery's
`send_task` to a queue of the bench's own, then consumes and acks them through kombu, once with each
transport, in alternating order, each in a fresh process (Celery keeps its pools for its life). It
prints, per transport, the process CPU per publish and per delivery-and-ack (median of the rounds),
their wall time, and the ratio of ours over kombu's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, str(ROOT))

TRANSPORTS = {"kombu": "redis", "ugent": "ugent_site.broker:RedisTransport"}


def setup() -> None:
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
    os.environ.pop("DATABASE_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
    import django
    django.setup()


def one_round(transport: str, n: int) -> dict:
    """In a child process: one round with one transport."""
    from kombu import Consumer, Queue
    setup()
    from ugent_site.celery import app
    app.conf.broker_transport = transport
    queue = f"bench-broker-{uuid.uuid4().hex[:8]}"
    for _ in range(20):  # warm: connections, declarations
        app.send_task("bench.noop", args=("turn-warm",), queue=queue)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(n):
        app.send_task("bench.noop", args=(f"turn-{i}",), queue=queue)
    out = {"publish_cpu": (time.process_time() - cpu) / n, "publish_wall": (time.perf_counter() - wall) / n}
    got = 0

    def on_message(body, message):
        nonlocal got
        got += 1
        message.ack()
    with app.connection_for_read() as conn:
        assert type(conn.transport).__module__ + ":" + type(conn.transport).__name__ \
            == {"redis": "kombu.transport.redis:Transport"}.get(transport, transport)
        conn.default_channel.basic_qos(0, 1, False)  # one at a time, as a worker with prefetch 1 takes turns
        with Consumer(conn, queues=[Queue(queue)], accept=["json"], callbacks=[on_message]):
            while got < 20:
                conn.drain_events(timeout=10)
            cpu, wall = time.process_time(), time.perf_counter()
            while got < n + 20:
                conn.drain_events(timeout=10)
            out["consume_cpu"] = (time.process_time() - cpu) / n
            out["consume_wall"] = (time.perf_counter() - wall) / n
        with conn.default_channel.conn_or_acquire() as client:
            client.delete(queue)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", choices=sorted(TRANSPORTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_round(TRANSPORTS[args.child], args.messages)))
        return 0
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
    results = {name: [] for name in TRANSPORTS}
    for r in range(args.rounds):
        order = list(TRANSPORTS) if r % 2 == 0 else list(reversed(TRANSPORTS))
        for name in order:
            child = subprocess.run([sys.executable, __file__, "--child", name, "--messages", str(args.messages)],
                                   capture_output=True, text=True, check=True, timeout=600)
            results[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"  round {r + 1}/{args.rounds}: {name} done", flush=True)
    print(f"\nbroker: {args.messages} task messages a round, {args.rounds} rounds, median of the rounds "
          f"({os.environ['REDIS_URL']})")
    print(f"{'transport':<10} {'publish cpu':>12} {'publish wall':>13} {'deliver+ack cpu':>16} "
          f"{'deliver+ack wall':>17}")
    med = {}
    for name, rounds in results.items():
        med[name] = {k: statistics.median(r[k] for r in rounds) * 1e6 for k in rounds[0]}
        m = med[name]
        print(f"{name:<10} {m['publish_cpu']:>10.0f}us {m['publish_wall']:>11.0f}us {m['consume_cpu']:>14.0f}us "
              f"{m['consume_wall']:>15.0f}us")
    a, b = med["ugent"], med["kombu"]
    ratio = {k: a[k] / b[k] for k in a}
    print(f"{'ugent/kombu':<10} {ratio['publish_cpu']:>11.2f}x {ratio['publish_wall']:>12.2f}x "
          f"{ratio['consume_cpu']:>15.2f}x {ratio['consume_wall']:>16.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
