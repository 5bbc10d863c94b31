"""The params of each bridge method, declared as shapes (``plugins_app.channel.sdk.shapes``); no Django.

``parse(Model, args, params)`` validates one request's named params and raises
-32602 ``Invalid params: <field>: <reason>`` (``data: {"field", "reason"}``) for
the first thing wrong, as docs/plugin-protocol.md names it.
"""
from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Optional, TypeVar

from pydantic import AfterValidator, Field, model_validator

from plugins_app.channel.sdk.jsonrpc import InvalidParams
from plugins_app.channel.sdk.messages import MAX_ID_LENGTH, _content_type
from plugins_app.channel.sdk.shapes import Shape, field_error, validate_shape

PROTOCOL_VERSION = 1
DEFAULT_POLL_SECS = 25.0

Name = Annotated[str, Field(min_length=1)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]


def _protocol(value: int) -> int:
    if value != PROTOCOL_VERSION:
        raise ValueError(f"unsupported; this host speaks {PROTOCOL_VERSION}")
    return value


def _base64(value: str) -> str:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("must be standard base64") from None
    return value


class HelloParams(Shape):
    plugin_id: Name
    token: Name
    kind: Name
    version: Name
    capabilities: list[str] = []
    protocol_version: Annotated[int, AfterValidator(_protocol)] = PROTOCOL_VERSION
    pid: Any = None  # informative only: kept when it is an integer


class HeartbeatParams(Shape):
    stats: dict = {}


class SubmitParams(Shape):
    message: Any  # validated as an InboundMessage, whose errors name message.<field>

    @model_validator(mode="after")
    def _present(self):
        if self.message is None:
            raise field_error("message", "is required")
        return self


class PollParams(Shape):
    max_items: Optional[Annotated[int, Field(ge=1)]] = None  # default: the session's max_in_flight
    timeout_secs: Annotated[float, Field(ge=0)] = DEFAULT_POLL_SECS


class AckParams(Shape):
    delivery_id: Name
    status: Literal["delivered", "failed"]
    retryable: Optional[bool] = None
    reason: Optional[str] = None
    channel_message_id: Optional[str] = None
    claim: Optional[Id] = None

    @model_validator(mode="after")
    def _failure_says_why(self):
        if self.status == "failed":
            if self.retryable is None:
                raise field_error("retryable", "is required when status is failed")
            if not self.reason:
                raise field_error("reason", "is required when status is failed")
        return self


class MediaGetParams(Shape):
    media_id: Name


class MediaPutParams(Shape):
    content_type: Annotated[Name, AfterValidator(_content_type)]
    filename: Optional[str] = None
    data_base64: Annotated[str, AfterValidator(_base64)]

    @property
    def data(self) -> bytes:
        return base64.b64decode(self.data_base64, validate=True)


P = TypeVar("P", bound=Shape)


def _invalid(field: str, reason: str) -> InvalidParams:
    return InvalidParams(reason, field=field)


def parse(model: type[P], args: tuple, params: dict) -> P:
    """One method's params, validated; -32602 naming the field otherwise."""
    if args:
        raise InvalidParams("params must be an object (named parameters)")
    return validate_shape(model, params, error=_invalid)
