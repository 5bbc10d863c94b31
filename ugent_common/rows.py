"""Statements of the turn path, compiled once.

Every message writes a receipt, a turn, messages and events, and the turn
runner reads and moves them. Through the ORM each statement cost 0.2 to 0.5 ms
of Python compiling the same SQL again; the chat API's added latency was
mostly that (profiled with bench/chat_latency.py and py-spy). A `Table` builds
a model's INSERT and UPDATE once per shape from the model's own fields, and
adapts values the way `Model.save` does (`get_db_prep_save`: JSON, datetimes,
foreign keys), so the columns, defaults and types stay the model's.

The hub's hand-written selects are named functions in channels_app.statements,
built against `Table.name` and `Table.col(...)`; other apps use only the
generic `get` and `values_list` here. Every statement runs on the Django connection's own DB-API
connection (`_run`), inside Django's transactions and with Django's error
translation, broken-transaction and thread checks, but without a
`CursorWrapper` per statement: that wrapper and its cursor cost about as much
Python as SQLite's own execution of these statements. When anything watches
Django's cursors (query logging, `execute_wrapper`, CaptureQueriesContext),
statements go through the full cursor so the watcher sees them.
"""
from __future__ import annotations

import datetime
import decimal
import itertools
import logging
import re
import secrets
import sqlite3
import threading
import uuid
import weakref
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.backends.sqlite3.base import FORMAT_QMARK_REGEX
from django.utils import timezone


logger = logging.getLogger(__name__)

# Field types whose str/int/bool values go to the database as they are (get_db_prep_save is identity).
_PLAIN = frozenset({"CharField", "TextField", "SlugField", "BooleanField", "IntegerField", "BigIntegerField",
                    "PositiveIntegerField", "SmallIntegerField", "ForeignKey", "OneToOneField"})


