"""The reads of live turns as the turn table grows: the sweep (every UGENT_TURN_SWEEP_SECONDS, 5 s by
default), a metrics scrape's queue gauges and the health board, over N ended turns and a few live ones.

Each read is timed two ways in the same run, interleaved: through `Turn.objects.live()` (the partial index
`turn_live`'s condition as literal SQL, so SQLite uses it) and written as before (`state = %s`, `state IN
(%s, %s)`: SQLite cannot match a bound parameter to the index's literal and reads every turn). Each
read's plan (SQLite's EXPLAIN QUERY PLAN) is printed beside its figures.

In-process on a scratch SQLite database (embedded mode); turns are accepted through the hub's own submit
(`services.message_submit`, the task publish left out), then ended in one UPDATE.

Usage: python bench/live_turns.py [--turns 20000,100000] [--reads 50]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scratch import scratch_install  # noqa: E402

scratch_install("ugent-live-turns-")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))]


def turns_add(n: int, caller) -> None:
    from channels_app import services
    from channels_app.models import Turn
    actor = services.actor_resolve(caller=caller, user="bench")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        for i in range(n):
            services.message_submit(inbound=services.Submission(actor=actor, caller=caller, text=f"m {i}",
                                                                conversation_id=f"c-{i // 20}"))
            if (i + 1) % 5000 == 0:
                print(f"    {i + 1}/{n} turns", file=sys.stderr, flush=True)
    Turn.objects.filter(state="accepted").update(state="completed")


def reads():
    """(name, read through live(), the same read written as before)."""
    from django.db.models import Count

    from channels_app.models import Turn, TurnState
    cutoff = "2000-01-01"
    return [
        ("sweep: running turns", lambda: list(Turn.objects.live().filter(state=TurnState.RUNNING)
                                               .select_related("actor")),
         lambda: list(Turn.objects.filter(state=TurnState.RUNNING).select_related("actor"))),
        ("sweep: accepted past the wait", lambda: list(Turn.objects.live().filter(
            state=TurnState.ACCEPTED, created_at__lt=cutoff).values_list("pk", flat=True)),
         lambda: list(Turn.objects.filter(state=TurnState.ACCEPTED, created_at__lt=cutoff)
                      .values_list("pk", flat=True))),
        ("scrape: live turns by state", lambda: dict(Turn.objects.live().values_list("state")
                                                      .annotate(n=Count("id")).order_by()),
         lambda: dict(Turn.objects.filter(state__in=[TurnState.ACCEPTED, TurnState.RUNNING])
                      .values_list("state").annotate(n=Count("id")).order_by())),
    ]


def plan(qs_fn) -> str:
    from django.db import connection
    seen = []

    def record(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)
    with connection.execute_wrapper(record):
        qs_fn()
    with connection.cursor() as cur:
        cur.execute("EXPLAIN QUERY PLAN " + seen[0][0], seen[0][1])
        return "; ".join(r[3] for r in cur.fetchall())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", default="20000,100000")
    ap.add_argument("--reads", type=int, default=50)
    args = ap.parse_args()
    import django
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from channels_app.models import Caller
    caller = Caller.objects.create(name="bench-live", role="operator")
    have, rows = 0, []
    for size in sorted(int(s) for s in args.turns.split(",")):
        print(f"  accepting turns to {size} ...", file=sys.stderr, flush=True)
        turns_add(size - have, caller)
        have = size
        for name, now_fn, before_fn in reads():
            now_t, before_t = [], []
            for _ in range(3):
                now_fn(), before_fn()  # warm
            for _ in range(args.reads):  # interleaved
                t0 = time.perf_counter()
                now_fn()
                t1 = time.perf_counter()
                before_fn()
                before_t.append(time.perf_counter() - t1)
                now_t.append(t1 - t0)
            rows.append((size, name, now_t, before_t, plan(now_fn), plan(before_fn)))
    print(f"reads of live turns on SQLite, {args.reads} each, interleaved; the table holds N ended turns")
    print(f"{'turns':>8}  {'read':<30}{'live() p50/p99 ms':>20}{'before p50/p99 ms':>20}{'before/live p50':>17}")
    for size, name, now_t, before_t, now_plan, before_plan in rows:
        n50, b50 = statistics.median(now_t) * 1000, statistics.median(before_t) * 1000
        print(f"{size:>8}  {name:<30}{n50:>11.3f} /{pct(now_t, 99) * 1000:>7.3f}"
              f"{b50:>11.3f} /{pct(before_t, 99) * 1000:>7.3f}{b50 / n50:>16.1f}x")
    print("plans (the largest size): ")
    for size, name, _, _, now_plan, before_plan in rows[-3:]:
        print(f"  {name}: live() {now_plan} | before {before_plan}")


if __name__ == "__main__":
    main()
