"""The rule engine core: parse rules.toml, compile conditions, evaluate messages.

Pure Python; imports nothing from Django. The Django side (hooks, admin,
management command) builds on :func:`parse_rules`, :class:`RuleSet` and the
string constants below, which are the contract of the rule engine spec and
must not be reworded.

Condition algebra (decided here, the spec is silent on the empty lists):

* ``{ all_of = [] }`` matches every message (an empty conjunction is true);
* ``{ any_of = [] }`` matches no message (an empty disjunction is false);
* ``{ field = F, contains_any = [] }`` matches no message;
* a field condition on a field the message does not carry never matches, so
  ``not`` around it always does.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

logger = logging.getLogger("ugent.rules")

# --------------------------------------------------------------------------
# Contract strings (letter for letter from the spec).
# --------------------------------------------------------------------------

IGNORED_ANSWER = "rule engine: message ignored"

DRY_RUN_MATCHED = '[dry-run] matched rule "{name}"'
DRY_RUN_NO_MATCH = '[dry-run] no rule matched for: "{text}"'
#: The channel and source type a dry run tests as (``manage.py rules test``).
DRY_RUN_CHANNEL = "cli"
DRY_RUN_SOURCE_TYPE = "user"

LOG_RULE_DROPPED = "rule dropped (rule=%s, reason=%s)"
LOG_RULE_SET_LOADED = "rule set loaded (rules=%d)"
LOG_RULE_SET_AUTO_RELOADED = "rule set auto-reloaded (rules=%d)"
LOG_FAILED_LOAD = "failed to load rule set — starting with empty rules (fail-open)"
LOG_AUTO_RELOAD_FAILED = "rule set auto-reload failed — retaining previous rule set"
LOG_WATCH_DISABLED = "rule engine watch disabled"
#: Not in the spec: the ``on_error = "closed"`` counterpart of LOG_FAILED_LOAD.
LOG_FAILED_LOAD_CLOSED = "failed to load rule set — refusing all messages (fail-closed)"

#: Reasons a rule is dropped as the file loads.
DROP_WORKFLOW_NOT_TRIGGER = "workflow '{workflow}' is not a cron job with rule_trigger = true"
DROP_UNKNOWN_ACTION = (
    "unknown native action '{action}'; the actions are compact_conversation and extract_memory"
)
#: Not worded by the spec ("a rule that gives an action params is dropped the same way").
DROP_ACTION_PARAMS = "native action '{action}' takes no params"

#: Answer to every message while a broken file is in force under ``on_error = "closed"``.
CLOSED_ANSWER = "rule engine: rule set failed to load; message refused"

#: Answers of ``/rules reload`` and the StartWorkflow / RunNativeAction outcomes.
RULES_RELOADED_ANSWER = "Rule set reloaded."
COMPACT_NOTHING_YET = "There is nothing to compact yet."
MEMORY_SAVED_MANY = "Saved {count} facts to memory."
MEMORY_SAVED_ONE = "Saved 1 fact to memory."
MEMORY_NOTHING_NEW = "Found nothing new to save to memory."
MEMORY_WRITES_OFF = "Memory writes are off for this conversation."
MEMORY_SENDER_UNKNOWN = "Memory cannot be saved for a sender who is not identified."
MEMORY_BACKEND_NEEDED = "Saving to memory needs the sqlite_fts or lance_embedded memory backend."
MEMORY_SAVE_FAILED = "Saving to memory failed; the agent's log says why."

NATIVE_ACTIONS = ("compact_conversation", "extract_memory")
FIELDS = ("text", "channel", "source_type", "user_id", "conversation_id", "input_mode")
DECISION_KINDS = ("PassToDefaultAgent", "Ignore", "StartWorkflow", "RunNativeAction")


def memory_saved_answer(count: int) -> str:
    """Return the extract_memory answer for ``count`` saved facts."""
    if count <= 0:
        return MEMORY_NOTHING_NEW
    if count == 1:
        return MEMORY_SAVED_ONE
    return MEMORY_SAVED_MANY.format(count=count)


class RuleSetError(Exception):
    """The whole rules file is refused (TOML error, wrong table, bad condition, duplicate name)."""


# --------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """The facts a condition can match. ``None`` means the message does not carry the field."""

    text: Optional[str] = None
    channel: Optional[str] = None
    source_type: Optional[str] = None
    user_id: Optional[str] = None
    conversation_id: Optional[str] = None
    input_mode: Optional[str] = None

    def get(self, name: str) -> Optional[str]:
        """Return the value of field ``name`` (one of :data:`FIELDS`), or None if absent."""
        return getattr(self, name)


# --------------------------------------------------------------------------
# Conditions
# --------------------------------------------------------------------------


def _fold(value: str) -> str:
    return value.casefold()


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class ConditionTrace:
    """How one condition fared against one message, for explain pages."""

    description: str
    held: bool
    children: tuple["ConditionTrace", ...] = ()
    note: str = ""

    def lines(self, indent: int = 0) -> list[str]:
        """Render the trace as indented ``[x]`` / ``[ ]`` lines."""
        mark = "[x]" if self.held else "[ ]"
        text = f"{'  ' * indent}{mark} {self.description}"
        if self.note:
            text += f" ({self.note})"
        out = [text]
        for child in self.children:
            out.extend(child.lines(indent + 1))
        return out


class Condition:
    """A compiled condition. Subclasses are immutable and built once per load."""

    def matches(self, message: Message) -> bool:  # pragma: no cover - abstract
        """Return True when the condition holds for ``message``."""
        raise NotImplementedError

    def trace(self, message: Message) -> ConditionTrace:  # pragma: no cover - abstract
        """Return a full (non short-circuiting) trace of the condition on ``message``."""
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        """Return a one-line human description."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class _FieldCondition(Condition):
    op = ""

    def __init__(self, field_name: str):
        self.field = field_name

    def _test(self, folded: str) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def matches(self, message: Message) -> bool:
        value = message.get(self.field)
        if value is None:
            return False
        return self._test(_fold(value))

    def trace(self, message: Message) -> ConditionTrace:
        value = message.get(self.field)
        if value is None:
            return ConditionTrace(self.describe(), False, note=f"message has no {self.field}")
        return ConditionTrace(self.describe(), self._test(_fold(value)))


