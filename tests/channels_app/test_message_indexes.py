"""Two reads every turn makes of its conversation's messages, which used to grow with the conversation.

The summary. Every turn reads its conversation's newest visible summary (the system message a compaction left). It
used to walk the conversation's messages backwards until it met one: in a conversation never compacted,
all of them, every turn (16–49 ms at 60,000 turns in one conversation). It now reads the partial index
`message_conv_system`, which holds only system messages, whatever the conversation's length.

The history. Every turn reads the newest visible user and assistant messages, up to its limit (20, or the
profile's history_turns). Through all the messages, a compacted conversation whose visible ones were fewer
than the limit walked every hidden message (each turn after a compaction). It reads the partial index
`message_conv_visible` now.

The plans are the databases' own: SQLite's, and PostgreSQL's generic plan of the prepared statement (what
`ugent_common.rows` runs after the second sighting, and which cannot prove a partial index from a bound
value: the role is in the SQL as the index's literal). What the read
returns is pinned against the ORM in tests/channels_app/test_statements.py."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

from channels_app import services, statements
from channels_app.models import Conversation, Message, Turn
from tests.support.plans import vm_steps
from ugent_common import rows

pytestmark = pytest.mark.django_db


def conversation_with(cast, n: int, *, summary_first: bool = False, hidden: bool = False) -> Conversation:
    """A conversation of `n` user and assistant messages (and, if asked, one summary before them), all
    hidden if asked (compacted) but for six visible ones after them."""
    name = f"{n}-{summary_first}-{hidden}"
    actor = services.actor_resolve(caller=cast.operator, user=f"u-{name}")
    with mock.patch("channels_app.tasks.run_turn.delay"):  # its turn, which the messages below belong to
        turn = services.message_submit(inbound=services.Submission(
            actor=actor, caller=cast.operator, text="first", conversation_id=f"c-{name}")).turn
    conv = turn.conversation
    made = []
    if summary_first:
        made.append(Message(conversation=conv, role=Message.Role.SYSTEM, content="the summary", turn=turn))
    made += [Message(conversation=conv, role=(Message.Role.USER, Message.Role.ASSISTANT)[i % 2], content=f"m {i}",
                     hidden=hidden, turn=turn) for i in range(n)]
    if hidden:
        made += [Message(conversation=conv, role=(Message.Role.USER, Message.Role.ASSISTANT)[i % 2],
                         content=f"kept {i}", turn=turn) for i in range(6)]
    Message.objects.bulk_create(made)
    return conv


def summary_reads(conv: Conversation):
    """The two statements that read the summary: by conversation, and by a turn's id alone (the claim's batch)."""
    turn_pk = Turn.objects.filter(conversation=conv).values_list("pk", flat=True).first()
    return [(statements._summary_latest_sql(), [conv.pk, False]),
            (statements._turn_summary_sql(), [turn_pk or 0, False])]


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


def history_reads(conv: Conversation):
    """The two history statements: by conversation (history_tail), and by a turn's id alone (the claim's)."""
    return [(statements._history_tail_sql(), [conv.pk, Message.Role.USER, Message.Role.ASSISTANT, 10 ** 9, 20]),
            (statements._turn_history_sql(), [0, Message.Role.USER, Message.Role.ASSISTANT, 0, 20, 0])]


def test_the_history_of_a_compacted_conversation_does_not_grow_with_what_it_hid(cast):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count")
    short, long = conversation_with(cast, 20, hidden=True), conversation_with(cast, 2000, hidden=True)
    steps, got = {}, {}
    for name, conv in (("short", short), ("long", long)):
        steps[name] = vm_steps(lambda conv=conv: got.__setitem__(
            name, statements.history_tail(conv.pk, 10 ** 9, 20)), every=10)
    kept = [(("user", "assistant")[i % 2], f"kept {i}") for i in range(6)]
    assert got["long"] == got["short"] == [("user", "first")] + kept  # what the compaction left visible
    assert steps["long"] <= steps["short"] + 2, steps


# (the reads, the conversation they are planned over, the index they must use)
READS = {"summary": (summary_reads, {}, "message_conv_system"),
         "history": (history_reads, {"hidden": True}, "message_conv_visible")}


@pytest.mark.parametrize("read", sorted(READS))
def test_the_read_uses_its_partial_index_on_sqlite(cast, read):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's plan; PostgreSQL's generic plan is checked below")
    reads, shape, index = READS[read]
    with connection.cursor() as cur:
        for sql, params in reads(conversation_with(cast, 10, **shape)):
            cur.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[3] for row in cur.fetchall()]
            on_messages = [p for p in plan if "channels_app_message" in p]
            assert on_messages and all(f"INDEX {index}" in p for p in on_messages), (sql, plan)


@pytest.mark.parametrize("read", sorted(READS))
def test_the_prepared_read_uses_its_partial_index_on_postgresql(cast, settings, monkeypatch, read):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's generic plan")
    reads, shape, index = READS[read]
    settings.UGENT_PG_PREPARE = True
    fresh = rows._Prepared()
    monkeypatch.setattr(rows, "_prepared", fresh)
    for sql, params in reads(conversation_with(cast, 10, **shape)):
        for _ in range(3):  # named at the second sighting, prepared on this connection
            rows.fetchall(sql, params)
        name = fresh.names[sql][0]
        with connection.cursor() as cur:
            # whether the generic plan can use the index at all, whatever statistics other tests left on a
            # table of ten rows (where a scan and a sort would win): no sequential scan
            cur.execute("SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off")
            try:
                cur.execute(f"EXPLAIN EXECUTE {name}({', '.join(['%s'] * len(params))})", params)
                plan = "\n".join(r[0] for r in cur.fetchall())
            finally:
                cur.execute("RESET plan_cache_mode; RESET enable_seqscan")
        assert index in plan and "Seq Scan on channels_app_message" not in plan, (sql, plan)
