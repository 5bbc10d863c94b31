"""Migration operations the apps share.

An index on a large table is built with CREATE INDEX CONCURRENTLY on PostgreSQL, so the writes that go on
meanwhile are not blocked; elsewhere as any index. A migration says, at module level (so that
`squashmigrations` can name its functions):

    def _add(apps, schema_editor):
        index_add_concurrently(apps, schema_editor, "channels_app", "Event", INDEX)

    def _remove(apps, schema_editor):
        index_remove_concurrently(apps, schema_editor, "channels_app", "Event", INDEX)

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction
    operations = [index_added_concurrently("Event", INDEX, _add, _remove)]
"""
from __future__ import annotations

from django.db import migrations


def index_add_concurrently(apps, schema_editor, app_label: str, model_name: str, index) -> None:
    """Build `index`. A build that failed or was cancelled leaves an invalid index of that name: it is
    dropped and built again."""
    model = apps.get_model(app_label, model_name)
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, index)
        return
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE c.relname = %s", [index.name])
        row = cur.fetchone()
    if row and row[0]:
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
    sql = str(index.create_sql(model, schema_editor, concurrently=True))
    schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))


def index_remove_concurrently(apps, schema_editor, app_label: str, model_name: str, index) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.remove_index(apps.get_model(app_label, model_name), index)
        return
    schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')


def index_added_concurrently(model_name: str, index, add, remove) -> migrations.SeparateDatabaseAndState:
    """The operation: AddIndex in the migration state, `add`/`remove` (the migration's own functions, which
    call the two above) in the database."""
    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AddIndex(model_name=model_name.lower(), index=index)],
        database_operations=[migrations.RunPython(add, remove)],
    )
