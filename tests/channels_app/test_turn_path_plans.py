"""No statement the turn path runs walks a table that grows with the work (issue #17: what grows with the
work). Every statement SQLite runs for turns of each kind and the reads clients make beside them is
recorded from SQLite itself (a trace callback on every connection, the turn threads' too), and each
distinct one is planned: a SCAN of a growing table, with or without an index to walk in order, fails.

SQLite only: its plan is made before any parameter is bound and does not depend on the table's size here
(no statistics), so the plans a small test database gets are the daemon's. PostgreSQL picks by its
statistics (tests/channels_app/test_live_turns_index.py and its kind check the reads by what they return)."""
from __future__ import annotations

import re
import threading

import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from tests.streams.conftest import chat, get, read_frames, stream

pytestmark = pytest.mark.django_db(transaction=True)

#: Tables whose rows come with messages, turns and their events (and so grow with use).
GROWING = re.compile(r"^(channels_app_(message|event|turn|receipt|conversation|toolcall|question\w*|steering\w*|"
                     r"artifact\w*|file\w*|usage\w*)|plugins_app_(memoryfact|outbound\w*|delivery\w*)|"
                     r"rules_app_\w*decision\w*)$")


@pytest.fixture
def traced():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's plans (see the module's docstring)")
    seen: list[str] = []
    lock = threading.Lock()

    def record(sql):
        with lock:
            seen.append(sql)

    def hook(sender, connection, **kwargs):
        connection.connection.set_trace_callback(record)
    connection.ensure_connection()
    connection.connection.set_trace_callback(record)
    connection_created.connect(hook, weak=False)
    try:
        yield seen
    finally:
        connection_created.disconnect(hook)
        connection.connection.set_trace_callback(None)


def scans(statements: list[str]) -> dict[str, list[str]]:
    """Each distinct read or write whose plan walks a growing table: {statement: its plan}."""
    out = {}
    with connection.cursor() as cur:
        for sql in dict.fromkeys(s.strip() for s in statements):
            if not sql.upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH", "INSERT")):
                continue
            cur.execute("EXPLAIN QUERY PLAN " + sql)
            plan = [row[3] for row in cur.fetchall()]
            walked = [p for p in plan if p.startswith("SCAN ") and GROWING.match(p.split()[1])]
            if walked:
                out[sql[:300]] = plan
    return out


def test_no_statement_of_a_turn_or_a_read_beside_it_walks_a_growing_table(tcast, traced):
    alice = tcast.alice
    for i in range(3):
        assert chat(alice, f"script:answer=answer {i}", conversation_id="plans").status_code == 200
    streamed = chat(alice, "script:answer=streamed", conversation_id="plans", stream=True)
    assert streamed.status_code == 200
    assert any(f["data"] == "[DONE]" for f in read_frames(streamed, until=lambda fs: fs and fs[-1]["data"] == "[DONE]"))
    assert chat(alice, "script:answer=in another", conversation_id="plans-2").status_code == 200
    for path, params in (("/v1/ugent/conversation/snapshot", {"conversation_id": "plans"}),
                         ("/v1/ugent/snapshot", {"conversation_id": "plans"}),
                         ("/v1/ugent/history", {"conversation_id": "plans"}),
                         ("/v1/ugent/receipt", {"conversation_id": "plans", "client_message_id": "none"})):
        assert get(path, alice, **params).status_code in (200, 404), path
    assert stream("/v1/ugent/events", alice, cursor="0", until=lambda frames: len(frames) >= 5)
    assert len(traced) > 50  # the trace saw the work (the turns ran on other threads too)
    assert scans(traced) == {}


def test_the_check_finds_a_walk(tcast, traced):
    assert chat(tcast.alice, "script:answer=hi", conversation_id="plans").status_code == 200
    planted = "SELECT id FROM channels_app_message WHERE content = 'hi'"  # no index on a message's text
    assert list(scans([*traced, planted])) == [planted]
