"""ToolBox plugins: ``opm.agents.toolbox`` entry points, and MCP servers through ovos-tool-adapters.

A plugin toolbox is built once per process for one config and kept (an MCP server is a child
process with a live session: starting one per turn would cost a second a turn). ``toolbox_plugin``
and ``mcp_toolbox`` hand out the kept copy; ``toolboxes_close`` ends them all (tests, shutdown).
No Django here.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from importlib.metadata import entry_points
from typing import Any, Optional

log = logging.getLogger("ugent.tools")
GROUP = "opm.agents.toolbox"
MCP_ENTRY_POINT = "ovos-mcp-toolbox"

#: Seconds before a toolbox that has no tools (its server was down or did not answer) is asked again.
RETRY_SECS = 30.0

_kept: dict[str, Any] = {}
_lock = threading.Lock()  # guards the dicts; never held while a toolbox is built or asked for its tools
_building: dict[str, threading.Lock] = {}  # per toolbox: one build or retry at a time
_retry_at: dict[str, float] = {}
_clock = time.monotonic


def toolbox_entry_points() -> dict[str, Any]:
    """The installed ToolBox plugins by entry-point name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def _key(kind: str, name: str, config: dict) -> str:
    return f"{kind}:{name}:{json.dumps(config, sort_keys=True, default=str)}"


def _build(entry: str, toolbox_id: str, config: dict):
    ep = toolbox_entry_points().get(entry)
    if ep is None:
        raise LookupError(f"no ToolBox plugin named {entry!r} is installed (entry point group {GROUP})")
    if entry == MCP_ENTRY_POINT:
        from plugins_app.agent.tools.mcp import OwnedMCPToolBox
        cls = OwnedMCPToolBox  # the adapter's, with its session owned by one task (tools/mcp.py)
    else:
        cls = ep.load()
    try:
        return cls(config=config, toolbox_id=toolbox_id)
    except TypeError:  # a plugin whose constructor takes only the base's (toolbox_id, config)
        return cls(toolbox_id, config)


def _usable(box) -> bool:
    """It has tools, and (an MCP toolbox) its server has not gone since it listed them."""
    return bool(box.tools) and not getattr(box, "broken", False)


def toolbox_plugin(entry: str, config: Optional[dict] = None, *, toolbox_id: Optional[str] = None):
    """The kept toolbox of plugin `entry` for `config` (built on first use). LookupError: not installed.

    Building one (an MCP server's start) or asking a toolbox without tools for them again (a server that was
    down at first use may be up now) can take its whole timeout: it holds up only the turns that want that
    toolbox, and is tried again at most every RETRY_SECS; in between such a toolbox comes back at once,
    without tools. An MCP toolbox whose server's process ended under a call connects again likewise."""
    config = dict(config or {})
    key = _key("plugin", entry, config)
    with _lock:
        box = _kept.get(key)
        if box is not None and (_usable(box) or _clock() < _retry_at.get(key, 0.0)):
            return box
        one = _building.setdefault(key, threading.Lock())
    with one:  # one build or retry of this toolbox at a time
        with _lock:
            box = _kept.get(key)
        if box is None:
            box = _build(entry, toolbox_id or entry, config)
            with _lock:
                _kept[key] = box
        elif not _usable(box) and _clock() >= _retry_at.get(key, 0.0):
            box.refresh_tools()  # (an MCP toolbox: connects again)
        if not _usable(box):
            with _lock:
                _retry_at[key] = _clock() + RETRY_SECS
    return box


def mcp_toolbox(name: str, *, command: str, args: list | None = None, env: dict | None = None,
                timeout: float = 30):
    """The kept MCP toolbox for one `[[tools.mcp]]` entry: a stdio server `command args…`."""
    config = {"transport": "stdio", "command": command, "args": list(args or []), "env": env or None,
              "timeout": int(timeout)}
    return toolbox_plugin(MCP_ENTRY_POINT, config, toolbox_id=f"mcp-{name}")


def toolboxes_kept() -> list:
    with _lock:
        return list(_kept.values())


def toolboxes_close() -> None:
    """Close every kept toolbox (an MCP server's process ends with its session)."""
    with _lock:
        boxes = list(_kept.values())
        _kept.clear()
        _retry_at.clear()
    for box in boxes:
        close = getattr(box, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                log.exception("closing toolbox %s failed", getattr(box, "toolbox_id", box))
