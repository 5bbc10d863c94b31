"""Request bodies and text read the same way by every view: bad input is a 400, never a 500.

- A body that is not JSON, is nested past the parser's depth, or is not an
  object: 400 (`invalid_json`, `json_too_deep`, `invalid_request`).
- A body larger than UGENT_MAX_REQUEST_BYTES (Django's DATA_UPLOAD_MAX_MEMORY_SIZE): 413
  (`request_too_large`), an error object as every other refusal, not Django's HTML 400.
- Text the hub would store (a message's content): no lone surrogate (it is not
  Unicode, and neither UTF-8 nor PostgreSQL can hold it) and no NUL (PostgreSQL
  text cannot hold it). Both are refused with a 400 in both run modes, so a
  message is taken or refused the same way on SQLite and PostgreSQL. DRF's
  CharField already refuses both in every other field.
"""
from __future__ import annotations

import json

from django.core.exceptions import RequestDataTooBig
from rest_framework.parsers import JSONParser

from channels_app.errors import ApplicationError, request_too_large

NOT_JSON = "The request body is not valid JSON."
TOO_DEEP = "The request body is nested too deeply."
NOT_OBJECT = "The request body must be a JSON object."


def request_body(request) -> bytes:
    """The body of a request a view reads itself (the chat): one over UGENT_MAX_REQUEST_BYTES is a 413."""
    try:
        return request.body
    except RequestDataTooBig:
        raise request_too_large() from None


def json_object_parse(raw: bytes | str) -> dict:
    """The body as a JSON object, or a 400 ApplicationError."""
    try:
        payload = json.loads(raw or b"{}")
    except RecursionError:  # the C scanner recurses once per level: 5,000 levels ends here, not in a 500
        raise ApplicationError(TOO_DEEP, status=400, code="json_too_deep")
    except (ValueError, UnicodeDecodeError):
        raise ApplicationError(NOT_JSON, status=400, code="invalid_json")
    if not isinstance(payload, dict):
        raise ApplicationError(NOT_OBJECT, status=400, code="invalid_request")
    return payload


class JsonObjectParser(JSONParser):
    """DRF's JSON parser with the errors above (its own lets a RecursionError through as a 500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        return json_object_parse(stream.read() if stream is not None else b"")


def text_problem(text: str) -> str | None:
    """Why `text` cannot be stored as it is, or None."""
    if "\x00" in text:
        return "holds a NUL character (U+0000), which cannot be stored: remove it."
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds a lone surrogate (U+{ord(text[exc.start]):04X}), which is not Unicode text: "
                "send the text as valid UTF-8.")
    return None
