"""A turn's summary and history reads as one conversation grows, both in the claim's batch of every turn:
the newest visible system message (the summary a compaction left), and the newest visible user and assistant
messages (20: the default limit).

Two reads of the same rows, interleaved in one run:
* now: `statements.summary_latest` through the partial index `message_conv_system`;
* before: the read as it was, walking the conversation's messages backwards from the newest until it met
  a system message (SQLite: `INDEXED BY message_conv_id`; PostgreSQL: the role bound as a parameter,
  which a prepared statement's generic plan cannot match to the index, so it walks `message_conv_id`).
The summary is read in a conversation never compacted (no summary), where the walk read every message; the
history in a compacted one (every message hidden but the last six), where it walked every hidden message
before `message_conv_visible` (before: SQLite `INDEXED BY message_conv_id`; PostgreSQL `hidden = %s` bound).

On PostgreSQL both are run as prepared statements with `plan_cache_mode = force_generic_plan`, as
`ugent_common.rows` runs them once a plan is cached. `--database-url` names a scratch PostgreSQL database
(its tables are made there); without it, a scratch SQLite file (embedded mode).

Usage: python bench/summary_read.py [--messages 2000,20000,60000] [--reads 200] [--database-url URL]
                                    [--read summary|history]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

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
    ap.add_argument("--read", choices=("summary", "history"), default="summary")
    args = ap.parse_args()
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    scratch_install("ugent-summary-read-", keep_database_url=bool(args.database_url))
    import django
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    call_command("migrate", verbosity=0)

    from channels_app import services, statements
    from channels_app.models import Caller, Message
    pg = connection.vendor == "postgresql"
    caller = Caller.objects.create(name=f"bench-summary-{os.getpid()}", role="operator")
    actor = services.actor_resolve(caller=caller, user=f"bench-{os.getpid()}")
    with mock.patch("channels_app.tasks.run_turn.delay"):  # one turn, which every message belongs to
        turn = services.message_submit(inbound=services.Submission(
            actor=actor, caller=caller, text="first", conversation_id=f"bench-{os.getpid()}")).turn
    conv = turn.conversation
    history = args.read == "history"
    if history:
        now_sql = statements._history_tail_sql()
        now_params = [conv.pk, "user", "assistant", 2 ** 62, 20]
        if pg:
            before_sql = now_sql.replace('NOT "hidden"', '"hidden" = %s')
            before_params = [conv.pk, False, "user", "assistant", 2 ** 62, 20]
        else:
            before_sql, before_params = now_sql.replace('NOT "hidden"', '"hidden" = 0'), now_params
    else:
        now_sql, now_params = statements._summary_latest_sql(), [conv.pk, False]
        if pg:
            before_sql = now_sql.replace(f"= '{Message.Role.SYSTEM.value}'", "= %s")
            before_params = [conv.pk, "system", False]
        else:
            before_sql, before_params = now_sql, now_params
    if not pg:
        before_sql = before_sql.replace("FROM \"channels_app_message\"", "FROM \"channels_app_message\" "
                                        "INDEXED BY message_conv_id")
    assert before_sql != now_sql
    cur = connection.cursor()
    if pg:
        cur.execute("SET plan_cache_mode = force_generic_plan")
        for name, sql in (("now_read", now_sql), ("before_read", before_sql)):
            n = iter(range(1, 20))
            cur.execute(f"PREPARE {name} AS " + re.sub("%s", lambda m: f"${next(n)}", sql))

        def now():
            cur.execute(f"EXECUTE now_read({', '.join(['%s'] * len(now_params))})", now_params)
            return cur.fetchall()

        def before():
            cur.execute(f"EXECUTE before_read({', '.join(['%s'] * len(before_params))})", before_params)
            return cur.fetchall()
    else:
        def now():
            cur.execute(now_sql, now_params)
            return cur.fetchall()

        def before():
            cur.execute(before_sql, before_params)
            return cur.fetchall()

    have, results = 0, []
    try:
        for size in sorted(int(s) for s in args.messages.split(",")):
            print(f"  messages to {size} ...", file=sys.stderr, flush=True)
            Message.objects.bulk_create(
                [Message(conversation=conv, role=("user", "assistant")[i % 2], content=f"m {i}", turn=turn,
                         hidden=history) for i in range(have, size)], batch_size=5000)
            if history:  # what a compaction leaves: the last few visible
                Message.objects.filter(conversation=conv, hidden=False).update(hidden=True)
                Message.objects.bulk_create([Message(conversation=conv, role=("user", "assistant")[i % 2],
                                                     content=f"kept {i}", turn=turn) for i in range(6)])
            have = size
            if pg:
                cur.execute("ANALYZE channels_app_message")
            assert now() == before() and len(now()) == (6 if history else 0)
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
            Message.objects.filter(conversation=conv).delete()
    shape = ("all of them hidden but the last six (compacted)" if history else "none of them a summary")
    print(f"the {args.read} read on {connection.vendor}, {args.reads} reads each, interleaved; one conversation "
          f"of N messages, {shape}")
    print(f"{'messages':>9}  {'index p50/p99 ms':>18}  {'walk (before) p50/p99 ms':>26}  {'before/now p50':>15}")
    for size, now_t, before_t in results:
        n50, b50 = statistics.median(now_t) * 1000, statistics.median(before_t) * 1000
        print(f"{size:>9}  {n50:>8.3f} /{pct(now_t, 99) * 1000:>8.3f}  {b50:>15.3f} /{pct(before_t, 99) * 1000:>8.3f}"
              f"  {b50 / n50:>14.1f}x")


if __name__ == "__main__":
    main()
