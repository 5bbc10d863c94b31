"""plugins.toml (schema_version = 1) <-> Plugin rows.

``plugins_parse`` validates a whole file before anything is written and names
the plugin and field of the first error (``plugins[1] (telegram-main).limits.max_in_flight:
must be a positive integer``); ``plugins_import`` writes the rows in one
transaction; ``plugins_export`` renders the rows back. Secret values never
appear in a file: ``secret_env_refs`` lists names only.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import tomli_w
from django.db import transaction

from plugins_app.models import PLUGIN_ID_RE, Plugin

SCHEMA_VERSION = 1
_KIND_RE = re.compile(r"^channel-[a-z0-9][a-z0-9_-]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TOP_KEYS = {"schema_version", "plugins"}
PLUGIN_KEYS = {"id", "kind", "enabled", "command", "args", "env_refs", "secret_env_refs", "limits", "routing"}
LIMIT_KEYS = {"max_in_flight", "max_retries", "heartbeat_secs"}
ROUTING_KEYS = {"workspace", "allowed_senders"}
DEFAULTS = {"max_in_flight": 64, "max_retries": 5, "heartbeat_secs": 30}


class PluginsFileError(ValueError):
    """A plugins.toml that cannot be imported; the message names the plugin and field."""


def _where(i: int, pid) -> str:
    return f"plugins[{i}] ({pid})" if isinstance(pid, str) and pid else f"plugins[{i}]"


def _str_list(value, where: str, *, pattern: re.Pattern | None = None) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PluginsFileError(f"{where}: must be an array of strings")
    if pattern is not None:
        for v in value:
            if not pattern.match(v):
                raise PluginsFileError(f"{where}: {v!r} is not an environment variable name")
    return list(value)


def plugins_parse(text: str, *, source: str = "plugins.toml") -> list[dict]:
    """Validate a plugins.toml text; returns one dict of Plugin fields per entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PluginsFileError(f"{source}: not valid TOML: {exc}") from None
    if "schema_version" not in data:
        raise PluginsFileError(f"{source}: schema_version is missing (this version reads schema_version = 1)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise PluginsFileError(f"{source}: unknown schema_version {data['schema_version']!r} "
                               f"(this version reads schema_version = 1)")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise PluginsFileError(f"{source}: unknown key {sorted(unknown)[0]!r}")
    entries = data.get("plugins", [])
    if not isinstance(entries, list):
        raise PluginsFileError(f"{source}: plugins must be an array of tables ([[plugins]])")
    out, seen = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise PluginsFileError(f"plugins[{i}]: must be a table")
        pid = entry.get("id")
        at = _where(i, pid)
        for key in sorted(set(entry) - PLUGIN_KEYS):
            raise PluginsFileError(f"{at}.{key}: unknown field")
        if not isinstance(pid, str) or not re.match(PLUGIN_ID_RE, pid):
            raise PluginsFileError(f"{at}.id: is required: letters, digits, '.', '_' and '-' (up to 100)")
        if pid in seen:
            raise PluginsFileError(f"{at}.id: {pid!r} is listed twice")
        seen.add(pid)
        kind = entry.get("kind")
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            raise PluginsFileError(f"{at}.kind: is required and looks like channel-telegram")
        command = entry.get("command")
        if not isinstance(command, str) or not command:
            raise PluginsFileError(f"{at}.command: is required (the worker executable)")
        enabled = entry.get("enabled", True)
        if not isinstance(enabled, bool):
            raise PluginsFileError(f"{at}.enabled: must be true or false")
        row = {"plugin_id": pid, "kind": kind, "enabled": enabled, "command": command,
               "args": _str_list(entry.get("args", []), f"{at}.args"),
               "env_refs": _str_list(entry.get("env_refs", []), f"{at}.env_refs", pattern=_ENV_RE),
               "secret_env_refs": _str_list(entry.get("secret_env_refs", []), f"{at}.secret_env_refs",
                                            pattern=_ENV_RE)}
        limits = entry.get("limits", {})
        if not isinstance(limits, dict):
            raise PluginsFileError(f"{at}.limits: must be a table")
        for key in sorted(set(limits) - LIMIT_KEYS):
            raise PluginsFileError(f"{at}.limits.{key}: unknown field")
        for key in ("max_in_flight", "max_retries"):
            value = limits.get(key, DEFAULTS[key])
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "max_in_flight" else 0):
                raise PluginsFileError(f"{at}.limits.{key}: must be a "
                                       f"{'positive' if key == 'max_in_flight' else 'non-negative'} integer")
            row[key] = value
        beat = limits.get("heartbeat_secs", DEFAULTS["heartbeat_secs"])
        if isinstance(beat, bool) or not isinstance(beat, (int, float)) or beat < 0:
            raise PluginsFileError(f"{at}.limits.heartbeat_secs: must be a non-negative number")
        row["heartbeat_secs"] = float(beat)
        routing = entry.get("routing", {})
        if not isinstance(routing, dict):
            raise PluginsFileError(f"{at}.routing: must be a table")
        for key in sorted(set(routing) - ROUTING_KEYS):
            raise PluginsFileError(f"{at}.routing.{key}: unknown field")
        workspace = routing.get("workspace", "")
        if not isinstance(workspace, str):
            raise PluginsFileError(f"{at}.routing.workspace: must be a string")
        row["workspace"] = workspace
        senders = _str_list(routing.get("allowed_senders", []), f"{at}.routing.allowed_senders")
        for s in senders:
            if s != "*" and (":" not in s or not s.split(":", 1)[1]):
                raise PluginsFileError(f"{at}.routing.allowed_senders: {s!r} is not channel:sender_id")
        row["allowed_senders"] = senders
        out.append(row)
    return out