class ContainsAny(_FieldCondition):
    """``{ field = F, contains_any = [...] }``, case-insensitive."""

    def __init__(self, field_name: str, needles: Sequence[str]):
        super().__init__(field_name)
        self.needles = tuple(needles)
        self._folded = tuple(_fold(n) for n in needles)

    def _test(self, folded: str) -> bool:
        return any(n in folded for n in self._folded)

    def describe(self) -> str:
        return f"{self.field} contains any of [{', '.join(_quote(n) for n in self.needles)}]"


class StartsWith(_FieldCondition):
    """``{ field = F, starts_with = "..." }``, case-insensitive."""

    def __init__(self, field_name: str, prefix: str):
        super().__init__(field_name)
        self.prefix = prefix
        self._folded = _fold(prefix)

    def _test(self, folded: str) -> bool:
        return folded.startswith(self._folded)

    def describe(self) -> str:
        return f"{self.field} starts with {_quote(self.prefix)}"


class Equals(_FieldCondition):
    """``{ field = F, equals = "..." }``, case-insensitive."""

    def __init__(self, field_name: str, value: str):
        super().__init__(field_name)
        self.value = value
        self._folded = _fold(value)

    def _test(self, folded: str) -> bool:
        return folded == self._folded

    def describe(self) -> str:
        return f"{self.field} equals {_quote(self.value)}"


class AllOf(Condition):
    """``{ all_of = [...] }``: every condition matches; an empty list always matches."""

    def __init__(self, items: Sequence[Condition]):
        self.items = tuple(items)

    def matches(self, message: Message) -> bool:
        return all(c.matches(message) for c in self.items)

    def trace(self, message: Message) -> ConditionTrace:
        kids = tuple(c.trace(message) for c in self.items)
        return ConditionTrace(self.describe(), all(k.held for k in kids), kids)

    def describe(self) -> str:
        return "all of" if self.items else "all of [] (always matches)"


class AnyOf(Condition):
    """``{ any_of = [...] }``: at least one condition matches; an empty list never matches."""

    def __init__(self, items: Sequence[Condition]):
        self.items = tuple(items)

    def matches(self, message: Message) -> bool:
        return any(c.matches(message) for c in self.items)

    def trace(self, message: Message) -> ConditionTrace:
        kids = tuple(c.trace(message) for c in self.items)
        return ConditionTrace(self.describe(), any(k.held for k in kids), kids)

    def describe(self) -> str:
        return "any of" if self.items else "any of [] (never matches)"


