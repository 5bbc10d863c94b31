"""The hub's named raw statements: every hand-written SELECT of channels_app lives here.

Why raw SQL at all: see ugent_common.rows and docs/performance.md (the ORM's per-statement
compiling was most of the chat path's added latency). Why here: one module to read, review and
pin. Each function is one statement, named for what it reads or does; its SQL is built once
(functools.cache) from the models' own table and column names (`rows.table(Model).name/.col()`)
and runs through `rows.fetchone`/`rows.fetchall` (Django's connection, transactions and error
translation). tests/channels_app/test_statements.py runs every function here against its ORM
equivalent on the same rows, fails when a function has no such pin, and fails when f-string SQL
appears in the apps' sources outside channels_app/rows.py and this module.

Other apps do not add their statements here (the hub imports no rules or plugins code): they use
the generic builders of `rows.Table` (`get`, `values_list`, `insert`, `update`).
"""
from __future__ import annotations

import functools
import json

from django.db import connection

from ugent_common import rows
from channels_app.models import (Actor, ApiKey, Caller, Conversation, Event, Message, Receipt, ReceiptState,
                                 Steering, SteeringState, Turn, TurnState)

EVENT_LOG_LOCK = 0x55474E54  # "UGNT": the advisory lock that orders event appends (channels_app.events)


# --- the database itself ---------------------------------------------------------------------

def database_ping() -> None:
    """One round trip to the database (GET /v1/health)."""
    rows.fetchone("SELECT 1", [])


def event_log_lock() -> None:
    """PostgreSQL: take the event log's transaction-scoped advisory lock (SQLite serialises writers)."""
    rows.batch([event_log_lock_step()])


def event_log_lock_step() -> rows.Step | None:
    """event_log_lock as a step of a batch; None on SQLite."""
    if connection.vendor == "postgresql":
        return rows.Step("SELECT pg_advisory_xact_lock(%s)", [EVENT_LOG_LOCK])
    return None


def commit_unflushed_step() -> rows.Step | None:
    """PostgreSQL: this transaction's COMMIT returns without waiting for its WAL to reach the disk
    (`synchronous_commit` off, for this transaction only); None on SQLite.

    For a write that nobody outside the database acts on before a later synchronous commit covers it:
    the WAL is flushed in order, so that commit makes this one durable too. Until then a crash of the
    database (not of the process that wrote) may lose it, which must then be as if it never happened
    (the turn's claim: docs/performance.md)."""
    if connection.vendor == "postgresql":
        return rows.Step("SET LOCAL synchronous_commit TO off", [])
    return None


def commit_flushed() -> None:
    """Undo commit_unflushed_step inside the same transaction: its COMMIT waits for the disk again."""
    if connection.vendor == "postgresql":
        rows.batch([rows.Step("SET LOCAL synchronous_commit TO on", [])])


# --- keys ------------------------------------------------------------------------------------

@functools.cache
def _caller_for_key_hash_sql() -> str:
    c, k = rows.table(Caller), rows.table(ApiKey)
    return (f"SELECT k.id, {c.select_list(c.attnames, 'c')} FROM {k.name} k JOIN {c.name} c "
            f"ON c.id = k.{k.col('caller')} WHERE k.{k.col('key_hash')} = %s AND k.{k.col('active')} = %s")


def caller_for_key_hash(key_hash: str) -> tuple[int, Caller] | None:
    """The active admin-made key with this hash: (its id, its caller); None when there is none."""
    row = rows.fetchone(_caller_for_key_hash_sql(), [key_hash, True])
    if row is None:
        return None
    c = rows.table(Caller)
    return row[0], c.from_row(c.attnames, row[1:])


# --- receipts --------------------------------------------------------------------------------

@functools.cache
def _receipt_exists_sql() -> str:
    t = rows.table(Receipt)
    return f"SELECT 1 FROM {t.name} WHERE {t.col('conversation')} = %s AND {t.col('client_message_id')} = %s"


def receipt_exists(conversation_pk: int, client_message_id: str) -> bool:
    """Whether the conversation already holds a receipt for this client_message_id."""
    return rows.fetchone(_receipt_exists_sql(), [conversation_pk, client_message_id]) is not None


@functools.cache
def _receipt_running_sql() -> str:
    r, t = rows.table(Receipt), rows.table(Turn)
    return (f"UPDATE {r.name} SET {r.col('state')} = %s, {r.col('started_at')} = %s, {r.col('updated_at')} = %s "
            f"WHERE id = (SELECT {t.col('receipt')} FROM {t.name} WHERE id = %s AND {t.col('state')} = %s "
            f"AND {t.col('started_at')} = %s)")


