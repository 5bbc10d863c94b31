"""A daemon's start: wall time until GET /v1/health answers 200, and the CPU its processes spent by then.

Each round starts a fresh daemon of this checkout on a copy of a migrated database (tests/support/daemon.py,
as the tests start theirs), waits for /v1/health, reads its processes' CPU time (user + system, from
/proc) and stops it. With --baseline-root, a daemon of another checkout (say `git worktree add /tmp/base
HEAD~1`) starts in the same rounds, alternating, so both see the same machine.

Usage: python bench/daemon_start.py [--rounds 10] [--servers] [--baseline-root CHECKOUT]
  --servers  uvicorn and a Celery worker over Redis and PostgreSQL (REDIS_URL, default
             redis://127.0.0.1:6379/12; DATABASE_URL's server holds each round's database)
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import tests.support.daemon as support  # noqa: E402
from bench.first_answer import run_mode  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """User and system seconds of a process and the children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def start_once(root: Path, templates: dict, tmp: Path, servers: bool) -> tuple[float, float]:
    saved_root, saved_templates = support.ROOT, support._templates
    support.ROOT, support._templates = root, templates  # migrate and spawn from that checkout
    try:
        d = support.Daemon(tmp, servers=servers)
        d.env["UGENT_STATIC_ROOT"] = str(ROOT / "var" / "test-static")  # collected once, this checkout's
        d.prepare()
        t0 = time.monotonic()
        d.spawn()
        wall = time.monotonic() - t0
        cpu = sum(cpu_of(p.pid) for p in d.procs)
        d.close()
    finally:
        support.ROOT, support._templates = saved_root, saved_templates
    return wall, cpu


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--servers", action="store_true")
    ap.add_argument("--baseline-root", metavar="CHECKOUT")
    args = ap.parse_args()
    run_mode(args.servers)
    targets = [("this checkout", ROOT, {})]
    if args.baseline_root:
        targets.append(("baseline", Path(args.baseline_root).resolve(), {}))
    figures: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name, _, _ in targets}
    mode = "servers (uvicorn + a Celery worker)" if args.servers else "embedded (manage.py rundaemon)"
    print(f"daemon start, {mode}: {args.rounds} rounds, targets alternating", flush=True)
    with tempfile.TemporaryDirectory(prefix="ugent-bench-start-") as tmp:
        for i in range(args.rounds):
            order = targets if i % 2 == 0 else targets[::-1]
            for name, root, templates in order:
                wall, cpu = start_once(root, templates, Path(tmp) / f"{i}-{len(templates)}-{name[:4]}",
                                       args.servers)
                figures[name]["wall"].append(wall)
                figures[name]["cpu"].append(cpu)
                print(f"  round {i + 1}/{args.rounds} {name:<14} health after {wall:5.2f} s, "
                      f"CPU {cpu:5.2f} s", flush=True)
    print()
    for name, _, _ in targets:
        f = figures[name]
        print(f"{name:<14} to health p50 {statistics.median(f['wall']):5.2f} s  p90 {pct(f['wall'], 0.9):5.2f} s   "
              f"CPU p50 {statistics.median(f['cpu']):5.2f} s  p90 {pct(f['cpu'], 0.9):5.2f} s")
    if args.baseline_root:
        a, b = figures["this checkout"], figures["baseline"]
        print(f"this ÷ baseline: to health {statistics.median(a['wall']) / statistics.median(b['wall']):.2f}×, "
              f"CPU {statistics.median(a['cpu']) / statistics.median(b['cpu']):.2f}× (p50s)")


if __name__ == "__main__":
    main()
