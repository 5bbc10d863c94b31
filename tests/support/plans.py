"""SQLite's plans of the statements a piece of code runs: which of them read a whole table."""
from __future__ import annotations

from django.db import connection


def statements_on(table: str, fn) -> list[tuple[str, tuple]]:
    """(sql, params) of each SELECT, UPDATE or DELETE on `table` that `fn()` runs through Django's cursors."""
    seen = []

    def record(execute, sql, params, many, context):
        seen.append((sql, tuple(params or ())))
        return execute(sql, params, many, context)
    with connection.execute_wrapper(record):
        fn()
    return [(sql, params) for sql, params in seen if f'"{table}"' in sql.split(" WHERE ")[0]
            and sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE"))]


def table_scans(table: str, statements) -> list[tuple[str, list[str]]]:
    """The statements whose plan reads `table` row by row (SCAN without an index), with their plans.
    SQLite only: its plan is the one made before any parameter is bound, as when the code runs."""
    out = []
    with connection.cursor() as cur:
        for sql, params in statements:
            cur.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[3] for row in cur.fetchall()]
            if any(p.startswith(f"SCAN {table}") and " INDEX " not in p for p in plan):
                out.append((sql, plan))
    return out


def vm_steps(fn, *, every: int = 100) -> int:
    """How much work SQLite did for `fn()`: its virtual machine's instructions, in units of `every`
    (the progress handler's count). The same for the same data whatever the machine's speed, so a
    test can tell a read that walks the whole table from one that stops early, where the plan of
    both is a SCAN (a walk in id order with a LIMIT). SQLite only."""
    connection.ensure_connection()
    ticks = [0]

    def tick():
        ticks[0] += 1
        return 0
    raw = connection.connection
    raw.set_progress_handler(tick, every)
    try:
        fn()
    finally:
        raw.set_progress_handler(None, every)
    return ticks[0]