def receipt_running_step(turn_pk: int, started_at) -> rows.Step:
    """The receipt of a turn claimed at `started_at` marked running, as a step of the claim's own batch
    (the receipt's id is not known before the claim reads the turn: one round trip fewer than writing it
    after). A turn not running, or started at another time (another worker's claim), changes nothing.
    Its result is the row count."""
    at = Turn._meta.get_field("started_at").get_db_prep_value(started_at, connection)  # both DateTimeFields
    return rows.Step(_receipt_running_sql(), [ReceiptState.RUNNING, at, at, turn_pk, TurnState.RUNNING, at],
                     rows.ROWCOUNT)


# --- turns -----------------------------------------------------------------------------------

@functools.cache
def _turn_state_sql() -> str:
    t = rows.table(Turn)
    return f"SELECT {t.col('state')} FROM {t.name} WHERE id = %s"


def turn_state(turn_pk: int) -> str | None:
    """The turn's state; None when there is no such turn."""
    return rows.batch([turn_state_step(turn_pk)])[0]


def _first_or_none(cur):
    row = cur.fetchone()
    return row[0] if row else None


def turn_state_step(turn_pk: int) -> rows.Step:
    """turn_state as a step of a batch: its result is the state, or None."""
    return rows.Step(_turn_state_sql(), [turn_pk], _first_or_none)


@functools.cache
def _turn_lock_sql() -> str:
    return f"SELECT id FROM {rows.table(Turn).name} WHERE id = %s FOR NO KEY UPDATE"


def turn_lock(turn_pk: int) -> None:
    """Hold the turn's row (FOR NO KEY UPDATE, see channels_app.events) until the transaction ends.
    SQLite's transactions here begin IMMEDIATE: the write lock is already held."""
    rows.batch([turn_lock_step(turn_pk)])


def _pending_steering_sql(turn_column: str) -> str:
    s = rows.table(Steering)
    return f"EXISTS (SELECT 1 FROM {s.name} WHERE {s.col('state')} = %s AND {s.col('turn')} = {turn_column})"


@functools.cache
def _turn_stop_check_sql() -> str:
    t = rows.table(Turn)
    return (f"SELECT {t.col('cancel_requested')}, {t.col('state')}, {_pending_steering_sql('t.id')} "
            f"FROM {t.name} t WHERE t.id = %s")


def turn_stop_check(turn_pk: int) -> tuple[bool, str, bool] | None:
    """The runner's look between engine items: (stop asked, state, steering waits); None when gone."""
    row = rows.fetchone(_turn_stop_check_sql(), [SteeringState.PENDING, turn_pk])
    return None if row is None else (bool(row[0]), row[1], bool(row[2]))


@functools.cache
def _steering_pending_sql() -> str:
    s = rows.table(Steering)
    return f"SELECT 1 FROM {s.name} WHERE {s.col('turn')} = %s AND {s.col('state')} = %s LIMIT 1"


def steering_pending(turn_pk: int) -> bool:
    """Whether a steering waits for this turn."""
    return rows.batch([steering_pending_step(turn_pk)])[0]


def _exists(cur) -> bool:
    return cur.fetchone() is not None


def steering_pending_step(turn_pk: int) -> rows.Step:
    """steering_pending as a step of a batch: its result is True or False."""
    return rows.Step(_steering_pending_sql(), [turn_pk, SteeringState.PENDING], _exists)


def turn_lock_step(turn_pk: int) -> rows.Step | None:
    """turn_lock as a step of a batch; None on SQLite."""
    if connection.vendor == "postgresql":
        return rows.Step(_turn_lock_sql(), [turn_pk])
    return None


_TURN_COLUMNS = ["id", "turn_id", "conversation_id", "actor_id", "receipt_id", "state", "model", "profile_id",
                 "allowed_tools", "denied_tools", "disable_memory_recall", "disable_code_context",
                 "disable_memory_write", "input_mode", "include_thinking", "citation_ids", "context",
                 "cancel_requested", "started_at", "created_at"]
_CONVERSATION_COLUMNS = ["id", "channel", "client_id", "external_id", "owner_id", "working_directory"]
_ACTOR_COLUMNS = ["id", "key", "channel", "user_id"]


@functools.cache
def _turn_fetch_parts():
    from plugins_app.agent.models import AgentProfile
    p = rows.table(AgentProfile)
    return ((rows.table(Turn), _TURN_COLUMNS), (rows.table(Conversation), _CONVERSATION_COLUMNS),
            (rows.table(Actor), _ACTOR_COLUMNS), (p, p.attnames))


@functools.cache
def _turn_fetch_sql() -> str:
    (t, _), (c, _), (a, _), (p, _) = parts = _turn_fetch_parts()
    columns = ", ".join(table.select_list(names, alias) for (table, names), alias in zip(parts, "tcap"))
    return (f"SELECT {columns}, {_pending_steering_sql('t.id')} "
            f"FROM {t.name} t JOIN {c.name} c ON c.id = t.{t.col('conversation')} "
            f"JOIN {a.name} a ON a.id = t.{t.col('actor')} "
            f"LEFT JOIN {p.name} p ON p.id = t.{t.col('profile')} WHERE t.id = %s")


