"""The tests' flush keeps the content types and permissions while they are as post_migrate made them.

pytest-django ends every transactional test with Django's `flush`: it empties every table, then sends
post_migrate, whose two receivers (contenttypes' and auth's) make every content type and permission
again, some 300 rows, one model at a time. That was 8% of the embedded pass's test-process CPU (py-spy
over the three workers), about 0.1 s a transactional test, whatever the test did.

Here a flush first reads those two tables. When they hold exactly the rows the last post_migrate left
(every column of every row), it empties every other table and sends no post_migrate: the end state is
the one Django's flush would give, the same rows (on PostgreSQL Django's would give them new ids, its
sequences not being reset; no test may rely on an id either way). When anything differs (a test added,
changed or deleted a content type or a permission) or nothing was recorded yet, the flush is Django's
own, and the rows its post_migrate makes are recorded. A flush that resets sequences or cascades
(`reset_sequences`, `available_apps`) is always Django's.

Loaded by tests/conftest.py, in the test process only: `manage.py flush` and the daemons the tests start
are Django's own. It holds only while post_migrate's receivers are contenttypes' and auth's: with any
other (an app added to INSTALLED_APPS), every flush is Django's.
"""
from __future__ import annotations

import weakref

from django.core.management import call_command, sql as management_sql
from django.core.management.commands import flush as flush_command
from django.db import connections

KEPT = ("django_content_type", "auth_permission")
#: (alias, database name) -> the rows of KEPT the last post_migrate left
_made: dict[tuple, tuple] = {}
#: the flushes in progress that kept the rows, by (alias, database name): their post_migrate is not sent
_kept: set[tuple] = set()


def _key(connection) -> tuple:
    return connection.alias, connection.settings_dict["NAME"]


def _rows(connection) -> tuple:
    out = []
    with connection.cursor() as cur:
        for table in KEPT:
            cur.execute(f"SELECT * FROM {connection.ops.quote_name(table)} ORDER BY id")
            out.append(tuple(cur.fetchall()))
    return tuple(out)


#: post_migrate's receivers whose rows are all in KEPT
KNOWN_RECEIVERS = {"django.contrib.auth.management.create_permissions",
                   "django.contrib.contenttypes.management.create_contenttypes"}


def _only_known_receivers() -> bool:
    from django.db.models.signals import post_migrate
    live = [r() if isinstance(r, weakref.ReferenceType) else r for _key_, r, *_ in post_migrate.receivers]
    return {f"{f.__module__}.{f.__qualname__}" for f in live if f is not None} <= KNOWN_RECEIVERS


def _sql_flush(style, connection, reset_sequences=True, allow_cascade=False):
    key = _key(connection)
    _kept.discard(key)
    if (reset_sequences or allow_cascade or key not in _made or not _only_known_receivers()
            or _rows(connection) != _made[key]):
        _made.pop(key, None)
        return management_sql.sql_flush(style, connection, reset_sequences=reset_sequences,
                                        allow_cascade=allow_cascade)
    tables = [t for t in connection.introspection.django_table_names(only_existing=True, include_views=False)
              if t not in KEPT]
    _kept.add(key)
    return connection.ops.sql_flush(style, tables, reset_sequences=False, allow_cascade=False)


def _emit_post_migrate_signal(verbosity, interactive, db, **kwargs):
    connection = connections[db]
    key = _key(connection)
    if key in _kept:
        _kept.discard(key)
        return
    management_sql.emit_post_migrate_signal(verbosity, interactive, db, **kwargs)
    _made[key] = _rows(connection)


def keep_what_post_migrate_makes() -> None:
    flush_command.sql_flush = _sql_flush
    flush_command.emit_post_migrate_signal = _emit_post_migrate_signal


def forget() -> None:
    """The next flush is Django's own (a test that must see it)."""
    _made.clear()
    _kept.clear()


def flush_as_pytest_django_does() -> None:
    """django.test.TransactionTestCase._fixture_teardown's flush, with available_apps unset (for the tests of
    the flush: tests/test_flush_keep.py, tests/test_pg_flush.py)."""
    call_command("flush", verbosity=0, interactive=False, database="default", reset_sequences=False,
                 allow_cascade=False, inhibit_post_migrate=False)
