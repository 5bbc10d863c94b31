"""Reads of the hub that are more than one filter: what the admin's health board shows of turns and events."""
from __future__ import annotations

from django.db.models import Count, Min
from django.utils import timezone

from channels_app.models import Event, Turn, TurnState


def _age(since) -> float | None:
    return None if since is None else max(0.0, (timezone.now() - since).total_seconds())


def turns_live_overview() -> dict:
    """Running and queued (accepted) turns: how many, and the age of the oldest of each."""
    rows = {r["state"]: r for r in Turn.objects.live()
            .values("state").annotate(n=Count("id"), oldest=Min("created_at")).order_by()}
    out = {}
    for state, name in ((TurnState.RUNNING, "running"), (TurnState.ACCEPTED, "queued")):
        row = rows.get(state, {})
        out[name] = {"count": row.get("n", 0), "oldest_age_secs": _age(row.get("oldest"))}
    out["oldest_running"] = list(Turn.objects.live().filter(state=TurnState.RUNNING).order_by("created_at")
                                 .values("pk", "turn_id", "model", "created_at", "cancel_requested")[:5])
    for t in out["oldest_running"]:
        t["age_secs"] = _age(t.pop("created_at"))
    return out


def events_retained() -> dict:
    """The durable event log as it stands: how many events are kept, and the age of the oldest."""
    agg = Event.objects.aggregate(n=Count("id"), oldest=Min("created_at"))
    return {"count": agg["n"], "oldest_age_secs": _age(agg["oldest"])}
