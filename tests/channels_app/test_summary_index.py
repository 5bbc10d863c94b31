"""Every turn reads its conversation's newest visible summary (the system message a compaction left). It
used to walk the conversation's messages backwards until it met one: in a conversation never compacted,
all of them, every turn (16–49 ms at 60,000 turns in one conversation). It now reads the partial index
`message_conv_system`, which holds only system messages, whatever the conversation's length.

The plans are the databases' own: SQLite's, and PostgreSQL's generic plan of the prepared statement (what
`ugent_common.rows` runs after the second sighting, and which cannot prove a partial index from a bound
value: the role is in the SQL as the index's literal). What the read
returns is pinned against the ORM in tests/channels_app/test_statements.py."""
from __future__ import annotations

import pytest
from django.db import connection

from channels_app import statements
from channels_app.models import Actor, Conversation, Message, Turn
from tests.support.plans import vm_steps
from ugent_common import rows

pytestmark = pytest.mark.django_db


def conversation_with(cast, n: int, *, summary_first: bool = False) -> Conversation:
    """A conversation of `n` user and assistant messages (and, if asked, one summary before them)."""
    actor = Actor.objects.create(key=f"web:u-{n}-{summary_first}", user_id=f"u-{n}-{summary_first}",
                                 caller=cast.operator)
    conv = Conversation.objects.create(external_id=f"c-{n}-{summary_first}", owner=actor, caller=cast.operator)
    made = []
    if summary_first:
        made.append(Message(conversation=conv, role=Message.Role.SYSTEM, content="the summary"))
    made += [Message(conversation=conv, role=(Message.Role.USER, Message.Role.ASSISTANT)[i % 2], content=f"m {i}")
             for i in range(n)]
    Message.objects.bulk_create(made)
    return conv


def summary_reads(conv: Conversation):
    """The two statements that read the summary: by conversation, and by a turn's id alone (the claim's batch)."""
    turn_pk = Turn.objects.filter(conversation=conv).values_list("pk", flat=True).first()
    return [(statements._summary_latest_sql(), [conv.pk, False]),
            (statements._turn_summary_sql(), [turn_pk or 0, False])]


def test_the_summary_read_uses_the_partial_index_on_sqlite(cast):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's plan; PostgreSQL's generic plan is checked below")
    conv = conversation_with(cast, 10)
    with connection.cursor() as cur:
        for sql, params in summary_reads(conv):
            cur.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[3] for row in cur.fetchall()]
            on_messages = [p for p in plan if "channels_app_message" in p]
            assert on_messages and all("INDEX message_conv_system" in p for p in on_messages), (sql, plan)


def test_the_summary_read_does_not_grow_with_the_conversation(cast):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count")
    short, long = conversation_with(cast, 20), conversation_with(cast, 2000)
    steps = {}
    for name, conv in (("short", short), ("long", long)):
        steps[name] = vm_steps(lambda conv=conv: statements.summary_latest(conv.pk), every=10)
    # a walk over the messages costs about 100× more for the long one (1,001 against 11 here without the
    # index); an index read the same
    assert steps["long"] <= steps["short"] + 2, steps
    # and it still finds a summary older than every other message, past thousands of them
    old = conversation_with(cast, 2000, summary_first=True)
    assert statements.summary_latest(old.pk) == "the summary"


def test_the_prepared_summary_read_uses_the_partial_index_on_postgresql(cast, settings, monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's generic plan")
    settings.UGENT_PG_PREPARE = True
    fresh = rows._Prepared()
    monkeypatch.setattr(rows, "_prepared", fresh)
    conv = conversation_with(cast, 10)
    for sql, params in summary_reads(conv):
        for _ in range(3):  # named at the second sighting, prepared on this connection
            assert rows.fetchone(sql, params) is None
        name = fresh.names[sql][0]
        with connection.cursor() as cur:
            cur.execute("SET plan_cache_mode = force_generic_plan")
            try:
                cur.execute(f"EXPLAIN EXECUTE {name}(%s, %s)", params)
                plan = "\n".join(r[0] for r in cur.fetchall())
            finally:
                cur.execute("RESET plan_cache_mode")
        assert "message_conv_system" in plan, (sql, plan)
        assert "message_conv_id" not in plan and "Seq Scan on channels_app_message" not in plan, plan
