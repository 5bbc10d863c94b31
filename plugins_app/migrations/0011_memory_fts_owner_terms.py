from importlib import import_module

from django.db import migrations

# SQLite's full-text table for recall (plugins_app/agent/memory/backends.py, FtsBackend) becomes contentless,
# and each term it indexes carries its owner's tag (backends.indexed_terms, the SQL function
# ugent_memory_terms): a search walks the user's own postings, and bm25 weighs a word by the user's own facts.
# Before, every match of every user was ranked and then checked against its row's owner, which at 100k facts
# was most of a recall. fts5vocab gives recall the number of the user's facts holding a word (whether its
# prefix is searched). PostgreSQL is unchanged (its tsvector column and GIN index, 0010).
TERMS = "ugent_memory_terms"
SQLITE = [
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_ai",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_ad",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_au",
    "DROP TABLE IF EXISTS plugins_app_memoryfact_fts",
    "CREATE VIRTUAL TABLE plugins_app_memoryfact_fts USING fts5(text, content='', "
    "tokenize='unicode61 remove_diacritics 2')",
    "CREATE VIRTUAL TABLE plugins_app_memoryfact_fts_vocab USING fts5vocab(plugins_app_memoryfact_fts, 'row')",
    f"INSERT INTO plugins_app_memoryfact_fts(rowid, text) SELECT id, {TERMS}(actor_key, text) FROM plugins_app_memoryfact",
    "CREATE TRIGGER plugins_app_memoryfact_ai AFTER INSERT ON plugins_app_memoryfact BEGIN "
    f"INSERT INTO plugins_app_memoryfact_fts(rowid, text) VALUES (new.id, {TERMS}(new.actor_key, new.text)); END",
    # a contentless table deletes by the terms it was given: the same function over the old values gives them
    "CREATE TRIGGER plugins_app_memoryfact_ad AFTER DELETE ON plugins_app_memoryfact BEGIN "
    "INSERT INTO plugins_app_memoryfact_fts(plugins_app_memoryfact_fts, rowid, text) "
    f"VALUES ('delete', old.id, {TERMS}(old.actor_key, old.text)); END",
    "CREATE TRIGGER plugins_app_memoryfact_au AFTER UPDATE OF text, actor_key ON plugins_app_memoryfact BEGIN "
    "INSERT INTO plugins_app_memoryfact_fts(plugins_app_memoryfact_fts, rowid, text) "
    f"VALUES ('delete', old.id, {TERMS}(old.actor_key, old.text)); "
    f"INSERT INTO plugins_app_memoryfact_fts(rowid, text) VALUES (new.id, {TERMS}(new.actor_key, new.text)); END",
]
# back to 0007's table: the text itself, read from the facts (external content), rebuilt from them
SQLITE_BACK = [
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_ai",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_ad",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_au",
    "DROP TABLE IF EXISTS plugins_app_memoryfact_fts_vocab",
    "DROP TABLE IF EXISTS plugins_app_memoryfact_fts",
    *import_module("plugins_app.migrations.0007_memory").SQLITE_FTS,
    "INSERT INTO plugins_app_memoryfact_fts(plugins_app_memoryfact_fts) VALUES ('rebuild')",
]


def _run(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor != "sqlite":
            return
        from plugins_app.agent.memory.backends import sqlite_function_add
        schema_editor.connection.ensure_connection()
        sqlite_function_add(schema_editor.connection.connection)  # whatever opened this connection
        for sql in statements:
            schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0010_memory_recall_statement'),
    ]

    operations = [
        migrations.RunPython(_run(SQLITE), _run(SQLITE_BACK)),
    ]
