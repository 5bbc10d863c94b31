"""The project's offline option matcher and yes/no engines (the OPM contracts of seed 001).

No ovos option-matcher or yes/no plugin is installed here, so the hub's questions read a free-text
reply with these: `OrdinalFuzzyOptionMatcher` ("the second one", "last", a label or id typed
roughly, by difflib) and `KeywordYesNoEngine` (English yes/no words, a negation flips). Both answer
None rather than guess, as the contracts require. Another installed plugin of the same groups can
replace them (UGENT_OPTION_MATCHER_ENGINE, UGENT_YESNO_ENGINE; plugins_app.agent.engines.registry).
"""
from __future__ import annotations

import difflib
import re
from typing import List, Optional

from ovos_plugin_manager.templates.agents import OptionMatcherEngine, YesNoEngine

ORDINALS = {
    "first": 1, "1st": 1, "one": 1, "second": 2, "2nd": 2, "two": 2, "third": 3, "3rd": 3, "three": 3,
    "fourth": 4, "4th": 4, "four": 4, "fifth": 5, "5th": 5, "five": 5, "sixth": 6, "6th": 6, "six": 6,
    "seventh": 7, "7th": 7, "seven": 7, "eighth": 8, "8th": 8, "eight": 8, "ninth": 9, "9th": 9, "nine": 9,
    "tenth": 10, "10th": 10, "ten": 10,
}
FROM_END = {"last": -1, "final": -1, "penultimate": -2}
FILLER = {"the", "a", "an", "one", "option", "choice", "number", "no", "please", "i", "want", "pick", "take",
          "choose", "select", "id", "like", "would", "go", "with", "for", "me", "it", "is", "that"}
FUZZY_CUTOFF = 0.75
# A reply that rules an option out ("not the first one", "neither") chooses none: it does not fit.
NEGATIONS = {"not", "none", "neither", "nor", "never", "don't", "dont", "nothing", "isn't", "wasn't"}


def _words(text: str) -> list[str]:
    return re.findall(r"[\w']+", (text or "").lower())


def _norm(text: str) -> str:
    return " ".join(_words(text))


class OrdinalFuzzyOptionMatcher(OptionMatcherEngine):
    """An utterance to one of the offered options, in English: an ordinal or position ("the second
    one", "2", "last", "second to last"), the option itself (its words inside the utterance), or a
    close spelling of it (difflib). None when nothing fits or two options fit equally."""

    def match_option(self, utterance: str, options: List[str], lang: Optional[str] = None) -> Optional[str]:
        if not options or not (utterance or "").strip():
            return None
        normed = [_norm(o) for o in options]
        said = _norm(utterance)
        # The option named outright wins over an ordinal inside it ("Option two" among labels).
        exact = [o for o, n in zip(options, normed) if n and n == said]
        if len(exact) == 1:
            return exact[0]
        if NEGATIONS.intersection(_words(utterance)):
            return None
        position = self._position(said, len(options))
        if position is not None:
            return options[position]
        contained = [o for o, n in zip(options, normed) if n and re.search(rf"\b{re.escape(n)}\b", said)]
        if len(contained) == 1:
            return contained[0]
        if len(contained) > 1:  # "low or high"? the longest wins only when it contains the others
            longest = max(contained, key=lambda o: len(_norm(o)))
            if all(_norm(o) in _norm(longest) for o in contained):
                return longest
            return None
        core = " ".join(w for w in _words(utterance) if w not in FILLER) or said
        scored = sorted(((difflib.SequenceMatcher(None, core, n).ratio(), o) for o, n in zip(options, normed)),
                        reverse=True)
        best_score, best = scored[0]
        if best_score < FUZZY_CUTOFF:
            return None
        if len(scored) > 1 and scored[1][0] >= best_score - 0.05:
            return None  # too close to call
        return best

    @staticmethod
    def _position(said: str, count: int) -> Optional[int]:
        words = said.split()
        if not words:
            return None
        if "to last" in said or "from last" in said or "from the end" in said:
            for w in words:
                if w in ORDINALS and ORDINALS[w] >= 2:
                    index = count - ORDINALS[w]
                    return index if 0 <= index < count else None
        meaningful = [w for w in words if w not in FILLER or w == "one"]
        hits = []
        for w in meaningful:
            if w in FROM_END:
                hits.append(count + FROM_END[w])
            elif w in ORDINALS and (w != "one" or len(meaningful) == 1):
                hits.append(ORDINALS[w] - 1)
            elif w.isdigit() and len(meaningful) <= 2:
                hits.append(int(w) - 1)
        hits = list(dict.fromkeys(hits))
        if len(hits) == 1 and 0 <= hits[0] < count:
            return hits[0]
        return None


YES = {"yes", "y", "yeah", "yep", "yup", "sure", "ok", "okay", "correct", "right", "affirmative", "true",
       "confirm", "confirmed", "agree", "absolutely", "definitely", "please", "proceed", "approve", "approved"}
NO = {"no", "n", "nope", "nah", "cancel", "negative", "false", "decline", "declined", "deny", "never",
      "reject", "stop", "abort"}
YES_PHRASES = ("go ahead", "do it", "of course", "sounds good")
NO_PHRASES = ("not at all", "no way", "don't", "do not", "rather not")
NEUTRAL_PHRASES = ("not sure", "maybe", "i don't know", "dunno", "no idea")
NEGATORS = {"not", "don't", "dont", "never"}


class KeywordYesNoEngine(YesNoEngine):
    """A reply to a yes/no question, in English: True, False, or None when it says neither or both."""

    def yes_or_no(self, question: str, response: str, lang: Optional[str] = None) -> Optional[bool]:
        said = " ".join(_words(response))
        if not said:
            return None
        if any(p in said for p in NEUTRAL_PHRASES):
            return None
        if any(p in said for p in NO_PHRASES):
            return False
        words = said.split()
        yes = any(w in YES for w in words) or any(p in said for p in YES_PHRASES)
        no = any(w in NO for w in words)
        if yes and any(w in NEGATORS for w in words):  # "not sure", "not ok"
            return False
        if yes == no:
            return None
        return yes
