"""The admin's change lists of the tables that grow with the traffic, page load by page load, against the
admin as it was.

A scratch database is filled to `--events` events and `--rows` rows of each other growing table (messages,
turns and their receipts, receipts, steering, files, conversations, actors, deliveries, cron runs, memory
facts; every turn a caller's and its key's, folded by the usage rollup); then each change list is loaded
`--loads` times as a superuser opens it (the view and its template,
as `changelist_view(request).render()`; the session and login middleware, the same for both, left out),
interleaved with the same list of the baseline: the admin modules of `--baseline-rev` (default: the commit
before the bounded lists), read from git and built on the same site, so both run against the same rows in
the same process. `--filtered` loads each list filtered as an operator opens it instead. The callers' and
keys' lists sum their turns' usage (their row count is the turns'), and last, the change page of the
conversation that holds every message is loaded the same way.

`--database-url` names a scratch PostgreSQL database (its tables are made there, and the rows made are
deleted at the end); without it, a scratch SQLite file (embedded mode).

Usage: python bench/admin_lists.py [--events 200000] [--rows 20000] [--loads 20] [--filtered]
                                   [--database-url URL] [--baseline-rev a1745cb]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from datetime import timedelta
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scratch import scratch_install  # noqa: E402

ADMIN_MODULES = ("channels_app/admin.py", "cron_app/admin.py", "plugins_app/channel/admin.py",
                 "plugins_app/agent/memory/admin.py")
# each list, and the filter an operator opens it with (--filtered)
LISTS = {
    "channels_app.event": {"type": "turn.delta"},
    "channels_app.message": {"role__exact": "user"},
    "channels_app.turn": {"state__exact": "completed"},
    "channels_app.receipt": {"state__exact": "completed"},
    "channels_app.steering": {"state__exact": "applied"},
    "channels_app.file": {"mime": "text/plain"},
    "channels_app.conversation": {"channel": "web"},
    "channels_app.actor": {"channel": "web"},
    "plugins_app.outbounddelivery": {"state__exact": "delivered"},
    "cron_app.cronrun": {"state__exact": "completed"},
    "plugins_app.memoryfact": {"tier__exact": "contextual"},
    "channels_app.caller": {"role__exact": "application"},
    "channels_app.apikey": {"active__exact": "1"},
}
#: the lists whose cost is their callers' turns, not their own rows
BY_TURNS = ("channels_app.caller", "channels_app.apikey")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))]


def baseline_admins(rev: str, site) -> dict:
    """The ModelAdmin of each model as `rev`'s admin modules made it, on `site` (not registered there)."""
    from django.contrib import admin

    def source(path):
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    made = {}

    def register(*models, site=None):
        def keep(cls):
            made.update((m, cls) for m in models)
            return cls
        return keep
    common = types.ModuleType("ugent_common.admin")  # the RecordAdmin the old modules import
    exec(compile(source("ugent_common/admin.py"), f"{rev}:ugent_common/admin.py", "exec"), common.__dict__)
    with mock.patch.object(admin, "register", register), mock.patch.dict(sys.modules, {"ugent_common.admin": common}):
        for path in ADMIN_MODULES:
            module = types.ModuleType(f"baseline.{path}")
            exec(compile(source(path), f"{rev}:{path}", "exec"), module.__dict__)
    return {model: cls(model, site) for model, cls in made.items()}


