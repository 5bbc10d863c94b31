"""Servers mode runs the turn path's statements prepared on PostgreSQL (ugent_common/rows.py, `_Prepared`):
a statement seen twice in the process is PREPAREd once a connection and sent as an EXECUTE from then on, so
the server parses and plans it once, not at every turn. These tests read the server's own view
(`pg_prepared_statements`, with its counts of plans made) to show the EXECUTE ran, and that nothing a
caller sees differs: the same rows, the same errors, transactions that commit and roll back as before.
PostgreSQL only (servers mode); embedded mode has no such path."""
from __future__ import annotations

import logging
import os
import re

import pytest
from django.db import IntegrityError, InternalError, ProgrammingError, connection, transaction

from channels_app import statements
from channels_app.models import Caller
from ugent_common import rows

pytestmark = [pytest.mark.skipif(not os.environ.get("DATABASE_URL"), reason="PostgreSQL only (servers mode)"),
              pytest.mark.django_db(transaction=True)]


@pytest.fixture
def prepared(monkeypatch, settings):
    """A process-wide list of its own, so that what other tests prepared does not count here; each
    test also starts on a new connection."""
    settings.UGENT_PG_PREPARE = True
    fresh = rows._Prepared()
    monkeypatch.setattr(rows, "_prepared", fresh)
    connection.close()
    return fresh


def on_server() -> dict[str, int]:
    """This connection's prepared statements: their PREPARE -> plans made and reused (custom + generic).
    (The server keeps the whole query string a PREPARE came in: inside a transaction, with its savepoint.)"""
    with connection.cursor() as cur:  # Django's cursor: sent as literal SQL, never prepared
        cur.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        found = {re.search(r"PREPARE ugent_\w+ AS [^;]*", sql).group(0): n for sql, n in cur.fetchall()}
    # names are the process's own (a random part): ugent_<hex>_<n> read as ugent_<n>
    return {re.sub(r"ugent_[0-9a-f]{8}_", "ugent_", sql): n for sql, n in found.items()}


def callers() -> rows.Table:
    return rows.table(Caller)


def run_get(name: str):
    return callers().get(name=name)


def test_a_statement_run_again_is_prepared_once_and_then_executed(prepared):
    Caller.objects.create(name="ada", role="user")
    assert run_get("ada").name == "ada"
    assert on_server() == {}  # once: sent as it is
    assert run_get("ada").name == "ada"
    (sql, runs), = on_server().items()
    assert sql.startswith("PREPARE ugent_1 AS SELECT") and "$1" in sql and runs == 1
    assert run_get("nobody") is None
    assert run_get("ada").name == "ada"
    assert on_server() == {sql: 3}  # the same statement executed twice more, prepared once


def test_a_batch_prepares_each_statement_and_answers_in_order(prepared):
    Caller.objects.create(name="ada", role="user")
    Caller.objects.create(name="bob", role="operator")
    t = callers()
    sql = f"SELECT {t.col('role')} FROM {t.name} WHERE {t.col('name')} = %s"

    def both():
        return rows.batch([rows.Step(sql, ["ada"], rows._FIRST), None,
                           rows.Step(sql + " AND id > %s", ["bob", 0], rows._FIRST)])

    assert both() == ["user", None, "operator"]
    assert both() == ["user", None, "operator"]
    assert both() == ["user", None, "operator"]
    assert sorted(on_server().values()) == [2, 2]


def test_a_prepare_outlives_the_transaction_that_made_it(prepared):
    Caller.objects.create(name="ada", role="user")
    with transaction.atomic():
        run_get("ada")
        run_get("ada")
        Caller.objects.create(name="gone", role="user")
        transaction.set_rollback(True)
    assert not Caller.objects.filter(name="gone").exists()
    assert run_get("ada").name == "ada"  # no "does not exist" (the PREPARE stayed) nor "already exists"
    assert list(on_server().values()) == [2]


