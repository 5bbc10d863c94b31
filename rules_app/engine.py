"""The rule engine core: parse rules.toml, compile conditions, evaluate messages.

Pure Python; imports nothing from Django. The file's shape is declared once, as
pydantic specs (``RulesFileSpec`` and below), checked at load and compiled into
plain objects, so evaluation never touches pydantic. The Django side (hooks, admin,
management command) builds on :func:`parse_rules`, :class:`CompiledRuleSet` and the
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
from typing import Annotated, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ugent_common.config import EmptyFileError, toml_refuse_empty
from ugent_common.validation import StrList, first_error, first_repeat, type_name

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
class MessageFacts:
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

    def matches(self, message: MessageFacts) -> bool:  # pragma: no cover - abstract
        """Return True when the condition holds for ``message``."""
        raise NotImplementedError

    def trace(self, message: MessageFacts) -> ConditionTrace:  # pragma: no cover - abstract
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

    def matches(self, message: MessageFacts) -> bool:
        value = message.get(self.field)
        if value is None:
            return False
        return self._test(_fold(value))

    def trace(self, message: MessageFacts) -> ConditionTrace:
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

    def matches(self, message: MessageFacts) -> bool:
        return all(c.matches(message) for c in self.items)

    def trace(self, message: MessageFacts) -> ConditionTrace:
        kids = tuple(c.trace(message) for c in self.items)
        return ConditionTrace(self.describe(), all(k.held for k in kids), kids)

    def describe(self) -> str:
        return "all of" if self.items else "all of [] (always matches)"


class AnyOf(Condition):
    """``{ any_of = [...] }``: at least one condition matches; an empty list never matches."""

    def __init__(self, items: Sequence[Condition]):
        self.items = tuple(items)

    def matches(self, message: MessageFacts) -> bool:
        return any(c.matches(message) for c in self.items)

    def trace(self, message: MessageFacts) -> ConditionTrace:
        kids = tuple(c.trace(message) for c in self.items)
        return ConditionTrace(self.describe(), any(k.held for k in kids), kids)

    def describe(self) -> str:
        return "any of" if self.items else "any of [] (never matches)"


class Not(Condition):
    """``{ not = { ... } }``."""

    def __init__(self, inner: Condition):
        self.inner = inner

    def matches(self, message: MessageFacts) -> bool:
        return not self.inner.matches(message)

    def trace(self, message: MessageFacts) -> ConditionTrace:
        kid = self.inner.trace(message)
        return ConditionTrace(self.describe(), not kid.held, (kid,))

    def describe(self) -> str:
        return "not"


class Always(Condition):
    """``{ always = true }`` matches everything; ``always = false`` nothing."""

    def __init__(self, value: bool):
        self.value = value

    def matches(self, message: MessageFacts) -> bool:
        return self.value

    def trace(self, message: MessageFacts) -> ConditionTrace:
        return ConditionTrace(self.describe(), self.value)

    def describe(self) -> str:
        return "always" if self.value else "never (always = false)"


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
class CompiledRule:
    """One compiled rule. ``index`` is its position in the file (for tie-breaking)."""

    name: str
    priority: int
    condition: Condition
    decision: Decision
    index: int

    def matches(self, message: MessageFacts) -> bool:
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

    rule: Optional[CompiledRule]
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
    """How one rule fared in :meth:`CompiledRuleSet.explain`."""

    rule: CompiledRule
    matched: bool
    reached: bool  # False for rules after the deciding one: they were never tried
    condition: ConditionTrace


@dataclass(frozen=True)
class Explanation:
    """Which rule decides a message and which conditions held or failed."""

    message: MessageFacts
    match: Match
    rules: tuple[RuleTrace, ...]
    error: Optional[str] = None

    @property
    def decided_by(self) -> Optional[CompiledRule]:
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


class CompiledRuleSet:
    """An immutable, compiled set of rules, sorted once for evaluation."""

    def __init__(
        self,
        rules: Iterable[CompiledRule] = (),
        *,
        source: Optional[str] = None,
        closed_error: Optional[str] = None,
    ):
        # sorted() is stable, so ties keep file order.
        self.rules: tuple[CompiledRule, ...] = tuple(sorted(rules, key=lambda r: (-r.priority, r.index)))
        self.source = source
        self.closed_error = closed_error
        from rules_app.index import RuleIndex  # it builds on the condition classes defined in this module
        self.index = RuleIndex(self.rules)

    @classmethod
    def empty(cls) -> "CompiledRuleSet":
        """A rule set with no rules: every message goes to the agent."""
        return cls()

    @classmethod
    def closed(cls, error: str, *, source: Optional[str] = None) -> "CompiledRuleSet":
        """A rule set that refuses every message (broken file under ``on_error = "closed"``)."""
        return cls((), source=source, closed_error=error)

    @property
    def is_closed(self) -> bool:
        """True when this set refuses every message."""
        return self.closed_error is not None

    def __len__(self) -> int:
        return len(self.rules)

    def evaluate(self, message: MessageFacts) -> Match:
        """Return the first matching rule in priority order, or a pass-through Match.

        Only the rules the index says could match are tried (rules_app/index.py); the answer is
        exactly :meth:`evaluate_linear`'s.
        """
        if self.closed_error is not None:
            return Match(None, Ignore(), refused=True)
        rule = self.index.first_match(message)
        return Match(None, PassToDefaultAgent()) if rule is None else Match(rule, rule.decision)

    def evaluate_linear(self, message: MessageFacts) -> Match:
        """:meth:`evaluate` by trying every rule in order: the reference the index is held to."""
        if self.closed_error is not None:
            return Match(None, Ignore(), refused=True)
        for rule in self.rules:
            if rule.condition.matches(message):
                return Match(rule, rule.decision)
        return Match(None, PassToDefaultAgent())

    def explain(self, message: MessageFacts) -> Explanation:
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
        match = self.evaluate(MessageFacts(text=text, channel=channel, source_type=DRY_RUN_SOURCE_TYPE))
        if match.rule is not None:
            return DRY_RUN_MATCHED.format(name=match.rule.name)
        return DRY_RUN_NO_MATCH.format(text=text)


@dataclass
class LoadResult:
    """What :func:`parse_rules` kept and dropped."""

    ruleset: CompiledRuleSet
    dropped: list[DroppedRule] = dc_field(default_factory=list)

    @property
    def rules(self) -> tuple[CompiledRule, ...]:
        """The rules kept, in evaluation order."""
        return self.ruleset.rules

    @property
    def count(self) -> int:
        """How many rules were kept."""
        return len(self.ruleset)


# --------------------------------------------------------------------------
# Parsing: the file's shape, declared once (pydantic), compiled into the plain objects above
# --------------------------------------------------------------------------
#
# Validation happens at load only: the specs below check the file and are then compiled into
# the Condition/CompiledRule/decision objects, so evaluation never touches pydantic. Keys the engine does
# not know are ignored (the seed: "enabled = false leaves a rule live"), so every spec is
# ``extra="ignore"``; types are strict, so ``priority = "1"`` is refused rather than read as 1.

_COMBINATOR_KEYS = ("all_of", "any_of", "not", "always")
_FIELD_OPS = ("contains_any", "starts_with", "equals")
_SPEC = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
_LABELS = {"rules": "name"}

#: Kept for callers that imported it from here; the one definition is ugent_common's.
_type_name = type_name


def _shape_error(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("shape", message, ctx)


def _conditions(value: Any) -> Any:
    if not isinstance(value, list):
        raise _shape_error("expected an array of conditions, found {found}", found=type_name(value))
    return value


class ConditionSpec(BaseModel):
    """One condition as the file writes it: exactly one of field (with one comparison), all_of,
    any_of, not, always. The allowed fields come from the validation context (routing's differ)."""

    model_config = _SPEC

    field: Optional[str] = None
    contains_any: Optional[StrList] = None
    starts_with: Optional[str] = None
    equals: Optional[str] = None
    all_of: Optional[Annotated[list["ConditionSpec"], BeforeValidator(_conditions)]] = None
    any_of: Optional[Annotated[list["ConditionSpec"], BeforeValidator(_conditions)]] = None
    not_: Optional["ConditionSpec"] = Field(None, alias="not")
    always: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _one_shape(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise _shape_error("a condition must be a table, found {found}", found=type_name(raw))
        shapes = [k for k in ("field", *_COMBINATOR_KEYS) if k in raw]
        ops = [k for k in _FIELD_OPS if k in raw]
        if not shapes:
            if ops:
                raise _shape_error("missing field `field` (for `{op}`)", op=ops[0])
            raise _shape_error(
                "condition of no known shape; expected `field` with contains_any/starts_with/equals, "
                "or one of all_of, any_of, not, always (found keys: {found})",
                found=", ".join(sorted(raw)) or "none")
        if len(shapes) > 1:
            raise _shape_error(
                "condition of no known shape; it mixes {shapes} "
                "(a condition has exactly one of field, all_of, any_of, not, always)",
                shapes=", ".join(shapes))
        if shapes[0] == "field" and isinstance(raw["field"], str):
            if not ops:
                raise _shape_error("condition of no known shape; field `{field}` needs one of "
                                   "contains_any, starts_with, equals", field=raw["field"])
            if len(ops) > 1:
                raise _shape_error("condition of no known shape; it gives both {a} and {b} "
                                   "(one comparison per condition; combine with all_of/any_of)",
                                   a=ops[0], b=ops[1])
        # Only the shape's own keys are read; an op beside a combinator was refused above.
        return {k: raw[k] for k in ("field", *_FIELD_OPS, *_COMBINATOR_KEYS) if k in raw}

    @field_validator("field")
    @classmethod
    def _known_field(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        ctx = info.context or {}
        fields = ctx.get("fields", FIELDS)
        if value is not None and value not in fields:
            refused = ctx.get("field_errors") or {}
            if value in refused:
                raise _shape_error(refused[value])
            raise _shape_error("unknown field `{value}`, expected one of {fields}",
                               value=value, fields=", ".join(fields))
        return value

    def compile(self) -> Condition:
        """The plain, immutable Condition this spec describes."""
        if self.field is not None:
            if self.contains_any is not None:
                return ContainsAny(self.field, self.contains_any)
            if self.starts_with is not None:
                return StartsWith(self.field, self.starts_with)
            return Equals(self.field, self.equals)
        if self.all_of is not None:
            return AllOf([c.compile() for c in self.all_of])
        if self.any_of is not None:
            return AnyOf([c.compile() for c in self.any_of])
        if self.not_ is not None:
            return Not(self.not_.compile())
        return Always(self.always)


class StartWorkflowSpec(BaseModel):
    """``[rules.decision.StartWorkflow]``."""

    model_config = _SPEC
    workflow: str
    inject_context: bool = False


class RunNativeActionSpec(BaseModel):
    """``[rules.decision.RunNativeAction]``; ``params`` is read only to drop the rule that gives it."""

    model_config = _SPEC
    action: str
    params: Any = None


class DecisionSpec(BaseModel):
    """A decision: ``decision = "Ignore"`` / ``"PassToDefaultAgent"``, or a ``{Kind: params}`` table."""

    model_config = _SPEC
    PassToDefaultAgent: Optional[bool] = None
    Ignore: Optional[bool] = None
    StartWorkflow: Optional[StartWorkflowSpec] = None
    RunNativeAction: Optional[RunNativeActionSpec] = None

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            if raw in ("PassToDefaultAgent", "Ignore"):
                return {raw: True}  # a table holding these is refused below, so only a string gets here
            if raw in ("StartWorkflow", "RunNativeAction"):
                raise _shape_error("decision `{kind}` needs a [rules.decision.{kind}] table", kind=raw)
            raise _shape_error("unknown decision `{kind}`, expected one of {kinds}",
                               kind=raw, kinds=", ".join(DECISION_KINDS))
        if not isinstance(raw, dict):
            raise _shape_error("expected a string or a table, found {found}", found=type_name(raw))
        kinds = [k for k in DECISION_KINDS if k in raw]
        if not kinds:
            raise _shape_error("unknown decision (found keys: {found}), expected one of {kinds}",
                               found=", ".join(sorted(raw)) or "none", kinds=", ".join(DECISION_KINDS))
        if len(kinds) > 1:
            raise _shape_error("more than one decision ({kinds})", kinds=", ".join(kinds))
        if kinds[0] in ("PassToDefaultAgent", "Ignore"):
            raise _shape_error('write decision = "{kind}", not a table', kind=kinds[0])
        return {kinds[0]: raw[kinds[0]]}

    def compile(self) -> tuple[Decision, Optional[str]]:
        """(decision, drop reason or None): an unknown action or one given params is dropped."""
        if self.StartWorkflow is not None:
            return StartWorkflow(self.StartWorkflow.workflow, self.StartWorkflow.inject_context), None
        if self.RunNativeAction is not None:
            spec = self.RunNativeAction
            problem = None
            if spec.action not in NATIVE_ACTIONS:
                problem = DROP_UNKNOWN_ACTION.format(action=spec.action)
            elif "params" in spec.model_fields_set:
                problem = DROP_ACTION_PARAMS.format(action=spec.action)
            return RunNativeAction(spec.action), problem
        return (Ignore() if self.Ignore else PassToDefaultAgent()), None


class RuleSpec(BaseModel):
    """One ``[[rules]]`` entry. Field order is check order: a key written under the wrong header
    shows up as ``missing field `match``` / ``missing field `decision```, as the seed says."""

    model_config = _SPEC
    name: str
    priority: int = 0
    match: ConditionSpec
    decision: DecisionSpec


def _rule_tables(value: Any) -> Any:
    if not isinstance(value, list):
        raise _shape_error("expected an array of tables: write each rule under [[rules]], found {found}",
                           found=type_name(value))
    return value


class RulesFileSpec(BaseModel):
    """A rules.toml document."""

    model_config = _SPEC
    rules: Annotated[list[RuleSpec], BeforeValidator(_rule_tables)] = []


WorkflowCheck = Callable[[str], Optional[str]]


def workflow_check_from(is_rule_trigger_job: Callable[[str], bool]) -> WorkflowCheck:
    """Build a ``workflow_check`` from a predicate "is NAME a cron job with rule_trigger = true"."""

    def check(workflow: str) -> Optional[str]:
        if is_rule_trigger_job(workflow):
            return None
        return DROP_WORKFLOW_NOT_TRIGGER.format(workflow=workflow)

    return check


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
    try:
        spec = ConditionSpec.model_validate(raw, context={"fields": tuple(fields), "field_errors": field_errors})
    except ValidationError as exc:
        raise RuleSetError(first_error(exc, root=where)) from None
    return spec.compile()


def parse_decision(raw: Any, where: str = "decision") -> tuple[Decision, Optional[str]]:
    """Compile one decision as rules.toml writes it (a string or a ``{Kind: params}`` table).

    Returns (decision, problem): ``problem`` is a load-time drop reason (an
    unknown native action, an action given params) or None. Raises
    :class:`RuleSetError` for a decision of no known shape.
    """
    try:
        spec = DecisionSpec.model_validate(raw)
    except ValidationError as exc:
        raise RuleSetError(first_error(exc, root=where)) from None
    return spec.compile()


def parse_rules(
    text: str,
    *,
    source: Union[str, Path, None] = None,
    workflow_check: Optional[WorkflowCheck] = None,
    check: bool = True,
    log: bool = True,
    refuse_empty: bool = False,
) -> LoadResult:
    """Parse and compile a rules.toml document.

    Raises :class:`RuleSetError` when the whole file is refused: invalid TOML,
    a missing required key (a key written in the wrong table shows up as
    "missing field `match`" / "missing field `decision`"), a condition of no
    known shape, a bad decision, or two rules with one name. The message reads
    ``<source>: <where>: <what>``, e.g. ``rules.toml: rules[1] (bad).match.any_of[0]: ...``.

    With ``check`` (the default) a rule that could never run is dropped, with
    a reason, while the rest loads: an unknown native action, an action given
    params, or (when ``workflow_check`` is given) a workflow it rejects;
    ``workflow_check(name)`` returns a drop reason or None. ``check=False``
    keeps every rule, as the TUI's ``/rules test`` does. With ``log`` each
    drop is logged at error as ``rule dropped (rule=NAME, reason=...)``.
    With ``refuse_empty`` a document with nothing in it (blank, or comments
    alone) is refused too (ugent_common.config.toml_refuse_empty).
    """
    src = str(source) if source is not None else "<rules>"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its text carries the line and column
        raise RuleSetError(f"{src}: invalid TOML: {exc}") from exc
    if refuse_empty:
        try:
            toml_refuse_empty(doc, source=src, remove="empty the set", says="rules = []", means="no rules")
        except EmptyFileError as exc:
            raise RuleSetError(exc.held) from None
    try:
        spec = RulesFileSpec.model_validate(doc, context={"fields": FIELDS})
    except ValidationError as exc:
        raise RuleSetError(f"{src}: {first_error(exc, data=doc, labels=_LABELS)}") from None

    kept: list[CompiledRule] = []
    dropped: list[DroppedRule] = []
    repeat = first_repeat(rule.name for rule in spec.rules)
    if repeat:
        first, i = repeat
        name = spec.rules[i].name
        raise RuleSetError(f"{src}: rules[{i}] ({name}): duplicate rule name `{name}` (rules[{first}] and rules[{i}])")
    for i, rule in enumerate(spec.rules):
        decision, problem = rule.decision.compile()
        if check:
            if problem is None and isinstance(decision, StartWorkflow) and workflow_check:
                problem = workflow_check(decision.workflow)
            if problem is not None:
                dropped.append(DroppedRule(rule.name, problem))
                continue
        kept.append(CompiledRule(rule.name, rule.priority, rule.match.compile(), decision, i))

    if log:
        for d in dropped:
            logger.error(LOG_RULE_DROPPED, d.name, d.reason)
    return LoadResult(CompiledRuleSet(kept, source=src), dropped)


def load_rules_file(
    path: Union[str, Path],
    *,
    workflow_check: Optional[WorkflowCheck] = None,
    check: bool = True,
    log: bool = True,
    refuse_empty: bool = False,
) -> LoadResult:
    """Read ``path`` and :func:`parse_rules` it; an unreadable file raises :class:`RuleSetError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleSetError(f"{p}: cannot read rules file: {exc}") from exc
    return parse_rules(text, source=p, workflow_check=workflow_check, check=check, log=log,
                       refuse_empty=refuse_empty)
