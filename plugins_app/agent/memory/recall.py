"""Recall: the user's facts a turn's text calls up, injected into what the engine sees.

Order: pinned facts, then the backend's matches (archival ones after the rest), then the other core
facts, newest first; facts are taken in that order while they fit `max_hits` and
`max_injected_tokens_est` (estimated as the runner counts tokens). The block is one system message
just before the newest user message, so the engine reads it as context for what was just asked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection
from django.utils import timezone
from ovos_plugin_manager.templates.agents import AgentContextManager, AgentMessage, MessageRole

from plugins_app.agent.engines.base import count_tokens
from plugins_app.agent.memory import conf as memory_conf_module
from plugins_app.agent.memory.backends import backend_named
from plugins_app.agent.memory.models import MemoryFact, Tier

RECALL_HEADER = "Memory about this user (facts saved from earlier conversations; they may be out of date):"


@dataclass
class RecalledFact:
    id: int
    text: str
    tier: str
    score: float

    def as_dict(self) -> dict:
        return {"id": self.id, "text": self.text, "tier": self.tier, "score": round(self.score, 4)}


@dataclass
class Recall:
    backend: str | None
    facts: list[RecalledFact] = field(default_factory=list)
    tokens_est: int = 0

    def block(self) -> str:
        """The system message's text: "" when nothing was recalled."""
        return block_text([f.text for f in self.facts]) if self.facts else ""


def block_text(texts: list[str]) -> str:
    return "\n".join([RECALL_HEADER, *(f"- {t}" for t in texts)])


_OWN_FACTS = (
    # pinned facts and other core facts, newest first, each up to the limit (the partial indexes of migration
    # 0008: their conditions written as the indexes' own, 'core' a literal), and whether the user holds any
    # fact at all: one statement, not three (each ORM query cost a turn its own build and round trip)
    "SELECT 'p', id, text, tier, updated_at FROM (SELECT id, text, tier, updated_at FROM plugins_app_memoryfact "
    "WHERE actor_key = %s AND pinned AND (expires_at IS NULL OR expires_at > %s) "
    "ORDER BY updated_at DESC LIMIT %s) pinned_facts "
    "UNION ALL SELECT 'c', id, text, tier, updated_at FROM (SELECT id, text, tier, updated_at "
    "FROM plugins_app_memoryfact WHERE actor_key = %s AND NOT pinned AND tier = 'core' "
    "AND (expires_at IS NULL OR expires_at > %s) ORDER BY updated_at DESC LIMIT %s) core_facts "
    "UNION ALL SELECT 'e', NULL, NULL, NULL, NULL "
    "WHERE EXISTS (SELECT 1 FROM plugins_app_memoryfact WHERE actor_key = %s)")


def own_facts(actor_key: str, want: int, now) -> tuple[bool, list[int], list[int], dict[int, RecalledFact]]:
    """(whether the user holds any fact, their pinned facts' ids, their other core facts' ids, those rows),
    the live ones only, newest first."""
    with connection.cursor() as cur:
        cur.execute(_OWN_FACTS, [actor_key, now, want, actor_key, now, want, actor_key])
        return own_facts_of(cur.fetchall())


def own_facts_of(found: list[tuple]) -> tuple[bool, list[int], list[int], dict[int, RecalledFact]]:
    """own_facts() from _OWN_FACTS's rows (or the same rows from a backend's search: PostgreSQL's function)."""
    held = bool(found)
    found = sorted((r for r in found if r[0] != "e"), key=lambda r: r[4], reverse=True)  # newest first
    rows = {fid: RecalledFact(fid, text, tier, 0.0) for _, fid, text, tier, _ in found}
    return (held, [r[1] for r in found if r[0] == "p"], [r[1] for r in found if r[0] == "c"], rows)


