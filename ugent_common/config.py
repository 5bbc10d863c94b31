"""Loading ugent.toml: the callers and keys of [web.auth]."""
from __future__ import annotations

import functools
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

log = logging.getLogger("ugent.config")
ROLES = ("operator", "application")
DEFAULT_CALLER = "default"  # the caller of UGENT_WEB_API_KEY


@dataclass(frozen=True)
class ConfiguredKey:
    caller: str
    role: str
    issuers: tuple = field(default_factory=tuple)
    raw: str = ""


def config_path() -> Path | None:
    if settings.UGENT_CONFIG:
        return Path(settings.UGENT_CONFIG)
    candidate = Path(settings.UGENT_WORKSPACE) / "ugent.toml"
    return candidate if candidate.exists() else None


@functools.lru_cache(maxsize=1)
def load_config() -> dict:
    """ugent.toml as a dict; {} when there is none. A broken file is logged, not fatal."""
    path = config_path()
    if not path or not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        log.error("ugent.toml could not be read (path=%s, error=%s)", path, exc)
        return {}


def configured_keys() -> list[ConfiguredKey]:
    """UGENT_WEB_API_KEY and each [[web.auth.keys]] entry whose environment variable is set."""
    auth = load_config().get("web", {}).get("auth", {})
    keys = []
    if settings.UGENT_WEB_API_KEY:
        role = auth.get("api_key_role", "operator")
        if role in ROLES:
            keys.append(ConfiguredKey(DEFAULT_CALLER, role, (), settings.UGENT_WEB_API_KEY))
        else:
            log.error("UGENT_WEB_API_KEY refused (api_key_role=%r; the roles are operator and application)", role)
    for entry in auth.get("keys", []):
        raw = os.environ.get(entry.get("key_env", ""), "")
        name, role = entry.get("name"), entry.get("role", "application")
        if not raw or not name:
            continue
        if role not in ROLES or name == DEFAULT_CALLER:
            log.error("key refused (name=%s, reason=%s)", name,
                      f"role {role!r} is not operator or application" if role not in ROLES
                      else f"the name {DEFAULT_CALLER!r} belongs to UGENT_WEB_API_KEY")
            continue
        keys.append(ConfiguredKey(name, role, tuple(entry.get("issuers", ())), raw))
    return keys


def reset_caches() -> None:
    load_config.cache_clear()
