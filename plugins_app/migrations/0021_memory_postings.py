from django.db import migrations

# PostgreSQL: recall's postings, kept the way SQLite's FTS5 keeps its owner-tagged terms (0011), so recall's
# counts and every arm of its statement (plugins_app/agent/memory/backends.py, FtsBackend._candidates_pg) are
# index-only scans of the user's own terms, and only its candidates' rows are read. Over the GIN index of
# 0010 each match cost a heap visit for its owner, expiry and words (about 1,000 for a six-word message at 100k
# facts). One row per distinct lexeme of a fact's to_tsvector('simple', text), the terms 0010's text_tsv held,
# so a word matches exactly the facts `text_tsv @@ 'word'` did and a prefix (a range of `term`, byte order as
# tsquery's prefix match) those of 'prefix':*. `actor` is the actor key's id in plugins_app_memoryactor, given
# on its first fact: one id a key, so no other user's postings are ever among a user's (a hash of the key
# could collide, and API callers choose their users' names). Triggers keep both in step with every write
# (services, the admin, bulk deletes, raw SQL); text_tsv and its GIN index are then used by nothing. An actor's
# id is kept when its facts are gone (a row a user). SQLite: nothing.
POSTGRES = [
    # the key is added after the backfill: built from sorted rows, its pages are full (64% when filled row by row)
    "CREATE TABLE plugins_app_memoryactor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
    "key text NOT NULL UNIQUE)",
    'CREATE TABLE plugins_app_memoryposting (actor bigint NOT NULL, fact_id bigint NOT NULL, '
    'term text COLLATE "C" NOT NULL)',
    # a key's id, given on its first fact: looked up, else added; a transaction adding the same new key at once
    # waits for the other's commit (the unique key), adds nothing, and then reads its id (READ COMMITTED:
    # each statement sees what committed before it)
    """CREATE FUNCTION plugins_app_memoryactor_id(actor_key text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    found bigint;
BEGIN
    SELECT id INTO found FROM plugins_app_memoryactor WHERE key = actor_key;
    IF found IS NULL THEN
        INSERT INTO plugins_app_memoryactor (key) VALUES (actor_key) ON CONFLICT (key) DO NOTHING
            RETURNING id INTO found;
    END IF;
    IF found IS NULL THEN
        SELECT id INTO found FROM plugins_app_memoryactor WHERE key = actor_key;
    END IF;
    RETURN found;
END $$""",
    """CREATE FUNCTION plugins_app_memoryfact_postings() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE plugins_app_memoryposting;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM plugins_app_memoryposting
            WHERE actor = (SELECT id FROM plugins_app_memoryactor WHERE key = OLD.actor_key)
            AND term = ANY (tsvector_to_array(to_tsvector('simple', OLD.text))) AND fact_id = OLD.id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO plugins_app_memoryposting (actor, fact_id, term)
            SELECT plugins_app_memoryactor_id(NEW.actor_key), NEW.id, t
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
    "INSERT INTO plugins_app_memoryactor (key) SELECT DISTINCT actor_key FROM plugins_app_memoryfact ORDER BY 1",
    "INSERT INTO plugins_app_memoryposting (actor, fact_id, term) SELECT a.id, f.id, t "
    "FROM plugins_app_memoryfact f JOIN plugins_app_memoryactor a ON a.key = f.actor_key, "
    "unnest(tsvector_to_array(f.text_tsv)) t",
    "ALTER TABLE plugins_app_memoryposting ADD CONSTRAINT plugins_app_memoryposting_pkey "
    "PRIMARY KEY (actor, term, fact_id)",
    "ANALYZE plugins_app_memoryposting",
    # last: these lock the facts table against reads too, until the commit that follows at once (the trigger
    # held only its writes)
    "DROP INDEX IF EXISTS plugins_app_memoryfact_text_tsv",
    "ALTER TABLE plugins_app_memoryfact DROP COLUMN IF EXISTS text_tsv",
]
POSTGRES_BACK = [
    "ALTER TABLE plugins_app_memoryfact ADD COLUMN text_tsv tsvector "
    "GENERATED ALWAYS AS (to_tsvector('simple', text)) STORED",
    "CREATE INDEX plugins_app_memoryfact_text_tsv ON plugins_app_memoryfact USING GIN (text_tsv) "
    "WITH (fastupdate = off)",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_ins ON plugins_app_memoryfact",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_upd ON plugins_app_memoryfact",
    "DROP TRIGGER IF EXISTS plugins_app_memoryfact_postings_trunc ON plugins_app_memoryfact",
    "DROP FUNCTION IF EXISTS plugins_app_memoryfact_postings()",
    "DROP TABLE IF EXISTS plugins_app_memoryposting",
    "DROP FUNCTION IF EXISTS plugins_app_memoryactor_id(text)",
    "DROP TABLE IF EXISTS plugins_app_memoryactor",
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
