"""rules_app's settings: read from the environment here, overridable in Django settings (tests)."""
from __future__ import annotations

from pathlib import Path

from django.conf import settings


#: Watch the rules file with a thread in every process that uses the rule engine.
RULES_WATCH = settings.UGENT_RULES_WATCH
#: Seconds between looks at the discovery locations (and the trust check); the spec promises five.
RULES_POLL_INTERVAL = settings.UGENT_RULES_POLL_INTERVAL
#: Seconds between an enforcing daemon's heartbeats on the rules record; three missed: not running.
RULES_HEARTBEAT_SECONDS = getattr(settings, "UGENT_RULES_HEARTBEAT_SECONDS", 10.0)
#: Seconds a process trusts its routing table before it looks at routing.toml again.
ROUTING_RECHECK_SECONDS = settings.UGENT_ROUTING_RECHECK_SECONDS


def _setting(name: str, default):
    return getattr(settings, name, default)


def workspace() -> Path:
    return Path(settings.UGENT_WORKSPACE)


def home() -> Path:
    """The home directory whose ~/.ugent/ is the last discovery location (ugent_common.config.ugent_home)."""
    from ugent_common.config import ugent_home
    return ugent_home()


def rules_watch() -> bool:
    return bool(_setting("UGENT_RULES_WATCH", RULES_WATCH))


def rules_poll_interval() -> float:
    return float(_setting("UGENT_RULES_POLL_INTERVAL", RULES_POLL_INTERVAL))


def routing_recheck_seconds() -> float:
    return float(_setting("UGENT_ROUTING_RECHECK_SECONDS", ROUTING_RECHECK_SECONDS))


def rules_heartbeat_seconds() -> float:
    return float(_setting("UGENT_RULES_HEARTBEAT_SECONDS", RULES_HEARTBEAT_SECONDS))
