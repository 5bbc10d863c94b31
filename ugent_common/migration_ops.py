"""Migration operations the apps share."""
from __future__ import annotations

from django.db import migrations


class AddIndexConcurrently(migrations.AddIndex):
    """AddIndex for a large table: on PostgreSQL built with CREATE INDEX CONCURRENTLY, so the writes that go
    on meanwhile are not blocked (the migration must say `atomic = False`: it runs outside a transaction);
    elsewhere as any index. A build that failed or was cancelled leaves an invalid index of that name: it is
    dropped and built again. (django.contrib.postgres's own operation of this name runs on PostgreSQL only.)"""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor != "postgresql":
            schema_editor.add_index(model, self.index)
            return
        with schema_editor.connection.cursor() as cur:
            cur.execute("SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                        "WHERE c.relname = %s", [self.index.name])
            row = cur.fetchone()
        if row and row[0]:
            schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.index.name}"')
        sql = str(self.index.create_sql(model, schema_editor, concurrently=True))
        schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor != "postgresql":
            schema_editor.remove_index(model, self.index)
            return
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.index.name}"')
