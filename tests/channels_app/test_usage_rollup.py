"""The usage rollup: ended turns folded into each caller's and key's totals, so the admin's caller and key lists
read a row per caller and key and the turns since the mark, not every turn ever run; and what they show is
still exactly every turn's usage."""
from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Count, F, Sum
from django.test import Client
from django.utils import timezone

from channels_app import usage
from channels_app.models import ApiKey, Receipt, Turn, Usage
from tests.channels_app.test_usage import chat

pytestmark = pytest.mark.django_db(transaction=True)
FIELDS = usage.FIELDS


def turns_of(tcast, caller: str, n: int, *, words: str = "one two three") -> list[Turn]:
    """`n` turns of the caller's key (the operator's or the application's), each answered with `words`."""
    extra = ({"user": "alice"} if caller == "operator" else
             {"federation_issuer": "example-crm", "federation_subject": "carol"})
    for _ in range(n):
        assert chat(tcast.keys[caller], f"script:answer={words}", **extra).status_code == 200
    return list(Turn.objects.order_by("-id")[:n])[::-1]


def copies(turn: Turn, n: int, *, tokens: int = 5) -> None:
    """`n` more ended turns like `turn` (bulk: a receipt and a turn each), `tokens` total tokens each."""
    receipt, tag = Receipt.objects.get(pk=turn.receipt_id), uuid.uuid4().hex[:8]
    made = Receipt.objects.bulk_create([Receipt(**{
        **{f.attname: getattr(receipt, f.attname) for f in Receipt._meta.concrete_fields if f.attname != "id"},
        "client_message_id": f"copy-{tag}-{i}"}) for i in range(n)])
    Turn.objects.bulk_create([Turn(**{
        **{f.attname: getattr(turn, f.attname) for f in Turn._meta.concrete_fields if f.attname != "id"},
        "turn_id": f"copy-{tag}-{i}", "receipt_id": r.pk, "prompt_tokens": tokens - 1, "completion_tokens": 1,
        "total_tokens": tokens}) for i, r in enumerate(made)])


def aged(*, seconds: int = 3600) -> None:
    """Every turn made so far as if accepted `seconds` ago (past the rollup's margin)."""
    Turn.objects.update(created_at=timezone.now() - timedelta(seconds=seconds))


