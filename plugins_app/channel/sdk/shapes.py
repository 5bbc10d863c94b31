"""Declared shapes for the bridge protocol: pydantic models, errors in the project's one style.

The SDK's messages (``messages.py``) and the bridge's request params
(``plugins_app.channel.bridge.params``) declare their shapes as ``Shape`` models: strict
(``"1"`` is not an integer, ``true`` is not a number), unknown members ignored
(a newer peer may add fields). A failure becomes one ``where: what`` line
(``ugent_common.validation``), ``where`` the dotted path (``message.attachments[0].kind``)
and ``what`` in the protocol's words (``must be one of image, audio, ...``), which
the bridge sends as -32602 ``Invalid params: <where>: <what>``.

A check that names a field other than where pydantic found it (a model-level
rule such as "an attachment needs a media_id or a url") raises ``field_error``.
No Django here.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from ugent_common.validation import error_location, error_message

__all__ = ["Shape", "ValidationError", "field_error", "shape_errors"]


class Shape(BaseModel):
    """A protocol shape: strict types, unknown members ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


def field_error(field: str, what: str) -> PydanticCustomError:
    """An error for ``field`` of the model being checked (raise it from a model validator)."""
    return PydanticCustomError("field_rule", what, {"field": field})


def _quoted(expected: str) -> list[str]:
    return re.findall(r"'([^']*)'", expected)


def _what(err: dict) -> str:
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind == "missing" or (kind.endswith("_type") and err.get("input", ...) is None):
        return "is required"  # an explicit null is as absent as a missing member
    words = {
        "string_type": "must be a string",
        "string_too_short": "must not be empty",
        "int_type": "must be an integer",
        "bool_type": "must be a boolean",
        "float_type": "must be a number",
        "list_type": "must be an array",
        "dict_type": "must be an object",
        "model_type": "must be an object",
        "model_attributes_type": "must be an object",
    }
    if kind in words:
        return words[kind]
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if kind == "greater_than_equal":
        return f"must be at least {ctx.get('ge')}"
    if kind == "greater_than":
        return f"must be greater than {ctx.get('gt')}"
    if kind == "literal_error":
        return "must be one of " + ", ".join(_quoted(str(ctx.get("expected", ""))))
    return error_message(err)


def shape_errors(exc: ValidationError, *, root: str = "", default: str = "params") -> list[tuple[str, str]]:
    """Each error of ``exc`` as (where, what), in pydantic's order."""
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        field = (err.get("ctx") or {}).get("field") if err.get("type") == "field_rule" else None
        if field:
            loc = loc + (field,)
        out.append((error_location(loc, root=root) or root or default, _what(err)))
    return out


def first_shape_error(exc: ValidationError, *, root: str = "", default: str = "params") -> tuple[str, str]:
    errors = shape_errors(exc, root=root, default=default)
    return errors[0] if errors else (root or default, "is not valid")


def validate_shape(model: type[Shape], value: Any, *, root: str = "", default: str = "params",
                   error: type[Exception]) -> Any:
    """``model`` validated from ``value``, or ``error(where, what)`` raised for its first error."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        where, what = first_shape_error(exc, root=root, default=default)
        raise error(where, what) from None
