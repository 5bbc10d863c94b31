"""One style for validation errors: shapes are declared with pydantic, errors read `where: what`.

Every validator of the project (the rule engine, routing, cron's and plugins' TOML, the worker SDK's
messages, the bridge's requests) declares its input as a pydantic model and reports a failure as
`ShapeError`s whose text is `<where>: <what>`, `where` being the dotted path into the input
(`rules[2].when.field`, `plugins[0].limits.heartbeat_secs`). Messages the seeds quote are kept
word for word by passing them as the `what` of a custom check (`PydanticCustomError` or a
`ValueError` raised inside a validator).
"""
from __future__ import annotations

from typing import Iterable

from pydantic import ValidationError


def error_location(loc: Iterable, *, root: str = "") -> str:
    """`("rules", 2, "when")` → `rules[2].when` (under `root` when given)."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_message(err: dict) -> str:
    msg = err.get("msg", "")
    # pydantic prefixes a ValueError raised in a validator with "Value error, "; ours are already worded
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg


def error_lines(exc: ValidationError, *, root: str = "") -> list[str]:
    """Each error of `exc` as `where: what`, in pydantic's order."""
    lines = []
    for err in exc.errors(include_url=False):
        where = error_location(err.get("loc", ()), root=root) or root or "input"
        lines.append(f"{where}: {error_message(err)}")
    return lines


def first_error(exc: ValidationError, *, root: str = "") -> str:
    """The first error as one line: what a config file's loader reports to the operator."""
    lines = error_lines(exc, root=root)
    return lines[0] if lines else (root or "input") + ": is not valid"
