"""The offline fact extractor: rules over what the user said, no model needed.

It reads statements a user makes about themselves and standing instructions ("my name is…",
"I prefer…", "remember that…", "always/never…") and words each as a fact about "User". A question
states nothing, so it yields nothing; neither does anything it does not recognise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from plugins_app.agent.memory.models import Tier

MAX_FACT_CHARS = 300
_SENTENCES = re.compile(r"(?<=[.!?;])\s+|\n+|,?\s+(?:and|but) (?=i\b|my\b)", re.I)
_VERBS = {"prefer": "prefers", "like": "likes", "love": "loves", "enjoy": "enjoys", "hate": "hates",
          "dislike": "dislikes", "don't like": "doesn't like", "do not like": "does not like",
          "use": "uses", "need": "needs", "want": "wants"}
_PLACES = {"live": "lives", "work": "works", "study": "studies"}
_EPHEMERAL = re.compile(r"\b(today|tonight|tomorrow|right now|this (morning|afternoon|evening|week))\b", re.I)


@dataclass(frozen=True)
class Candidate:
    text: str
    tier: str


def _clean(value: str) -> str:
    value = value.strip().strip("\"'“”").rstrip(" .!;,")
    return re.sub(r"\s+", " ", value)


def _sentence(text: str) -> str:
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!")) else text + "."


_RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(r"^(?:hi|hello|hey)?[, ]*my name is (?P<x>[^,.;!?]+)", re.I),
     lambda m: (f"User's name is {_clean(m['x'])}", Tier.CORE)),
    (re.compile(r"^(?:please )?call me (?P<x>[^,.;!?]+)", re.I),
     lambda m: (f"User wants to be called {_clean(m['x'])}", Tier.CORE)),
    (re.compile(r"^i(?:'m| am) allergic to (?P<x>.+)", re.I),
     lambda m: (f"User is allergic to {_clean(m['x'])}", Tier.CORE)),
    (re.compile(r"^i (?:really )?(?P<v>prefer|like|love|enjoy|hate|dislike|don't like|do not like|use|need|want)"
                r" (?P<x>.+)", re.I),
     lambda m: (f"User {_VERBS[m['v'].lower()]} {_clean(m['x'])}", Tier.CONTEXTUAL)),
    (re.compile(r"^i (?P<v>live|work|study) (?P<p>in|at|as|for|on) (?P<x>.+)", re.I),
     lambda m: (f"User {_PLACES[m['v'].lower()]} {m['p'].lower()} {_clean(m['x'])}", Tier.CONTEXTUAL)),
    (re.compile(r"^i(?:'m| am) (?P<a>an?) (?P<x>.+)", re.I),
     lambda m: (f"User is {m['a'].lower()} {_clean(m['x'])}", Tier.CONTEXTUAL)),
    (re.compile(r"^my (?P<k>[a-z][\w -]{0,40}?) (?P<b>is|are) (?P<x>.+)", re.I),
     lambda m: (f"User's {m['k'].lower()} {m['b'].lower()} {_clean(m['x'])}", Tier.CONTEXTUAL)),
    (re.compile(r"^(?:please )?(?P<w>always|never) (?P<x>.+)", re.I),
     lambda m: (f"{m['w'].capitalize()} {_clean(m['x'])}", Tier.CORE)),
]
_REMEMBER = re.compile(r"^(?:please |also |and )*(?:always )?remember(?: this| that)?\s*[:,-]?\s*(?:that\s+)?(?P<x>.*)$",
                       re.I)


def _one(sentence: str) -> Candidate | None:
    for pattern, word in _RULES:
        m = pattern.match(sentence)
        if m:
            text, tier = word(m)
            if _EPHEMERAL.search(text):
                tier = Tier.EPHEMERAL
            return Candidate(_sentence(text[:MAX_FACT_CHARS]), tier)
    return None


def extract_facts(text: str) -> list[Candidate]:
    """The facts one message states, in order, each once."""
    found: list[Candidate] = []
    for raw in _SENTENCES.split(text or ""):
        sentence = raw.strip()
        if not sentence or sentence.endswith("?"):
            continue
        m = _REMEMBER.match(sentence)
        if m:
            rest = _clean(m["x"])
            if not rest:
                continue
            fact = _one(rest) or Candidate(_sentence(rest[:MAX_FACT_CHARS]), Tier.CORE)
        else:
            fact = _one(sentence)
        if fact and all(normalize(f.text) != normalize(fact.text) for f in found):
            found.append(fact)
    return found


def normalize(text: str) -> str:
    """How duplicates are recognised: case, spacing and the closing full stop do not count."""
    return re.sub(r"\s+", " ", text).strip().rstrip(".!").lower()[:500]
