"""Which citations a completed turn reports (`ugent.citations`, the receipt's `citations`).

The candidates are the evidence ids the request supplied (`ugent_citation_ids`) and the ids the engine
itself reported. How a request-supplied id is checked:

- **No NLI engine configured** (the default): the lexical check. The id is kept when the answer names
  it or the engine reported it.
- **An NLI engine configured** (ugent.toml `[citations] nli_engine = "<opm.agents.nli entry point>"`,
  its config in `[citations.nli_config]`): the id's evidence is read from the turn's prompt (the text
  after a mention of the id up to the next supplied id or a blank line, the longest such passage) and the id is kept only when the engine's
  `predict_entailment(premise=evidence, hypothesis=sentence)` holds for at least one sentence of the
  answer: the answer used that evidence, whether or not it names the id. An id whose evidence the
  prompt does not hold, and every id when the engine fails or is not installed, falls back to the
  lexical check (logged).

An id the engine reported that the request did not supply (its own retrieval's, `notes/…`) is the
engine's word and passes unchanged: the hub holds no evidence to check it against.

The NLI engine is a plugin's code, so it is asked on a thread of its own (ugent_common.bounded) for at most
UGENT_CITATIONS_NLI_TIMEOUT seconds for the whole answer; later, or while UGENT_TURN_STUCK_MAX of its checks
still run past that, the lexical check decides (logged), as when it fails. It is never asked inside a
transaction (a hook's answer is ended in the message's own, which in embedded mode holds the one SQLite
writer turn): there the lexical check decides.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from django.conf import settings
from django.db import connection

from ugent_common import bounded
from ugent_common.config import load_config

log = logging.getLogger("ugent.turns")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# What separates an id from its passage: brackets, a colon, a dash, spaces ("[ev-1]: text").
MIN_EVIDENCE_WORDS = 3
_LEAD = re.compile(r"^[\]\)\}>:=\-–—|\s]+")


@dataclass(frozen=True)
class CitationsConfig:
    """ugent.toml's [citations]: the NLI engine that checks citations ("" for the lexical check)."""

    nli_engine: str = ""
    nli_config: dict = field(default_factory=dict)


def citations_config() -> CitationsConfig:
    """[citations] as ugent.toml holds it now (read again when the file changes)."""
    section = load_config().get("citations") or {}
    if not isinstance(section, dict):
        return CitationsConfig()
    conf = section.get("nli_config") or {}
    return CitationsConfig(nli_engine=str(section.get("nli_engine") or "").strip(),
                           nli_config=dict(conf) if isinstance(conf, dict) else {})


def _id_pattern(cid: str) -> re.Pattern:
    # The id as a token of its own: "ev-1" is not found inside "ev-10" or "prev-1".
    return re.compile(rf"(?<![\w-]){re.escape(cid)}(?![\w-])")


def evidence_passages(prompt: str, ids: list[str]) -> dict[str, str]:
    """Each id's evidence in the prompt: after a mention of the id, the text up to the next mention of
    any supplied id or a blank line; of several mentions ("use [a1] and [a2]", then the sources), the
    longest passage. A passage of fewer than MIN_EVIDENCE_WORDS words is none."""
    prompt = prompt or ""
    mentions = [(m.start(), m.end(), cid) for cid in ids for m in _id_pattern(cid).finditer(prompt)]
    marks = sorted(start for start, _end, _cid in mentions)
    out: dict[str, str] = {}
    for start, end_of_id, cid in mentions:
        end = next((s for s in marks if s > start), len(prompt))
        blank = _BLANK_LINE.search(prompt, end_of_id, end)
        passage = _LEAD.sub("", prompt[end_of_id:blank.start() if blank else end])
        passage = passage.rstrip().rstrip("[({<").strip()  # a bracketed next id leaves its bracket behind
        if len(passage.split()) >= MIN_EVIDENCE_WORDS and len(passage) > len(out.get(cid, "")):
            out[cid] = passage
    return out


