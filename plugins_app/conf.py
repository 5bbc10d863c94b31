"""Settings of the plugins room, read from the environment with working defaults.

Read through functions (not module constants) where a test or a long-running
supervisor should see a change without a re-import.
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings

from ugent_site.settings import env

# Where the bridges' sockets, the workers' pid files, logs and outboxes live.
RUN_DIR = Path(env("UGENT_PLUGIN_RUN_DIR", default=str(settings.VAR_DIR / "run" / "plugins")))
PID_DIR = Path(env("UGENT_PLUGIN_PID_DIR", default=str(settings.VAR_DIR / "run" / "plugin-pids")))
LOG_DIR = Path(env("UGENT_PLUGIN_LOG_DIR", default=str(settings.VAR_DIR / "log" / "plugins")))
STATE_DIR = Path(env("UGENT_PLUGIN_STATE_DIR", default=str(settings.VAR_DIR / "plugin-state")))

# The global plugin settings `plugins setup --no-input` and `plugins migrate` read.
GLOBAL_PLUGINS_TOML = Path(env("UGENT_GLOBAL_PLUGINS_TOML",
                               default=str(Path("~/.ugent/plugins.toml").expanduser())))

# Key of the secrets vault (secret_env_refs); derived from SECRET_KEY when unset.
SECRETS_KEY = env("UGENT_SECRETS_KEY", default="")

# The supervisor loop and its restart policy (per-plugin heartbeat_secs is on the row).
SUPERVISOR_INTERVAL = env.float("UGENT_PLUGIN_SUPERVISOR_INTERVAL", default=0.5)
EMBEDDED_SUPERVISOR = env.bool("UGENT_PLUGIN_EMBEDDED_SUPERVISOR", default=True)
STOP_GRACE_SECS = env.float("UGENT_PLUGIN_STOP_GRACE_SECS", default=5.0)
BACKOFF_INITIAL_SECS = env.float("UGENT_PLUGIN_BACKOFF_INITIAL_SECS", default=1.0)
BACKOFF_MAX_SECS = env.float("UGENT_PLUGIN_BACKOFF_MAX_SECS", default=60.0)
RESTARTS_PER_ROUND = env.int("UGENT_PLUGIN_RESTARTS_PER_ROUND", default=5)
COOLDOWN_SECS = env.float("UGENT_PLUGIN_COOLDOWN_SECS", default=60.0)
STABLE_SECS = env.float("UGENT_PLUGIN_STABLE_SECS", default=60.0)
STARTUP_GRACE_SECS = env.float("UGENT_PLUGIN_STARTUP_GRACE_SECS", default=10.0)
REAP_GRACE_SECS = env.float("UGENT_PLUGIN_REAP_GRACE_SECS", default=2.0)

# Outbound deliveries: the pause before retry n is RETRY_BACKOFF * 2**(n-2), capped.
RETRY_BACKOFF_SECS = env.float("UGENT_PLUGIN_RETRY_BACKOFF_SECS", default=2.0)
RETRY_BACKOFF_MAX_SECS = env.float("UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS", default=300.0)
# A long-poll re-reads the table at least this often, even if a wake-up was lost.
POLL_RECHECK_SECS = env.float("UGENT_PLUGIN_POLL_RECHECK_SECS", default=1.0)

# Media put by workers (attachments): size limit and retention.
MEDIA_MAX_BYTES = env.int("UGENT_PLUGIN_MEDIA_MAX_BYTES", default=8 * 1024 * 1024)
MEDIA_TTL_SECS = env.int("UGENT_PLUGIN_MEDIA_TTL_SECS", default=86400)


def supervision_overrides() -> dict:
    """SupervisionLimits fields from the settings above (the heartbeat comes from each row)."""
    return {"stop_grace_secs": STOP_GRACE_SECS, "backoff_initial_secs": BACKOFF_INITIAL_SECS,
            "backoff_max_secs": BACKOFF_MAX_SECS, "restarts_per_round": RESTARTS_PER_ROUND,
            "cooldown_secs": COOLDOWN_SECS, "stable_secs": STABLE_SECS,
            "startup_grace_secs": STARTUP_GRACE_SECS}


def workspace_plugins_toml() -> Path:
    return Path(settings.UGENT_WORKSPACE) / "plugins.toml"
