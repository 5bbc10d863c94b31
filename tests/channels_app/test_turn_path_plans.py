"""No statement the turn path runs walks a table that grows with the work (issue #17: what grows with the
work). Every statement SQLite runs for turns (non-stream and streamed, follow-ups in one conversation and a
new one) and the reads clients make beside them (snapshots, history, a receipt, the event stream) is
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

from tests.streams.conftest import get, read_frames, stream
from tests.support.http import chat
from tests.support.memory import memory_config  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)

#: Tables that do not grow with the work (settings, keys, profiles, rule sets, plugins; Django's own, which the
#: turn path does not write): a walk of one is no worse than a seek. Every other table grows (messages, turns,
#: events, actors, facts, runs, the full-text tables...).
FIXED = re.compile(r"^(django_\w+|auth_\w+|sqlite_\w+|channels_app_(caller|callerdefaults|apikey|issuer)|"
                   r"plugins_app_(agentprofile|plugin|pluginsecret|memorysettings)|rules_app_(rule|ruleset|workspacetrust)|"
                   r"cron_app_(cronsettings|cronjob|crontask|crondestination))$")
#: A table named in a statement (after FROM, JOIN, UPDATE or a comma of a join), and the alias SQLite's plan
#: names it by (Django's U0, T3; the hub's t, k).
_NAMED = re.compile(r'(?:\b(?:FROM|JOIN|UPDATE)|,)\s+(?:"?main"?\.)?"?(\w+)"?(?:\s+(?:AS\s+)?"?(?!(?:WHERE|ON|INNER|'
                    r'LEFT|CROSS|JOIN|ORDER|GROUP|LIMIT|USING|SET|VALUES|UNION|WINDOW|NATURAL|INDEXED)\b)(\w+)"?)?',
                    re.IGNORECASE)
#: A virtual table's plan line that uses no constraint of its own: idxNum 0 and no idxStr ("INDEX 0:") walks
#: it; a full-text MATCH ("0:M1") or fts5vocab's term lookup ("1:") does not.
_VIRTUAL_WALK = re.compile(r"VIRTUAL TABLE INDEX 0:$")


def tables_by_name(sql: str) -> dict[str, set[str]]:
    """{a name a plan may give a table (an alias, or the table's own name): the tables it stands for}
    (Django gives sibling subqueries the same alias, U0)."""
    out: dict[str, set[str]] = {}
    for table, alias in _NAMED.findall(sql):
        out.setdefault(table, set()).add(table)
        if alias:
            out.setdefault(alias, set()).add(table)
    return out


def walks(sql: str, plan: list[str], tables: set[str]) -> list[str]:
    """The plan's lines that walk a growing table. A name the statement does not give (a subquery's, a CTE's)
    counts when it is a table's own name; an alias counts when any table it stands for grows."""
    named = tables_by_name(sql)
    out = []
    for line in plan:
        if not line.startswith("SCAN ") or (" VIRTUAL TABLE " in line and not _VIRTUAL_WALK.search(line)):
            continue
        name = line.split()[1]
        stands_for = named.get(name, {name}) & tables  # (the pattern also catches a select list's commas)
        if any(not FIXED.match(t) for t in stands_for):
            out.append(line)
    return out


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
    tables = set(connection.introspection.table_names(include_views=True))
    with connection.cursor() as cur:
        for sql in dict.fromkeys(s.strip() for s in statements):
            if not sql.upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH", "INSERT")):
                continue
            cur.execute("EXPLAIN QUERY PLAN " + sql)
            plan = [row[3] for row in cur.fetchall()]
            if walks(sql, plan, tables):
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


def test_no_statement_of_a_turn_with_memory_and_a_tool_walks_a_growing_table(tcast, traced, memory_config):  # noqa: F811
    from plugins_app.agent.memory.models import MemoryFact
    from channels_app.models import ToolCall
    memory_config.backend("sqlite_fts")
    alice = tcast.alice
    assert chat(alice, "script:answer=noted. I live in Lisbon and I like green tea.", conversation_id="mem").status_code == 200
    assert chat(alice, "script:call=workspace_list|result", conversation_id="mem").status_code == 200
    assert chat(alice, "script:answer=ok. Which tea do I like?", conversation_id="mem").status_code == 200
    ran = list(traced)
    assert MemoryFact.objects.exists() and ToolCall.objects.exists()  # the work reached both
    assert scans(ran) == {}


def test_the_check_finds_a_walk(tcast, traced):
    assert chat(tcast.alice, "script:answer=hi", conversation_id="plans").status_code == 200
    planted = ["SELECT id FROM channels_app_message WHERE content = 'hi'",  # no index on a message's text
               'SELECT t."id" FROM "channels_app_turn" t WHERE t.error = \'x\'',  # aliased, as the hub writes
               'SELECT "channels_app_actor"."id" FROM "channels_app_actor" WHERE "channels_app_actor"."id" IN '
               '(SELECT U0."actor_id" FROM "channels_app_message" U0 WHERE U0."content" = \'hi\')']  # Django's U0
    planted += ['UPDATE "channels_app_turn" SET "error" = \'x\' WHERE "error" = \'y\'',  # an UPDATE's walk
                'SELECT 1 FROM "channels_app_caller" c, "channels_app_message" m WHERE m."content" = c."name"',
                'SELECT 1 FROM "channels_app_actor" WHERE "id" IN (SELECT U0."actor_id" FROM "channels_app_message" U0 '
                'WHERE U0."content" = \'x\') AND "id" IN (SELECT U0."id" FROM "channels_app_caller" U0)',  # two U0
                "SELECT rowid FROM plugins_app_memoryfact_fts"]  # a full-text table walked without a MATCH
    assert list(scans([*traced, *planted])) == [p[:300] for p in planted]
    assert tables_by_name(planted[2]) == {"channels_app_actor": {"channels_app_actor"},
                                          "channels_app_message": {"channels_app_message"}, "U0": {"channels_app_message"}}
