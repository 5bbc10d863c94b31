"""Routing: shape the prompt before the rule engine runs (hook priority 50).

routing.toml holds ``[[routes]]``; each has a name, a priority and a match
condition in the rule engine's condition language (compiled by
:class:`rules_app.engine.ConditionSpec`), and actions: ``rewrite``
(regex), ``tags``, ``allowed_tools`` (narrow only), ``inject_context``,
``delegate_research`` (a research task the turn delegates before it answers) and ``reject``. Every matching route applies, in descending priority (ties in
file order); a ``reject`` ends routing. See docs/routing.md.

Pure Python, no Django. The file's shape is declared once (``RoutingFileSpec``,
pydantic), checked at load and compiled into plain objects.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ugent_common.config import toml_refuse_empty
from ugent_common.validation import StrList, first_error, first_repeat, type_name

from .engine import FIELDS, Condition, ConditionSpec, MessageFacts, RuleSetError

logger = logging.getLogger("ugent.routing")

#: Routing cannot match how a message was made; that is the rule engine's job.
ROUTING_FIELDS = tuple(f for f in FIELDS if f != "input_mode")
_ROUTING_FIELD_ERRORS = {
    "input_mode": "field `input_mode` is not available to routing; match it in rules.toml instead",
}

LOG_ROUTING_LOADED = "routing loaded (routes=%d)"
LOG_ROUTING_FAILED = "failed to load routing — starting with no routes (fail-open)"
LOG_ROUTING_RELOAD_FAILED = "routing auto-reload failed — retaining previous routes"


class RoutingError(RuleSetError):
    """The whole routing file is refused."""


@dataclass(frozen=True)
class Rewrite:
    """One compiled ``rewrite = { pattern, replace }``; ``replace`` uses Python ``re.sub`` syntax."""

    pattern: re.Pattern
    replace: str

    def apply(self, text: str) -> str:
        """Return ``text`` with every match of the pattern replaced."""
        return self.pattern.sub(self.replace, text)


@dataclass(frozen=True)
class Route:
    """One compiled route."""

    name: str
    priority: int
    condition: Condition
    index: int
    rewrites: tuple[Rewrite, ...] = ()
    tags: tuple[str, ...] = ()
    allowed_tools: Optional[frozenset[str]] = None
    inject_context: Optional[str] = None
    reject: Optional[str] = None
    delegate_research: Optional[str] = None  # the task's template; ``{text}`` is the message


@dataclass(frozen=True)
class RoutingOutcome:
    """What routing did to one message."""

    text: Optional[str]
    tags: tuple[str, ...] = ()
    allowed_tools: Optional[frozenset[str]] = None
    """None: the turn's tools are untouched; else the turn may use only tools in this set."""
    context: tuple[str, ...] = ()
    rejection: Optional[str] = None
    matched: tuple[str, ...] = ()
    delegate_research: Optional[str] = None
    """The research task the first matching delegate-research route set (its ``{text}`` filled in)."""

    @property
    def rejected(self) -> bool:
        """True when a route rejected the message; answer it with :attr:`rejection`."""
        return self.rejection is not None

    @property
    def injected_context(self) -> Optional[str]:
        """The injected context blocks joined by blank lines, or None."""
        return "\n\n".join(self.context) if self.context else None

    def narrow_tools(self, tools: Iterable[str]) -> list[str]:
        """The turn's tools after routing: ``tools`` filtered, never extended, order kept."""
        tools = list(tools)
        if self.allowed_tools is None:
            return tools
        return [t for t in tools if t in self.allowed_tools]

    def apply(self, message: MessageFacts) -> MessageFacts:
        """``message`` with its text replaced by the rewritten text (what the rule engine sees)."""
        return dataclasses.replace(message, text=self.text)


class RoutingTable:
    """A compiled, sorted set of routes."""

    def __init__(self, routes: Iterable[Route] = (), *, source: Optional[str] = None):
        self.routes: tuple[Route, ...] = tuple(sorted(routes, key=lambda r: (-r.priority, r.index)))
        self.source = source

    def __len__(self) -> int:
        return len(self.routes)

    def route(self, message: MessageFacts) -> RoutingOutcome:
        """Apply every matching route to ``message`` in order and return the outcome.

        Each route's condition sees the text as rewritten by the routes before
        it. Tags accumulate (no duplicates), ``allowed_tools`` intersect,
        context blocks accumulate, and the first ``reject`` stops routing.
        """
        current = dataclasses.replace(message, input_mode=None)
        tags: list[str] = []
        allowed: Optional[frozenset[str]] = None
        context: list[str] = []
        matched: list[str] = []
        rejection: Optional[str] = None
        research: Optional[str] = None
        for route in self.routes:
            if not route.condition.matches(current):
                continue
            matched.append(route.name)
            if route.reject is not None:
                rejection = route.reject
                break
            if route.rewrites and current.text is not None:
                text = current.text
                for rw in route.rewrites:
                    text = rw.apply(text)
                current = dataclasses.replace(current, text=text)
            for tag in route.tags:
                if tag not in tags:
                    tags.append(tag)
            if route.allowed_tools is not None:
                allowed = route.allowed_tools if allowed is None else allowed & route.allowed_tools
            if route.inject_context is not None:
                context.append(route.inject_context)
            if route.delegate_research is not None and research is None:
                research = route.delegate_research.replace("{text}", current.text or "")
        return RoutingOutcome(
            text=current.text,
            tags=tuple(tags),
            allowed_tools=allowed,
            context=tuple(context),
            rejection=rejection,
            matched=tuple(matched),
            delegate_research=research,
        )


