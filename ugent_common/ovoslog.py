"""ovos_utils' LOG names each line after its caller, and finds the caller cheaply (`caller_by_frame`).

`ovos_utils.log.LOG` (the logger of ovos-plugin-manager, ovos-config and ovos-bus-client) works out
a line's logger name, "<module>:<function>:<line>" of its caller, with `inspect.stack()`, on every
call, a debug line below the level included. `inspect.stack()` reads the source line of every frame
on the stack and looks every frame's module up among all of `sys.modules`. ovos-config makes six such
calls while it loads its configuration, at the first import of `ovos_plugin_manager.templates`: 0.6 s
of CPU in a bare interpreter, 1.1 s in a process with Django loaded (1,700 modules, a deep stack),
which every daemon, web process and Celery worker paid once while it started (4.9 s of CPU for an
embedded daemon's start on the 2-core VM; py-spy put 23% of the start's samples under those calls).

`caller_by_frame()` gives `LOG` a `_get_real_logger` that takes the same frame with
`sys._getframe`: the same logger name, the same handlers, the same diagnostic line, without reading
any source. (One difference: a caller in code with no module file, `python -c` or `exec`, is named by
its globals' `__name__` where the library gave an empty name.) Called from ugent_site/settings.py,
before anything imports ovos-config. No Django imports.
"""
from __future__ import annotations

import sys

_MARK = "_ugent_caller_by_frame"


def _get_real_logger(cls):
    """ovos_utils.log.LOG._get_real_logger (0.8.5), its caller found without inspect.stack()."""
    name = "" if cls.name is None else cls.name + " - "
    # [0] this function, [1] LOG.debug / info / warning / error / exception, [2] their caller
    frame = sys._getframe(2)
    name += f"{frame.f_globals.get('__name__', '')}:{frame.f_code.co_name}:{frame.f_lineno}"
    logger = cls.create_logger(name, tostdout=True)
    if cls.diagnostic_mode:
        try:
            from ovos_bus_client.message import dig_for_message
            msg = dig_for_message()
            if msg:
                logger.debug(f"DIAGNOSTIC - source bus message {msg.serialize()}")
        except ImportError:
            pass
    return logger


def caller_by_frame() -> bool:
    """Install the cheap caller lookup on ovos_utils' LOG; False if ovos-utils is not installed."""
    try:
        from ovos_utils.log import LOG
    except ImportError:
        return False
    if not getattr(LOG, _MARK, False):
        LOG._get_real_logger = classmethod(_get_real_logger)
        setattr(LOG, _MARK, True)
    return True
