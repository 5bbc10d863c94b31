"""Migration operations the apps share."""
from __future__ import annotations

from django.db import migrations


def index_added_concurrently(app_label: str, model_name: str, index) -> migrations.SeparateDatabaseAndState:
    """AddIndex for a large table: on PostgreSQL built with CREATE INDEX CONCURRENTLY, so the writes that go
    on meanwhile are not blocked (the migration must say `atomic = False`: it runs outside a transaction);
    elsewhere as any index. A build that failed or was cancelled leaves an invalid index of that name: it is
    dropped and built again."""

    def add(apps, schema_editor):
        model = apps.get_model(app_label, model_name)
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cur:
                cur.execute("SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                            "WHERE c.relname = %s", [index.name])
                row = cur.fetchone()
            if row and row[0]:
                schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
            sql = str(index.create_sql(model, schema_editor, concurrently=True))
            schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY",
                                              "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
        else:
            schema_editor.add_index(model, index)

    def remove(apps, schema_editor):
        model = apps.get_model(app_label, model_name)
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
        else:
            schema_editor.remove_index(model, index)

    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AddIndex(model_name=model_name.lower(), index=index)],
        database_operations=[migrations.RunPython(add, remove)],
    )
