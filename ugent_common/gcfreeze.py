"""What a process holds once started, moved out of the cyclic garbage collector's sight (UGENT_GC_FREEZE).

A started daemon holds about 160,000-195,000 objects the collector tracks: Django's apps, models and
URLconf, the engines, pydantic's and DRF's classes. None of them is ever garbage, yet every collection
of the oldest generation walks them all again, with the GIL held: 78 ms each on the 2-core VM under
load, every thread stopped, against under 0.1 ms once they are frozen. `gc.freeze()` after start-up
puts what is alive then in the permanent generation: never walked, never freed. What start-up left as
garbage is collected first, so only live objects are frozen; one of them that later dies inside a cycle
is never freed (a few engines' caches replaced by a reload, at most once).

What it buys, measured: the tail, not a turn's CPU. The daemon on bench/chat_latency.py
(`--embedded-env UGENT_GC_FREEZE=false`, interleaved rounds, two runs of 2026-12-03), frozen over not:
at sixteen clients p99 0.82x and 0.60x (167 against 278 ms), p50 1.04x and 1.00x; at one client p50
1.04x and 1.03x, CPU a turn 1.01x and 1.03x, p99 0.96x and 1.09x. Full collections
are rare in a steady daemon (one needs a quarter as many new long-lived objects as there are
already), so it is their stall that goes, not a steady cost. An in-process bench, whose Django test
client leaves far more garbage a request, gains more (bench/memory.py's plain-turn harness, frozen by
hand: 29.6 ms p50 with the collector, 26.9 frozen, 22.1 with it off).

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