# --------------------------------------------------------------------------
# Parsing: routing.toml's shape, declared once (pydantic), compiled into the objects above
# --------------------------------------------------------------------------
# Keys routing does not know are ignored, as the rule engine's are; types are strict.

_SPEC = ConfigDict(strict=True, extra="ignore")
_LABELS = {"routes": "name"}


def _one_or_many(value: Any) -> Any:
    # `rewrite = { ... }` is a list of one, so its errors read `rewrite[0]`.
    return [value] if isinstance(value, dict) else value


def _route_tables(value: Any) -> Any:
    if not isinstance(value, list):
        raise PydanticCustomError("shape", "expected an array of tables: write each route under [[routes]], "
                                  "found {found}", {"found": type_name(value)})
    return value


class RewriteSpec(BaseModel):
    """``rewrite = { pattern, replace }``: both compile at load, so a bad one refuses the file."""

    model_config = _SPEC
    pattern: str
    replace: str

    @field_validator("pattern")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise PydanticCustomError("regex", "invalid regex: {error}", {"error": str(exc)}) from None
        return value

    @field_validator("replace")
    @classmethod
    def _template(cls, value: str, info: ValidationInfo) -> str:
        if "pattern" in info.data:
            try:
                # Compiles the replacement template now, so a bad group reference refuses the file at load.
                re.compile(info.data["pattern"]).sub(value, "")
            except (re.error, IndexError) as exc:
                raise PydanticCustomError("regex", "invalid replacement: {error}", {"error": str(exc)}) from None
        return value


def _non_empty(value: Optional[str]) -> Optional[str]:
    if value is not None and not value.strip():
        raise PydanticCustomError("empty", "expected a non-empty message string")
    return value


class RouteSpec(BaseModel):
    """One ``[[routes]]`` entry."""

    model_config = _SPEC
    name: str
    priority: int = 0
    match: ConditionSpec
    rewrite: Annotated[list[RewriteSpec], BeforeValidator(_one_or_many)] = []
    tags: StrList = []
    allowed_tools: Optional[StrList] = None
    inject_context: Optional[str] = None
    reject: Annotated[Optional[str], AfterValidator(_non_empty)] = None
    delegate_research: Optional[Union[bool, str]] = None  # true: the message itself is the task

    def compile(self, index: int) -> Route:
        """The plain Route this entry describes."""
        return Route(
            self.name, self.priority, self.match.compile(), index,
            tuple(Rewrite(re.compile(r.pattern), r.replace) for r in self.rewrite),
            tuple(self.tags),
            frozenset(self.allowed_tools) if self.allowed_tools is not None else None,
            self.inject_context, self.reject,
            ("{text}" if self.delegate_research is True else (self.delegate_research or None)),
        )


class RoutingFileSpec(BaseModel):
    """A routing.toml document."""

    model_config = _SPEC
    routes: Annotated[list[RouteSpec], BeforeValidator(_route_tables)] = []


_CONTEXT = {"fields": ROUTING_FIELDS, "field_errors": _ROUTING_FIELD_ERRORS}


def parse_routing(text: str, *, source: Union[str, Path, None] = None, refuse_empty: bool = False) -> RoutingTable:
    """Parse and compile a routing.toml document; raises :class:`RoutingError` to refuse the file.

    Keys routing does not know are ignored; a missing name or match, a
    condition of no known shape, a bad regex and two routes with one name
    refuse the whole file. The message reads ``<source>: <where>: <what>``.
    With ``refuse_empty`` a document with nothing in it (blank, or comments
    alone) raises ugent_common.config.EmptyFileError (toml_refuse_empty), as
    a watched rules file's reload does: ``routes = []`` says no routes.
    """
    src = str(source) if source is not None else "<routing>"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RoutingError(f"{src}: invalid TOML: {exc}") from exc
    if refuse_empty:
        toml_refuse_empty(doc, source=src, remove="remove every route", says="routes = []", means="no routes")
    try:
        spec = RoutingFileSpec.model_validate(doc, context=_CONTEXT)
    except ValidationError as exc:
        raise RoutingError(f"{src}: {first_error(exc, data=doc, labels=_LABELS)}") from None
    repeat = first_repeat(route.name for route in spec.routes)
    if repeat:
        first, i = repeat
        name = spec.routes[i].name
        raise RoutingError(f"{src}: routes[{i}] ({name}): duplicate route name `{name}` "
                           f"(routes[{first}] and routes[{i}])")
    routes: list[Route] = []
    for i, route in enumerate(spec.routes):
        routes.append(route.compile(i))
    return RoutingTable(routes, source=src)


def load_routing_file(path: Union[str, Path], *, refuse_empty: bool = False) -> RoutingTable:
    """Read and parse ``path``; an unreadable or invalid file raises :class:`RoutingError` (an empty one
    EmptyFileError, with ``refuse_empty``: :func:`parse_routing`)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RoutingError(f"{p}: cannot read routing file: {exc}") from exc
    return parse_routing(text, source=p, refuse_empty=refuse_empty)


def load_routing_or_empty(path: Optional[Union[str, Path]]) -> RoutingTable:
    """Load ``path`` failing open: log and return an empty table when it is None, unreadable or invalid."""
    if path is None:
        return RoutingTable()
    try:
        table = load_routing_file(path)
    except RoutingError as exc:
        logger.error("%s (error=%s)", LOG_ROUTING_FAILED, exc)
        return RoutingTable()
    logger.info(LOG_ROUTING_LOADED, len(table))
    return table
