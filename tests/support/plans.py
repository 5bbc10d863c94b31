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
