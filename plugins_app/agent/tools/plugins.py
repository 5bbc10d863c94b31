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
_failed: dict[str, tuple[float, str]] = {}  # a build that raised: when it may be tried again, and why
_generation = 0  # toolboxes_close() counts up: a build that ends after a close is not kept
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


def toolbox_plugin(entry: str, config: Optional[dict] = None, *, toolbox_id: Optional[str] = None,
                   start_timeout: Optional[float] = None):
    """The kept toolbox of plugin `entry` for `config` (built on first use). LookupError: not installed.

    `start_timeout`: the most seconds its constructor, or a retry's `refresh_tools`, may take, on a thread of
    its own (ugent_common.bounded): one that never returns then counts as a failed start (tried again after
    RETRY_SECS) instead of holding every turn that wants the toolbox for ever. None: no bound (tests).

    Building one (an MCP server's start) or asking a toolbox without tools for them again (a server that was
    down at first use may be up now) can take its whole timeout: it holds up only the turns that want that
    toolbox, and is tried again at most every RETRY_SECS; in between such a toolbox comes back at once,
    without tools, and a build that raised raises again at once. An MCP toolbox whose server's process
    ended under a call connects again likewise."""
    config = dict(config or {})
    # (its id too: two [[tools.mcp]] entries naming the same server are two toolboxes, each under its name)
    key = _key("plugin", entry if toolbox_id is None else f"{entry}#{toolbox_id}", config)
    with _lock:
        box = _kept.get(key)
        if box is not None and (_usable(box) or _clock() < _retry_at.get(key, 0.0)):
            return box
        _raise_if_failed_lately(entry, key)
        one = _building.setdefault(key, threading.Lock())
        generation = _generation
    with one:  # one build or retry of this toolbox at a time
        with _lock:
            if generation != _generation:  # toolboxes_close() ran while this waited (shutdown)
                raise RuntimeError(f"toolbox {entry} was not started: the toolboxes were closed")
            box = _kept.get(key)
            if box is None:
                _raise_if_failed_lately(entry, key)  # the build this one waited for raised
        if box is None:
            def build_kept():
                # On the start's thread: kept when it is made, even past its caller's time (a toolbox slower
                # to start than the timeout comes up at last, and is not left open and started again).
                made = _build(entry, toolbox_id or entry, config)
                with _lock:
                    kept = generation == _generation
                    if kept:
                        _failed.pop(key, None)
                        box = _kept.setdefault(key, made)
                if not kept or box is not made:  # the toolboxes were closed meanwhile, or a later try came first
                    _close(made)
                if not kept:  # toolboxes_close() ran meanwhile (shutdown): this one ends too
                    raise RuntimeError(f"toolbox {entry} was closed as it started (the toolboxes were closed)")
                return box
            try:
                box = _bounded(build_kept, start_timeout, f"toolbox {toolbox_id or entry}")
            except Exception as exc:
                with _lock:
                    box = _kept.get(key) if generation == _generation else None  # made just as its time ran out
                    if box is None and generation == _generation:  # (not a memo for the toolboxes after a close)
                        _failed[key] = (_clock() + RETRY_SECS, f"{type(exc).__name__}: {exc}")
                if box is None:
                    raise
        elif not _usable(box) and _clock() >= _retry_at.get(key, 0.0):
            try:
                _bounded(box.refresh_tools, start_timeout, f"toolbox {toolbox_id or entry}")  # (MCP: connects again)
            except Exception:  # kept without tools, asked again after RETRY_SECS like one that listed none
                log.warning("toolbox %s could not list its tools", getattr(box, "toolbox_id", entry), exc_info=True)
        if not _usable(box):
            with _lock:
                if generation == _generation:
                    _retry_at[key] = _clock() + RETRY_SECS
    return box


#: Starts of one toolbox left running past their time at once; a further one is refused without a thread.
START_OVERRUN_MAX = 4


def _bounded(fn, timeout: Optional[float], what: str):
    """fn() under `timeout` seconds on a thread of its own (None: here, unbounded); TimeoutError past it."""
    if timeout is None:
        return fn()
    from ugent_common import bounded
    done = bounded.call_bounded(fn, timeout=timeout, owner=f"start:{what}", limit=START_OVERRUN_MAX,
                                name="ugent-toolbox-start")
    if done.error is not None:
        raise done.error
    if done.timed_out or done.refused:
        raise TimeoutError(f"the {what} did not start within {timeout:g} s (UGENT_PLUGIN_START_TIMEOUT)")
    return done.value


def _raise_if_failed_lately(entry: str, key: str) -> None:
    """(_lock held) A build of this toolbox raised less than RETRY_SECS ago: raise again, without waiting."""
    failed = _failed.get(key)
    if failed is not None and _clock() < failed[0]:
        raise RuntimeError(f"toolbox {entry} failed to start ({failed[1]}); it is tried again "
                           f"{RETRY_SECS:g} s after that attempt")


def mcp_toolbox(name: str, *, command: str, args: list | None = None, env: dict | None = None,
                timeout: float = 30, start_timeout: Optional[float] = None):
    """The kept MCP toolbox for one `[[tools.mcp]]` entry: a stdio server `command args…`."""
    config = {"transport": "stdio", "command": command, "args": list(args or []), "env": env or None,
              "timeout": int(timeout)}
    return toolbox_plugin(MCP_ENTRY_POINT, config, toolbox_id=f"mcp-{name}", start_timeout=start_timeout)


def toolboxes_kept() -> list:
    with _lock:
        return list(_kept.values())


def toolboxes_close() -> None:
    """Close every kept toolbox (an MCP server's process ends with its session). A build still running
    ends with its toolbox closed, not kept."""
    global _generation
    with _lock:
        boxes = list(_kept.values())
        _kept.clear()
        _retry_at.clear()
        _failed.clear()
        _generation += 1
    for box in boxes:
        _close(box)


def _close(box) -> None:
    close = getattr(box, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing toolbox %s failed", getattr(box, "toolbox_id", box))
