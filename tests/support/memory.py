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
    cfg.write("")
    yield cfg
    config.reset_caches()
    conf.reset()


def gin_fts(tsv: str = "f.text_tsv", *, expired_counted: bool = False):
    """sqlite_fts's PostgreSQL search as it was before the postings table (migration 0021): the GIN index on the
    stored tsvector text_tsv (0010, 0012), each match's row read for its owner, expiry and words. The tests
    compare recall through the postings with it (`tsv` then to_tsvector('simple', f.text), what text_tsv held,
    computed per row; `expired_counted`: the user's expired facts counted in the words' weights, as the
    postings' statement counts them, and still never returned); bench/memory.py measures it beside them (its
    scratch database keeps text_tsv)."""
    from plugins_app.agent.memory.backends import FtsBackend

    class GinFts(FtsBackend):
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