class Table:
    """One model's table: inserts and updates with the model's defaults and adaptation."""

    def __init__(self, model):
        self.model = model
        meta = model._meta
        self.name = connection.ops.quote_name(meta.db_table)
        self.fields = [f for f in meta.concrete_fields if not f.primary_key]
        self.by_name = {f.name: f for f in self.fields}
        self.by_name.update({f.attname: f for f in self.fields})
        self._insert_sql: dict[tuple, str] = {}
        self._update_sql: dict[tuple, str] = {}
        self._get_sql: dict[tuple, str] = {}
        self.attnames = ["id"] + [f.attname for f in self.fields]
        self._converters = {f.attname: _converter(f) for f in self.fields}

    def col(self, name: str) -> str:
        return connection.ops.quote_name(self.by_name[name].column)

    def _prep(self, field, value):
        return None if value is None else self._converters[field.attname](value)

    def _values(self, values: dict) -> tuple[dict, dict]:
        """Every column's Python value by attname (given, auto_now(_add), or the model default),
        and the related instances given for foreign keys."""
        now = timezone.now()
        row, related = {}, {}
        for f in self.fields:
            if f.attname in values:
                value = values[f.attname]
            elif f.name in values:
                value = values[f.name]
                if value is not None and f.is_relation:
                    related[f.name] = value
                    value = value.pk
            elif getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False):
                value = now
            else:
                value = f.get_default()
            row[f.attname] = value
        return row, related

    def _insert_of(self, row: dict) -> Step:
        sql = self._insert_sql.get(())
        if sql is None:
            cols = ", ".join(connection.ops.quote_name(f.column) for f in self.fields)
            marks = ", ".join(["%s"] * len(self.fields))
            sql = self._insert_sql[()] = f"INSERT INTO {self.name} ({cols}) VALUES ({marks}) RETURNING id"
        return Step(sql, [self._prep(f, row[f.attname]) for f in self.fields], _FIRST)

    def _insert(self, row: dict) -> int:
        return run_step(self._insert_of(row))

    def insert(self, **values) -> int:
        """INSERT one row; fields not given get their model default, auto_now(_add) fields now. Returns its id."""
        return self._insert(self._values(values)[0])

    def insert_step(self, **values) -> Step:
        """`insert` as a Step for `batch`: its result is the new row's id."""
        return self._insert_of(self._values(values)[0])

    def create(self, **values):
        """As `Model.objects.create` (without its signals): the saved instance."""
        row, related = self._values(values)
        pk = self._insert(row)
        obj = self.model(pk=pk, **row)
        for name, instance in related.items():
            setattr(obj, name, instance)
        obj._state.adding = False
        obj._state.db = connection.alias
        return obj

    def from_row(self, names: list[str], values) -> object:
        """An instance from a raw select of `names` (attnames, any order): the fields not read load on access."""
        got = dict(zip(names, values))
        for name, value in got.items():
            got[name] = self._from_db(name, value)
        ordered = [f.attname for f in self.model._meta.concrete_fields if f.attname in got]
        return self.model.from_db(connection.alias, ordered, [got[n] for n in ordered])

    def _from_db(self, name: str, value):
        """A raw column value as the model's field reads it (JSON decoded, datetimes aware)."""
        f = self.by_name.get(name)
        if f is not None and value is not None:
            if hasattr(f, "from_db_value"):
                return f.from_db_value(value, None, connection)
            if f.get_internal_type() == "DateTimeField" and timezone.is_naive(value):
                return timezone.make_aware(value, dt_timezone.utc)
        return value

    def get(self, **where):
        """The first row (by id) whose fields equal `where`, as an instance; None when there is none."""
        names = tuple(where)
        nulls = tuple(n for n in names if where[n] is None)
        key = (names, nulls)
        sql = self._get_sql.get(key)
        if sql is None:
            sql = self._get_sql[key] = (f"SELECT {self.select_list(self.attnames)} FROM {self.name} "
                                        f"WHERE {self._conditions(names, nulls)} ORDER BY {self._column('id')} LIMIT 1")
        row = fetchone(sql, [self._lookup(n, v) for n, v in where.items() if v is not None])
        return None if row is None else self.from_row(self.attnames, row)

    def values_list(self, names: list[str], *, order_by: tuple[str, ...] = ("id",), **where) -> list[tuple]:
        """As `Model.objects.filter(**where).order_by(*order_by).values_list(*names)`, for plain equality
        and ascending order: the values as the fields read them, built once per shape (for apps that may not add
        statements to channels_app.statements)."""
        names, order_by = tuple(names), tuple(order_by)
        where_names = tuple(where)
        nulls = tuple(n for n in where_names if where[n] is None)
        key = ("values", names, order_by, where_names, nulls)
        sql = self._get_sql.get(key)
        if sql is None:
            condition = f" WHERE {self._conditions(where_names, nulls)}" if where_names else ""
            order = ", ".join(self._column(n) for n in order_by)
            sql = self._get_sql[key] = (f"SELECT {self.select_list(list(names))} FROM {self.name}{condition}"
                                        + (f" ORDER BY {order}" if order else ""))
        found = fetchall(sql, [self._lookup(n, v) for n, v in where.items() if v is not None])
        return [tuple(self._from_db(n, v) for n, v in zip(names, r)) for r in found]

    def _conditions(self, names: tuple, nulls: tuple) -> str:
        """Equality on each name; a None value is IS NULL, as in the ORM."""
        return " AND ".join(f"{self._column(n)} IS NULL" if n in nulls else f"{self._column(n)} = %s" for n in names)

    def _lookup(self, name: str, value):
        if name in ("id", "pk"):
            return value
        return self.by_name[name].get_db_prep_value(value, connection)

    def select_list(self, names: list[str], alias: str | None = None) -> str:
        prefix = f"{alias}." if alias else ""
        return ", ".join(prefix + self._column(n) for n in names)

    def update(self, where: dict, **values) -> int:
        """UPDATE rows matching `where` (equality on each field) with `values` (and updated_at); the row count."""
        return run_step(self.update_step(where, **values))

    def update_step(self, where: dict, **values) -> Step:
        """`update` as a Step for `batch`: its result is the row count."""
        if "updated_at" in self.by_name and "updated_at" not in values:
            values["updated_at"] = timezone.now()
        set_names, where_names = tuple(values), tuple(where)
        nulls = tuple(n for n in where_names if where[n] is None)
        key = (set_names, where_names, nulls)
        sql = self._update_sql.get(key)
        if sql is None:
            sets = ", ".join(f"{self._column(n)} = %s" for n in set_names)
            sql = self._update_sql[key] = f"UPDATE {self.name} SET {sets} WHERE {self._conditions(where_names, nulls)}"
        params = [self._prep(self.by_name[n], values[n]) for n in set_names]
        params += [self._lookup(n, where[n]) for n in where_names if where[n] is not None]
        return Step(sql, params, _ROWCOUNT)

    def _column(self, name: str) -> str:
        if name in ("id", "pk"):
            return connection.ops.quote_name(self.model._meta.pk.column)
        return self.col(name)


