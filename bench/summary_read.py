"""A turn's summary read as one conversation grows: the newest visible system message (the summary a
compaction left), which every turn reads in the claim's batch.

Two reads of the same rows, interleaved in one run:
* now: `statements.summary_latest` through the partial index `message_conv_system`;
* before: the read as it was, walking the conversation's messages backwards from the newest until it met
  a system message (SQLite: `INDEXED BY message_conv_id`; PostgreSQL: the role bound as a parameter,
  which a prepared statement's generic plan cannot match to the index, so it walks `message_conv_id`).
The conversation has no summary (never compacted), the case where the walk read every message.

On PostgreSQL both are run as prepared statements with `plan_cache_mode = force_generic_plan`, as
`ugent_common.rows` runs them once a plan is cached. `--database-url` names a scratch PostgreSQL database
(its tables are made there); without it, a scratch SQLite file (embedded mode).

Usage: python bench/summary_read.py [--messages 2000,20000,60000] [--reads 200] [--database-url URL]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scratch import scratch_install  # noqa: E402


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", default="2000,20000,60000")
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--database-url", default="")
    args = ap.parse_args()
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    scratch_install("ugent-summary-read-", keep_database_url=bool(args.database_url))
    import django
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    call_command("migrate", verbosity=0)

    from channels_app import statements
    from channels_app.models import Actor, Caller, Conversation, Message
    pg = connection.vendor == "postgresql"
    caller = Caller.objects.create(name=f"bench-summary-{os.getpid()}", role="operator")
    actor = Actor.objects.create(key=f"web:bench-summary-{os.getpid()}", user_id="bench", caller=caller)
    conv = Conversation.objects.create(external_id=f"bench-{os.getpid()}", owner=actor, caller=caller)
    now_sql = statements._summary_latest_sql()
    if pg:
        before_sql = now_sql.replace(f"= '{Message.Role.SYSTEM.value}'", "= %s")
    else:
        before_sql = now_sql.replace("FROM \"channels_app_message\"", "FROM \"channels_app_message\" "
                                     "INDEXED BY message_conv_id")
    assert before_sql != now_sql
    cur = connection.cursor()
    if pg:
        cur.execute("SET plan_cache_mode = force_generic_plan")
        n = iter(range(1, 10))
        cur.execute("PREPARE now_read AS " + now_sql.replace("%s", "$%d") % (next(n), next(n)))
        n = iter(range(1, 10))
        cur.execute("PREPARE before_read AS " + before_sql.replace("%s", "$%d") % (next(n), next(n), next(n)))

        def now():
            cur.execute("EXECUTE now_read(%s, %s)", [conv.pk, False])
            return cur.fetchall()

        def before():
            cur.execute("EXECUTE before_read(%s, %s, %s)", [conv.pk, "system", False])
            return cur.fetchall()
    else:
        def now():
            cur.execute(now_sql, [conv.pk, False])
            return cur.fetchall()

        def before():
            cur.execute(before_sql, [conv.pk, False])
            return cur.fetchall()

    have, results = 0, []
    try:
        for size in sorted(int(s) for s in args.messages.split(",")):
            print(f"  messages to {size} ...", file=sys.stderr, flush=True)
            Message.objects.bulk_create(
                [Message(conversation=conv, role=("user", "assistant")[i % 2], content=f"m {i}")
                 for i in range(have, size)], batch_size=5000)
            have = size
            if pg:
                cur.execute("ANALYZE channels_app_message")
            assert now() == before() == []
            now_t, before_t = [], []
            for _ in range(args.reads):
                t0 = time.perf_counter()
                now()
                t1 = time.perf_counter()
                before()
                before_t.append(time.perf_counter() - t1)
                now_t.append(t1 - t0)
            results.append((size, now_t, before_t))
    finally:
        if pg:
            Conversation.objects.filter(pk=conv.pk).delete()
            Actor.objects.filter(pk=actor.pk).delete()
            caller.delete()
    print(f"the summary read on {connection.vendor}, {args.reads} reads each, interleaved; one conversation "
          f"of N messages, none of them a summary")
    print(f"{'messages':>9}  {'index p50/p99 ms':>18}  {'walk (before) p50/p99 ms':>26}  {'before/now p50':>15}")
    for size, now_t, before_t in results:
        n50, b50 = statistics.median(now_t) * 1000, statistics.median(before_t) * 1000
        print(f"{size:>9}  {n50:>8.3f} /{pct(now_t, 99) * 1000:>8.3f}  {b50:>15.3f} /{pct(before_t, 99) * 1000:>8.3f}"
              f"  {b50 / n50:>14.1f}x")


if __name__ == "__main__":
    main()
