"""A conversation's snapshot (`streams.conversation_snapshot`, at each stream's subscribe and at a gap) reads
its newest receipts through `receipt_conv_id`: PostgreSQL walked every receipt's id backwards and SQLite
sorted every receipt of the conversation, so a subscribe cost more each day. The plans are the databases'
own, over a conversation of 2,000 receipts and 30,000 newer ones of another conversation (where the walk
passed every one of those).
Without the index: SQLite `SEARCH ... USING INDEX channels_app_receipt_conversation_id_...` then `USE TEMP
B-TREE FOR ORDER BY`; PostgreSQL `Index Scan Backward using channels_app_receipt_pkey`."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

from channels_app import services, streams
from channels_app.models import Receipt
from tests.support.plans import statements_on

pytestmark = pytest.mark.django_db


def receipts_made(cast) -> tuple:
    """Alice's viewer and her conversation "snap" with 2,000 receipts; 30,000 newer ones elsewhere."""
    actor = services.actor_resolve(caller=cast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        turn = services.message_submit(inbound=services.Submission(
            actor=actor, caller=cast.operator, text="first", conversation_id="snap")).turn
        other = services.message_submit(inbound=services.Submission(
            actor=actor, caller=cast.operator, text="first", conversation_id="elsewhere")).turn
    first = Receipt.objects.get(pk=turn.receipt_id)
    made = [Receipt(conversation=first.conversation, client_message_id=f"s-{i}", content_hash="x", actor=actor)
            for i in range(2000)]
    made += [Receipt(conversation=other.conversation, client_message_id=f"o-{i}", content_hash="x", actor=actor)
             for i in range(30000)]
    Receipt.objects.bulk_create(made, batch_size=2000)
    with connection.cursor() as cur:
        cur.execute("ANALYZE channels_app_receipt")  # (statistics outlive the test's rollback: this table's only)
    viewer = services.viewer_resolve(caller=cast.operator, user="alice")
    return viewer, first.conversation


def test_the_snapshot_reads_the_conversation_s_newest_receipts_through_its_index(cast):
    viewer, conv = receipts_made(cast)
    snapshot = {}
    found = statements_on("channels_app_receipt",
                          lambda: snapshot.update(streams.conversation_snapshot(viewer=viewer, conversation=conv)))
    assert len(snapshot["receipts"]) == streams.SNAPSHOT_RECEIPTS
    assert snapshot["receipts"][-1]["client_message_id"] == "s-1999"  # the newest, last
    (sql, params), = [(s, p) for s, p in found if "ORDER BY" in s]
    with connection.cursor() as cur:
        if connection.vendor == "sqlite":
            cur.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[3] for row in cur.fetchall()]
            assert any("channels_app_receipt USING INDEX receipt_conv_id" in p for p in plan), plan
            assert not any("TEMP B-TREE FOR ORDER BY" in p for p in plan), plan  # no sort of them all
        else:
            cur.execute("EXPLAIN " + sql, params)
            plan = "\n".join(r[0] for r in cur.fetchall())
            assert "receipt_conv_id" in plan and "receipt_pkey" not in plan, plan
