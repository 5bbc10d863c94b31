"""Settings of the plugins room, read from the environment with working defaults.

Read through functions (not module constants) where a test or a long-running
supervisor should see a change without a re-import.
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings


# Where the bridges' sockets, the workers' pid files, logs and outboxes live.
RUN_DIR = Path(settings.UGENT_PLUGIN_RUN_DIR)
PID_DIR = Path(settings.UGENT_PLUGIN_PID_DIR)
LOG_DIR = Path(settings.UGENT_PLUGIN_LOG_DIR)
STATE_DIR = Path(settings.UGENT_PLUGIN_STATE_DIR)
# A worker's log file is rotated before it passes this size (three older files are kept).
LOG_MAX_BYTES = settings.UGENT_PLUGIN_LOG_MAX_BYTES
# A worker's data size cap (MiB) when its plugin sets none; 0: no cap.
MEMORY_MAX_MB = settings.UGENT_PLUGIN_MEMORY_MAX_MB


def global_plugins_toml() -> Path:
    """The global plugin settings `plugins setup --no-input` and `plugins migrate` read: UGENT_GLOBAL_PLUGINS_TOML,
    else `.ugent/plugins.toml` under UGENT_HOME (the user's home by default), beside the rules and routing files."""
    from ugent_common.config import ugent_home
    explicit = getattr(settings, "UGENT_GLOBAL_PLUGINS_TOML", "")
    return Path(explicit).expanduser() if explicit else ugent_home() / ".ugent" / "plugins.toml"


# Key of the secrets vault (secret_env_refs); derived from SECRET_KEY when unset.
SECRETS_KEY = settings.UGENT_SECRETS_KEY

# The supervisor loop and its restart policy (per-plugin heartbeat_secs is on the row).
SUPERVISOR_INTERVAL = settings.UGENT_PLUGIN_SUPERVISOR_INTERVAL
EMBEDDED_SUPERVISOR = settings.UGENT_PLUGIN_EMBEDDED_SUPERVISOR
STOP_GRACE_SECS = settings.UGENT_PLUGIN_STOP_GRACE_SECS
BACKOFF_INITIAL_SECS = settings.UGENT_PLUGIN_BACKOFF_INITIAL_SECS
BACKOFF_MAX_SECS = settings.UGENT_PLUGIN_BACKOFF_MAX_SECS
RESTARTS_PER_ROUND = settings.UGENT_PLUGIN_RESTARTS_PER_ROUND
COOLDOWN_SECS = settings.UGENT_PLUGIN_COOLDOWN_SECS
STABLE_SECS = settings.UGENT_PLUGIN_STABLE_SECS
STARTUP_GRACE_SECS = settings.UGENT_PLUGIN_STARTUP_GRACE_SECS
REAP_GRACE_SECS = settings.UGENT_PLUGIN_REAP_GRACE_SECS

# Outbound deliveries: the pause before retry n is RETRY_BACKOFF * 2**(n-2), capped.
RETRY_BACKOFF_SECS = settings.UGENT_PLUGIN_RETRY_BACKOFF_SECS
RETRY_BACKOFF_MAX_SECS = settings.UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS
# A long-poll re-reads the table at least this often, even if a wake-up was lost.
POLL_RECHECK_SECS = settings.UGENT_PLUGIN_POLL_RECHECK_SECS

# Media put by workers (attachments): size limit and retention.
MEDIA_MAX_BYTES = settings.UGENT_PLUGIN_MEDIA_MAX_BYTES
# What one plugin may hold at once: the sizes of its media not yet expired.
MEDIA_QUOTA_BYTES = settings.UGENT_PLUGIN_MEDIA_QUOTA_BYTES
MEDIA_TTL_SECS = settings.UGENT_PLUGIN_MEDIA_TTL_SECS
# A plugin's inbound.submit calls: a rate a second (0: no limit) and how many may come at once (the bridge's bucket).
SUBMIT_RATE = settings.UGENT_PLUGIN_SUBMIT_RATE
SUBMIT_BURST = settings.UGENT_PLUGIN_SUBMIT_BURST
# Settled deliveries (delivered, discarded) are deleted this long after they settled.
DELIVERY_RETENTION_SECS = settings.UGENT_PLUGIN_DELIVERY_RETENTION_SECS


def supervision_overrides() -> dict:
    """SupervisionLimits fields from the settings above (the heartbeat comes from each row)."""
    return {"stop_grace_secs": STOP_GRACE_SECS, "backoff_initial_secs": BACKOFF_INITIAL_SECS,
            "backoff_max_secs": BACKOFF_MAX_SECS, "restarts_per_round": RESTARTS_PER_ROUND,
            "cooldown_secs": COOLDOWN_SECS, "stable_secs": STABLE_SECS,
            "startup_grace_secs": STARTUP_GRACE_SECS}


def workspace_plugins_toml() -> Path:
    return Path(settings.UGENT_WORKSPACE) / "plugins.toml"
