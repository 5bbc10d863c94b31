"""One style for validation errors: shapes are declared with pydantic, errors read `where: what`.

Every validator of the project (the rule engine, routing, cron's and plugins' TOML, the worker SDK's
messages, the bridge's requests) declares its input as a pydantic model and reports a failure as
one line `<where>: <what>`, `where` being the dotted path into the input (`rules[2].match.field`,
`plugins[0].limits.heartbeat_secs`). The style, decided once here:

* an entry of a named list carries its name after its index: `plugins[0] (telegram-main).kind`
  (`labels={"plugins": "id"}`), so an operator finds it in a long file;
* a missing key is reported at the table that lacks it, as serde words it and the rule engine's
  seed quotes (rules[0] (late): missing field `decision`);
* a key a strict file does not know: `jobs[0] (a).schedul: unknown field`;
* a wrong type names both, in TOML's words: `priority: expected an integer, found string`;
* a message the seeds quote is kept word for word by raising it as the `what` of a custom check
  (`PydanticCustomError`, or a `ValueError` inside a validator).

Types shared by the declarations (`StrList`, `one_of`) live here too.
"""
from __future__ import annotations

import datetime as _dt
from typing import Annotated, Any, Iterable, Mapping, Optional

from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic_core import PydanticCustomError


def type_name(value: Any) -> str:
    """The TOML name of a value's type, for `found …`."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return "datetime"
    return type(value).__name__


#: pydantic's type errors, said as what the file should have held.
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "bool_type": "a boolean", "bool_parsing": "a boolean",
    "string_type": "a string",
    "float_type": "a number", "float_parsing": "a number",
    "list_type": "an array", "tuple_type": "an array",
    "dict_type": "a table", "model_type": "a table", "model_attributes_type": "a table",
    "dataclass_type": "a table",
}


def error_location(loc: Iterable, *, root: str = "", data: Any = None,
                   labels: Optional[Mapping[str, str]] = None) -> str:
    """`("rules", 2, "match")` → `rules[2].match` (under `root` when given).

    With `data` (the input validated) and `labels` (`{list key: label key}`), an entry of such a
    list whose label is a non-empty string reads `rules[2] (its-name)`.
    """
    out = root
    cur = data
    prev: Any = None
    for part in loc:
        nxt = None
        try:
            nxt = cur[part] if isinstance(cur, (dict, list)) else None
        except (KeyError, IndexError, TypeError):
            nxt = None
        if isinstance(part, int):
            out += f"[{part}]"
            key = labels.get(prev) if (labels and isinstance(prev, str)) else None
            label = nxt.get(key) if (key and isinstance(nxt, dict)) else None
            if isinstance(label, str) and label:
                out += f" ({label})"
        else:
            out += f".{part}" if out else str(part)
        cur, prev = nxt, part
    return out


def error_message(err: dict) -> str:
    """The `what` of one pydantic error, in the project's words."""
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, found {type_name(err.get('input'))}"
    msg = err.get("msg", "")
    # pydantic prefixes a ValueError raised in a validator with "Value error, "; ours are already worded
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg


def error_lines(exc: ValidationError, *, root: str = "", data: Any = None,
                labels: Optional[Mapping[str, str]] = None) -> list[str]:
    """Each error of `exc` as `where: what`, in pydantic's order."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        what = error_message(err)
        if err.get("type") == "missing" and loc:
            loc, what = loc[:-1], f"missing field `{loc[-1]}`"
        where = error_location(loc, root=root, data=data, labels=labels) or root or "input"
        lines.append(f"{where}: {what}")
    return lines


def first_error(exc: ValidationError, *, root: str = "", data: Any = None,
                labels: Optional[Mapping[str, str]] = None) -> str:
    """The first error as one line: what a config file's loader reports to the operator."""
    lines = error_lines(exc, root=root, data=data, labels=labels)
    return lines[0] if lines else (root or "input") + ": is not valid"


# --------------------------------------------------------------------------
# Shared declarations
# --------------------------------------------------------------------------


def _strings(value: Any) -> Any:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PydanticCustomError("str_list", "expected an array of strings, found {found}",
                                  {"found": _found_for_list(value)})
    return value


def _found_for_list(value: Any) -> str:
    if isinstance(value, list):
        i, bad = next((i, v) for i, v in enumerate(value) if not isinstance(v, str))
        return f"{type_name(bad)} at [{i}]"
    return type_name(value)


#: An array of strings, refused as a whole (`tags: expected an array of strings, found string`).
StrList = Annotated[list[str], BeforeValidator(_strings)]


def one_of(*values: str):
    """A string that must be one of `values`: `'sometimes' is not one of skip, queue, allow`."""
    allowed = ", ".join(values)

    def check(value: str) -> str:
        if value not in values:
            raise PydanticCustomError("one_of", "'{value}' is not one of {allowed}",
                                      {"value": value, "allowed": allowed})
        return value

    return Annotated[str, AfterValidator(check)]


def first_repeat(values) -> tuple[int, int] | None:
    """(first index, repeat index) of the first value that comes twice, or None: the names and ids
    of a config file's entries must be unique, and each loader words the error its own way."""
    seen: dict = {}
    for i, value in enumerate(values):
        if value in seen:
            return seen[value], i
        seen[value] = i
    return None
