"""The project's offline NLI engine: a lexical-overlap entailment baseline (opm.agents.nli).

`LexicalOverlapNLI` is a baseline, not a model: it says the premise entails the hypothesis when most
of the hypothesis's content words (stop words dropped, a crude English suffix stem) occur in the
premise, every number the hypothesis states occurs there too, and negation does not part them (a hypothesis that
negates needs a premise that negates; a premise's "not"/"never"/"n't" governing a word the hypothesis
asserts refuses it). It cannot see a paraphrase with other words, and it takes a sentence that reuses
the premise's words in another sense as entailed. It exists so citation checking
(channels_app.citations) can run offline and be tested; install a real NLI plugin of the same group
for meaning rather than overlap (ugent.toml `[citations] nli_engine`, docs/tools.md).

Config: `threshold` (the share of the hypothesis's content words the premise must hold, default
0.6), `min_words` (a hypothesis with fewer content words is never entailed, default 2).
"""
from __future__ import annotations

import re
from typing import Optional

from ovos_plugin_manager.templates.agents import NaturalLanguageInferenceEngine

STOP_WORDS = frozenset("""
a an the and or but if then so of to in on at by for with from into onto about as is are was were be been
being am do does did has have had having it its this that these those there here i you he she we they me
him her us them my your his our their what which who whom whose when where why how can could will would
shall should may might must also just only very too than such each any some all both either neither
see says said per via according which whereas while
""".split())
NEGATIONS = frozenset({"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without",
                       "cannot", "isn't", "aren't", "wasn't", "weren't", "don't", "doesn't", "didn't",
                       "won't", "wouldn't", "can't", "couldn't", "shouldn't", "hasn't", "haven't", "hadn't"})
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SUFFIXES = ("ings", "ing", "edly", "ed", "ies", "es", "s", "ly")


def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def _words(text: str) -> list[str]:
    return [w.replace("’", "'") for w in _WORD.findall((text or "").lower())]


def _negated(words: list[str]) -> bool:
    return any(w in NEGATIONS or w.endswith("n't") for w in words)


def _negated_terms(words: list[str], reach: int = 3) -> set[str]:
    """The content words a negation governs: those up to `reach` words after it."""
    out: set[str] = set()
    for i, w in enumerate(words):
        if w in NEGATIONS or w.endswith("n't"):
            out |= _content(words[i + 1:i + 1 + reach])
    return out


def _content(words: list[str]) -> set[str]:
    return {_stem(w) for w in words if w not in STOP_WORDS and w not in NEGATIONS and not w.isdigit()}


class LexicalOverlapNLI(NaturalLanguageInferenceEngine):
    """Entailment by word overlap, numbers and negation: a baseline, clearly not a model (see module)."""

    def predict_entailment(self, premise: str, hypothesis: str, lang: Optional[str] = None) -> bool:
        threshold = float(self.config.get("threshold", 0.6))
        min_words = int(self.config.get("min_words", 2))
        p_words, h_words = _words(premise), _words(hypothesis)
        wanted = _content(h_words)
        if len(wanted) < min_words:
            return False
        if _negated(h_words) and not _negated(p_words):
            return False  # the hypothesis denies what the premise never denies
        if not _negated(h_words) and wanted & _negated_terms(p_words):
            return False  # the premise denies a word the hypothesis asserts
        if not set(_NUMBER.findall(hypothesis or "")) <= set(_NUMBER.findall(premise or "")):
            return False
        held = _content(p_words)
        return len(wanted & held) / len(wanted) >= threshold
