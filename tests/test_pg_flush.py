"""The tests' own flush of PostgreSQL's test database (tests/support/pg_flush.py): rows deleted, tables kept.

pytest-django flushes the database after each transactional test; on PostgreSQL the suite deletes the rows
instead of truncating every table. The flush must still leave every table empty, rows that reference each
other included (the foreign keys are checked at the flush's commit), and post_migrate's rows back."""
from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.support.flush_keep import flush_as_pytest_django_does

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("not __import__('os').environ.get('DATABASE_URL', '').startswith('postgres')",
                                 reason="the flush of PostgreSQL's test database")]


def test_a_flush_deletes_every_row_and_truncates_nothing(tcast):
    from channels_app.models import Actor, Caller, Conversation
    from plugins_app.agent.memory.models import MemoryFact
    actor = Actor.objects.create(key="web:alice", user_id="alice")
    Conversation.objects.create(external_id="c-1", owner=actor, caller=tcast.operator)
    MemoryFact.objects.create(actor_key="web:alice", text="User likes tea.", normalized="user likes tea.")
    with CaptureQueriesContext(connection) as seen:
        flush_as_pytest_django_does()
    sent = " ".join(q["sql"] for q in seen.captured_queries)
    assert "TRUNCATE" not in sent and 'DELETE FROM "channels_app_conversation"' in sent
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    with connection.cursor() as cur:
        left = {}
        for table in tables:
            cur.execute(f'SELECT count(*) FROM "{table}"')
            left[table] = cur.fetchone()[0]
    # what post_migrate makes again, and nothing else
    assert {t for t, n in left.items() if n} == {"django_content_type", "auth_permission"}, left
    with connection.cursor() as cur:  # memory's postings, no model's table: emptied by their triggers
        cur.execute("SELECT count(*) FROM plugins_app_memoryposting")
        assert cur.fetchone()[0] == 0
    assert ContentType.objects.get_for_model(Caller).model == "caller"
    assert not Caller.objects.exists() and not Conversation.objects.exists()


def test_a_flush_that_resets_sequences_is_djangos():
    with CaptureQueriesContext(connection) as seen:
        call_command("flush", verbosity=0, interactive=False, reset_sequences=True, inhibit_post_migrate=True)
    assert any(q["sql"].startswith("TRUNCATE") and "RESTART IDENTITY" in q["sql"] for q in seen.captured_queries)


def test_what_the_delete_flush_relies_on_holds():
    """Every foreign key is checked at commit, and no trigger acts on a delete but memory's postings' (migration
    0021: a fact's delete deletes its postings, which the flush wants, since their table is no model's): a key
    or trigger that a migration adds by hand would otherwise fail some later test's teardown, far from its
    cause."""
    with connection.cursor() as cur:
        cur.execute("SELECT conname FROM pg_constraint WHERE contype = 'f' AND connamespace = 'public'::regnamespace "
                    "AND NOT (condeferrable AND condeferred)")
        assert cur.fetchall() == []
        cur.execute("SELECT c.relname, tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                    "WHERE NOT t.tgisinternal AND c.relnamespace = 'public'::regnamespace ORDER BY tgname")
        assert cur.fetchall() == [("plugins_app_memoryfact", f"plugins_app_memoryfact_postings_{op}")
                                  for op in ("ins", "trunc", "upd")]