class Not(Condition):
    """``{ not = { ... } }``."""

    def __init__(self, inner: Condition):
        self.inner = inner

    def matches(self, message: Message) -> bool:
        return not self.inner.matches(message)

    def trace(self, message: Message) -> ConditionTrace:
        kid = self.inner.trace(message)
        return ConditionTrace(self.describe(), not kid.held, (kid,))

    def describe(self) -> str:
        return "not"


class Always(Condition):
    """``{ always = true }`` matches everything; ``always = false`` nothing."""

    def __init__(self, value: bool):
        self.value = value

    def matches(self, message: Message) -> bool:
        return self.value

    def trace(self, message: Message) -> ConditionTrace:
        return ConditionTrace(self.describe(), self.value)

    def describe(self) -> str:
        return "always" if self.value else "never (always = false)"


_COMBINATOR_KEYS = ("all_of", "any_of", "not", "always")
_FIELD_OPS = ("contains_any", "starts_with", "equals")


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


def compile_condition(
    raw: Any,
    *,
    where: str = "match",
    fields: Sequence[str] = FIELDS,
    field_errors: Optional[Mapping[str, str]] = None,
) -> Condition:
    """Compile one condition table (as parsed from TOML) into a :class:`Condition`.

    ``where`` names the condition's place in error messages; ``fields`` is the
    set of field names allowed (routing passes a smaller one) and
    ``field_errors`` gives a specific message for a known-but-refused field.
    Raises :class:`RuleSetError` for a condition of no known shape, a wrong
    type or an unknown field. Keys the engine does not know are ignored.
    """
    if not isinstance(raw, dict):
        raise RuleSetError(f"{where}: a condition must be a table, found {_type_name(raw)}")
    shapes = [k for k in ("field", *_COMBINATOR_KEYS) if k in raw]
    if not shapes:
        ops = [k for k in _FIELD_OPS if k in raw]
        if ops:
            raise RuleSetError(f"{where}: missing field `field` (for `{ops[0]}`)")
        found = ", ".join(sorted(raw)) or "none"
        raise RuleSetError(
            f"{where}: condition of no known shape; expected `field` with "
            f"contains_any/starts_with/equals, or one of all_of, any_of, not, always "
            f"(found keys: {found})"
        )
    if len(shapes) > 1:
        raise RuleSetError(
            f"{where}: condition of no known shape; it mixes {', '.join(shapes)} "
            f"(a condition has exactly one of field, all_of, any_of, not, always)"
        )
    shape = shapes[0]
    value = raw[shape]
    if shape == "field":
        if not isinstance(value, str):
            raise RuleSetError(f"{where}.field: expected a string, found {_type_name(value)}")
        if value not in fields:
            if field_errors and value in field_errors:
                raise RuleSetError(f"{where}.field: {field_errors[value]}")
            raise RuleSetError(
                f"{where}.field: unknown field `{value}`, expected one of {', '.join(fields)}"
            )
        ops = [k for k in _FIELD_OPS if k in raw]
        if not ops:
            raise RuleSetError(
                f"{where}: condition of no known shape; field `{value}` needs one of "
                f"contains_any, starts_with, equals"
            )
        if len(ops) > 1:
            raise RuleSetError(
                f"{where}: condition of no known shape; it gives both {ops[0]} and {ops[1]} "
                f"(one comparison per condition; combine with all_of/any_of)"
            )
        op = ops[0]
        arg = raw[op]
        if op == "contains_any":
            if not isinstance(arg, list) or not all(isinstance(a, str) for a in arg):
                raise RuleSetError(f"{where}.contains_any: expected an array of strings")
            return ContainsAny(value, arg)
        if not isinstance(arg, str):
            raise RuleSetError(f"{where}.{op}: expected a string, found {_type_name(arg)}")
        return StartsWith(value, arg) if op == "starts_with" else Equals(value, arg)
    if shape in ("all_of", "any_of"):
        if not isinstance(value, list):
            raise RuleSetError(f"{where}.{shape}: expected an array of conditions, found {_type_name(value)}")
        items = [
            compile_condition(v, where=f"{where}.{shape}[{i}]", fields=fields, field_errors=field_errors)
            for i, v in enumerate(value)
        ]
        return AllOf(items) if shape == "all_of" else AnyOf(items)
    if shape == "not":
        return Not(compile_condition(value, where=f"{where}.not", fields=fields, field_errors=field_errors))
    if not isinstance(value, bool):
        raise RuleSetError(f"{where}.always: expected a boolean, found {_type_name(value)}")
    return Always(value)


