"""Routing: shape the prompt before the rule engine runs (hook priority 50).

routing.toml holds ``[[routes]]``; each has a name, a priority and a match
condition in the rule engine's condition language (compiled by
:func:`rules_app.engine.compile_condition`), and actions: ``rewrite``
(regex), ``tags``, ``allowed_tools`` (narrow only), ``inject_context`` and
``reject``. Every matching route applies, in descending priority (ties in
file order); a ``reject`` ends routing. See docs/routing.md.

Pure Python, no Django.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .engine import FIELDS, Condition, Message, RuleSetError, _type_name, compile_condition

logger = logging.getLogger("ugent.routing")

#: Routing cannot match how a message was made; that is the rule engine's job.
ROUTING_FIELDS = tuple(f for f in FIELDS if f != "input_mode")
_ROUTING_FIELD_ERRORS = {
    "input_mode": "field `input_mode` is not available to routing; match it in rules.toml instead",
}

LOG_ROUTING_LOADED = "routing loaded (routes=%d)"
LOG_ROUTING_FAILED = "failed to load routing — starting with no routes (fail-open)"


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

    def apply(self, message: Message) -> Message:
        """``message`` with its text replaced by the rewritten text (what the rule engine sees)."""
        return dataclasses.replace(message, text=self.text)


class RoutingTable:
    """A compiled, sorted set of routes."""

    def __init__(self, routes: Iterable[Route] = (), *, source: Optional[str] = None):
        self.routes: tuple[Route, ...] = tuple(sorted(routes, key=lambda r: (-r.priority, r.index)))
        self.source = source

    def __len__(self) -> int:
        return len(self.routes)

    def route(self, message: Message) -> RoutingOutcome:
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
        return RoutingOutcome(
            text=current.text,
            tags=tuple(tags),
            allowed_tools=allowed,
            context=tuple(context),
            rejection=rejection,
            matched=tuple(matched),
        )


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RoutingError(f"{where}: expected an array of strings")
    return tuple(value)


def _rewrite(raw: Any, where: str) -> Rewrite:
    if not isinstance(raw, dict):
        raise RoutingError(f"{where}: expected a table {{ pattern, replace }}, found {_type_name(raw)}")
    for key in ("pattern", "replace"):
        if key not in raw:
            raise RoutingError(f"{where}: missing field `{key}`")
        if not isinstance(raw[key], str):
            raise RoutingError(f"{where}.{key}: expected a string, found {_type_name(raw[key])}")
    try:
        pattern = re.compile(raw["pattern"])
    except re.error as exc:
        raise RoutingError(f"{where}.pattern: invalid regex: {exc}") from None
    try:
        # Compiles the replacement template now, so a bad group reference refuses the file at load.
        pattern.sub(raw["replace"], "")
    except (re.error, IndexError) as exc:
        raise RoutingError(f"{where}.replace: invalid replacement: {exc}") from None
    return Rewrite(pattern, raw["replace"])


def _route(raw: Any, i: int) -> Route:
    where = f"routes[{i}]"
    if not isinstance(raw, dict):
        raise RoutingError(f"{where}: expected a table, found {_type_name(raw)}")
    if "name" not in raw:
        raise RoutingError(f"{where}: missing field `name`")
    name = raw["name"]
    if not isinstance(name, str):
        raise RoutingError(f"{where}.name: expected a string, found {_type_name(name)}")
    where = f"route '{name}'"
    priority = raw.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RoutingError(f"{where}.priority: expected an integer, found {_type_name(priority)}")
    if "match" not in raw:
        raise RoutingError(f"{where}: missing field `match`")
    try:
        condition = compile_condition(
            raw["match"], where=f"{where}.match", fields=ROUTING_FIELDS, field_errors=_ROUTING_FIELD_ERRORS
        )
    except RuleSetError as exc:
        raise RoutingError(str(exc)) from None
    rewrites: tuple[Rewrite, ...] = ()
    if "rewrite" in raw:
        rw = raw["rewrite"]
        if isinstance(rw, list):
            rewrites = tuple(_rewrite(r, f"{where}.rewrite[{j}]") for j, r in enumerate(rw))
        else:
            rewrites = (_rewrite(rw, f"{where}.rewrite"),)
    tags = _strings(raw["tags"], f"{where}.tags") if "tags" in raw else ()
    allowed = frozenset(_strings(raw["allowed_tools"], f"{where}.allowed_tools")) if "allowed_tools" in raw else None
    inject = raw.get("inject_context")
    if inject is not None and not isinstance(inject, str):
        raise RoutingError(f"{where}.inject_context: expected a string, found {_type_name(inject)}")
    reject = raw.get("reject")
    if reject is not None and (not isinstance(reject, str) or not reject.strip()):
        raise RoutingError(f"{where}.reject: expected a non-empty message string")
    return Route(name, priority, condition, i, rewrites, tags, allowed, inject, reject)


def parse_routing(text: str, *, source: Union[str, Path, None] = None) -> RoutingTable:
    """Parse and compile a routing.toml document; raises :class:`RoutingError` to refuse the file.

    Keys routing does not know are ignored; a missing name or match, a
    condition of no known shape, a bad regex and two routes with one name
    refuse the whole file.
    """
    src = str(source) if source is not None else "<routing>"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RoutingError(f"{src}: invalid TOML: {exc}") from exc
    raw_routes = doc.get("routes", [])
    if not isinstance(raw_routes, list):
        raise RoutingError(f"{src}: `routes` must be an array of tables: write each route under [[routes]]")
    routes: list[Route] = []
    seen: dict[str, int] = {}
    try:
        for i, raw in enumerate(raw_routes):
            route = _route(raw, i)
            if route.name in seen:
                raise RoutingError(
                    f"route '{route.name}': duplicate route name `{route.name}` "
                    f"(routes[{seen[route.name]}] and routes[{i}])"
                )
            seen[route.name] = i
            routes.append(route)
    except RoutingError as exc:
        raise RoutingError(f"{src}: {exc}") from None
    return RoutingTable(routes, source=src)


def load_routing_file(path: Union[str, Path]) -> RoutingTable:
    """Read and parse ``path``; an unreadable or invalid file raises :class:`RoutingError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RoutingError(f"{p}: cannot read routing file: {exc}") from exc
    return parse_routing(text, source=p)


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