def plugins_import(*, text: str, source: str = "plugins.toml", prune: bool = False) -> dict:
    """Create or update the rows a plugins.toml names (all or nothing). With ``prune``, rows the
    file does not name are disabled (never deleted: their deliveries stay). Returns counts."""
    rows = plugins_parse(text, source=source)
    created = updated = disabled = 0
    with transaction.atomic():
        for row in rows:
            fields = dict(row)
            plugin_id = fields.pop("plugin_id")
            if fields["enabled"]:
                fields["disabled_reason"] = ""
            _, made = Plugin.objects.update_or_create(plugin_id=plugin_id, defaults=fields)
            created += made
            updated += not made
        if prune:
            disabled = (Plugin.objects.exclude(plugin_id__in=[r["plugin_id"] for r in rows])
                        .filter(enabled=True).update(enabled=False))
    return {"created": created, "updated": updated, "disabled": disabled}


def plugin_to_entry(plugin: Plugin) -> dict:
    beat = plugin.heartbeat_secs
    entry = {"id": plugin.plugin_id, "kind": plugin.kind, "enabled": plugin.enabled,
             "command": plugin.command, "args": list(plugin.args or []), "env_refs": list(plugin.env_refs or [])}
    if plugin.secret_env_refs:
        entry["secret_env_refs"] = list(plugin.secret_env_refs)
    entry["limits"] = {"max_in_flight": plugin.max_in_flight, "max_retries": plugin.max_retries,
                       "heartbeat_secs": int(beat) if float(beat).is_integer() else beat}
    routing = {"allowed_senders": list(plugin.allowed_senders or [])}
    if plugin.workspace:
        routing = {"workspace": plugin.workspace, **routing}
    entry["routing"] = routing
    return entry


def plugins_export(plugins=None) -> str:
    plugins = list(Plugin.objects.order_by("plugin_id") if plugins is None else plugins)
    return tomli_w.dumps({"schema_version": SCHEMA_VERSION, "plugins": [plugin_to_entry(p) for p in plugins]})


def plugins_write(path: Path, plugins=None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(plugins_export(plugins))
    tmp.replace(path)
    return path