def recall(*, actor_key: str, text: str, conf=None) -> Recall:
    """What memory recalls for `actor_key` before a turn on `text` (reads only; writes nothing)."""
    conf = conf or memory_conf_module.memory_conf()
    if not conf.durable:
        return Recall(backend=None)
    backend = backend_named(conf.backend)
    recalled = Recall(backend=conf.backend)
    if not actor_key or conf.max_hits <= 0:
        return recalled
    want = conf.max_hits
    now = timezone.now()
    found: dict[int, tuple[str, str]] = {}
    # PostgreSQL's sqlite_fts: the own facts and the search in one round trip (its function, migration 0023)
    both = getattr(backend, "search_with_own_facts", None)
    both = both and both(actor_key=actor_key, text=text, limit=want * 2, want=want, now=now, rows=found)
    held, pinned, core, rows = own_facts_of(both[0]) if both else own_facts(actor_key, want, now)
    if not held:
        return recalled  # one index seek: a user with no facts costs no full-text search (PostgreSQL's ran in
        # the same call: it finds no postings of theirs)
    hits = both[1] if both else backend.search(actor_key=actor_key, text=text, limit=want * 2, conf=conf, rows=found)
    rows.update({fid: RecalledFact(fid, text, tier, 0.0) for fid, (text, tier) in found.items() if fid not in rows})
    scores = {fid: 1.0 for fid in pinned}
    for fid, score in hits:
        scores.setdefault(fid, score)
    for fid in core:
        scores.setdefault(fid, 0.0)
    # the hits' rows by primary key (a seek; through the user's queryset SQLite would walk their rows), then
    # checked here: a hit the index still holds for a fact now expired, or not this user's, is dropped
    missing = [fid for fid in scores if fid not in rows]
    if missing:
        rows.update({fid: RecalledFact(fid, text, tier, 0.0) for fid, text, tier, owner, expires in
                     MemoryFact.objects.filter(pk__in=missing).order_by()
                     .values_list("id", "text", "tier", "actor_key", "expires_at")
                     if owner == actor_key and (expires is None or expires > now)})
    hit_ids = [fid for fid, _ in hits]
    ordered = pinned + [fid for fid in hit_ids if rows.get(fid) and rows[fid].tier != Tier.ARCHIVAL] + \
        [fid for fid in hit_ids if rows.get(fid) and rows[fid].tier == Tier.ARCHIVAL] + core
    budget = conf.max_injected_tokens_est
    used = count_tokens(RECALL_HEADER)
    seen: set[int] = set()
    for fid in ordered:
        if fid in seen or fid not in rows:
            continue
        seen.add(fid)
        cost = count_tokens(f"- {rows[fid].text}")
        if used + cost > budget:
            continue  # a shorter fact further down may still fit
        recalled.facts.append(RecalledFact(fid, rows[fid].text, rows[fid].tier, scores[fid]))
        used += cost
        if len(recalled.facts) >= want:
            break
    recalled.tokens_est = used if recalled.facts else 0
    return recalled


class MemoryContextManager(AgentContextManager):
    """The AgentContextManager that puts a user's recalled facts into the engine's messages.

    config: {"actor_key": the user, "system_prompt": optional}; `conf` the memory settings to use.
    History is what the hub hands it (update_history); it keeps none of its own between turns.
    """

    def __init__(self, config: dict | None = None, *, conf=None):
        super().__init__(config)
        self.conf = conf
        self._history: dict[str, list[AgentMessage]] = {}
        self.last_recall: Recall | None = None

    def get_history(self, session_id: str) -> list[AgentMessage]:
        return list(self._history.get(session_id, []))

    def update_history(self, new_messages: list[AgentMessage], session_id: str):
        self._history.setdefault(session_id, []).extend(new_messages)

    def recall_for(self, utterance: str) -> Recall:
        self.last_recall = recall(actor_key=self.config.get("actor_key", ""), text=utterance, conf=self.conf)
        return self.last_recall

    def build_conversation_context(self, utterance: str, session_id: str, *,
                                   recalled: Recall | None = None) -> list[AgentMessage]:
        """[system prompt], the history, the recalled facts, then the utterance as the last user message."""
        messages = []
        if self.system_prompt:
            messages.append(AgentMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
        messages.extend(self.get_history(session_id))
        found = recalled if recalled is not None else self.recall_for(utterance)
        if found.facts:
            messages.append(AgentMessage(role=MessageRole.SYSTEM, content=found.block()))
        messages.append(AgentMessage(role=MessageRole.USER, content=utterance))
        return messages


class TurnRecall:
    """Recall for one turn, at the cadence memory is set to: per_prompt recalls once, on the turn's
    text; every_call recalls again before each engine call (each step of a tool loop too), on the newest
    user message."""

    def __init__(self, *, actor_key: str, disabled: bool, session_id: str = "default"):
        self.disabled = disabled
        self.session_id = session_id
        self.conf = None if disabled else memory_conf_module.memory_conf()
        self.manager = MemoryContextManager({"actor_key": actor_key}, conf=self.conf)
        self.recalled: Recall | None = None
        self.calls = 0

    def messages(self, messages: list) -> list:
        """`messages` with the recalled facts put just before the newest user message. In a tool loop that
        message is followed by the engine's calls and their results, which stay after it."""
        if self.disabled or not self.conf.durable or not messages:
            return messages
        users = [i for i, m in enumerate(messages) if getattr(m.role, "value", m.role) == MessageRole.USER.value]
        if not users:
            return messages
        at = users[-1]
        last = messages[at]
        if self.recalled is None or self.conf.recall_cadence == "every_call":
            self.recalled = self.manager.recall_for(last.content)
        self.calls += 1
        manager = MemoryContextManager({"actor_key": ""}, conf=self.conf)
        manager.update_history(list(messages[:at]), self.session_id)
        built = manager.build_conversation_context(last.content, self.session_id, recalled=self.recalled)
        # built ends with the utterance as a plain AgentMessage: the turn's own is put back, whose files (a
        # MultimodalAgentMessage's images, audio and documents) a multimodal engine must still get
        return built[:-1] + [last] + list(messages[at + 1:])