def fill(events: int, rows: int):
    """The rows; the conversation that holds every message."""
    from django.utils import timezone

    from channels_app import usage
    from channels_app.models import (Actor, ApiKey, Caller, Conversation, Event, File, Message, Receipt, Steering,
                                     Turn)
    from cron_app.models import CronRun
    from plugins_app.agent.memory.models import MemoryFact
    from plugins_app.channel.models import OutboundDelivery, Plugin
    tag = os.getpid()
    actor = Actor.objects.create(key=f"web:bench-{tag}", user_id=f"bench-{tag}")
    conv = Conversation.objects.create(external_id=f"bench-{tag}", owner=actor)
    plugin = Plugin.objects.create(plugin_id=f"bench-{tag}", kind="echo")
    batch = 5000

    def made(label, model, n, make):
        for start in range(0, n, batch):
            print(f"  {label}: {start:,} of {n:,} ...", file=sys.stderr, flush=True)
            model.objects.bulk_create([make(i) for i in range(start, min(n, start + batch))], batch_size=batch)
    made("receipts", Receipt, rows * 2, lambda i: Receipt(conversation=conv, client_message_id=f"r-{i}",
                                                           content_hash="x", actor=actor, state="completed"))
    receipts = list(Receipt.objects.filter(conversation=conv).order_by("id").values_list("id", flat=True)[:rows])
    caller = Caller.objects.create(name=f"bench-{tag}", role="application")
    key = ApiKey.objects.create(caller=caller, label="bench", key_hash=f"bench-{tag}", prefix="ugk_bench")
    long_ago = timezone.now() - timedelta(days=1)
    made("turns", Turn, rows, lambda i: Turn(turn_id=f"bench-{tag}-{i}", conversation=conv, actor=actor,
                                            receipt_id=receipts[i], state="completed", model="ugent-notes",
                                            caller=caller, api_key=key, prompt_tokens=7,
                                            completion_tokens=3, total_tokens=10))
    # (created_at is set on insert: the turns are made old enough to fold after)
    Turn.objects.filter(conversation=conv).update(created_at=long_ago)
    print(f"  usage rollup of {rows:,} turns ...", file=sys.stderr, flush=True)
    usage.usage_rollup()
    turn = Turn.objects.filter(conversation=conv).order_by("-id").first()
    made("events", Event, events, lambda i: Event(conversation=conv, turn=turn, type="turn.delta", data={"text": "x"}))
    made("messages", Message, rows, lambda i: Message(conversation=conv, role=("user", "assistant")[i % 2],
                                                      content=f"message {i}"))
    made("steering", Steering, rows, lambda i: Steering(turn=turn, actor=actor, text=f"s {i}", state="applied"))
    later = timezone.now() + timedelta(days=30)
    made("files", File, rows, lambda i: File(file_id=f"bench-{tag}-{i}", conversation=conv, actor=actor,
                                             filename=f"f{i}.txt", mime="text/plain", size=1, sha256="x",
                                             storage_name=f"s{i}", expires_at=later))
    made("conversations", Conversation, rows, lambda i: Conversation(external_id=f"bench-{tag}-{i}", owner=actor))
    made("actors", Actor, rows, lambda i: Actor(key=f"web:bench-{tag}-{i}", user_id=f"u{i}"))
    made("deliveries", OutboundDelivery, rows, lambda i: OutboundDelivery(
        delivery_id=f"bench-{tag}-{i}", plugin=plugin, conversation=conv, state="delivered"))
    made("cron runs", CronRun, rows, lambda i: CronRun(job_name=f"job-{i % 5}", trigger="scheduled",
                                                       state="completed"))
    made("memory facts", MemoryFact, rows, lambda i: MemoryFact(actor_key=actor.key, text=f"fact {i}",
                                                                normalized=f"fact {i}"))
    return conv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200000)
    ap.add_argument("--rows", type=int, default=20000, help="rows of each other growing table")
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--filtered", action="store_true", help="each list filtered as an operator opens it")
    ap.add_argument("--database-url", default="")
    ap.add_argument("--baseline-rev", default="a1745cb", help="the commit whose admin is the baseline")
    args = ap.parse_args()
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    scratch_install("ugent-admin-lists-", keep_database_url=bool(args.database_url))
    import django
    django.setup()
    from django.apps import apps
    from django.contrib import admin
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection
    from django.test import RequestFactory
    call_command("migrate", verbosity=0)
    from channels_app.models import Message, Turn
    pg = connection.vendor == "postgresql"
    models = [apps.get_model(name) for name in LISTS]
    if pg:
        with connection.cursor() as cur:  # a scratch database: the lists' tables hold this run's rows only
            cur.execute("TRUNCATE " + ", ".join(f'"{m._meta.db_table}"' for m in models) + " CASCADE")
    conv = fill(args.events, args.rows)
    if pg:
        with connection.cursor() as cur:
            for m in models:
                cur.execute(f'ANALYZE "{m._meta.db_table}"')
    user = User.objects.create_superuser(f"bench-{os.getpid()}", password="x")
    old = baseline_admins(args.baseline_rev, admin.site)
    factory = RequestFactory()

    def load(model_admin, params, object_id=None):
        request = factory.get("/", params)
        request.user = user
        response = (model_admin.changelist_view(request) if object_id is None else
                    model_admin.change_view(request, object_id))
        response.render()
        assert response.status_code == 200, response.status_code
        return response

    def timed(new_admin, old_admin, params, object_id=None):
        load(new_admin, params, object_id), load(old_admin, params, object_id)  # warmed: templates, caches
        new_t, old_t = [], []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            load(new_admin, params, object_id)
            t1 = time.perf_counter()
            load(old_admin, params, object_id)
            old_t.append(time.perf_counter() - t1)
            new_t.append(t1 - t0)
        return new_t, old_t

    results = []
    try:
        for name, model in zip(LISTS, models):
            params = LISTS[name] if args.filtered else {}
            new_admin, old_admin = admin.site._registry[model], old[model]
            print(f"  {name} ...", file=sys.stderr, flush=True)
            new_t, old_t = timed(new_admin, old_admin, params)
            results.append((name, (Turn if name in BY_TURNS else model).objects.count(), new_t, old_t))
        print("  the conversation's page ...", file=sys.stderr, flush=True)
        conversation = apps.get_model("channels_app.conversation")
        new_t, old_t = timed(admin.site._registry[conversation], old[conversation], {}, str(conv.pk))
        results.append(("conversation page (messages)", Message.objects.filter(conversation=conv).count(),
                        new_t, old_t))
    finally:
        if pg:
            with connection.cursor() as cur:
                cur.execute("TRUNCATE " + ", ".join(f'"{m._meta.db_table}"' for m in models) + " CASCADE")
            User.objects.filter(pk=user.pk).delete()
    print(f"admin change lists on {connection.vendor}, {'filtered' if args.filtered else 'as opened'}; "
          f"{args.loads} loads each, interleaved with the baseline ({args.baseline_rev}'s admin)")
    print(f"{'list':<30} {'rows':>9}  {'now p50/p95 ms':>17}  {'before p50/p95 ms':>19}  {'before/now p50':>14}")
    for name, n, new_t, old_t in results:
        n50, o50 = statistics.median(new_t) * 1000, statistics.median(old_t) * 1000
        print(f"{name:<30} {n:>9,}  {n50:>7.1f} /{pct(new_t, 95) * 1000:>7.1f}  {o50:>9.1f} /{pct(old_t, 95) * 1000:>7.1f}"
              f"  {o50 / n50:>13.1f}x")


if __name__ == "__main__":
    main()
