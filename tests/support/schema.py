"""Validation against the OpenAI schema bundle in tests/data/ (see tests/data/README.md)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema

SPEC = Path(__file__).resolve().parents[1] / "data" / "openai-chat-subset.json"


@functools.lru_cache(maxsize=1)
def bundle() -> dict:
    return json.loads(SPEC.read_text())


def validate(obj, root: str) -> None:
    b = bundle()
    schema = {"$schema": b["$schema"], "$defs": b["$defs"], "$ref": f"#/$defs/{root}"}
    jsonschema.Draft202012Validator(schema).validate(obj)