def turn_fetch(turn_pk: int) -> Turn:
    """The turn with its conversation, actor and profile (None when removed), and whether steering
    waits (`turn.pending_steering`): one statement. Turn.DoesNotExist when there is no such turn."""
    turn = rows.batch([turn_fetch_step(turn_pk)])[0]
    if turn is None:
        raise Turn.DoesNotExist(turn_pk)
    return turn


def turn_fetch_step(turn_pk: int) -> rows.Step:
    """turn_fetch as a step of a batch: its result is the turn, or None when there is no such turn."""
    return rows.Step(_turn_fetch_sql(), [SteeringState.PENDING, turn_pk], _turn_from_cursor)


def _turn_from_cursor(cur) -> Turn | None:
    row = cur.fetchone()
    if row is None:
        return None
    objects, i = [], 0
    for table, names in _turn_fetch_parts():
        values = row[i:i + len(names)]
        objects.append(table.from_row(names, values) if values[0] is not None else None)  # no profile: None
        i += len(names)
    turn, turn.conversation, turn.actor, turn.profile = objects[0], objects[1], objects[2], objects[3]
    turn.pending_steering = bool(row[i])
    return turn


# --- messages --------------------------------------------------------------------------------

def _history_sql(conversation: str, limit: str) -> str:
    """The newest visible user/assistant messages of turns before one, newest first: the conversation and
    the limit as SQL expressions (placeholders, or subqueries naming the turn).

    Through the partial index `message_conv_visible`, whose condition is written here as its own SQL (a
    prepared statement's generic plan cannot prove it from a bound value). Through all the messages, a
    compacted conversation whose visible ones were fewer than the limit walked every hidden message, on
    each of the turns after a compaction."""
    m = rows.table(Message)
    return (f"SELECT {m.col('role')}, {m.col('content')} FROM {m.name} WHERE {m.col('conversation')} = {conversation} "
            f"AND NOT {m.col('hidden')} AND {m.col('role')} IN (%s, %s) AND {m.col('turn')} < %s "
            f"ORDER BY id DESC LIMIT {limit}")


def _summary_sql(conversation: str) -> str:
    """Through the partial index `message_conv_system` (before it, the read walked every message of a
    conversation never compacted, every turn). The index's condition goes in as its own literal SQL: a
    prepared statement's generic plan on PostgreSQL cannot prove the index from a bound role."""
    m = rows.table(Message)
    return (f"SELECT {m.col('content')} FROM {m.name} WHERE {m.col('conversation')} = {conversation} "
            f"AND {m.col('role')} = '{Message.Role.SYSTEM.value}' AND {m.col('hidden')} = %s "
            f"ORDER BY id DESC LIMIT 1")


def _conversation_of_turn() -> str:
    t = rows.table(Turn)
    return f"(SELECT {t.col('conversation')} FROM {t.name} WHERE id = %s)"


@functools.cache
def _history_tail_sql() -> str:
    return _history_sql("%s", "%s")


def history_tail(conversation_pk: int, before_turn_pk: int, limit: int) -> list[tuple[str, str]]:
    """The newest `limit` visible user/assistant messages of turns before this one, oldest first:
    (role, content)."""
    return rows.batch([history_tail_step(conversation_pk, before_turn_pk, limit)])[0]


def _oldest_first(cur) -> list[tuple[str, str]]:
    past = cur.fetchall()
    past.reverse()
    return [(role, content) for role, content in past]


def history_tail_step(conversation_pk: int, before_turn_pk: int, limit: int) -> rows.Step:
    """history_tail as a step of a batch."""
    return rows.Step(_history_tail_sql(), [conversation_pk, Message.Role.USER, Message.Role.ASSISTANT,
                                           before_turn_pk, limit], _oldest_first)


@functools.cache
def _turn_history_sql() -> str:
    from plugins_app.agent.models import AgentProfile
    t, p = rows.table(Turn), rows.table(AgentProfile)
    return _history_sql(_conversation_of_turn(),
                        f"COALESCE((SELECT COALESCE(p.{p.col('history_turns')}, %s) FROM {t.name} t "
                        f"LEFT JOIN {p.name} p ON p.id = t.{t.col('profile')} WHERE t.id = %s), 0)")


def turn_history_step(turn_pk: int, default_limit: int) -> rows.Step:
    """history_tail for a turn named by its id alone: its conversation's, as many as its profile's
    history_turns (`default_limit` when it has no profile). For a batch sent before the turn is read."""
    return rows.Step(_turn_history_sql(), [turn_pk, Message.Role.USER, Message.Role.ASSISTANT, turn_pk,
                                           default_limit, turn_pk], _oldest_first)


