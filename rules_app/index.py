"""The rule index: which rules could match a message, found without trying them all.

``CompiledRuleSet.evaluate`` must give exactly the linear engine's answer (the
first rule, in priority then file order, whose condition holds), at a cost that
grows with the rules that *could* match rather than with all rules.

Compiling: every field condition (``equals``, ``starts_with``, one needle of
``contains_any``) is an **atom**, shared by every rule that names it. For each
rule we derive a **trigger**: a set of literals (an atom that must hold, or one
that must not) such that the rule can match only if at least one literal of its
trigger is true. It is a necessary condition, never a sufficient one:

* a field condition triggers on itself;
* ``all_of`` needs every child, so any one child's trigger is enough; the most
  selective is taken (its atoms shared by the fewest rules);
* ``any_of`` needs some child: the union of the children's triggers;
* ``not`` is pushed inwards (De Morgan), turning atoms into negative literals;
* ``always = true``, an empty ``all_of`` and the like cannot be indexed: such a
  rule is always a candidate. ``always = false`` and an empty ``any_of`` never are.

Evaluating: the atoms that hold for the message are found by hash lookups
(``equals``), a probe per distinct prefix length (``starts_with``) and one
Aho–Corasick pass per field (``contains_any``), all on the case-folded value the
conditions themselves fold. The candidates are the rules whose trigger has a
true literal, plus the unindexed ones; they are tried in priority order with
their full conditions, and the first that holds decides: the linear answer.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import ahocorasick

from rules_app.engine import (
    AllOf,
    Always,
    AnyOf,
    CompiledRule,
    Condition,
    ContainsAny,
    Equals,
    MessageFacts,
    Not,
    StartsWith,
    _fold,
)

#: A literal: (atom id, polarity). (7, True) holds when atom 7 holds; (7, False) when it does not.
Literal = tuple[int, bool]


@dataclass(frozen=True)
class _Atom:
    field: str
    op: str        # "equals", "starts_with", "contains" or "present" (a field condition every value meets)
    value: str     # folded


def _atoms_of(cond: Condition) -> list[_Atom]:
    """The atoms a field condition stands for (contains_any: one per needle)."""
    if isinstance(cond, Equals):
        return [_Atom(cond.field, "equals", cond._folded)]
    if isinstance(cond, StartsWith):
        return [_Atom(cond.field, "present" if not cond._folded else "starts_with", cond._folded)]
    if isinstance(cond, ContainsAny):
        return [_Atom(cond.field, "present" if not n else "contains", n) for n in cond._folded]
    return []


class _Compiler:
    def __init__(self):
        self.ids: dict[_Atom, int] = {}
        self.atoms: list[_Atom] = []
        self.uses: dict[int, int] = defaultdict(int)   # how many rules name each atom (selectivity)

    def atom_id(self, atom: _Atom) -> int:
        if atom not in self.ids:
            self.ids[atom] = len(self.atoms)
            self.atoms.append(atom)
        return self.ids[atom]

    def count(self, cond: Condition, seen: set[int]) -> None:
        for atom in _atoms_of(cond):
            seen.add(self.atom_id(atom))
        for child in getattr(cond, "items", ()):
            self.count(child, seen)
        if isinstance(cond, Not):
            self.count(cond.inner, seen)

    def cost(self, literals: frozenset[Literal], n_rules: int) -> int:
        # A negative literal is true for most messages: it makes a rule a candidate almost always.
        return sum(self.uses[a] if positive else n_rules for a, positive in literals)

    def trigger(self, cond: Condition, positive: bool, n_rules: int) -> Optional[frozenset[Literal]]:
        """Literals one of which must be true for ``cond`` (negated unless ``positive``) to hold;
        None when no such set is known (the rule is always a candidate)."""
        if isinstance(cond, (Equals, StartsWith, ContainsAny)):
            if isinstance(cond, ContainsAny) and not positive and len(cond._folded) != 1:
                # not (a or b) = (not a) and (not b): either negative literal alone is necessary
                if not cond._folded:
                    return None  # not (never) = always
                return frozenset({(self.atom_id(_atoms_of(cond)[0]), False)})
            return frozenset((self.atom_id(a), positive) for a in _atoms_of(cond))
        if isinstance(cond, Not):
            return self.trigger(cond.inner, not positive, n_rules)
        if isinstance(cond, Always):
            return frozenset() if cond.value != positive else None
        if isinstance(cond, (AllOf, AnyOf)):
            every = isinstance(cond, AllOf) == positive   # De Morgan: not any_of = all_of of nots
            kids = [self.trigger(c, positive, n_rules) for c in cond.items]
            if every:
                known = [k for k in kids if k is not None]
                return min(known, key=lambda k: self.cost(k, n_rules)) if known else None
            if any(k is None for k in kids):
                return None
            return frozenset().union(*kids)
        return None  # a condition type the index does not know: always try it


class RuleIndex:
    """Candidate rules for a message, in evaluation order (see the module docstring)."""

    def __init__(self, rules: Sequence[CompiledRule]):
        self.rules = tuple(rules)
        c = _Compiler()
        for rule in self.rules:
            seen: set[int] = set()
            c.count(rule.condition, seen)
            for a in seen:
                c.uses[a] += 1
        self.always: list[int] = []                         # positions of rules that cannot be indexed
        by_literal: dict[Literal, list[int]] = defaultdict(list)
        for pos, rule in enumerate(self.rules):
            trig = c.trigger(rule.condition, True, len(self.rules))
            if trig is None:
                self.always.append(pos)
            for lit in trig or ():
                by_literal[lit].append(pos)
        self.atoms = c.atoms
        self.positive: dict[int, tuple[int, ...]] = {a: tuple(p) for (a, pol), p in by_literal.items() if pol}
        self.negative: list[tuple[int, tuple[int, ...]]] = [(a, tuple(p)) for (a, pol), p in by_literal.items()
                                                            if not pol]
        self.fields = sorted({atom.field for atom in c.atoms})
        # Per field: equals value -> atoms; prefix length -> {prefix: atom}; an automaton of needles.
        self._equals: dict[str, dict[str, int]] = defaultdict(dict)
        self._prefixes: dict[str, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
        self._present: dict[str, int] = {}
        needles: dict[str, dict[str, int]] = defaultdict(dict)
        for aid, atom in enumerate(c.atoms):
            if atom.op == "equals":
                self._equals[atom.field][atom.value] = aid
            elif atom.op == "starts_with":
                self._prefixes[atom.field][len(atom.value)][atom.value] = aid
            elif atom.op == "contains":
                needles[atom.field][atom.value] = aid
            else:
                self._present[atom.field] = aid
        self._automata: dict[str, ahocorasick.Automaton] = {}
        for field_name, words in needles.items():
            automaton = ahocorasick.Automaton()
            for word, aid in words.items():
                automaton.add_word(word, aid)
            automaton.make_automaton()
            self._automata[field_name] = automaton
        self._prefix_lengths = {f: sorted(by_len) for f, by_len in self._prefixes.items()}

    def held_atoms(self, message: MessageFacts) -> set[int]:
        """The atoms that hold for ``message``: exactly the field conditions that would match it."""
        held: set[int] = set()
        for field_name in self.fields:
            value = message.get(field_name)
            if value is None:
                continue  # a field condition never holds on a missing field
            folded = _fold(value)
            if field_name in self._present:
                held.add(self._present[field_name])
            aid = self._equals.get(field_name, {}).get(folded)
            if aid is not None:
                held.add(aid)
            if field_name in self._prefixes:
                table = self._prefixes[field_name]
                for length in self._prefix_lengths[field_name]:
                    if length > len(folded):
                        break
                    aid = table[length].get(folded[:length])
                    if aid is not None:
                        held.add(aid)
            automaton = self._automata.get(field_name)
            if automaton is not None:
                held.update(aid for _, aid in automaton.iter(folded))
        return held

    def candidates(self, message: MessageFacts) -> Iterator[int]:
        """Positions (in evaluation order) of the rules that could match ``message``, ascending; a
        rule reached through two literals comes twice. Lazy: the first match ends the walk."""
        held = self.held_atoms(message)
        lists = [self.positive[a] for a in held if a in self.positive]
        lists.extend(p for a, p in self.negative if a not in held)
        if self.always:
            lists.append(self.always)
        return iter(lists[0]) if len(lists) == 1 else heapq.merge(*lists)

    def first_match(self, message: MessageFacts) -> Optional[CompiledRule]:
        """The rule the linear engine would pick for ``message``, or None."""
        last = -1
        for pos in self.candidates(message):
            if pos == last:
                continue  # a rule reached through two literals is tried once
            last = pos
            rule = self.rules[pos]
            if rule.condition.matches(message):
                return rule
        return None
