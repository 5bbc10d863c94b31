"""Memory's migrations over an install that already holds facts: 0011 rebuilds SQLite's full-text table with
the owner-tagged terms, 0021 fills PostgreSQL's postings, so the facts saved before each are still recalled,
each by its own user only."""
from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from plugins_app.agent.memory import recall_preview
from tests.support.memory import memory_config  # noqa: F401

BEFORE = ("plugins_app", "0010_memory_recall_statement")  # the migration under test: 0011


def migrate(target) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([target])


def migrate_to_latest() -> None:
    """Every migration, the one under test among them: the app's code reads the schema as it is now (the
    memory settings' row, say), so it runs after the last one, as in an upgraded install."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_facts_saved_before_0011_are_recalled_after_it_by_their_owner_only(memory_config):  # noqa: F811
    if connection.vendor != "sqlite":
        pytest.skip("0011 changes SQLite's full-text table only")
    memory_config.backend("sqlite_fts")
    migrate(BEFORE)
    try:
        with connection.cursor() as cur:  # rows as 0010's schema holds them (0007's triggers index them)
            cur.execute("INSERT INTO plugins_app_memoryfact (created_at, updated_at, actor_key, text, normalized, tier, "
                        "source, source_ref, pinned, seen_count) VALUES (datetime('now'), datetime('now'), "
                        "'web:alice', 'User likes green tea.', 'user likes green tea.', 'contextual', 'turn', '', 0, 1)")
        migrate_to_latest()  # 0011 among them
        assert [f["text"] for f in recall_preview(actor_key="web:alice", text="tea?")["facts"]] == \
            ["User likes green tea."]
        assert recall_preview(actor_key="web:bob", text="tea?")["facts"] == []
    finally:
        migrate_to_latest()


@pytest.mark.django_db(transaction=True)
def test_facts_saved_before_0021_are_recalled_through_the_postings_by_their_owner_only(memory_config):  # noqa: F811
    """0021 on PostgreSQL: the postings are filled from the facts already held, and the GIN index and the
    stored tsvector it replaced are dropped; migrating back makes them again."""
    from plugins_app.agent.memory.models import MemoryFact
    if connection.vendor != "postgresql":
        pytest.skip("0021 changes PostgreSQL's schema only")
    memory_config.backend("sqlite_fts")
    migrate(("plugins_app", "0020_plugin_allow_remote_control"))
    try:
        with connection.cursor() as cur:  # rows as 0020's schema holds them (text_tsv, GIN-indexed)
            for actor, text in (("web:alice", "User likes green tea."), ("web:alice", "User owns two teapots."),
                                ("web:bob", "User likes coffee.")):
                cur.execute("INSERT INTO plugins_app_memoryfact (created_at, updated_at, actor_key, text, normalized, "
                            "tier, source, source_ref, pinned, seen_count) VALUES (CURRENT_TIMESTAMP, "
                            "CURRENT_TIMESTAMP, %s, %s, %s, 'contextual', 'turn', '', FALSE, 1)",
                            [actor, text, text.lower()])
        migrate_to_latest()  # 0021 among them
        assert [f["text"] for f in recall_preview(actor_key="web:alice", text="tea?")["facts"]] == \
            ["User likes green tea."]
        assert [f["text"] for f in recall_preview(actor_key="web:alice", text="teapot?")["facts"]] == \
            ["User owns two teapots."]  # by the word's prefix, a range of the postings
        assert recall_preview(actor_key="web:bob", text="tea teapot?")["facts"] == []
        assert [f["text"] for f in recall_preview(actor_key="web:bob", text="coffee")["facts"]] == \
            ["User likes coffee."]
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM plugins_app_memoryposting")
            assert cur.fetchone()[0] == 11  # each fact's distinct words
            cur.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'plugins_app_memoryfact'::regclass "
                        "AND attname = 'text_tsv' AND NOT attisdropped")
            assert cur.fetchone()[0] == 0
        migrate(("plugins_app", "0020_plugin_allow_remote_control"))
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM plugins_app_memoryfact WHERE text_tsv @@ to_tsquery('simple', 'tea')")
            assert cur.fetchone()[0] == 1
            cur.execute("SELECT to_regclass('plugins_app_memoryposting')")
            assert cur.fetchone()[0] is None
    finally:
        MemoryFact.objects.all().delete()
        migrate_to_latest()


@pytest.mark.django_db(transaction=True)
def test_0023_adds_the_search_function_and_migrating_back_drops_it(memory_config):  # noqa: F811
    """0023 on PostgreSQL: recall's search as a function; back to 0022 it is gone. SQLite: nothing to do."""
    from plugins_app.agent.memory import services

    def search_function():
        with connection.cursor() as cur:
            cur.execute("SELECT to_regprocedure('plugins_app_memory_search(text, text[], text[], bigint[], bigint, "
                        "bigint, boolean, timestamptz, bigint, bigint)') IS NOT NULL")
            return cur.fetchone()[0]

    memory_config.backend("sqlite_fts")
    migrate(("plugins_app", "0022_memory_fact_expiry_idx"))
    try:
        if connection.vendor == "postgresql":
            assert not search_function()
    finally:
        migrate_to_latest()
    if connection.vendor == "postgresql":
        assert search_function()
    services.fact_save(actor_key="web:alice", text="User likes green tea.")
    assert [f["text"] for f in recall_preview(actor_key="web:alice", text="teas?")["facts"]] == \
        ["User likes green tea."]  # "teas": its prefix, a range of the postings


