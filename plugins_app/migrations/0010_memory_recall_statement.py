from django.db import migrations

# Recall's full-text statement (plugins_app/agent/memory/backends.py, FtsBackend.candidates), per vendor.
# SQLite: the statement checks each match's owner and expiry before bm25's LIMIT; this index holds both beside
# the id, so that check reads a narrow index page instead of the fact's whole row (its text, its embedding).
SQLITE = ["CREATE INDEX memory_fact_fts_filter ON plugins_app_memoryfact (id, actor_key, expires_at)"]
SQLITE_DROP = ["DROP INDEX IF EXISTS memory_fact_fts_filter"]
# PostgreSQL: the tsvector stored beside the text (generated, so it follows every write) and GIN-indexed, so that
# ranking a match reads it instead of running to_tsvector on the text again; it replaces 0007's expression index.
POSTGRES = [
    "ALTER TABLE plugins_app_memoryfact ADD COLUMN text_tsv tsvector "
    "GENERATED ALWAYS AS (to_tsvector('simple', text)) STORED",
    "CREATE INDEX plugins_app_memoryfact_text_tsv ON plugins_app_memoryfact USING GIN (text_tsv)",
    "DROP INDEX IF EXISTS plugins_app_memoryfact_tsv",
]
POSTGRES_DROP = [
    "CREATE INDEX IF NOT EXISTS plugins_app_memoryfact_tsv ON plugins_app_memoryfact "
    "USING GIN (to_tsvector('simple', text))",
    "DROP INDEX IF EXISTS plugins_app_memoryfact_text_tsv",
    "ALTER TABLE plugins_app_memoryfact DROP COLUMN IF EXISTS text_tsv",
]


def _run(statements):
    def run(apps, schema_editor):
        for sql in statements.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0009_profile_context_tokens'),
    ]

    operations = [
        migrations.RunPython(_run({"sqlite": SQLITE, "postgresql": POSTGRES}),
                             _run({"sqlite": SQLITE_DROP, "postgresql": POSTGRES_DROP})),
    ]
