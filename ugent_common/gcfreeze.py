"""What a process holds once started, moved out of the cyclic garbage collector's sight (UGENT_GC_FREEZE).

A started daemon holds about 195,000 objects the collector tracks: Django's apps, models and URLconf,
the engines, pydantic's and DRF's classes. None of them is ever garbage, yet every collection of the
oldest generation walks them all again, and a turn leaves about 400 objects in reference cycles (its
run, toolboxes and rows, DRF's serializer fields: measured with gc.DEBUG_SAVEALL), so the collector
runs all the time: on the 2-core machine a turn of the in-process bench took 29.6 ms p50 with the
collector on, 22.1 with it off and 26.9 frozen, and in a quieter run 18.0, 16.1 and 15.7
(interleaved rounds, the same run each). `gc.freeze()` after start-up puts what is alive then in the
permanent generation: never walked, never freed. What start-up left as garbage is collected first, so
only live objects are frozen; one of them that later dies inside a cycle is never freed (a few engines'
caches replaced by a reload, at most once).

Called where a process has finished starting: at the end of ugent_site/asgi.py (a web process, and
rundaemon, which imports it last, once warm) and when warming ends (plugins_app.agent.warm: a Celery
worker in servers mode). Calling it again freezes what has come since. No Django imports: the setting
is read by the callers.
"""
from __future__ import annotations

import gc


def freeze(enabled: bool = True) -> int:
    """Collect, then freeze every object alive now; how many are frozen in all (0 when not enabled)."""
    if not enabled:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