# --------------------------------------------------------------------------
# Decisions and rules
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PassToDefaultAgent:
    """The agent answers as usual."""

    kind = "PassToDefaultAgent"


@dataclass(frozen=True)
class Ignore:
    """Stop the message; the sender is answered :data:`IGNORED_ANSWER`."""

    kind = "Ignore"


@dataclass(frozen=True)
class StartWorkflow:
    """Stop the message and start the named rule-triggered cron job for the sender."""

    workflow: str
    inject_context: bool = False
    kind = "StartWorkflow"


@dataclass(frozen=True)
class RunNativeAction:
    """Stop the message and run a native action on the sender's conversation."""

    action: str
    kind = "RunNativeAction"


Decision = Union[PassToDefaultAgent, Ignore, StartWorkflow, RunNativeAction]


def describe_decision(decision: Decision) -> str:
    """Return a short human description of ``decision``."""
    if isinstance(decision, StartWorkflow):
        extra = ", inject_context" if decision.inject_context else ""
        return f"StartWorkflow(workflow={decision.workflow!r}{extra})"
    if isinstance(decision, RunNativeAction):
        return f"RunNativeAction(action={decision.action!r})"
    return decision.kind


@dataclass(frozen=True)
class Rule:
    """One compiled rule. ``index`` is its position in the file (for tie-breaking)."""

    name: str
    priority: int
    condition: Condition
    decision: Decision
    index: int

    def matches(self, message: Message) -> bool:
        """Return True when this rule's condition holds for ``message``."""
        return self.condition.matches(message)


@dataclass(frozen=True)
class DroppedRule:
    """A rule refused as the file loaded; the rest of the file still loads."""

    name: str
    reason: str


@dataclass(frozen=True)
class Match:
    """The result of evaluating a message: the deciding rule (or None) and its decision."""

    rule: Optional[Rule]
    decision: Decision
    refused: bool = False  # True when a broken file is in force under on_error = "closed"

    @property
    def stops(self) -> bool:
        """True when the message does not reach the agent."""
        return self.refused or not isinstance(self.decision, PassToDefaultAgent)

    @property
    def answer(self) -> Optional[str]:
        """The fixed answer to the sender, where the spec gives one (Ignore, closed refusal)."""
        if self.refused:
            return CLOSED_ANSWER
        if isinstance(self.decision, Ignore):
            return IGNORED_ANSWER
        return None


@dataclass(frozen=True)
class RuleTrace:
    """How one rule fared in :meth:`RuleSet.explain`."""

    rule: Rule
    matched: bool
    reached: bool  # False for rules after the deciding one: they were never tried
    condition: ConditionTrace


@dataclass(frozen=True)
class Explanation:
    """Which rule decides a message and which conditions held or failed."""

    message: Message
    match: Match
    rules: tuple[RuleTrace, ...]
    error: Optional[str] = None

    @property
    def decided_by(self) -> Optional[Rule]:
        """The deciding rule, or None when no rule matched."""
        return self.match.rule

    def lines(self) -> list[str]:
        """Render the explanation as plain-text lines."""
        out: list[str] = []
        if self.error is not None:
            out.append(f"rule set failed to load: {self.error}")
        if self.match.refused:
            out.append(f"refused: {CLOSED_ANSWER}")
        elif self.match.rule is None:
            out.append("no rule matched: the agent answers")
        else:
            out.append(
                f'rule "{self.match.rule.name}" decides: {describe_decision(self.match.decision)}'
            )
        for t in self.rules:
            state = "matched" if t.matched else "did not match"
            if not t.reached:
                state += ", not reached"
            out.append(f'rule "{t.rule.name}" (priority {t.rule.priority}): {state}')
            out.extend(t.condition.lines(1))
        return out


