"""Expired facts are deleted by the hourly retention job once UGENT_MEMORY_EXPIRED_KEEP_SECS has passed
(the admin shows them until then), and a fact deleted while it is being stated again is saved anew."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from plugins_app.agent.memory import lance, recall_preview, services
from plugins_app.agent.memory.models import MemoryFact, MemorySighting
from tests.support.memory import BACKENDS, memory_config  # noqa: F401
from tests.support.plans import statements_on, table_scans

pytestmark = pytest.mark.django_db
ALICE, BOB = "web:alice", "web:bob"
DAY = 86400


@pytest.fixture(params=[b for b in BACKENDS if b != "none"])
def backend(request, memory_config):  # noqa: F811
    memory_config.backend(request.param)
    lance._stores.clear()
    yield request.param
    lance._stores.clear()


def save(actor, text, tier="contextual", **kw):
    return services.fact_save(actor_key=actor, text=text, tier=tier, **kw)[0]


def expired(fact, days):
    MemoryFact.objects.filter(pk=fact.pk).update(expires_at=timezone.now() - timedelta(days=days))


def test_facts_expired_longer_than_the_keep_are_deleted_and_no_other(backend, settings):
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = 7 * DAY
    old = save(ALICE, "User needs green tea tonight.", tier="ephemeral")
    recent = save(ALICE, "User needs black coffee tonight.", tier="ephemeral")
    live = save(BOB, "User needs green tea tomorrow.", tier="ephemeral")
    lasting = save(ALICE, "User likes green tea.")
    pinned = save(ALICE, "User drinks green tea at noon.", tier="ephemeral")
    expired(old, 8)
    expired(recent, 6)
    expired(pinned, 30)
    MemoryFact.objects.filter(pk=pinned.pk).update(pinned=True)  # pinned facts are never forgotten by age
    assert services.facts_expired_prune() == 1
    assert set(MemoryFact.objects.values_list("id", flat=True)) == {recent.pk, live.pk, lasting.pk, pinned.pk}
    assert services.facts_expired_prune() == 0  # nothing left to delete: a second run deletes nothing
    # the deleted fact is gone from recall's index as well as the rows (the postings, FTS5, LanceDB's table)
    assert "User needs green tea tonight." not in [f["text"] for f in recall_preview(
        actor_key=ALICE, text="green tea tonight")["facts"]]
    if backend == "lance_embedded":
        table = lance.store(384).table()
        assert old.pk not in {r["id"] for r in table.to_arrow().select(["id"]).to_pylist()}
        assert recent.pk in {r["id"] for r in table.to_arrow().select(["id"]).to_pylist()}


def test_a_negative_keep_keeps_expired_facts_for_ever(backend, settings):
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = -1
    fact = save(ALICE, "User needs green tea tonight.", tier="ephemeral")
    expired(fact, 3650)
    assert services.facts_expired_prune() == 0
    assert MemoryFact.objects.filter(pk=fact.pk).exists()


def test_a_keep_of_zero_deletes_facts_as_soon_as_they_expire(backend, settings):
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = 0
    gone = save(ALICE, "User needs green tea tonight.", tier="ephemeral")
    kept = save(ALICE, "User needs black coffee tonight.", tier="ephemeral")  # expires in a day
    MemoryFact.objects.filter(pk=gone.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert services.facts_expired_prune() == 1
    assert list(MemoryFact.objects.values_list("id", flat=True)) == [kept.pk]


def test_the_prune_deletes_in_batches_until_none_is_left(backend, settings):
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = 0
    facts = [save(ALICE, f"User needs item number {i} tonight.", tier="ephemeral") for i in range(7)]
    MemoryFact.objects.filter(pk__in=[f.pk for f in facts[:5]]).update(
        expires_at=timezone.now() - timedelta(hours=1))
    assert services.facts_expired_prune(batch=2) == 5
    assert sorted(MemoryFact.objects.values_list("id", flat=True)) == sorted(f.pk for f in facts[5:])


def test_the_prune_seeks_the_expiry_index_not_every_fact(memory_config, settings):  # noqa: F811
    """An install of a million facts, a few of them ephemeral: the hourly job reads those, not the table (on
    SQLite each row holds its 1.5 kB vector under lance_embedded)."""
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")
    memory_config.backend("sqlite_fts")
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = 0
    MemoryFact.objects.bulk_create([
        MemoryFact(actor_key=ALICE, text=f"fact {i}", normalized=f"fact {i}", tier="ephemeral" if i % 10 == 0
                   else "contextual", expires_at=timezone.now() - timedelta(hours=1) if i % 10 == 0 else None)
        for i in range(100)])
    counted = []
    found = statements_on("plugins_app_memoryfact", lambda: counted.append(services.facts_expired_prune()))
    assert counted == [10]
    assert found and table_scans("plugins_app_memoryfact", found) == []


@pytest.mark.django_db(transaction=True)  # the task opens fresh connections, as in a worker
def test_the_beat_task_prunes(memory_config, settings):  # noqa: F811
    memory_config.backend("sqlite_fts")
    settings.UGENT_MEMORY_EXPIRED_KEEP_SECS = 0
    fact = save(ALICE, "User needs green tea tonight.", tier="ephemeral")
    expired(fact, 1)
    from plugins_app.tasks import prune_memory
    assert prune_memory() == 1
    assert not MemoryFact.objects.exists()


def test_beat_start_schedules_the_memory_prune(transactional_db):
    from django_celery_beat.models import PeriodicTask

    from plugins_app.tasks import _retention_schedules
    _retention_schedules()
    _retention_schedules()
    tasks = PeriodicTask.objects.filter(task="plugins_app.tasks.prune_memory", enabled=True)
    assert tasks.count() == 1
    assert tasks.get().interval.every == 3600


def test_a_fact_deleted_while_it_is_stated_again_is_saved_anew(backend, monkeypatch):
    """The save found the fact there (its insert refused as a duplicate), then it was deleted (the prune, a
    forget, the admin) before the merge read it: the statement is not lost, it is saved as a new fact. (The
    merge itself holds the row: PostgreSQL's row lock, SQLite's IMMEDIATE transaction.)"""
    first = save(ALICE, "User likes green tea.", seen_in="t1")
    real = services._merge
    calls = []

    def deleted_meanwhile(actor_key, key, *args):
        calls.append(key)
        if len(calls) == 1:
            assert services.fact_forget(actor_key=actor_key, fact_id=first.pk)
        return real(actor_key, key, *args)
    monkeypatch.setattr(services, "_merge", deleted_meanwhile)
    again, created = services.fact_save(actor_key=ALICE, text="User likes green tea.", seen_in="t2")
    assert calls == ["user likes green tea"]
    assert created and again.pk != first.pk
    assert list(MemoryFact.objects.values_list("id", "seen_count")) == [(again.pk, 1)]
    assert list(MemorySighting.objects.values_list("fact_id", "ref")) == [(again.pk, "t2")]
    assert [f["text"] for f in recall_preview(actor_key=ALICE, text="green tea")["facts"]] == [
        "User likes green tea."]
