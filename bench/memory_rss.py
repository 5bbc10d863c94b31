"""The embedded daemon's resident memory: idle, and as turns go by (issue #17, item 5).

Starts the embedded daemon (one process: uvicorn, turn threads, the in-process Celery worker, beat and
the supervisor) with an `openai-compatible` profile in front of the stub upstream, reads its RSS from
/proc when idle, then sends --turns non-stream turns (a new conversation every --per-conversation
turns, so the conversation and event tables grow as in real use) from --concurrency clients and reads
the RSS again every --every turns. The baseline, measured in the same run, is a bare Python process
that imports and sets up Django with the same settings (what any Django daemon costs before it does
anything).

Usage: python bench/memory_rss.py [--turns 10000] [--every 1000] [--concurrency 4]
Prints figures; asserts nothing. Targets: at most 250 MB idle, and no growth between the 5,000th and
the 10,000th turn.
"""
from __future__ import annotations

import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--per-conversation", type=int, default=10)
    args = ap.parse_args()
    os.environ.pop("REDIS_URL", None)
    os.environ.pop("DATABASE_URL", None)
    stub, stub_url = start_stub()
    tmp = Path(tempfile.mkdtemp(prefix="ugent-rss-"))
    d = Daemon(tmp, servers=False, extra_env={"UGENT_CPU_AFFINITY": "off"})
    try:
        (tmp / "workspace").mkdir(parents=True)
        d.manage("migrate", "--noinput")
        d.manage("shell", "-c", "from plugins_app.models import AgentProfile as P; "
                 f"P.objects.create(name='bench', provider='openai-compatible', is_default=True, "
                 f"config={{'base_url': '{stub_url}', 'model': 'stub-model'}})")
        baseline = bare_django_rss(d.env)
        d.spawn()
        pid = d.procs[0].pid
        time.sleep(3.0)  # warming and the first beat ticks settle
        idle = tree_rss_mb(pid)
        print(f"embedded daemon RSS: bare Django process {baseline:.1f} MB (baseline, same run); "
              f"daemon idle {idle:.1f} MB ({idle / baseline:.2f}x)", flush=True)
        samples: list[tuple[int, float]] = [(0, idle)]
        done = 0
        lock = threading.Lock()
        headers = {"x-api-key": d.key}
        t0 = time.perf_counter()

        def one(i: int, client: httpx.Client):
            body = {"model": "bench", "conversation_id": f"rss-{i // args.per_conversation}",
                    "client_message_id": f"m-{i}", "messages": [{"role": "user", "content": f"hello {i}"}]}
            r = client.post(d.base + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            r.raise_for_status()

        def worker(start: int):
            nonlocal done
            with httpx.Client() as client:
                for i in range(start, args.turns, args.concurrency):
                    one(i, client)
                    with lock:
                        done += 1
                        if done % args.every == 0:
                            samples.append((done, tree_rss_mb(pid)))
                            rate = done / (time.perf_counter() - t0)
                            print(f"  {done:>6} turns: RSS {samples[-1][1]:.1f} MB ({rate:.0f} turns/s)",
                                  file=sys.stderr, flush=True)

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for f in [pool.submit(worker, s) for s in range(args.concurrency)]:
                f.result()
        time.sleep(2.0)
        after = tree_rss_mb(pid)
        print(f"\n{'turns':>8}{'RSS MB':>10}{'vs idle':>10}{'vs bare Django':>16}")
        for n, mb in samples + [(args.turns, after)]:
            print(f"{n:>8}{mb:>10.1f}{mb / idle:>9.2f}x{mb / baseline:>15.2f}x")
        half = min(samples, key=lambda s: abs(s[0] - args.turns // 2))
        print(f"\ngrowth from turn {half[0]} to turn {args.turns}: {after - half[1]:+.1f} MB "
              f"({(after - half[1]) / half[1] * 100:+.1f}%); idle {idle:.1f} MB")
        print("targets: at most 250 MB idle; no growth between the 5,000th and the 10,000th turn")
    finally:
        d.close()
        stub.terminate()


if __name__ == "__main__":
    main()
