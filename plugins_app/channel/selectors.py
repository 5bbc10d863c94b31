"""Reads of the plugins room: what the supervisor should run, and status."""
from __future__ import annotations

import os
import sys

from django.db.models import Count, Q

from plugins_app.channel.models import DeliveryState, OutboundDelivery, Plugin, PluginSecret, PluginState
from plugins_app.channel.secrets import secret_decrypt
from plugins_app.channel.workers import kind_module
from ugent_common.logs import secret_add

# A bare `python` command means the daemon's own interpreter (the workers' minimal PATH has no venv).
PYTHON_ALIASES = ("python", "python3")


def plugins_enabled() -> list[Plugin]:
    return list(Plugin.objects.filter(enabled=True).order_by("plugin_id"))


def conversation_workspace(conversation) -> str:
    """The hub's workspace resolver (settings.UGENT_WORKSPACE_RESOLVERS): for a conversation a channel plugin
    serves, that plugin's ``[plugins.routing] workspace`` (a relative one from UGENT_WORKSPACE); "" for any
    other conversation, or a plugin that names none. Read as the turn asks, so an edit in the admin counts
    from the next turn."""
    if conversation.channel == "web" or not conversation.client_id:
        return ""
    plugin = Plugin.objects.filter(plugin_id=conversation.client_id).only("kind", "workspace").first()
    if plugin is None or plugin.channel != conversation.channel or not plugin.workspace:
        return ""
    from django.conf import settings
    return os.path.join(str(settings.UGENT_WORKSPACE), plugin.workspace)  # (an absolute one stays as it is)


def plugin_argv(plugin: Plugin) -> tuple[str, list[str]] | None:
    """The command and args the supervisor runs for ``plugin``; None when it names no command and its
    kind is not installed (nothing can be started)."""
    args = [str(a) for a in plugin.args or []]
    if not plugin.command:
        module = kind_module(plugin.kind)
        return None if module is None else (sys.executable, ["-m", module, *args])
    return (sys.executable if plugin.command in PYTHON_ALIASES else plugin.command), args


def plugin_memory_max_mb(own: int | None) -> int:
    """The data size cap (MiB) a plugin's worker runs under, given the plugin's own ``memory_max_mb``:
    that, else UGENT_PLUGIN_MEMORY_MAX_MB; 0 is no cap."""
    from plugins_app.channel import conf
    return conf.MEMORY_MAX_MB if own is None else own


def plugin_environment(plugin: Plugin, environ: dict | None = None) -> tuple[dict[str, str], list[str]]:
    """The worker's own environment (env_refs from the daemon's, secret_env_refs from the vault),
    and the names that could not be filled."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    missing: list[str] = []
    for name in plugin.env_refs or []:
        if name in environ:
            env[name] = environ[name]
        else:
            missing.append(name)
    stored = {s.name: s.ciphertext for s in PluginSecret.objects.filter(plugin=plugin)}
    for name in plugin.secret_env_refs or []:
        value = secret_decrypt(stored[name]) if name in stored else None
        if value is None:
            missing.append(name)
        else:
            secret_add(value)  # a worker's secret never reaches a log line (ugent_common.logs)
            env[name] = value
    return env, missing


def plugins_status() -> dict:
    """The plugins section of GET /v1/ugent/status."""
    counts = {p["plugin_id"]: p for p in Plugin.objects.annotate(
        pending=Count("deliveries", filter=Q(deliveries__state=DeliveryState.PENDING)),
        in_flight=Count("deliveries", filter=Q(deliveries__state=DeliveryState.IN_FLIGHT)),
        dead_letters=Count("deliveries", filter=Q(deliveries__state=DeliveryState.DEAD_LETTER)),
    ).values("plugin_id", "kind", "enabled", "state", "state_reason", "disabled_reason", "pid",
             "last_heartbeat", "restarts", "memory_max_mb", "pending", "in_flight", "dead_letters")}
    for row in counts.values():
        row["last_heartbeat"] = row["last_heartbeat"].isoformat() if row["last_heartbeat"] else None
        row["memory_max_mb"] = plugin_memory_max_mb(row["memory_max_mb"])
        row["circuit"] = plugin_circuit(row["state"], row["disabled_reason"])
    return {"plugins": list(counts.values())}


def plugin_circuit(state: str, disabled_reason: str) -> str:
    """The circuit breaker as the operator reads it: open (disabled by it), cooldown, or closed."""
    if state == PluginState.DISABLED and disabled_reason.startswith("circuit breaker"):
        return "open"
    return "cooldown" if state == PluginState.COOLDOWN else "closed"


def plugin_log_tail(plugin_id: str, *, lines: int = 5, max_bytes: int = 8192) -> list[str] | None:
    """The last lines a plugin's worker wrote (the supervisor writes its stdout and stderr to
    <log dir>/<plugin>.log, rotated to <plugin>.log.1 … at UGENT_PLUGIN_LOG_MAX_BYTES: the tail reads
    across the rotation), with the plugin's secrets masked; None when this host has no such file
    (servers mode: the log is on the supervisor's host)."""
    from plugins_app.channel import conf
    from plugins_app.channel.supervisor.process import log_file_path, read_log_tail
    try:
        raw, cut = read_log_tail(log_file_path(conf.LOG_DIR, plugin_id), max_bytes)
    except OSError:
        return None
    tail = raw.decode("utf-8", "replace")
    kept = [line for line in tail.splitlines() if line.strip()][-lines:]
    if cut and kept and len(kept) == len(tail.splitlines()):
        kept = kept[1:]  # the first line was cut by the byte window
    secrets = [secret_decrypt(c) for c in PluginSecret.objects.filter(plugin__plugin_id=plugin_id)
               .values_list("ciphertext", flat=True)]
    for value in filter(None, secrets):
        if len(value) >= 4:
            kept = [line.replace(value, "••••") for line in kept]
    return kept


def deliveries_for(plugin_id: str, state: str | None = None) -> list[OutboundDelivery]:
    rows = OutboundDelivery.objects.filter(plugin__plugin_id=plugin_id).order_by("id")
    return list(rows.filter(state=state) if state else rows)
