"""message_submit under real concurrency on PostgreSQL: a message whose transaction fails on a constraint
another request's commit made must not be answered with what a third request committed meanwhile.

Embedded mode (SQLite) skips it: a message's transaction holds the one write lock from its first write to its
commit, so no other request can commit a turn or a conversation in between, and the IntegrityError path below
cannot be reached with someone else's conversation there."""
from __future__ import annotations

import threading
import time

import pytest
from django.db import close_old_connections, connection, connections, transaction

from channels_app.models import Conversation, Turn
from tests.support.http import chat

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("not __import__('os').environ.get('DATABASE_URL', '').startswith('postgres')",
                                 reason="needs PostgreSQL's row locks: SQLite serialises every write (module doc)")]


def _waiting(n: int, what: str) -> None:
    """Until n of the test database's sessions wait on a lock (ordering by PostgreSQL's own locks, not sleeps)."""
    for _ in range(3000):
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock'")
            if cur.fetchone()[0] >= n:
                return
        time.sleep(0.01)
    raise AssertionError(f"never waited: {what}")


def _in_thread(out: dict, name: str, fn) -> threading.Thread:
    def run():
        try:
            out[name] = fn()
        finally:
            connections.close_all()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_message_that_loses_a_race_is_never_answered_with_someone_elses_receipt(tcast):
    """bob's first message to X (turn_id T) creates X, then finds T taken by carol's commit: his transaction
    rolls back; alice's first message to X, which waited on bob's X, makes X hers with receipt m1. bob's
    refusal must be the 403 he would have had had alice come first, never alice's receipt (her turn, her
    answer) under bob's 409."""
    out: dict = {}
    assert chat(tcast.carol, "c", conversation_id="carol-c").status_code == 200
    carol_turn = Turn.objects.get()
    carol_took, carol_may_commit, lock_may_go = threading.Event(), threading.Event(), threading.Event()

    def carol_takes_the_id():  # carol's turn takes T in a transaction that commits after bob checked T
        with transaction.atomic():
            Turn.objects.filter(pk=carol_turn.pk).update(turn_id="T-bob")
            carol_took.set()
            carol_may_commit.wait(60)

    def the_table_held():  # queued behind alice: bob's re-read of X waits until alice has committed
        with transaction.atomic(), connections["default"].cursor() as cur:
            cur.execute(f"LOCK TABLE {Conversation._meta.db_table} IN ACCESS EXCLUSIVE MODE")
            lock_may_go.wait(60)

    threads = [_in_thread(out, "carol", carol_takes_the_id)]
    assert carol_took.wait(60)
    threads.append(_in_thread(out, "bob", lambda: chat(tcast.bob, "bob's words", conversation_id="X",
                                                       client_message_id="m1", turn_id="T-bob")))
    _waiting(1, "bob's turn on carol's uncommitted T")
    threads.append(_in_thread(out, "alice", lambda: chat(tcast.alice, "alice secret question",
                                                         conversation_id="X", client_message_id="m1")))
    _waiting(2, "alice's X on bob's uncommitted X")
    threads.append(_in_thread(out, "lock", the_table_held))
    _waiting(3, "the table lock behind alice")
    carol_may_commit.set()
    lock_may_go.set()
    for t in threads:
        t.join(90)
    close_old_connections()
    alice, bob = out["alice"], out["bob"]
    assert alice.status_code == 200, alice.content
    assert Conversation.objects.get(external_id="X").owner.user_id == "alice"
    assert bob.status_code == 403 and bob.json()["error"]["code"] == "conversation_not_owned", bob.content
    assert "alice" not in bob.content.decode() and not bob.has_header("x-ugent-turn-id")