def answer_sentences(answer: str, ids: list[str]) -> list[str]:
    """The answer's sentences, with the id mentions taken out (they are no claim of their own)."""
    text = answer or ""
    for cid in ids:
        text = _id_pattern(cid).sub("", text)
    text = re.sub(r"[\[\(]\s*[,;]?\s*[\]\)]", "", text)  # brackets the ids left empty
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def _lexical(cid: str, answer: str, claimed: list[str]) -> bool:
    return cid in claimed or _id_pattern(cid).search(answer or "") is not None


def _engine(conf: CitationsConfig):
    from plugins_app.agent.engines.registry import nli_engine
    return nli_engine(conf.nli_engine, conf.nli_config)


def _nli_check(conf: CitationsConfig, passages: dict[str, str], sentences: list[str],
               lang: str | None) -> set[str] | None:
    """The ids whose passage entails a sentence of the answer, by the NLI engine on a thread of its own (the
    module says why); None when the lexical check must decide: the engine failed, is not installed, did
    not answer within UGENT_CITATIONS_NLI_TIMEOUT, or was not asked (UGENT_TURN_STUCK_MAX checks overrun)."""
    def check() -> set[str]:
        engine = _engine(conf)
        return {cid for cid, passage in passages.items()
                if any(engine.predict_entailment(passage, s, lang) for s in sentences)}
    timeout = settings.UGENT_CITATIONS_NLI_TIMEOUT
    done = bounded.call_bounded(check, timeout=timeout, owner=f"nli:{conf.nli_engine}",
                                limit=settings.UGENT_TURN_STUCK_MAX, name="ugent-nli")
    if done.error is not None:
        exc = done.error
        log.warning("citations: the NLI engine %r failed; the lexical check decides this turn's citations",
                    conf.nli_engine, exc_info=(type(exc), exc, exc.__traceback__))
        return None
    if done.timed_out or done.refused:
        why = (f"{done.refused} earlier checks of it are still running past their time limit" if done.refused
               else f"it did not answer within {timeout:g} s")
        log.warning("citations: the NLI engine %r was not heard (%s); the lexical check decides this turn's "
                    "citations", conf.nli_engine, why)
        return None
    return done.value


def citations_verify(*, requested: list[str], claimed: list[str], answer: str, prompt: str,
                     lang: str | None = None) -> list[str]:
    """The citation ids a completed turn reports: `claimed` (the engine's, in its order) and
    `requested` (the request's ugent_citation_ids), each request-supplied id checked as the module
    says. Ids keep their first order: the engine's, then the request's."""
    requested = [c for c in dict.fromkeys(requested or []) if c]
    claimed = [c for c in dict.fromkeys(claimed or []) if c]
    if not requested:  # nothing to check: the turn path reads no config
        return claimed
    supplied = set(requested)
    conf = citations_config()
    kept: set[str] = set()
    checked_by_nli: set[str] = set()
    if conf.nli_engine and connection.in_atomic_block:
        log.info("citations: a turn ended inside a transaction (a hook's answer): the lexical check decides, "
                 "the NLI engine %r is not asked there", conf.nli_engine)
    elif conf.nli_engine:
        passages = evidence_passages(prompt, requested)
        entailed = _nli_check(conf, passages, answer_sentences(answer, requested), lang) if passages else None
        if entailed is not None:
            checked_by_nli, kept = set(passages), entailed
    for cid in requested:
        if cid not in checked_by_nli and _lexical(cid, answer, claimed):
            kept.add(cid)
    ordered = [c for c in claimed if c not in supplied or c in kept]
    ordered += [c for c in requested if c in kept and c not in ordered]
    return ordered


def citations_status() -> dict:
    """The `citations` section of GET /v1/ugent/status: which check runs, and whether its engine loads."""
    conf = citations_config()
    if not conf.nli_engine:
        return {"check": "lexical", "nli_engine": None}
    try:
        engine = _engine(conf)
    except Exception as exc:
        return {"check": "lexical", "nli_engine": conf.nli_engine, "installed": False,
                "error": f"{type(exc).__name__}: {exc}"}
    return {"check": "nli", "nli_engine": conf.nli_engine, "installed": True,
            "class": f"{type(engine).__module__}.{type(engine).__qualname__}"}