@functools.cache
def _turn_summary_sql() -> str:
    return _summary_sql(_conversation_of_turn())


def turn_summary_step(turn_pk: int) -> rows.Step:
    """summary_latest for the conversation of a turn named by its id alone."""
    return rows.Step(_turn_summary_sql(), [turn_pk, False], _first_or_none)


@functools.cache
def _summary_latest_sql() -> str:
    return _summary_sql("%s")


def summary_latest(conversation_pk: int) -> str | None:
    """The newest visible system message (the summary a compaction left); None when there is none."""
    return rows.batch([summary_latest_step(conversation_pk)])[0]


def summary_latest_step(conversation_pk: int) -> rows.Step:
    """summary_latest as a step of a batch."""
    return rows.Step(_summary_latest_sql(), [conversation_pk, False], _first_or_none)


@functools.cache
def _harness_open_exists_sql() -> str:
    from channels_app.models import HarnessItem
    h = rows.table(HarnessItem)
    return (f"SELECT 1 FROM {h.name} WHERE {h.col('conversation')} = %s AND {h.col('state')} = %s "
            f"AND {h.col('check_spec')} <> %s LIMIT 1")


def harness_open_exists(conversation_pk: int) -> bool:
    """Whether the conversation has an open harness item with a check (what the end of a turn verifies)."""
    return rows.run_step(harness_open_step(conversation_pk))


def harness_open_step(conversation_pk: int) -> rows.Step:
    """harness_open_exists as a step of a batch: its result is True or False."""
    from channels_app.models import HarnessState
    return rows.Step(_harness_open_exists_sql(), [conversation_pk, HarnessState.OPEN, ""], _exists)


# --- events ----------------------------------------------------------------------------------

@functools.cache
def _turn_events_after_sql() -> str:
    e = rows.table(Event)
    return (f"SELECT id, {e.col('type')}, {e.col('data')} FROM {e.name} WHERE {e.col('turn')} = %s AND id > %s "
            f"ORDER BY id")


def turn_events_after(turn_pk: int, cursor: int) -> list[tuple[int, str, dict]]:
    """The turn's events after `cursor`, in cursor order: (id, type, data)."""
    return [(pk, etype, json.loads(data)) for pk, etype, data in rows.fetchall(_turn_events_after_sql(),
                                                                                 [turn_pk, cursor])]


@functools.cache
def _event_id_before_sql() -> str:
    e = rows.table(Event)
    return f"SELECT MAX(id) FROM {e.name} WHERE {e.col('turn')} = %s AND id < %s"


def event_id_before(turn_pk: int, first_id: int) -> int:
    """The turn's newest event id below `first_id`; 0 when there is none."""
    row = rows.fetchone(_event_id_before_sql(), [turn_pk, first_id])
    return (row[0] if row else None) or 0


@functools.cache
def _turn_event_latest_sql() -> str:
    e = rows.table(Event)
    return f"SELECT MAX(id) FROM {e.name} WHERE {e.col('turn')} = %s"


def turn_event_latest_step(turn_pk: int) -> rows.Step:
    """The turn's newest event id (0 when it has none), as a step of a batch. Read under the log's
    lock, before an append's inserts, it is the id of the turn's event before the append's first:
    every appender holds that lock until it commits."""
    return rows.Step(_turn_event_latest_sql(), [turn_pk], _first_or_zero)


@functools.cache
def _conversation_event_head_sql() -> str:
    from channels_app.models import Conversation, Turn
    e, c, t = rows.table(Event), rows.table(Conversation), rows.table(Turn)
    return (f"SELECT (SELECT MAX(id) FROM {e.name} WHERE {e.col('conversation')} = {c.name}.id), "
            f"{c.col('external_id')}, {c.col('client_id')}, {c.col('channel')}, {c.col('owner')}, "
            f"(SELECT {t.col('turn_id')} FROM {t.name} WHERE id = %s) FROM {c.name} WHERE {c.name}.id = %s")


def conversation_event_head_step(conversation_pk: int, turn_pk: int | None) -> rows.Step:
    """As a step of an append's batch, read under the log's lock before its inserts: the conversation's
    newest event id (0 when none: the id before the append's first, as turn_event_latest_step is for a
    turn) and what a stream's rows carry of the conversation and the turn (notify.ROW_FIELDS)."""
    return rows.Step(_conversation_event_head_sql(), [turn_pk, conversation_pk], _head_row)


def _head_row(cur):
    row = cur.fetchone()
    return None if row is None else ((row[0] or 0), *row[1:])


def _first_or_zero(cur) -> int:
    row = cur.fetchone()
    return (row[0] if row else None) or 0
