"""Where a chat turn's CPU goes in the embedded daemon, read from the kernel's accounting, not from samples.

Starts the stub upstream and the embedded daemon (as bench/chat_latency.py does) and sends, one client, in
interleaved rounds:

  * a turn: a non-stream chat request the stub answers (what chat_latency measures);
  * a refusal after validation: the same request with an empty `messages` list, refused 400 on the accept
    thread after the key and the body were checked: the HTTP server, the /v1/ handler and its middleware,
    the view, the accept's thread hop, the key and the validation, and the error's JSON, with no turn;
  * a refusal of the key: a wrong key, refused 401 on the accept thread (the key's digest looked up);
  * GET /v1/health: a DRF view on the API's own threads, with a database ping.

For each it prints the daemon's CPU per request (user + system, /proc/<pid>/stat, every thread), p50
latency, and for the turn the CPU each of the daemon's threads spent per turn, by thread name when py-spy is
installed (it names the threads; the kernel sees them all as "python"; a thread that ended during a probe is
not listed, so the threads may add up to less than the total). The turn's own work is the turn's
CPU less the refusal's: what an HTTP path leaner than Django's could never remove.

Why: py-spy's `--gil` samples put about a third of the daemon's time in the HTTP server and Django's request
path (docs/performance.md, "Against LiteLLM"); the kernel's per-thread CPU says how much that really is.

Usage: python bench/turn_cpu.py [--requests 1000] [--rounds 4]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from chat_latency import pct, process_cpu_seconds, start_embedded, start_stub  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds so far (user + system)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name, from `py-spy dump` (empty without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return {}
    dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True).stdout
    names = {}
    for line in dump.splitlines():
        if line.startswith("Thread "):  # Thread 8984 (idle): "MainThread"
            parts = line.split()
            try:
                names[int(parts[1])] = line.split('"')[1] if '"' in line else parts[1]
            except (ValueError, IndexError):
                pass
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000, help="requests per probe (over all rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    stub, stub_url = start_stub()
    d = start_embedded(stub_url)
    pid = d.procs[0].pid
    chat = d.base + "/v1/chat/completions"
    good = {"model": "bench", "messages": [{"role": "user", "content": "hello"}]}
    probes = {  # name -> (method, url, headers, body, status it must answer)
        "turn": ("POST", chat, {"x-api-key": d.key}, good, 200),
        "refused 400 (validated)": ("POST", chat, {"x-api-key": d.key}, {"model": "bench", "messages": []}, 400),
        "refused 401 (key)": ("POST", chat, {"x-api-key": "ugk_wrong_" + "0" * 32}, good, 401),
        "GET /v1/health": ("GET", d.base + "/v1/health", {}, None, 200),
    }
    per = max(1, args.requests // args.rounds)
    cpu: dict[str, float] = collections.Counter()
    lat: dict[str, list] = collections.defaultdict(list)
    threads: dict[int, float] = collections.Counter()
    try:
        with httpx.Client(timeout=60) as client:
            def send(method, url, headers, body, status):
                t0 = time.perf_counter()
                r = client.request(method, url, headers=headers, json=body)
                took = time.perf_counter() - t0
                if r.status_code != status:
                    raise RuntimeError(f"{method} {url}: {r.status_code} {r.text[:300]}")
                return took
            for probe in probes.values():  # warm-up: connections, imports, caches
                for _ in range(50):
                    send(*probe)
            for rnd in range(args.rounds):
                for name, probe in probes.items():
                    before, tbefore = process_cpu_seconds([pid]), thread_cpu(pid)
                    for _ in range(per):
                        lat[name].append(send(*probe))
                    cpu[name] += process_cpu_seconds([pid]) - before
                    if name == "turn":
                        for tid, s in thread_cpu(pid).items():
                            threads[tid] += s - tbefore.get(tid, 0.0)
                print(f"  round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
        names = thread_names(pid)
    finally:
        d.close()
        stub.terminate()
    n = per * args.rounds
    print(f"the embedded daemon's CPU per request, one client, {n} requests a probe in {args.rounds} interleaved rounds")
    print(f"{'probe':<28}{'cpu ms':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for name in probes:
        print(f"{name:<28}{cpu[name] / n * 1000:>9.3f}{statistics.median(lat[name]) * 1000:>9.2f}"
              f"{pct(lat[name], 99) * 1000:>9.2f}")
    turn, floor = cpu["turn"] / n * 1000, cpu["refused 400 (validated)"] / n * 1000
    if not turn:
        print("\ntoo few requests to read a turn's CPU (clock ticks of 10 ms): raise --requests")
        return
    print(f"\nthe turn's own work (a turn less a validated refusal): {turn - floor:.3f} ms of {turn:.3f} "
          f"({(turn - floor) / turn:.0%}); the HTTP path, the view, the hop, the key and the validation: "
          f"{floor:.3f} ms ({floor / turn:.0%})")
    print("\na turn's CPU by thread" + ("" if names else " (install py-spy for their names)") + ":")
    for tid, s in sorted(threads.items(), key=lambda kv: -kv[1]):
        if s / n * 1000 >= 0.01:
            print(f"  {names.get(tid, str(tid)):<28}{s / n * 1000:>9.3f} ms")


if __name__ == "__main__":
    main()
