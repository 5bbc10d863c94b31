"""plugins.toml (schema_version = 1) <-> Plugin rows.

``plugins_parse`` validates a whole file before anything is written and names
the plugin and field of the first error, in the one style of ugent_common.validation
(``plugins[1] (telegram-main).limits.max_in_flight: must be a positive integer``);
the file's shape is declared once, as the strict pydantic specs below (an unknown
key, ``enabled = "yes"`` or ``max_retries = "5"`` is refused). ``plugins_import``
writes the rows in one transaction; ``plugins_export`` renders the rows back.
Secret values never appear in a file: ``secret_env_refs`` lists names only.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated

import tomli_w
from django.db import transaction
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from plugins_app.channel.models import PLUGIN_ID_RE, Plugin
from plugins_app.channel.workers import kind_module
from ugent_common.validation import StrList, first_error, first_repeat

SCHEMA_VERSION = 1
_KIND_RE = re.compile(r"^channel-[a-z0-9][a-z0-9_-]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULTS = {"max_in_flight": 64, "max_retries": 5, "heartbeat_secs": 30}
_SPEC = ConfigDict(strict=True, extra="forbid")
_LABELS = {"plugins": "id"}
_READS = "(this version reads schema_version = 1)"


class PluginsFileError(ValueError):
    """A plugins.toml that cannot be imported; the message names the plugin and field."""


def _check(test, message: str):
    """An AfterValidator refusing a value ``test`` rejects, with ``message`` (``{value}`` is the value)."""

    def check(value):
        if not test(value):
            raise PydanticCustomError("plugins", message, {"value": repr(value)})
        return value

    return AfterValidator(check)


def _env_names(values: list[str]) -> list[str]:
    for v in values:
        if not _ENV_RE.match(v):
            raise PydanticCustomError("plugins", "{value} is not an environment variable name", {"value": repr(v)})
    return values


def _senders(values: list[str]) -> list[str]:
    for s in values:
        if s != "*" and (":" not in s or not s.split(":", 1)[1]):
            raise PydanticCustomError("plugins", "{value} is not channel:sender_id", {"value": repr(s)})
    return values


EnvNames = Annotated[StrList, AfterValidator(_env_names)]


class LimitsSpec(BaseModel):
    """``[plugins.limits]``."""

    model_config = _SPEC
    max_in_flight: Annotated[int, _check(lambda v: v >= 1, "must be a positive integer")] = DEFAULTS["max_in_flight"]
    max_retries: Annotated[int, _check(lambda v: v >= 0, "must be a non-negative integer")] = DEFAULTS["max_retries"]
    heartbeat_secs: Annotated[float, _check(lambda v: v >= 0, "must be a non-negative number")] = DEFAULTS["heartbeat_secs"]
    # absent: UGENT_PLUGIN_MEMORY_MAX_MB; 0: no cap
    memory_max_mb: Annotated[int, _check(lambda v: 0 <= v < 2 ** 31,
                                         "must be a whole number of MiB from 0 (no cap) to 2147483647")] | None = None


class RoutingSpec(BaseModel):
    """``[plugins.routing]``."""

    model_config = _SPEC
    workspace: str = ""
    allowed_senders: Annotated[StrList, AfterValidator(_senders)] = []
    allow_remote_control: Annotated[StrList, AfterValidator(_senders)] = []


class PluginSpec(BaseModel):
    """One ``[[plugins]]`` entry."""

    model_config = _SPEC
    id: Annotated[str, _check(lambda v: re.match(PLUGIN_ID_RE, v),
                              "{value} may hold only letters, digits, '.', '_' and '-' (up to 100)")]
    kind: Annotated[str, _check(lambda v: _KIND_RE.match(v), "{value} does not look like channel-telegram")]
    enabled: bool = True
    command: str = Field("", validate_default=True)
    args: StrList = []
    env_refs: EnvNames = []
    secret_env_refs: EnvNames = []
    limits: LimitsSpec = LimitsSpec()
    routing: RoutingSpec = RoutingSpec()

    @field_validator("command")
    @classmethod
    def _command_or_installed_kind(cls, command: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if not command and kind and kind_module(kind) is None:
            raise PydanticCustomError("plugins", "must be set: {kind} is not a kind UGENT ships "
                                      "or an installed package registers", {"kind": repr(kind)})
        return command

    def row(self) -> dict:
        """The Plugin fields this entry sets."""
        return {"plugin_id": self.id, "kind": self.kind, "enabled": self.enabled, "command": self.command,
                "args": list(self.args), "env_refs": list(self.env_refs),
                "secret_env_refs": list(self.secret_env_refs),
                "max_in_flight": self.limits.max_in_flight, "max_retries": self.limits.max_retries,
                "heartbeat_secs": float(self.limits.heartbeat_secs), "memory_max_mb": self.limits.memory_max_mb,
                "workspace": self.routing.workspace, "allowed_senders": list(self.routing.allowed_senders),
                "allow_remote_control": list(self.routing.allow_remote_control)}


class PluginsFileSpec(BaseModel):
    """A plugins.toml document of schema_version 1."""

    model_config = _SPEC
    schema_version: int
    plugins: list[PluginSpec] = []


def plugins_parse(text: str, *, source: str = "plugins.toml") -> list[dict]:
    """Validate a plugins.toml text; returns one dict of Plugin fields per entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PluginsFileError(f"{source}: not valid TOML: {exc}") from None
    # The version says which shape the rest has, so it is read before the shape is checked.
    if "schema_version" not in data:
        raise PluginsFileError(f"{source}: missing field `schema_version` {_READS}")
    if data["schema_version"] != SCHEMA_VERSION or isinstance(data["schema_version"], bool):
        raise PluginsFileError(f"{source}: schema_version: unknown schema_version {data['schema_version']!r} {_READS}")
    try:
        spec = PluginsFileSpec.model_validate(data)
    except ValidationError as exc:
        raise PluginsFileError(f"{source}: {first_error(exc, data=data, labels=_LABELS)}") from None
    repeat = first_repeat(plugin.id for plugin in spec.plugins)
    if repeat:
        first, i = repeat
        pid = spec.plugins[i].id
        raise PluginsFileError(f"{source}: plugins[{i}] ({pid}).id: {pid!r} is listed twice "
                               f"(plugins[{first}] and plugins[{i}])")
    return [plugin.row() for plugin in spec.plugins]


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
    entry = {"id": plugin.plugin_id, "kind": plugin.kind, "enabled": plugin.enabled}
    if plugin.command:
        entry["command"] = plugin.command
    entry.update({"args": list(plugin.args or []), "env_refs": list(plugin.env_refs or [])})
    if plugin.secret_env_refs:
        entry["secret_env_refs"] = list(plugin.secret_env_refs)
    entry["limits"] = {"max_in_flight": plugin.max_in_flight, "max_retries": plugin.max_retries,
                       "heartbeat_secs": int(beat) if float(beat).is_integer() else beat}
    if plugin.memory_max_mb is not None:
        entry["limits"]["memory_max_mb"] = plugin.memory_max_mb
    routing = {"allowed_senders": list(plugin.allowed_senders or [])}
    if plugin.allow_remote_control:
        routing["allow_remote_control"] = list(plugin.allow_remote_control)
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