def test_a_failing_statement_in_a_batch_raises_as_before_and_the_connection_goes_on(prepared):
    Caller.objects.create(name="ada", role="user")
    t = callers()
    insert = t._insert_of(t._values({"name": "ada", "role": "user"})[0])
    read = rows.Step(f"SELECT count(*) FROM {t.name}", [], rows._ONE)
    rows.batch([read])
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            rows.batch([read, insert])  # the read is prepared now, in front of an insert that fails
    assert rows.batch([read, read]) == [(1,), (1,)]
    assert Caller.objects.count() == 1


def test_a_statement_the_server_cannot_prepare_runs_as_literal_sql_without_harming_the_transaction(
        prepared, caplog):
    caplog.set_level(logging.WARNING, logger="ugent_common.rows")
    with transaction.atomic():
        Caller.objects.create(name="kept", role="user")
        answers = [rows.fetchone("SELECT %s + %s", [i, 1]) for i in range(4)]  # literal: 0 + 1; $1 + $2: which +?
    assert answers == [(1,), (2,), (3,), (4,)]
    assert Caller.objects.filter(name="kept").exists()  # the refused PREPARE cost the transaction nothing
    assert on_server() == {}
    assert [r.getMessage() for r in caplog.records].count(
        "statement not prepared, sent as literal SQL from now on "
        "(operator is not unique: unknown + unknown): SELECT %s + %s") == 1
    prepared.seen.clear()  # and refused outside a transaction (autocommit): no savepoint there
    assert [rows.fetchone("SELECT %s + %s", [2, i]) for i in range(3)] == [(2,), (3,), (4,)]
    assert on_server() == {}


def test_a_new_connection_prepares_again(prepared):
    Caller.objects.create(name="ada", role="user")
    run_get("ada")
    run_get("ada")
    assert len(on_server()) == 1
    connection.close()
    assert run_get("ada").name == "ada"
    assert list(on_server().values()) == [1]


def test_settings_and_statements_that_are_not_preparable_go_as_literal_sql(prepared, settings):
    for _ in range(3):
        with transaction.atomic():
            rows.batch([statements.commit_unflushed_step(), rows.Step("SELECT 1", [], rows._ONE)])
    assert list(on_server()) == ["PREPARE ugent_1 AS SELECT 1"]  # the SET LOCAL is not
    settings.UGENT_PG_PREPARE = False
    Caller.objects.create(name="ada", role="user")
    for _ in range(3):
        assert run_get("ada").name == "ada"
    assert list(on_server()) == ["PREPARE ugent_1 AS SELECT 1"]


def test_a_process_prepares_at_most_max_statements(prepared, monkeypatch):
    monkeypatch.setattr(prepared, "MAX", 2)
    for n in range(4):
        for _ in range(2):
            assert rows.fetchone(f"SELECT {n} + %s", [1]) == (n + 1,)
    assert sorted(on_server()) == ["PREPARE ugent_1 AS SELECT 0 + $1", "PREPARE ugent_2 AS SELECT 1 + $1"]


def test_a_literal_percent_sign_survives_the_prepare(prepared):
    Caller.objects.create(name="50%", role="user")
    t = callers()
    sql = f"SELECT {t.col('name')} FROM {t.name} WHERE {t.col('name')} LIKE '%%' || %s"
    assert [rows.fetchone(sql, ["%"]) for _ in range(3)] == [("50%",)] * 3
    assert any("LIKE '%' || $1" in s for s in on_server())


def test_a_name_is_never_given_twice_even_after_a_refusal(prepared):
    """A refused statement's name stays unused: a later statement given it again would run, on every
    connection that prepared the first holder, that statement's SQL with its own values."""
    refused, c, d = "SELECT %s + %s", "SELECT 'I am C: ' || %s", "SELECT 'I am D: ' || %s"
    prepared._named(refused)
    assert prepared._named(refused) is not None  # named, its PREPARE not tried yet (another thread's, say)
    assert [rows.fetchone(c, ["x"]) for _ in range(2)] == [("I am C: x",)] * 2  # C prepared now
    assert rows.fetchone(refused, [1, 2]) == (3,)  # refused: literal SQL from now on
    assert [rows.fetchone(d, ["y"]) for _ in range(3)] == [("I am D: y",)] * 3
    assert len(set(on_server())) == 2 and len({name for name, _ in prepared.names.values()}) == 2