def every_turn_summed() -> tuple[dict, dict]:
    """What summing every turn gives, per caller and per key (the lists' figures before the rollup)."""
    def summed(field):
        return {row[field]: {"turns": row["n"], "prompt_tokens": row["p"] or 0, "completion_tokens": row["c"] or 0,
                             "total_tokens": row["t"] or 0}
                for row in Turn.objects.exclude(**{field: None}).values(field).order_by().annotate(
                    n=Count("id"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"), t=Sum("total_tokens"))}
    return summed("caller_id"), summed("api_key_id")


def shown(tcast) -> tuple[dict, dict]:
    """usage_for over every caller and admin-issued key, empty ones left out."""
    callers = [tcast.operator.pk, tcast.app.pk, tcast.outsider.pk]
    by_caller, by_key = usage.usage_for(caller_ids=callers, key_ids=list(ApiKey.objects.values_list("pk", flat=True)))
    return ({k: v for k, v in by_caller.items() if v["turns"]}, {k: v for k, v in by_key.items() if v["turns"]})


def test_the_rollup_folds_ended_turns_up_to_the_first_live_one_and_the_sums_stay_exact(tcast):
    first = turns_of(tcast, "operator", 3)
    live = turns_of(tcast, "app", 1)[0]
    later = turns_of(tcast, "app", 2, words="four five six seven")
    aged()
    Turn.objects.filter(pk=live.pk).update(state="running")
    assert shown(tcast) == every_turn_summed()  # nothing folded yet: all of it read since the mark (0)
    assert usage.usage_rollup() == 3
    assert usage.usage_mark() == first[-1].pk  # not past the live turn, whose usage is written at its end
    assert shown(tcast) == every_turn_summed()
    assert usage.usage_rollup() == 0  # run again, it folds nothing twice
    assert shown(tcast) == every_turn_summed()
    # the live turn ends (with its usage): the rest is folded, each once
    Turn.objects.filter(pk=live.pk).update(state="completed", prompt_tokens=10, completion_tokens=2, total_tokens=12)
    assert usage.usage_rollup() == 3 and usage.usage_mark() == later[-1].pk
    assert shown(tcast) == every_turn_summed()
    assert Usage.objects.get(caller=tcast.app).total_tokens == sum(
        t.total_tokens for t in Turn.objects.filter(caller=tcast.app))


def test_turns_younger_than_the_margin_wait_and_are_still_shown(tcast, settings):
    settings.UGENT_USAGE_ROLLUP_MARGIN_SECS = 300
    old = turns_of(tcast, "operator", 2)
    aged()
    young = turns_of(tcast, "operator", 2)  # accepted just now
    assert usage.usage_rollup() == 2 and usage.usage_mark() == old[-1].pk
    assert shown(tcast) == every_turn_summed()
    assert usage.usage_rollup(now=timezone.now() + timedelta(seconds=301)) == 2
    assert usage.usage_mark() == young[-1].pk and shown(tcast) == every_turn_summed()


def test_the_rollup_goes_a_chunk_at_a_time_and_passes_turns_of_a_deleted_caller(tcast):
    turns_of(tcast, "app", 1)
    copies(Turn.objects.get(), 9)
    gone = turns_of(tcast, "operator", 2)
    Turn.objects.filter(pk__in=[t.pk for t in gone]).update(caller=None, api_key=None)
    aged()
    assert usage.usage_rollup(chunk=3) == 12 and usage.usage_mark() == Turn.objects.order_by("id").last().pk
    assert shown(tcast) == every_turn_summed()
    assert Usage.objects.get(caller=tcast.app).turns == 10


def test_a_rollup_between_the_lists_reads_counts_nothing_twice(tcast, monkeypatch):
    """A rollup that commits after a list read the mark and before it read the totals put its turns in both
    the totals and the turns read after the mark: the list re-reads when the mark moved under it."""
    turns_of(tcast, "operator", 3)
    aged()
    real_mark, calls = usage.usage_mark, []

    def mark_then_a_rollup():
        calls.append(1)
        mark = real_mark()
        if len(calls) == 1:
            usage.usage_rollup()  # commits between this read and the totals' read
        return mark
    monkeypatch.setattr(usage, "usage_mark", mark_then_a_rollup)
    got = shown(tcast)
    monkeypatch.setattr(usage, "usage_mark", real_mark)
    assert got == every_turn_summed() and len(calls) >= 3


def test_the_lists_read_under_the_marks_lock_when_rollups_keep_moving_it(tcast, monkeypatch):
    """Rollups folding chunk after chunk moved the mark between a list's two reads of it ten times running:
    the last read is made under the mark's row lock, which holds them off for it, not left inconsistent."""
    turns_of(tcast, "operator", 1)
    copies(Turn.objects.get(), 30)
    aged()
    real_mark, reads = usage.usage_mark, []

    def moved_each_time():
        reads.append(1)
        mark = real_mark()
        if len(reads) % 2 == 1:  # between the two reads of each attempt, a rollup folds one more turn
            _fold_one(real_mark)
        return mark
    monkeypatch.setattr(usage, "usage_mark", moved_each_time)
    got = shown(tcast)
    monkeypatch.undo()
    assert len(reads) == 20 and usage.usage_mark() > 0  # ten attempts, each moved under it
    assert got == every_turn_summed()


def _fold_one(real_mark) -> None:
    """Fold the next turn only (the rollup's write, as a chunk of one)."""
    from channels_app.models import EventLogMark
    nxt = Turn.objects.filter(id__gt=real_mark()).order_by("id").first()
    if nxt is None:
        return
    Usage.objects.update_or_create(caller_id=nxt.caller_id, key_id=nxt.api_key_id or 0, defaults={})
    Usage.objects.filter(caller_id=nxt.caller_id, key_id=nxt.api_key_id or 0).update(
        turns=F("turns") + 1, prompt_tokens=F("prompt_tokens") + (nxt.prompt_tokens or 0),
        completion_tokens=F("completion_tokens") + (nxt.completion_tokens or 0),
        total_tokens=F("total_tokens") + (nxt.total_tokens or 0))
    EventLogMark.objects.update_or_create(name=EventLogMark.USAGE_ROLLED_THROUGH, defaults={"value": nxt.pk})


def test_a_caller_deleted_while_its_turns_are_folded_is_passed_over(tcast, monkeypatch):
    turns_of(tcast, "app", 2)
    turns_of(tcast, "operator", 1)
    aged()
    real_fold = usage._fold

    def deleted_first(sums, **kwargs):
        tcast.app.delete()  # after the chunk was read, before its totals are written
        return real_fold(sums, **kwargs)
    monkeypatch.setattr(usage, "_fold", deleted_first)
    assert usage.usage_rollup() == 3
    monkeypatch.undo()
    assert list(Usage.objects.values_list("caller_id", "turns")) == [(tcast.operator.pk, 1)]
    assert usage.usage_mark() == Turn.objects.order_by("id").last().pk


def test_two_rollups_at_once_fold_each_turn_once(tcast):
    turns_of(tcast, "app", 1)
    copies(Turn.objects.get(), 400)
    aged()
    results, errors = [], []

    def run():
        try:
            results.append(usage.usage_rollup(chunk=50))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sum(results) == 401, (results, errors)
    assert Usage.objects.get(caller=tcast.app).turns == 401 and shown(tcast) == every_turn_summed()


def test_the_admin_lists_show_every_turns_usage_and_read_no_more_as_the_history_grows(tcast):
    from tests.support.plans import statements_on, vm_steps
    turns_of(tcast, "app", 1)
    copies(Turn.objects.get(), 30)
    admin = Client()
    admin.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))

    def pages():
        return admin.get("/admin/channels_app/caller/").content.decode(), admin.get(
            "/admin/channels_app/apikey/").content.decode()
    aged()
    usage.usage_rollup()
    turns_of(tcast, "app", 1)  # one since the mark
    total = Turn.objects.filter(caller=tcast.app).aggregate(t=Sum("total_tokens"))["t"]
    callers, keys = pages()
    assert f'<td class="field-total_tokens">{total}</td>' in callers
    assert '<td class="field-turns_count">32</td>' in keys
    if connection.vendor == "sqlite":
        small = vm_steps(pages, every=10)
        copies(Turn.objects.filter(caller=tcast.app).first(), 3000)
        aged()
        usage.usage_rollup()
        large = vm_steps(pages, every=10)
        # a sum over every turn read each of them: 3,000 more turns cost 33x the two pages (a deeper index: a few
        # per cent)
        assert large <= small * 1.2, (small, large)
        callers, _ = pages()
        assert '<td class="field-turns_count">3032</td>' in callers
    else:
        on_turns = statements_on("channels_app_turn", pages)
        assert on_turns and all('"channels_app_turn"."id" >' in sql for sql, _ in on_turns), on_turns


def test_beat_schedules_the_rollup_and_its_task_runs_it(tcast):
    from django_celery_beat.models import PeriodicTask

    from channels_app import tasks
    tasks._retention_schedule()
    entry = PeriodicTask.objects.get(name=usage.USAGE_ROLLUP_TASK_NAME)
    assert entry.task == "channels_app.tasks.rollup_usage" and entry.enabled
    turns_of(tcast, "operator", 1)
    aged()
    assert tasks.rollup_usage() == 1 and usage.usage_mark() == Turn.objects.get().pk
