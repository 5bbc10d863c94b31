"""Calls that may never return, on threads of their own, with a time limit and a cap on how many overrun.

Python cannot stop a thread. A call past its time limit (a tool, an engine asked by a command) is answered
at once and its thread is left to finish; until it does it counts against its owner (a toolbox, an
engine), and an owner with `limit` such calls is refused at once, without a thread. So one owner that
hangs costs at most `limit` threads, plus the calls that started within one timeout of its first hang
(the cap counts calls past their limit, not calls under way), and the others go on.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("ugent.overrun")

_overrun: dict[str, int] = {}
_lock = threading.Lock()


def _connection_close() -> None:
    """Close this thread's database connection, if Django is in use here (plugin code may run without it)."""
    db = sys.modules.get("django.db")
    if db is None:
        return
    try:
        db.connection.close()
    except Exception:  # not configured (a worker without settings), or already gone
        pass


def overrunning(prefix: str = "") -> dict[str, int]:
    """Owner → its calls still running past their time limit (owners starting with `prefix`)."""
    with _lock:
        return {k: v for k, v in _overrun.items() if v and k.startswith(prefix)}


def overrun_status() -> dict:
    """The `overrun` section of GET /v1/ugent/status: every owner's calls still running past their time limit
    in this process (`toolbox:…`, `engine:…`, `matcher:…`, `yesno:…`, `summarizer:…`, `nli:…`, `start:…`)."""
    return {"calls": overrunning()}


@dataclass
class Bounded:
    """How a bounded call ended: `value`, or `error` (what it raised), or `timed_out`, `stopped`, or
    `refused` (the owner's overrunning calls, counted)."""
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    stopped: bool = False
    refused: int = 0


def call_bounded(fn: Callable[[], Any], *, timeout: float, owner: str, limit: int,
                 should_stop: Callable[[], bool] = lambda: False, name: str = "ugent-bounded") -> Bounded:
    with _lock:
        count = _overrun.get(owner, 0)
    if count >= limit:
        return Bounded(refused=count)
    box: dict = {}
    done = threading.Event()
    state = {"overrun": False}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the call's failure is its caller's to report
            box["error"] = exc
        finally:
            _connection_close()  # the call's thread may have used the database
            with _lock:
                done.set()
                if state["overrun"]:
                    _overrun[owner] -= 1
                    if not _overrun[owner]:
                        del _overrun[owner]

    def abandon() -> None:
        with _lock:
            if not done.is_set():
                state["overrun"] = True
                _overrun[owner] = _overrun.get(owner, 0) + 1
                log.warning("a call of %s is still running past its time limit; %d such call(s) now",
                            owner, _overrun[owner])

    threading.Thread(target=target, name=name, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            abandon()
            return Bounded(timed_out=True)
        if should_stop():
            abandon()
            return Bounded(stopped=True)
    if "error" in box:
        return Bounded(error=box["error"])
    return Bounded(value=box.get("value"))