def test_values_the_inferred_types_cannot_take_go_as_literal_sql_with_the_same_answer(prepared):
    Caller.objects.create(name="ada", role="user")
    t = callers()
    assert [t.get(id=2 ** 63) for _ in range(3)] == [None] * 3  # bigint's range: no row, not an error
    assert [t.get(id=-(2 ** 63) - 1) for _ in range(3)] == [None] * 3
    assert [rows.fetchone("SELECT %s", [5]) for _ in range(3)] == [(5,)] * 3  # the server took $1 as text
    assert [rows.fetchone("SELECT '[10,20]'::jsonb -> %s", [1]) for _ in range(3)] == [("20",)] * 3  # an index, not a key
    ada = Caller.objects.get(name="ada")
    assert [t.get(id=ada.pk).name for _ in range(3)] == ["ada"] * 3  # in range: prepared and executed
    assert [runs for sql, runs in on_server().items() if "WHERE \"id\" = $1" in sql] == [3]


def _drop_prepared():
    with connection.cursor() as cur:
        cur.execute("DEALLOCATE ALL")


def test_statements_dropped_under_a_connection_are_prepared_again(prepared, caplog):
    Caller.objects.create(name="ada", role="user")
    run_get("ada")
    run_get("ada")
    _drop_prepared()
    assert run_get("ada").name == "ada"  # outside a transaction: tried again as literal SQL
    assert "prepared statements dropped on a connection" in caplog.text
    assert run_get("ada").name == "ada"
    assert list(on_server().values()) == [1]  # prepared again
    _drop_prepared()
    with pytest.raises(ProgrammingError, match="does not exist"):
        with transaction.atomic():  # inside one the call fails (its transaction cannot go on)...
            run_get("ada")
    assert run_get("ada").name == "ada"  # ...and the connection is whole again for the next
    assert list(on_server().values()) == [1]


def test_a_plan_a_migration_changed_under_is_prepared_again(prepared):
    """A column a prepared statement returns changes its type (an AlterField of max_length does): its
    cached plan no longer fits, and the connection prepares its statements again."""
    Caller.objects.create(name="ada", role="user")
    t = callers()
    sql = f"SELECT {t.col('name')} FROM {t.name} WHERE {t.col('role')} = %s"
    assert [rows.fetchone(sql, ["user"]) for _ in range(2)] == [("ada",)] * 2
    with connection.cursor() as cur:
        cur.execute(f"ALTER TABLE {t.name} ALTER COLUMN {t.col('name')} TYPE varchar(120)")
    try:
        assert [rows.fetchone(sql, ["user"]) for _ in range(3)] == [("ada",)] * 3
    finally:
        with connection.cursor() as cur:
            cur.execute(f"ALTER TABLE {t.name} ALTER COLUMN {t.col('name')} TYPE varchar(100)")


def test_inside_a_failed_transaction_the_error_is_the_one_it_always_was(prepared):
    Caller.objects.create(name="ada", role="user")
    run_get("ada")  # seen once: the next sighting would PREPARE
    with pytest.raises(InternalError, match="current transaction is aborted"):
        with transaction.atomic():
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT 1/0")
            except Exception:
                pass  # caught, without a savepoint: the transaction is failed, Django does not know
            run_get("ada")
    assert on_server() == {}
    assert run_get("ada").name == "ada"


def test_the_turn_path_runs_prepared(prepared, tcast):
    """The statements a turn sends carry choices (TextChoices, a str) and ids: they run as EXECUTEs."""
    from channels_app.models import Turn
    from tests.streams.test_fanout import _conversation
    turn = Turn.objects.filter(conversation=_conversation(tcast.bob, "cb")).latest("id")
    for _ in range(3):
        assert statements.turn_fetch(turn.pk).pk == turn.pk
        assert statements.steering_pending(turn.pk) is False
    runs = on_server()
    assert [n for sql, n in runs.items() if '"channels_app_turn" t JOIN' in sql][0] >= 2, runs
    assert [n for sql, n in runs.items() if sql.endswith('"channels_app_steering" WHERE "turn_id" = $1 '
                                                         'AND "state" = $2 LIMIT 1')][0] >= 2, runs