class RuleSet:
    """An immutable, compiled set of rules, sorted once for evaluation."""

    def __init__(
        self,
        rules: Iterable[Rule] = (),
        *,
        source: Optional[str] = None,
        closed_error: Optional[str] = None,
    ):
        # sorted() is stable, so ties keep file order.
        self.rules: tuple[Rule, ...] = tuple(sorted(rules, key=lambda r: (-r.priority, r.index)))
        self.source = source
        self.closed_error = closed_error

    @classmethod
    def empty(cls) -> "RuleSet":
        """A rule set with no rules: every message goes to the agent."""
        return cls()

    @classmethod
    def closed(cls, error: str, *, source: Optional[str] = None) -> "RuleSet":
        """A rule set that refuses every message (broken file under ``on_error = "closed"``)."""
        return cls((), source=source, closed_error=error)

    @property
    def is_closed(self) -> bool:
        """True when this set refuses every message."""
        return self.closed_error is not None

    def __len__(self) -> int:
        return len(self.rules)

    def evaluate(self, message: Message) -> Match:
        """Return the first matching rule in priority order, or a pass-through Match."""
        if self.closed_error is not None:
            return Match(None, Ignore(), refused=True)
        for rule in self.rules:
            if rule.condition.matches(message):
                return Match(rule, rule.decision)
        return Match(None, PassToDefaultAgent())

    def explain(self, message: Message) -> Explanation:
        """Evaluate ``message`` and trace every rule's condition (for a "test a message" page)."""
        match = self.evaluate(message)
        traces = []
        decided = match.refused
        for rule in self.rules:
            tr = rule.condition.trace(message)
            traces.append(RuleTrace(rule, tr.held, not decided, tr))
            if tr.held and not decided:
                decided = True
        return Explanation(message, match, tuple(traces), self.closed_error)

    def dry_run(self, text: str, *, channel: str = DRY_RUN_CHANNEL) -> str:
        """Return the ``[dry-run]`` line for ``text`` tested as channel ``cli``, source type user."""
        match = self.evaluate(Message(text=text, channel=channel, source_type=DRY_RUN_SOURCE_TYPE))
        if match.rule is not None:
            return DRY_RUN_MATCHED.format(name=match.rule.name)
        return DRY_RUN_NO_MATCH.format(text=text)


