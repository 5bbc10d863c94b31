"""Finding and instantiating chat engines through OPM's opm.agents.* entry points.

Engine instances are cached per profile version: engines are stateless (the
seed), so one instance serves every turn of a profile and keeps its
connection pool warm.
"""
from __future__ import annotations

import importlib
import os
import threading

from ovos_plugin_manager.utils import PluginTypes, find_plugins

_lock = threading.Lock()
_instances: dict[tuple, object] = {}
_extra: dict[str, type] = {}


def register_engine(name: str, cls: type) -> None:
    """Register an engine class in-process (tests, embedding applications)."""
    _extra[name] = cls


def _env_engines() -> dict[str, type]:
    """UGENT_EXTRA_ENGINES="name=module:Class,..." for engines that are not installed packages."""
    out = {}
    for item in filter(None, os.environ.get("UGENT_EXTRA_ENGINES", "").split(",")):
        name, _, target = item.partition("=")
        module, _, attr = target.partition(":")
        out[name.strip()] = getattr(importlib.import_module(module.strip()), attr.strip())
    return out


def chat_engines() -> dict[str, type]:
    """Every installed chat engine by entry-point name (multimodal ones included)."""
    found = {}
    for group in (PluginTypes.AGENT_CHAT, PluginTypes.AGENT_CHAT_MULTIMODAL):
        found.update(find_plugins(group))
    found.update(_env_engines())
    found.update(_extra)
    return found


def engine_class(provider: str) -> type:
    if provider in _extra:
        return _extra[provider]
    engines = chat_engines()
    if provider not in engines:
        raise LookupError(f"no chat engine named '{provider}' is installed")
    return engines[provider]


def engine_for_profile(profile) -> object:
    key = (profile.pk, profile.updated_at, profile.provider)
    with _lock:
        engine = _instances.get(key)
        if engine is None:
            for old in [k for k in _instances if k[0] == profile.pk]:
                _close(_instances.pop(old))
            config = dict(profile.config or {})
            if profile.system_prompt and "system_prompt" not in config:
                config["system_prompt"] = profile.system_prompt
            _never_logged(config)
            engine = engine_class(profile.provider)(config)
            _instances[key] = engine
        return engine


def _never_logged(config: dict) -> None:
    """A profile's secret-named config values (api_key, token, …) are redacted from every log line."""
    from ugent_common.logs import secret_add
    for name, value in config.items():
        if isinstance(value, str) and any(w in name.lower() for w in ("key", "token", "secret", "password")):
            secret_add(value)


def _close(engine) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            pass


def reset() -> None:
    with _lock:
        for engine in _instances.values():
            _close(engine)
        _instances.clear()
