"""Memory's test helpers: point ugent.toml's [memory] at a backend for one test."""
from __future__ import annotations

from pathlib import Path

import pytest

BACKENDS = ["sqlite_fts", "lance_embedded"]


class MemoryConfig:
    def __init__(self, path: Path, settings):
        self.path, self.settings = path, settings

    def write(self, text: str) -> None:
        from plugins_app.agent.memory import conf
        from ugent_common import config
        self.path.write_text(text)
        self.settings.UGENT_CONFIG = str(self.path)
        config.reset_caches()
        conf.reset()

    def backend(self, name: str, **extra) -> None:
        lines = [f'backend = "{name}"'] + [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
        self.write("[memory]\n" + "\n".join(lines) + "\n")


@pytest.fixture
def memory_config(tmp_path, settings):
    """Writes <tmp>/ugent.toml and makes it the one in force (re-read at once)."""
    from plugins_app.agent.memory import conf
    from ugent_common import config
    settings.UGENT_CONFIG_RECHECK_SECS = 0
    settings.UGENT_MEMORY_SETTINGS_RECHECK_SECS = 0
    settings.UGENT_MEMORY_LANCE_DIR = tmp_path / "memory.lance"  # each test its own LanceDB dataset
    cfg = MemoryConfig(tmp_path / "ugent.toml", settings)
    cfg.write("[web.auth]\n")  # no [memory] (an empty file is refused, ugent.E001)
    yield cfg
    config.reset_caches()
    conf.reset()


# PostgreSQL's recall as migration 0021 left it (kept as the baseline migration 0023's search function is compared
# with, as gin_fts keeps the GIN statement): the counts of the words as a statement of their own, then one statement
# with an index scan of the postings for each word and prefix (a text of its own for each message, so planned
# at every recall by Django's client-side binding).
PG_ACTOR = "a AS MATERIALIZED (SELECT id FROM plugins_app_memoryactor WHERE key = %s)"  # the user's id: pg_posted's `a`


def pg_posted(match: str, source: str, *, prefix: bool) -> tuple[str, list]:
    """PostgreSQL: (SELECT fact_id of the user's postings matching one arm, its parameters), in a statement
    WITH PG_ACTOR (the user's id, looked up once). The arm's term is
    the lexeme PostgreSQL's own parser makes of `source` (the word, or the prefix), so a fact matches exactly
    when its to_tsvector('simple', text) @@ to_tsquery('simple', match): the term itself, or for a prefix a
    range of terms. A word the parser cuts into several lexemes ("ab²cd", "0e5e": a phrase) is looked for by one of
    them and the phrase checked on the fact's text; one it makes no lexeme of matches nothing, as before.
    The parsing runs on constants, folded when the statement is planned (a fifth of its planning): a word of
    ASCII letters only is its own lexeme, and skips it."""
    if source.isascii() and source.isalpha():
        return ("SELECT fact_id FROM plugins_app_memoryposting p WHERE p.actor = (SELECT id FROM a) "
                f"AND p.term {'^@' if prefix else '='} %s", [source])
    return ("SELECT fact_id FROM plugins_app_memoryposting p WHERE p.actor = (SELECT id FROM a) "
            f"AND p.term {'^@' if prefix else '='} (tsvector_to_array(to_tsvector('simple', %s)))[1] "
            "AND (numnode(to_tsquery('simple', %s)) = 1 OR EXISTS (SELECT 1 FROM plugins_app_memoryfact f "
            "WHERE f.id = p.fact_id AND to_tsvector('simple', f.text) @@ to_tsquery('simple', %s)))",
            [source, match, match])


class CountsThenCandidates:
    """Mixed into an FtsBackend: PostgreSQL's search as two statements, the counts (which words' prefixes are
    searched), then the candidates (_candidates_pg), as it was before PG_SEARCH; recall reads the user's own
    facts in a statement before them."""

    search_with_own_facts = None

    def counts(self, actor_key, words):
        from django.db import connection
        with connection.cursor() as cur:
            held = [pg_posted(f"'{w}'", w, prefix=False) for w in words]
            cur.execute(f"WITH {PG_ACTOR} " + " UNION ALL ".join(
                f"SELECT %s, (SELECT count(*) FROM ({sql} LIMIT %s) held)" for sql, _ in held),
                [actor_key, *(v for w, (_, params) in zip(words, held) for v in (w, *params, self.CANDIDATES))])
            return dict(cur.fetchall()), 0

    def candidates(self, actor_key, arms, limit, *, held, total):
        from django.db import connection
        from django.utils import timezone
        if not arms:
            return []
        with connection.cursor() as cur:
            return self._candidates_pg(cur, actor_key, arms, limit, timezone.now())

    def search(self, *, actor_key, text, limit, conf=None, rows=None):
        from plugins_app.agent.memory.backends import rrf
        words = self.terms(text)
        if not words or limit <= 0:
            return []
        candidates = max(limit, self.CANDIDATES)
        held, total = self.counts(actor_key, words) if any(map(self.prefix_of, words)) else ({}, 0)
        prefixes = list(dict.fromkeys(p for w in words if (p := self.prefix_of(w)) and held.get(w, 0) < candidates))
        arms = self.arms(actor_key, words, prefixes)
        found = self.candidates(actor_key, arms, candidates, held=held, total=total)
        hits = rrf(self.rankings(arms, [(fid, bits) for fid, _, _, bits in found]))[:limit]
        if rows is not None:
            kept = {fid: (text, tier) for fid, text, tier, _ in found}
            rows.update({fid: kept[fid] for fid, _ in hits})
        return hits

    @classmethod
    def _candidates_pg(cls, cur, actor_key, arms, limit, now) -> list[tuple[int, str, str, int]]:
        """PostgreSQL: the user's live facts matching any arm, with which arms each matches, from the postings
        table (migration 0021): each arm an index-only scan of the user's own terms, the word counts counted
        over those same matches, the total the facts table's row estimate (pg_class.reltuples, as SQLite's is
        its whole index's). One statement, no ranking function over the rows: only the best 2 × `limit`
        matches' rows are read, and those past their expiry dropped (ephemeral facts are kept when they
        expire, so reading the user's expired facts first would grow without end). When fewer than `limit`
        of them were live, the statement runs again with each match's row checked before the limit. The
        counts include the user's expired facts (the GIN statement's left them out: docs/memory.md)."""
        word_arm = {word: i for i, (_, word, factor) in enumerate(arms) if factor == 1}  # n{i}: its count
        posted = [pg_posted(match, word if factor == 1 else cls.prefix_of(word), prefix=factor < 1)
                  for match, word, factor in arms]
        walks = " UNION ALL ".join(f"SELECT fact_id, {1 << i} AS b FROM ({sql}) a{i}"
                                   for i, (sql, _) in enumerate(posted))
        counts = ", ".join(f"count(*) FILTER (WHERE bits & {1 << i} <> 0) AS n{i}" for i in word_arm.values())
        # each arm's weight computed once, not for each match (its numeric arithmetic was most of the statement)
        weights = ", ".join(
            f"{factor!r} * ln(1 + (greatest(t.total, c.n{word_arm[word]}) - c.n{word_arm[word]} + 0.5) / "
            f"(c.n{word_arm[word]} + 0.5)) AS w{i}" for i, (_, word, factor) in enumerate(arms))
        score = " + ".join(f"CASE WHEN m.bits & {1 << i} <> 0 THEN w.w{i} ELSE 0 END" for i in range(len(arms)))
        live = "f.actor_key = %s AND (f.expires_at IS NULL OR f.expires_at > %s)"

        def run(checked: bool, read: int):
            cur.execute(
                f"WITH {PG_ACTOR}, "
                f"m AS MATERIALIZED (SELECT s.fact_id AS id, bit_or(s.b) AS bits FROM ({walks}) s GROUP BY s.fact_id), "
                f"c AS (SELECT {counts} FROM m), "
                "t AS (SELECT greatest(reltuples, 0)::float8 AS total FROM pg_class "
                "WHERE oid = 'plugins_app_memoryfact'::regclass), "
                f"w AS MATERIALIZED (SELECT {weights} FROM c, t), "
                f"k AS (SELECT m.id, m.bits, round(({score})::numeric, 9) AS score FROM m, w "
                + (f"WHERE EXISTS (SELECT 1 FROM plugins_app_memoryfact f WHERE f.id = m.id AND {live}) "
                   if checked else "") +
                "ORDER BY score DESC, m.id DESC LIMIT %s) "
                # the owner checked on the kept rows too: a posting of the user's is never another's fact (one id
                # a key), but a stray one must not show it
                f"SELECT f.id, f.text, f.tier, k.bits, {live} FROM k JOIN plugins_app_memoryfact f ON f.id = k.id "
                "ORDER BY k.score DESC, k.id DESC",
                [actor_key, *(v for _, params in posted for v in params),
                 *((actor_key, now) if checked else ()), read, actor_key, now])
            return cur.fetchall()

        found = run(False, 2 * limit)
        kept = [row[:4] for row in found if row[4]]
        if len(kept) >= limit or len(found) < 2 * limit:  # the best `limit` live ones, or every match read
            return kept[:limit]
        return [row[:4] for row in run(True, limit)]


def postings_0021():
    """sqlite_fts's PostgreSQL search as migration 0021 left it: the counts, then the candidates statement
    over the postings with a scan per word and prefix, both planned at every recall (bench/memory.py measures
    it beside PG_SEARCH; test_memory_postings.py's randomized test compares their results)."""
    from plugins_app.agent.memory.backends import FtsBackend

    class Postings0021(CountsThenCandidates, FtsBackend):
        pass

    return Postings0021()



def gin_fts(tsv: str = "f.text_tsv", *, expired_counted: bool = False):
    """sqlite_fts's PostgreSQL search as it was before the postings table (migration 0021): the GIN index on the
    stored tsvector text_tsv (0010, 0012), each match's row read for its owner, expiry and words. The tests
    compare recall through the postings with it (`tsv` then to_tsvector('simple', f.text), what text_tsv held,
    computed per row; `expired_counted`: the user's expired facts counted in the words' weights, as the
    postings' statement counts them, and still never returned); bench/memory.py measures it beside them (its
    scratch database keeps text_tsv)."""
    from plugins_app.agent.memory.backends import FtsBackend

    class GinFts(CountsThenCandidates, FtsBackend):
        def counts(self, actor_key, words):
            from django.db import connection
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT w, (SELECT count(*) FROM (SELECT 1 FROM plugins_app_memoryfact f WHERE f.actor_key = %s "
                    f"AND {tsv} @@ to_tsquery('simple', quote_literal(w)) LIMIT %s) held) "
                    "FROM unnest(%s::text[]) w", [actor_key, self.CANDIDATES, words])
                return dict(cur.fetchall()), 0

        @classmethod
        def _candidates_pg(cls, cur, actor_key, arms, limit, now):
            word_arm = {word: i for i, (_, word, factor) in enumerate(arms) if factor == 1}
            hits = ", ".join(f"{tsv} @@ to_tsquery('simple', %s) AS h{i}" for i in range(len(arms)))
            counts = ", ".join(f"count(*) FILTER (WHERE h{i}) AS n{i}" for i in word_arm.values())
            score = " + ".join(
                f"CASE WHEN m.h{i} THEN {factor!r} * ln(1 + (greatest(t.total, c.n{word_arm[word]}) - "
                f"c.n{word_arm[word]} + 0.5) / (c.n{word_arm[word]} + 0.5)) ELSE 0 END"
                for i, (_, word, factor) in enumerate(arms))
            bits = " + ".join(f"CASE WHEN m.h{i} THEN {1 << i} ELSE 0 END" for i in range(len(arms)))
            live = "(f.expires_at IS NULL OR f.expires_at > %s)"
            cur.execute(
                f"WITH m AS MATERIALIZED (SELECT f.id, f.text, f.tier, {live} AS live, {hits} "
                f"FROM plugins_app_memoryfact f WHERE f.actor_key = %s AND {tsv} @@ to_tsquery('simple', %s) "
                + ("" if expired_counted else f"AND {live}") + "), "
                f"c AS (SELECT {counts} FROM m), "
                "t AS (SELECT greatest(reltuples, 0)::float8 AS total FROM pg_class "
                "WHERE oid = 'plugins_app_memoryfact'::regclass) "
                f"SELECT m.id, m.text, m.tier, {bits} FROM m, c, t WHERE m.live "
                f"ORDER BY round(({score})::numeric, 9) DESC, m.id DESC LIMIT %s",
                [now, *(match for match, _, _ in arms), actor_key, " | ".join(match for match, _, _ in arms),
                 *(() if expired_counted else (now,)), limit])
            return cur.fetchall()

    return GinFts()


def recall_through(backend, *, recall=None, **kwargs):
    """recall (plugins_app.agent.memory.recall's, or `recall`) with `backend` in sqlite_fts's place."""
    from plugins_app.agent.memory import backends, recall as recall_module
    recall = recall or recall_module.recall
    now = backends._BACKENDS["sqlite_fts"]
    backends._BACKENDS["sqlite_fts"] = backend
    try:
        return recall(**kwargs)
    finally:
        backends._BACKENDS["sqlite_fts"] = now
