from django.db import migrations

# PostgreSQL: recall's GIN index on the facts' tsvector (0010) takes each new fact into its pending list, which
# every search then reads whole, until autovacuum or 4 MB of it moves it into the index proper. Measured on 11k
# facts saved one statement at a time (EXPLAIN ANALYZE): a one-word lookup read 321 buffers and took 1.4 ms
# against 0.007 ms once the list was merged; recall's statement 9.2 against 2.5 ms. Facts are written after a
# turn, off its path: each insert now goes into the index itself, and recall's cost does not depend on when
# autovacuum last ran. SQLite: nothing.
POSTGRES = [
    "ALTER INDEX plugins_app_memoryfact_text_tsv SET (fastupdate = off)",
    "SELECT gin_clean_pending_list('plugins_app_memoryfact_text_tsv'::regclass)",
]
POSTGRES_BACK = ["ALTER INDEX plugins_app_memoryfact_text_tsv RESET (fastupdate)"]


def _run(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            for sql in statements:
                schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0011_memory_fts_owner_terms'),
    ]

    operations = [
        migrations.RunPython(_run(POSTGRES), _run(POSTGRES_BACK)),
    ]