@pytest.mark.django_db(transaction=True)
def test_0023_applies_where_the_function_is_there_already(memory_config):  # noqa: F811
    """A database that applied this migration under its earlier name (0022_memory_search_function, before
    main's 0022) holds the function: 0023 replaces it rather than failing."""
    from importlib import import_module
    if connection.vendor != "postgresql":
        pytest.skip("the function is PostgreSQL's")
    search = import_module("plugins_app.migrations.0023_memory_search_function").SEARCH
    memory_config.backend("sqlite_fts")
    migrate(("plugins_app", "0022_memory_fact_expiry_idx"))
    try:
        with connection.cursor() as cur:
            cur.execute(search.replace("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION"))  # as the old 0022 left it
    finally:
        migrate_to_latest()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_proc WHERE proname = 'plugins_app_memory_search'")
        assert cur.fetchone()[0] == 1


@pytest.mark.django_db(transaction=True)
def test_0015_counts_what_the_after_turn_extraction_saved_before_it_as_seen_in_its_turn(memory_config):  # noqa: F811
    from plugins_app.agent.memory import services
    from plugins_app.agent.memory.models import MemoryFact
    memory_config.backend("sqlite_fts")
    migrate(("plugins_app", "0014_outbounddelivery_settled_index"))
    try:
        with connection.cursor() as cur:  # a fact the after-turn task saved, one the conversation's action saved
            for text, source, ref in (("User likes green tea.", "turn", "t9"), ("User's name is Alice.", "conversation",
                                                                                 "c1")):
                cur.execute("INSERT INTO plugins_app_memoryfact (created_at, updated_at, actor_key, text, normalized, "
                            "tier, source, source_ref, pinned, seen_count) VALUES (CURRENT_TIMESTAMP, "
                            "CURRENT_TIMESTAMP, 'web:alice', %s, %s, 'contextual', %s, %s, FALSE, 1)",
                            [text, text.lower(), source, ref])
        migrate_to_latest()  # 0015 among them
        tea = MemoryFact.objects.get(normalized="user likes green tea.")
        assert list(tea.sightings.values_list("ref", flat=True)) == ["t9"]
        assert not MemoryFact.objects.get(normalized="user's name is alice.").sightings.exists()
        # the task redelivered after the upgrade counts nothing again
        assert services.fact_save(actor_key="web:alice", text="User likes green tea.", seen_in="t9")[0].seen_count == 1
    finally:
        MemoryFact.objects.all().delete()
        migrate_to_latest()