def _converter(field):
    """How `field.get_db_prep_save` adapts a non-None value, without its per-call layers for the
    common types (the general path for anything else)."""
    kind = field.get_internal_type()
    general = field.get_db_prep_save
    if kind in _PLAIN:
        return lambda value: value if type(value) in (str, int, bool) else general(value, connection)
    if kind == "DateTimeField":
        def datetime_value(value):
            if type(value) is datetime.datetime and value.tzinfo is not None:
                return connection.ops.adapt_datetimefield_value(value)
            return general(value, connection)  # naive or not a datetime: Django's checks and warnings
        return datetime_value
    if kind == "JSONField" and type(field).get_prep_value is models.JSONField.get_prep_value:
        encoder = field.encoder
        return lambda value: connection.ops.adapt_json_value(value, encoder)
    return lambda value: general(value, connection)


def _ONE(cur):
    return cur.fetchone()


def _FIRST(cur):
    return cur.fetchone()[0]


def _ALL(cur):
    return cur.fetchall()


def _ROWCOUNT(cur):
    return cur.rowcount


ROWCOUNT = _ROWCOUNT  # a Step's result: the rows its statement changed (statements' own UPDATE steps)


_qmark_sql: dict[str, str] = {}


def _run(sql: str, params, result, parts=None):
    """Execute one statement (or a batch's, joined: `parts` their (SQL, parameter count)) on the default
    connection and return `result(cursor)`."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.queries_logged or db.execute_wrappers or db.vendor not in ("sqlite", "postgresql"):
        with db.cursor() as cur:
            cur.execute(sql, params)
            return result(cur)
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    with db.wrap_database_errors:
        cur = db.create_cursor()
        try:
            if db.vendor == "sqlite":
                query = _qmark_sql.get(sql)
                if query is None:
                    query = _qmark_sql[sql] = FORMAT_QMARK_REGEX.sub("?", sql).replace("%%", "%")
                sqlite3.Cursor.execute(cur, query, params)
            elif settings.UGENT_PG_PREPARE:
                _prepared.execute(cur, db, parts or [(sql, len(params))], params)
            else:
                cur.execute(sql, params)
            return result(cur)
        finally:
            cur.close()


class _Prepared:
    """The turn path's statements prepared on PostgreSQL, once a connection (`UGENT_PG_PREPARE`).

    Sent as literal SQL, every statement was parsed and planned again at every turn, and that was most
    of the server's own time: 1.3 ms of its CPU for the claim's five statements, 0.4 ms as EXECUTEs of
    statements prepared before (docs/performance.md, "Servers mode"). A statement seen twice in the
    process gets a name, and each connection PREPAREs it before its first EXECUTE there: one round trip
    a statement a connection. PREPARE is not undone by a rollback, so once it answered the statement is
    there for the connection's life. Statements are still sent as literal SQL strings (Django binds
    parameters on the client): psycopg's own server-side binding, prepared and pipelined, cost more
    Python than it saved.

    What the caller sees does not change:
    * The server infers a prepared statement's parameter types from the SQL around them, where a literal
      was typed from its own value. Each call's values are checked against the types the server inferred
      (`_fits`), and a call whose values do not fit (an integer out of its column's range, a number where
      the server took text) goes as literal SQL, as before, with its result and its error.
    * A statement the server will not prepare (a parameter whose type nothing around it says, say) goes
      as literal SQL from then on; inside a transaction its PREPARE runs within a savepoint, so that
      costs the caller's transaction nothing. Inside a transaction already failed, nothing is prepared.
    * Names are never reused in a process and carry a random part, so a session a pooler hands on from
      another process never holds one of ours for other SQL.
    * A connection whose prepared statements went away (`DEALLOCATE`), or whose cached plan no longer
      fits its table (a migration changed a column a statement returns), drops them all and prepares
      again: the failing call is tried once more as literal SQL when no transaction holds it, and fails
      as it would have otherwise.
    Past `MAX` statements a process prepares no more (each costs the server memory on every connection);
    only SELECT, INSERT, UPDATE and DELETE can be prepared."""

    MAX = 128
    PREPARABLE = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")
    NEVER = -(1 << 30)

    def __init__(self):
        self.prefix = f"ugent_{secrets.token_hex(4)}_"
        self.counter = itertools.count(1)
        self.seen: dict[str, int] = {}  # SQL -> times run before it got a name (NEVER: not preparable)
        self.names: dict[str, tuple[str, str]] = {}  # SQL -> (name, its PREPARE)
        self.checks: dict[str, tuple] = {}  # SQL -> per parameter, what a value must pass to be sent to it
        self.lock = threading.Lock()
        # connection -> the names prepared there; None: drop them all (DEALLOCATE ALL) before the next PREPARE
        self.on: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _named(self, sql: str):
        named = self.names.get(sql)
        if named is not None or len(self.names) >= self.MAX:
            return named
        n = self.seen.get(sql, 0) + 1
        if n < 2:
            self.seen[sql] = n
            return None
        if not sql.lstrip()[:6].upper().startswith(self.PREPARABLE):
            self.seen[sql] = self.NEVER
            return None
        with self.lock:
            named = self.names.get(sql)
            if named is None and len(self.names) < self.MAX and self.seen.get(sql, 0) >= 0:
                name = f"{self.prefix}{next(self.counter)}"
                count = iter(range(1, 1 << 16))
                body = _PLACEHOLDER.sub(lambda m: "%" if m.group(0) == "%%" else f"${next(count)}", sql)
                named = self.names[sql] = (name, f"PREPARE {name} AS {body}")
                self.seen.pop(sql, None)
        return named

    def _prepare(self, cur, db, sql: str, name: str, prepare: str) -> bool:
        """PREPARE on this connection; False (and never again in the process) when the server refuses."""
        from psycopg import InterfaceError, OperationalError, errors

        inside = not db.get_autocommit()
        try:
            cur.execute(f"SAVEPOINT ugent_prepare; {prepare}; RELEASE SAVEPOINT ugent_prepare" if inside
                        else prepare)
        except (OperationalError, InterfaceError, errors.QueryCanceled):  # the connection, not the statement
            raise
        except errors.DatabaseError as exc:
            if inside:
                cur.execute("ROLLBACK TO SAVEPOINT ugent_prepare; RELEASE SAVEPOINT ugent_prepare")
            if not isinstance(exc, errors.DuplicatePreparedStatement):  # else ours already: a name is never reused
                with self.lock:
                    self.names.pop(sql, None)
                    self.seen[sql] = self.NEVER
                logger.warning("statement not prepared, sent as literal SQL from now on (%s): %s",
                               str(exc).splitlines()[0], sql[:120])
                return False
        if sql not in self.checks:
            cur.execute("SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = %s", [name])
            self.checks[sql] = tuple(_param_check(t) for t in cur.fetchone()[0])
        return True

    def execute(self, cur, db, parts, params) -> None:
        from psycopg import errors, pq

        conn = db.connection
        literal = "; ".join(sql for sql, _ in parts)
        if conn.info.transaction_status == pq.TransactionStatus.INERROR:
            cur.execute(literal, params)  # and fails as it always did
            return
        there = self.on.get(conn, ())
        if there is None or there == ():
            if there is None:
                cur.execute("DEALLOCATE ALL")
            there = self.on[conn] = set()
        texts, at = [], 0
        for sql, nparams in parts:
            named = self._named(sql)
            if named is not None and named[0] not in there:
                if self._prepare(cur, db, sql, *named):
                    there.add(named[0])
                else:
                    named = None
            if named is not None and not _fits(self.checks.get(sql), params, at, nparams):
                named = None
            at += nparams
            if named is None:
                texts.append(sql)
            elif nparams:
                texts.append(f"EXECUTE {named[0]}({', '.join(['%s'] * nparams)})")
            else:
                texts.append(f"EXECUTE {named[0]}")
        try:
            cur.execute("; ".join(texts), params)
        except (errors.InvalidSqlStatementName, errors.FeatureNotSupported) as exc:
            if isinstance(exc, errors.FeatureNotSupported) and "cached plan must not change" not in str(exc):
                raise
            self.on[conn] = None  # dropped and prepared again, from the next call on
            logger.warning("prepared statements dropped on a connection (%s)", str(exc).splitlines()[0])
            if not db.get_autocommit():
                raise
            cur.execute(literal, params)


def _fits(checks: tuple | None, params, at: int, n: int) -> bool:
    """Whether a call's values suit the parameter types the server inferred for its statement: a string or
    NULL suits any (a literal of one was typed by the SQL around it, too)."""
    if checks is None:
        return False
    for i in range(n):
        value = params[at + i]
        if value is not None and not isinstance(value, str) and not checks[i](value):  # TextChoices are str
            return False
    return True


def _param_check(pgtype: str):
    bound = _INT_BOUNDS.get(pgtype)
    if bound is not None:
        return lambda v: isinstance(v, int) and type(v) is not bool and -bound <= v < bound  # IntegerChoices
    return _PARAM_CHECKS.get(pgtype, _text_only)


def _text_only(value) -> bool:
    return False  # text, varchar and any other type: a string or NULL (checked before)


_INT_BOUNDS = {"smallint": 1 << 15, "integer": 1 << 31, "bigint": 1 << 63}
_PARAM_CHECKS = {
    "boolean": lambda v: type(v) is bool,
    "numeric": lambda v: type(v) in (int, float, decimal.Decimal),
    "double precision": lambda v: type(v) in (int, float),
    "real": lambda v: type(v) in (int, float),
    "timestamp with time zone": lambda v: isinstance(v, datetime.datetime),
    "timestamp without time zone": lambda v: isinstance(v, datetime.datetime),
    "date": lambda v: type(v) is datetime.date,
    "interval": lambda v: isinstance(v, datetime.timedelta),
    "uuid": lambda v: isinstance(v, uuid.UUID),
    "bytea": lambda v: isinstance(v, (bytes, bytearray, memoryview)),
    # Django's JSON adapter (psycopg's Jsonb), as the literal it renders
    "jsonb": lambda v: not isinstance(v, (int, float, list, tuple)),
    "json": lambda v: not isinstance(v, (int, float, list, tuple)),
}


_PLACEHOLDER = re.compile(r"%%|%s")
_prepared = _Prepared()


def fetchone(sql: str, params) -> tuple | None:
    return _run(sql, params, _ONE)


class Step:
    """One statement for `batch`: its SQL, its parameters, and what to take from its result
    (`result(cursor)`; None for a statement whose result nobody reads)."""

    __slots__ = ("sql", "params", "result")

    def __init__(self, sql: str, params, result=None):
        self.sql, self.params, self.result = sql, params, result


def run_step(step: Step):
    return _run(step.sql, step.params, step.result or _NOTHING)


def _NOTHING(cur):
    return None


def batch(steps: list) -> list:
    """Run statements in order and return each one's result (None for a None step, which is skipped).

    On PostgreSQL they go as one query string, one round trip: the server runs them one after
    another in the connection's transaction, each with its own snapshot, exactly as if they had
    been sent one at a time (Django's cursors bind parameters client-side, so the simple query
    protocol carries several statements); the first that fails raises, and the ones after it do
    not run. Elsewhere (SQLite, in the process) one at a time. Each round trip is a wake-up of the
    database's process and of this one, which on a small machine costs more than the statement."""
    todo = [(i, s) for i, s in enumerate(steps) if s is not None]
    out: list = [None] * len(steps)
    if not todo:
        return out
    if len(todo) == 1 or connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        for i, s in todo:
            out[i] = run_step(s)
        return out

    def results(cur):
        for n, (i, s) in enumerate(todo):
            if n:
                cur.nextset()
            if s.result is not None:
                out[i] = s.result(cur)
        return out
    return _run("; ".join(s.sql for _, s in todo), [p for _, s in todo for p in s.params], results,
                [(s.sql, len(s.params)) for _, s in todo])


def fetchall(sql: str, params) -> list[tuple]:
    return _run(sql, params, _ALL)


_tables: dict = {}


def table(model) -> Table:
    t = _tables.get(model)
    if t is None:
        t = _tables[model] = Table(model)
    return t
