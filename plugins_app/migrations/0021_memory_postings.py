from django.db import migrations

# PostgreSQL: recall's postings, kept the way SQLite's FTS5 keeps its owner-tagged terms (0011), so recall's
# counts and every arm of its statement (plugins_app/agent/memory/backends.py, FtsBackend._candidates_pg) are
# index-only scans of the user's own terms, and only its 50 candidates' rows are read. Over the GIN index of
# 0010 each match cost a heap visit for its owner, expiry and words (about 1,000 for a six-word message at 100k
# facts). One row per distinct lexeme of a fact's to_tsvector('simple', text), the terms 0010's text_tsv held,
# so a word matches exactly the facts `text_tsv @@ 'word'` did and a prefix (a range of `term`, byte order as
# tsquery's prefix match) those of 'prefix':*. `actor` is a 64-bit hash of the actor key (an owner check on
# the candidates' rows keeps a collision from showing another user's fact). Triggers keep it in step with every
# write (services, the admin, bulk deletes, raw SQL); text_tsv and its GIN index are then used by nothing.
# recall also needs the user's expired facts (kept forever, and excluded before the weights are counted):
# memory_fact_expiry_idx reads them from the few ephemeral facts. SQLite: nothing.
POSTGRES = [
    # the key is added after the backfill: built from sorted rows, its pages are full (64% when filled row by row)
    'CREATE TABLE plugins_app_memoryposting (actor bigint NOT NULL, fact_id bigint NOT NULL, '
    'term text COLLATE "C" NOT NULL)',
    """CREATE FUNCTION plugins_app_memoryfact_postings() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE plugins_app_memoryposting;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM plugins_app_memoryposting WHERE actor = hashtextextended(OLD.actor_key, 0)
            AND term = ANY (tsvector_to_array(to_tsvector('simple', OLD.text))) AND fact_id = OLD.id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO plugins_app_memoryposting (actor, fact_id, term)
            SELECT hashtextextended(NEW.actor_key, 0), NEW.id, t
            FROM unnest(tsvector_to_array(to_tsvector('simple', NEW.text))) t;
    END IF;
    RETURN NULL;
END $$""",
    "CREATE TRIGGER plugins_app_memoryfact_postings_ins AFTER INSERT OR DELETE ON plugins_app_memoryfact "
    "FOR EACH ROW EXECUTE FUNCTION plugins_app_memoryfact_postings()",
    "CREATE TRIGGER plugins_app_memoryfact_postings_upd AFTER UPDATE OF actor_key, text ON plugins_app_memoryfact "
    "FOR EACH ROW WHEN (OLD.text IS DISTINCT FROM NEW.text OR OLD.actor_key IS DISTINCT FROM NEW.actor_key) "
    "EXECUTE FUNCTION plugins_app_memoryfact_postings()",
    "CREATE TRIGGER plugins_app_memoryfact_postings_trunc AFTER TRUNCATE ON plugins_app_memoryfact "
    "FOR EACH STATEMENT EXECUTE FUNCTION plugins_app_memoryfact_postings()",
    "INSERT INTO plugins_app_memoryposting (actor, fact_id, term) SELECT hashtextextended(actor_key, 0), id, t "
    "FROM plugins_app_memoryfact, unnest(tsvector_to_array(text_tsv)) t",
    "ALTER TABLE plugins_app_memoryposting ADD CONSTRAINT plugins_app_memoryposting_pkey "
    "PRIMARY KEY (actor, term, fact_id)",
    "CREATE INDEX memory_fact_expiry_idx ON plugins_app_memoryfact (actor_key, expires_at) INCLUDE (id) "
    "WHERE expires_at IS NOT NULL",
    "DROP INDEX IF EXISTS plugins_app_memoryfact_text_tsv",
    "ALTER TABLE plugins_app_memoryfact DROP COLUMN IF EXISTS text_tsv",
    "ANALYZE plugins_app_memoryposting",
]
POSTGRES_BACK = [
    "ALTER TABLE plugins_app_memoryfact ADD COLUMN text_tsv tsvector "
    "GENERATED ALWAYS AS (to_tsvector('simple', text)) STORED",
    "CREATE INDEX plugins_app_memoryfact_text_tsv ON plugins_app_memoryfact USING GIN (text_tsv) "
    "WITH (fastupdate = off)",
    "DROP INDEX IF EXISTS memory_fact_expiry_idx",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_ins ON plugins_app_memoryfact",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_upd ON plugins_app_memoryfact",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_trunc ON plugins_app_memoryfact",
    "DROP FUNCTION IF EXISTS plugins_app_memoryfact_postings()",
    "DROP TABLE IF EXISTS plugins_app_memoryposting",
]


def _run(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            for sql in statements:
                schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0020_plugin_allow_remote_control'),
    ]

    operations = [
        migrations.RunPython(_run(POSTGRES), _run(POSTGRES_BACK)),
    ]
