from django.db import migrations

# PostgreSQL: sqlite_fts's search as one function, plugins_app_memory_search (plugins_app/agent/memory/backends.py,
# FtsBackend._search_pg, calls it). 0021's recall ran two statements, the counts of the words (which decide the
# prefixes searched) and the candidates, each with an index scan of the postings for every word and prefix written
# into its text: a new text for every message, which the server planned at every recall (0.4-0.6 ms of about 1.4,
# and Django binds parameters on the client, so nothing is prepared). Here the words, their prefixes and the
# prefixes' ranges are arrays, the text is always the same, and PL/pgSQL keeps the statement's plan for the
# session. Its plan is the generic one (plan_cache_mode; left to choose, the server kept planning it afresh, its
# generic plan's estimates being no better than the custom ones': the words' lexemes are only known as it runs),
# and JIT is off for it (those estimates put its cost past jit_above_cost: 23 ms compiling a 2 ms statement).
#
# Arguments: the actor key; the words (each searched); each word's prefix (NULL: none) and that prefix's arm's bit
# (the same bit for one prefix); the cap of a word's count and the candidates (a prefix is searched when a word of
# it is held fewer than `candidates` times, its count capped at `cap`); whether each match's row is checked before
# the limit; now; how many rows to read; how many of the user's pinned and of their core facts to return first
# (0: none). Rows: the user's own facts first, as recall's _OWN_FACTS gives them (kind 'p', 'c', 'e'), then the
# search's candidates (kind 's'): (id, text, tier, the arms it matched as bits: bit i the i-th word,
# the prefixes' bits as given; whether it is the user's and live), best first: by the weights of the arms each
# matches, rounded, then newest. The weights: each word its IDF among the facts, ln(1 + (N - n + 0.5) / (n + 0.5)),
# n the user's facts holding it (expired ones too), N the facts table's row estimate; a prefix half its last word's.
SEARCH = r"""
CREATE OR REPLACE FUNCTION plugins_app_memory_search(text, text[], text[], bigint[], bigint, bigint, boolean, timestamptz,
                                          bigint, bigint)
RETURNS TABLE (found_kind text, found_id bigint, found_text text, found_tier text, found_bits bigint,
               found_live boolean, found_updated timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
BEGIN
IF $10 > 0 THEN
-- the user's own facts first (recall.py's _OWN_FACTS): pinned ('p') and other core ('c') facts, live, newest first,
-- up to $10 each, and whether the user holds any fact ('e'), on the partial indexes of migration 0008; the last
-- as the newest of theirs by memory_fact_actor_idx (EXISTS got a seq scan of the facts table in the kept generic
-- plan when the statistics see few users, one holding most facts)
RETURN QUERY
SELECT 'p'::text, o.id, o.text::text, o.tier::text, NULL::bigint, NULL::boolean, o.updated_at
FROM (SELECT f.id, f.text, f.tier, f.updated_at FROM plugins_app_memoryfact f
      WHERE f.actor_key = $1 AND f.pinned AND (f.expires_at IS NULL OR f.expires_at > $8)
      ORDER BY f.updated_at DESC LIMIT $10) o
UNION ALL
SELECT 'c'::text, o.id, o.text::text, o.tier::text, NULL::bigint, NULL::boolean, o.updated_at
FROM (SELECT f.id, f.text, f.tier, f.updated_at FROM plugins_app_memoryfact f
      WHERE f.actor_key = $1 AND NOT f.pinned AND f.tier = 'core' AND (f.expires_at IS NULL OR f.expires_at > $8)
      ORDER BY f.updated_at DESC LIMIT $10) o
UNION ALL
SELECT 'e'::text, NULL::bigint, NULL::text, NULL::text, NULL::bigint, NULL::boolean, NULL::timestamptz
WHERE (SELECT 1 FROM plugins_app_memoryfact f WHERE f.actor_key = $1 ORDER BY f.updated_at DESC LIMIT 1) IS NOT NULL;
END IF;
-- then the search's candidates ('s')
RETURN QUERY
WITH a AS MATERIALIZED (SELECT id FROM plugins_app_memoryactor WHERE key = $1),
-- each word (ord: its arm's bit), the lexeme PostgreSQL's parser makes of it (what 0021's postings hold), its
-- tsquery (a phrase, checked on the fact's text, when the parser cuts the word into several lexemes)
q AS MATERIALIZED (
    SELECT i.ord - 1 AS ord, i.word, i.prefix, i.pbit,
           (tsvector_to_array(to_tsvector('simple', i.word)))[1] AS lexeme,
           to_tsquery('simple', '''' || i.word || '''') AS wq
    FROM unnest($2::text[], $3::text[], $4::bigint[]) WITH ORDINALITY AS i (word, prefix, pbit, ord)),
wm AS MATERIALIZED (
    SELECT q.ord, p.fact_id FROM q CROSS JOIN LATERAL (
        SELECT p.fact_id FROM plugins_app_memoryposting p
        WHERE p.actor = (SELECT id FROM a) AND p.term = q.lexeme
          AND (numnode(q.wq) = 1 OR EXISTS (SELECT 1 FROM plugins_app_memoryfact f
                                            WHERE f.id = p.fact_id AND to_tsvector('simple', f.text) @@ q.wq))) p),
t AS (SELECT greatest(reltuples, 0)::float8 AS total FROM pg_class WHERE oid = 'plugins_app_memoryfact'::regclass),
-- each word's count among the user's facts, and its weight
n AS MATERIALIZED (
    SELECT c.ord, c.prefix, c.pbit, c.n, 1.0 * ln(1 + (greatest(t.total, c.n) - c.n + 0.5) / (c.n + 0.5)) AS w
    FROM (SELECT q.ord, q.prefix, q.pbit, coalesce(c.n, 0) AS n
          FROM q LEFT JOIN (SELECT wm.ord, count(*) AS n FROM wm GROUP BY wm.ord) c ON c.ord = q.ord) c
    CROSS JOIN t),
-- the prefixes searched: a word of it held fewer than `candidates` times (its count capped), weighed half its last
-- word's weight, in the order of its first such word (o, after the words); a range of the terms in byte order (as
-- tsquery's prefix match compares: the prefix, up to the prefix with its last character's successor)
pa AS MATERIALIZED (
    SELECT x.pbit, x.lo, x.pq,
           left(x.lo, -1) || chr(CASE ascii(right(x.lo, 1)) WHEN 55295 THEN 57344
                                 ELSE ascii(right(x.lo, 1)) + 1 END) AS hi,
           0.5 * ln(1 + (greatest(t.total, x.wn) - x.wn + 0.5) / (x.wn + 0.5)) AS w,
           64 + row_number() OVER (ORDER BY x.first) AS o
    FROM (SELECT n.pbit, (tsvector_to_array(to_tsvector('simple', min(n.prefix))))[1] AS lo,
                 to_tsquery('simple', '''' || min(n.prefix) || ''':*') AS pq,
                 min(n.ord) FILTER (WHERE least(n.n, $5) < $6) AS first,
                 (array_agg(n.n ORDER BY n.ord DESC))[1] AS wn
          FROM n WHERE n.pbit <> 0 GROUP BY n.pbit) x
    CROSS JOIN t WHERE x.first IS NOT NULL),
-- the arms each match matched (a fact holding several terms of a prefix matches its arm once)
m AS (
    SELECT s.fact_id AS id, bit_or(s.b) AS bits
    FROM (SELECT wm.fact_id, 1::bigint << wm.ord::int AS b FROM wm
          UNION ALL
          SELECT p.fact_id, pa.pbit FROM pa CROSS JOIN LATERAL (
              SELECT p.fact_id FROM plugins_app_memoryposting p
              WHERE p.actor = (SELECT id FROM a) AND p.term >= pa.lo COLLATE "C" AND p.term < pa.hi COLLATE "C"
                AND (numnode(pa.pq) = 1 OR EXISTS (
                    SELECT 1 FROM plugins_app_memoryfact f
                    WHERE f.id = p.fact_id AND to_tsvector('simple', f.text) @@ pa.pq))) p) s
    GROUP BY s.fact_id),
-- a match's score is the weights of its arms summed in the arms' order (the words, then the prefixes) and rounded:
-- the same for every match of the same arms, so summed once for each set of arms, and ranked (r) for the sort
sc AS (
    SELECT d.bits, dense_rank() OVER (ORDER BY round(sum(ar.w ORDER BY ar.o)::numeric, 9) DESC) AS r
    FROM (SELECT DISTINCT m.bits FROM m) d
    JOIN (SELECT 1::bigint << n.ord::int AS bit, n.w, n.ord AS o FROM n
          UNION ALL SELECT pa.pbit, pa.w, pa.o FROM pa) ar ON d.bits & ar.bit <> 0
    GROUP BY d.bits),
k AS (
    SELECT m.id, m.bits, sc.r FROM m JOIN sc ON sc.bits = m.bits
    WHERE NOT $7 OR EXISTS (SELECT 1 FROM plugins_app_memoryfact f WHERE f.id = m.id AND f.actor_key = $1
                                                                    AND (f.expires_at IS NULL OR f.expires_at > $8))
    ORDER BY sc.r, m.id DESC LIMIT $9)
SELECT 's'::text, f.id, f.text::text, f.tier::text, k.bits,
       f.actor_key = $1 AND (f.expires_at IS NULL OR f.expires_at > $8), NULL::timestamptz
FROM k JOIN plugins_app_memoryfact f ON f.id = k.id ORDER BY k.r, k.id DESC;
END $$
"""
SEARCH_BACK = "DROP FUNCTION IF EXISTS plugins_app_memory_search(text, text[], text[], bigint[], bigint, bigint, " \
    "boolean, timestamptz, bigint, bigint)"


def _run(statement):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(statement)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0022_memory_fact_expiry_idx'),
    ]

    operations = [
        migrations.RunPython(_run(SEARCH), _run(SEARCH_BACK)),
    ]
