"""UGENT_LOG_LEVEL and UGENT_LOG_FORMAT read one way for the daemon (ugent_common/logs.py, from settings)
and the worker SDK (ChannelWorker.main): a value one accepts the other does too. No Django here, the SDK
imports this module."""
from __future__ import annotations

import logging

LOG_FORMATS = ("plain", "json")
DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL = "plain", "INFO"


def log_level_name(value: str | None) -> str:
    """UGENT_LOG_LEVEL as a level name logging knows: any name of ``logging.getLevelNamesMapping()``
    (WARN, FATAL and NOTSET too), in any case; unset or empty is INFO. Another value raises ValueError
    naming the setting. The one rule for the daemon (settings) and the worker SDK (ChannelWorker.main), so
    a value one accepts the other does too."""
    level = (value or "").strip().upper()
    if not level:
        return DEFAULT_LOG_LEVEL
    names = logging.getLevelNamesMapping()
    if level not in names:
        raise ValueError(f"UGENT_LOG_LEVEL={level!r} is not one of {', '.join(names)} (in any case)")
    return level


def log_format_name(value: str | None) -> str:
    """UGENT_LOG_FORMAT as ``plain`` or ``json``, in any case; unset or empty is plain. Another value
    raises ValueError naming the setting."""
    fmt = (value or "").strip().lower()
    if not fmt:
        return DEFAULT_LOG_FORMAT
    if fmt not in LOG_FORMATS:
        raise ValueError(f"UGENT_LOG_FORMAT={fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    return fmt
