"""Channel workers that ship with UGENT, and the list of installed channel kinds.

A kind is installed when a worker module for it is known: the ones here, or
any package that declares an entry point in the ``ugent.channel_workers``
group (``channel-foo = "foo_plugin.worker"``). A worker module names its
``KIND``, a one-line ``DESCRIPTION`` and the ``ENV_REFS`` it needs.

An installed kind needs no ``command`` in plugins.toml: the supervisor runs
``python -m <module> <args...>`` with the daemon's own interpreter.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points

log = logging.getLogger("ugent.plugins")

BUILTIN = {
    "channel-dingtalk": "plugins_app.channel.workers.dingtalk",
    "channel-discord": "plugins_app.channel.workers.discord",
    "channel-echo": "plugins_app.channel.workers.echo",
    "channel-email": "plugins_app.channel.workers.email",
    "channel-line": "plugins_app.channel.workers.line",
    "channel-salesforce": "plugins_app.channel.workers.salesforce",
    "channel-slack": "plugins_app.channel.workers.slack",
    "channel-telegram": "plugins_app.channel.workers.telegram",
    "channel-translate": "plugins_app.channel.workers.translate",
    "channel-wecom": "plugins_app.channel.workers.wecom",
    "channel-wechat": "plugins_app.channel.workers.wechat",
    "channel-weixin": "plugins_app.channel.workers.weixin",
    "channel-whatsapp": "plugins_app.channel.workers.whatsapp",
}


@dataclass(frozen=True)
class ChannelKind:
    kind: str
    module: str
    description: str = ""
    env_refs: tuple[str, ...] = field(default_factory=tuple)


#: (the stamp of the import path when read, when, what was found)
_found: tuple[tuple, float, dict[str, str]] | None = None
#: An answer is read again after this long whatever the stamp says: pip writes a package's entry points into
#: its metadata directory after making it, which changes no directory on the import path.
_FOUND_MAX_AGE_SECS = 30.0


def _import_path_stamp() -> tuple:
    """Each import path entry with its modification time: installing, upgrading or removing a package adds
    or removes a directory in one of them, which changes it."""
    stamp = []
    for entry in sys.path:
        try:
            stamp.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            stamp.append((entry, None))
    return tuple(stamp)


def kind_modules() -> dict[str, str]:
    """Each installed kind's worker module, without importing any of them.

    Reading the entry points reads every installed distribution's metadata (10 ms here), and the supervisor
    asks for each plugin at every step, twice a second: the answer is kept until the import path changes,
    or for _FOUND_MAX_AGE_SECS."""
    global _found
    stamp = _import_path_stamp()
    kept = _found
    if kept is not None and kept[0] == stamp and time.monotonic() - kept[1] < _FOUND_MAX_AGE_SECS:
        return dict(kept[2])
    found = dict(BUILTIN)
    try:
        for ep in entry_points(group="ugent.channel_workers"):
            found.setdefault(ep.name, ep.value.split(":")[0])
    except Exception:  # a broken third-party package must not hide the built-in kinds
        log.exception("could not read ugent.channel_workers entry points")
    _found = (stamp, time.monotonic(), found)
    return dict(found)


def kind_module(kind: str) -> str | None:
    """The worker module UGENT starts for ``kind`` when its plugin names no ``command``."""
    return kind_modules().get(kind)


def installed_kinds() -> dict[str, ChannelKind]:
    out = {}
    for kind, module in sorted(kind_modules().items()):
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            log.warning("channel kind %s: %s does not import (%s)", kind, module, exc)
            continue
        out[kind] = ChannelKind(kind, module, getattr(mod, "DESCRIPTION", ""),
                                tuple(getattr(mod, "ENV_REFS", ())))
    return out
