"""Warming at start: engine discovery and each profile's engine (the notes index) before the first turn.

The first answer after a start used to wait for the scan of every installed engine and then for the
notes index (issue #12: 22 s). A daemon process (rundaemon, or a Celery worker in servers mode) starts
`warm_start()` once: a background thread that scans the engines, then builds the engine of every
allowed profile and calls its `warm()` where it has one. A turn that comes first does not wait for the
scan: it loads only its own engine (plugins_app.agent.engines.registry). rundaemon opens its listener
once warming is done (at most UGENT_WARM_WAIT_SECS), so /v1/health answering means warm; the rest of
its start-up (worker, beat, supervisor) runs beside it. UGENT_WARM_AT_START=false turns it off
(bench/first_answer.py measures both).

In servers mode the web processes and the workers are separate: a worker that has warmed says so in
Redis (`warm_mark`, a key per task queue, refreshed while the worker lives and gone within
WARM_MARK_TTL of its death), and GET /v1/health answers 503 "warming" until one has, for at most
UGENT_WARM_WAIT_SECS after it was first asked, so a load balancer or a start script that waits for
health sends its first turn to a warm worker.
"""
from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import close_old_connections

log = logging.getLogger("ugent.engines")

_started: threading.Thread | None = None
_lock = threading.Lock()

WARM_MARK_TTL = 30          # seconds a warm mark outlives its worker
WARM_MARK_REFRESH = 10
_seen_warm = False          # this web process saw a warm worker: health stops asking Redis
_first_asked: float | None = None


def engines_warm() -> dict:
    """Scan the engines, then build and warm each allowed profile's engine; what was warmed and how long."""
    from plugins_app.agent.engines.registry import chat_engines, engine_for_profile
    from plugins_app.agent.models import AgentProfile
    from plugins_app.agent.profiles import profiles_ensure_defaults
    t0 = time.monotonic()
    engines = chat_engines()
    scanned = time.monotonic() - t0
    warmed, failed = [], {}
    try:
        profiles_ensure_defaults()
        profiles = list(AgentProfile.objects.filter(allowed=True).order_by("-is_default", "name"))
    finally:
        close_old_connections()
    for profile in profiles:
        try:
            engine = engine_for_profile(profile)
            warm = getattr(engine, "warm", None)
            if callable(warm):
                warm()
            warmed.append(profile.qualified_name)
        except Exception as exc:  # a profile whose engine is missing or broken fails its own turns, not the start
            failed[profile.qualified_name] = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    log.info("engines warmed in %.2f s (scan %.2f s): %d engine(s) installed; profiles ready: %s%s", took, scanned,
             len(engines), ", ".join(warmed) or "none",
             "".join(f"; {name} failed: {why}" for name, why in failed.items()))
    return {"engines": sorted(engines), "warmed": warmed, "failed": failed, "seconds": took}


def warm_start(*, mark: bool = True) -> threading.Thread | None:
    """Warm in a background thread, once per process; None when UGENT_WARM_AT_START is off. `mark`: servers
    mode, say so in Redis once warm (a worker that takes turns; not one that only takes background work)."""
    global _started
    if not settings.UGENT_WARM_AT_START:
        return None
    with _lock:
        if _started is None:
            # the freeze is decided now, by the process starting, not by whatever settings hold when warming ends
            _started = threading.Thread(target=_run, args=(settings.UGENT_GC_FREEZE, mark), name="ugent-warm",
                                        daemon=True)
            _started.start()
        return _started


def _run(gc_freeze: bool = False, mark: bool = True) -> None:
    from plugins_app.agent.code_context import code_context_warm
    # the workspace's code index (seconds for a large tree) builds beside, never delaying the warm mark
    threading.Thread(target=code_context_warm, name="ugent-warm-code", daemon=True).start()
    try:
        engines_warm()
    except Exception:
        log.exception("warming the engines failed; the first turn will do it")
    finally:
        close_old_connections()
    from ugent_common import malloctrim
    from ugent_common.gcfreeze import freeze
    freeze(gc_freeze)  # the engines now loaded stay: out of the garbage collector's walks
    malloctrim.start(settings.UGENT_MALLOC_TRIM_SECS)  # a worker's freed C memory back now and then
    if mark and settings.REDIS_URL and settings.UGENT_MODE == "servers":
        _keep_warm_mark()


def _warm_key() -> str:
    return f"ugent:warm:{settings.CELERY_TASK_DEFAULT_QUEUE}"


def _redis():
    import redis
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def _keep_warm_mark() -> None:
    """Say in Redis that a worker of this queue is warm, for as long as this process lives."""
    import socket
    client, name = _redis(), f"{socket.gethostname()}:{__import__('os').getpid()}"
    while True:
        try:
            client.set(_warm_key(), name, ex=WARM_MARK_TTL)
        except Exception as exc:  # Redis away for a moment: the mark lapses, health says warming, we retry
            log.warning("could not record the warm mark: %s", exc)
        time.sleep(WARM_MARK_REFRESH)


def workers_warm() -> bool:
    """Servers mode, for GET /v1/health: whether to answer ready. True once a worker of this queue has
    warmed (then without asking again), when warming is off, or UGENT_WARM_WAIT_SECS after the first ask."""
    global _seen_warm, _first_asked
    if _seen_warm or not settings.UGENT_WARM_AT_START or settings.UGENT_MODE != "servers":
        return True
    now = time.monotonic()
    if _first_asked is None:
        _first_asked = now
    try:
        _seen_warm = bool(_redis().exists(_warm_key()))
    except Exception:
        _seen_warm = False
    return _seen_warm or now - _first_asked >= settings.UGENT_WARM_WAIT_SECS
