"""Database connections around work that runs outside a request (tasks, the API's own threads)."""
from __future__ import annotations

import functools

from django.db import close_old_connections


def call_with_fresh_connections(fn, /, *args, **kwargs):
    """Call `fn` between two close_old_connections(), as Django's request signals would around a view:
    a broken or expired connection is not reused, and one past CONN_MAX_AGE is closed after."""
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


def with_fresh_connections(fn):
    """`fn` always called through call_with_fresh_connections (for tasks). A function, not a partial:
    Celery binds a `bind=True` task's function as a method."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return call_with_fresh_connections(fn, *args, **kwargs)

    return wrapper


def tables_required(*models, unreachable_ok: bool = False) -> None:
    """For a management command an operator may run before the first `migrate`: the tables these models need
    are there, else a one-line CommandError saying to migrate (rather than a "no such table" traceback).
    Each of `models` is a model class or an app label (every model of that app); every command that reads
    the database calls this first (tests/common/test_commands_before_migrate.py runs them on an empty one).
    A database that cannot be reached is a one-line CommandError too, unless `unreachable_ok`: a long-running
    command whose loop waits for the database (runsupervisor, started at boot beside PostgreSQL) goes on."""
    from django.apps import apps
    from django.core.management.base import CommandError
    from django.db import OperationalError, connection
    wanted = []
    for m in models:
        wanted += apps.get_app_config(m).get_models() if isinstance(m, str) else [m]
    try:
        have = set(connection.introspection.table_names())
    except OperationalError as exc:
        if unreachable_ok:
            return
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CommandError(f"cannot reach the database: {first}") from None
    missing = [m._meta.db_table for m in wanted
               if m._meta.managed and not m._meta.proxy and m._meta.db_table not in have]
    if missing:
        raise CommandError(f"the database has no {missing[0]} table yet: run `python manage.py migrate` first")