@dataclass
class LoadResult:
    """What :func:`parse_rules` kept and dropped."""

    ruleset: RuleSet
    dropped: list[DroppedRule] = dc_field(default_factory=list)

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules kept, in evaluation order."""
        return self.ruleset.rules

    @property
    def count(self) -> int:
        """How many rules were kept."""
        return len(self.ruleset)


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------

WorkflowCheck = Callable[[str], Optional[str]]


def workflow_check_from(is_rule_trigger_job: Callable[[str], bool]) -> WorkflowCheck:
    """Build a ``workflow_check`` from a predicate "is NAME a cron job with rule_trigger = true"."""

    def check(workflow: str) -> Optional[str]:
        if is_rule_trigger_job(workflow):
            return None
        return DROP_WORKFLOW_NOT_TRIGGER.format(workflow=workflow)

    return check


def _parse_decision(raw: Any, where: str) -> tuple[Decision, Optional[str]]:
    """Return (decision, params-problem) where the problem is a drop reason or None."""
    if isinstance(raw, str):
        if raw == "PassToDefaultAgent":
            return PassToDefaultAgent(), None
        if raw == "Ignore":
            return Ignore(), None
        if raw in ("StartWorkflow", "RunNativeAction"):
            raise RuleSetError(
                f"{where}: decision `{raw}` needs a [rules.decision.{raw}] table"
            )
        raise RuleSetError(
            f"{where}: unknown decision `{raw}`, expected one of {', '.join(DECISION_KINDS)}"
        )
    if not isinstance(raw, dict):
        raise RuleSetError(f"{where}: expected a string or a table, found {_type_name(raw)}")
    kinds = [k for k in DECISION_KINDS if k in raw]
    if not kinds:
        found = ", ".join(sorted(raw)) or "none"
        raise RuleSetError(
            f"{where}: unknown decision (found keys: {found}), expected one of "
            f"{', '.join(DECISION_KINDS)}"
        )
    if len(kinds) > 1:
        raise RuleSetError(f"{where}: more than one decision ({', '.join(kinds)})")
    kind = kinds[0]
    body = raw[kind]
    if kind in ("PassToDefaultAgent", "Ignore"):
        raise RuleSetError(f'{where}: write decision = "{kind}", not a table')
    if not isinstance(body, dict):
        raise RuleSetError(f"{where}.{kind}: expected a table, found {_type_name(body)}")
    if kind == "StartWorkflow":
        if "workflow" not in body:
            raise RuleSetError(f"{where}.StartWorkflow: missing field `workflow`")
        workflow = body["workflow"]
        if not isinstance(workflow, str):
            raise RuleSetError(f"{where}.StartWorkflow.workflow: expected a string, found {_type_name(workflow)}")
        inject = body.get("inject_context", False)
        if not isinstance(inject, bool):
            raise RuleSetError(
                f"{where}.StartWorkflow.inject_context: expected a boolean, found {_type_name(inject)}"
            )
        return StartWorkflow(workflow, inject), None
    if "action" not in body:
        raise RuleSetError(f"{where}.RunNativeAction: missing field `action`")
    action = body["action"]
    if not isinstance(action, str):
        raise RuleSetError(f"{where}.RunNativeAction.action: expected a string, found {_type_name(action)}")
    problem = None
    if action not in NATIVE_ACTIONS:
        problem = DROP_UNKNOWN_ACTION.format(action=action)
    elif "params" in body:
        problem = DROP_ACTION_PARAMS.format(action=action)
    return RunNativeAction(action), problem


def parse_decision(raw: Any, where: str = "decision") -> tuple[Decision, Optional[str]]:
    """Compile one decision as rules.toml writes it (a string or a ``{Kind: params}`` table).

    Returns (decision, problem): ``problem`` is a load-time drop reason (an
    unknown native action, an action given params) or None. Raises
    :class:`RuleSetError` for a decision of no known shape.
    """
    return _parse_decision(raw, where)


def parse_rules(
    text: str,
    *,
    source: Union[str, Path, None] = None,
    workflow_check: Optional[WorkflowCheck] = None,
    check: bool = True,
    log: bool = True,
) -> LoadResult:
    """Parse and compile a rules.toml document.

    Raises :class:`RuleSetError` when the whole file is refused: invalid TOML,
    a missing required key (a key written in the wrong table shows up as
    "missing field `match`" / "missing field `decision`"), a condition of no
    known shape, a bad decision, or two rules with one name.

    With ``check`` (the default) a rule that could never run is dropped, with
    a reason, while the rest loads: an unknown native action, an action given
    params, or (when ``workflow_check`` is given) a workflow it rejects;
    ``workflow_check(name)`` returns a drop reason or None. ``check=False``
    keeps every rule, as the TUI's ``/rules test`` does. With ``log`` each
    drop is logged at error as ``rule dropped (rule=NAME, reason=...)``.
    """
    src = str(source) if source is not None else "<rules>"

    def fail(msg: str) -> RuleSetError:
        return RuleSetError(f"{src}: {msg}")

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise fail(f"invalid TOML: {exc}") from exc

    raw_rules = doc.get("rules", [])
    if not isinstance(raw_rules, list):
        raise fail("`rules` must be an array of tables: write each rule under [[rules]]")

    kept: list[Rule] = []
    dropped: list[DroppedRule] = []
    seen: dict[str, int] = {}
    try:
        for i, raw in enumerate(raw_rules):
            where = f"rules[{i}]"
            if not isinstance(raw, dict):
                raise RuleSetError(f"{where}: expected a table, found {_type_name(raw)}")
            if "name" not in raw:
                raise RuleSetError(f"{where}: missing field `name`")
            name = raw["name"]
            if not isinstance(name, str):
                raise RuleSetError(f"{where}.name: expected a string, found {_type_name(name)}")
            where = f"rule '{name}'"
            if name in seen:
                raise RuleSetError(
                    f"{where}: duplicate rule name `{name}` (rules[{seen[name]}] and rules[{i}])"
                )
            seen[name] = i
            priority = raw.get("priority", 0)
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise RuleSetError(f"{where}.priority: expected an integer, found {_type_name(priority)}")
            if "match" not in raw:
                raise RuleSetError(f"{where}: missing field `match`")
            if "decision" not in raw:
                raise RuleSetError(f"{where}: missing field `decision`")
            condition = compile_condition(raw["match"], where=f"{where}.match")
            decision, problem = _parse_decision(raw["decision"], f"{where}.decision")
            if check:
                if problem is None and isinstance(decision, StartWorkflow) and workflow_check:
                    problem = workflow_check(decision.workflow)
                if problem is not None:
                    dropped.append(DroppedRule(name, problem))
                    continue
            kept.append(Rule(name, priority, condition, decision, i))
    except RuleSetError as exc:
        raise fail(str(exc)) from None

    if log:
        for d in dropped:
            logger.error(LOG_RULE_DROPPED, d.name, d.reason)
    return LoadResult(RuleSet(kept, source=src), dropped)


def load_rules_file(
    path: Union[str, Path],
    *,
    workflow_check: Optional[WorkflowCheck] = None,
    check: bool = True,
    log: bool = True,
) -> LoadResult:
    """Read ``path`` and :func:`parse_rules` it; an unreadable file raises :class:`RuleSetError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleSetError(f"{p}: cannot read rules file: {exc}") from exc
    return parse_rules(text, source=p, workflow_check=workflow_check, check=check, log=log)
