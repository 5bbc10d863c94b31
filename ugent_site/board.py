"""The admin index as a health board: the figures of GET /v1/ugent/status, each linked to its change list.

The rules, plugins and cron figures come from the very sections /v1/ugent/status reports
(`channels_app.status.status_report`, the sections named in UGENT_STATUS_SECTIONS), so the board and
the API cannot disagree; turns, deliveries and events come from the hub's and the plugins' selectors.
A section is read defensively: a key it no longer has shows as "—", a key it gained shows under
"more", and a section that failed shows its error.
"""
from __future__ import annotations

import re
from datetime import datetime
from urllib.parse import urlencode

from django.urls import NoReverseMatch, reverse
from django.utils import timezone

LINE_COL = re.compile(r"line (\d+), column (\d+)")
#: What the rules card shows itself; any other scalar the section reports goes under "more".
RULES_SHOWN = {"in_force", "rules", "refusing_all", "on_error", "watching", "file", "admin", "routing"}


def changelist(model: str, **filters) -> str | None:
    """The admin change list of `app_label.model`, filtered (query string as the list's own filters)."""
    app, name = model.split(".")
    try:
        url = reverse(f"admin:{app}_{name}_changelist")
    except NoReverseMatch:
        return None
    return url + ("?" + urlencode(filters) if filters else "")


def change(model: str, pk) -> str | None:
    app, name = model.split(".")
    try:
        return reverse(f"admin:{app}_{name}_change", args=[pk])
    except NoReverseMatch:
        return None


def age_text(seconds) -> str:
    if seconds is None:
        return "—"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600}h"


def since(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return max(0.0, (timezone.now() - datetime.fromisoformat(iso)).total_seconds())
    except (TypeError, ValueError):
        return None


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def rules_card(section: dict) -> dict:
    if "error" in section and len(section) == 1:
        return {"title": "Rules in force", "error": section["error"]}
    f = section.get("file") or {}
    error = f.get("last_error")
    at = LINE_COL.search(error or "")
    ruleset_url = changelist("rules_app.ruleset", source="file")
    return {
        "title": "Rules in force",
        "tone": "bad" if f.get("status") in ("failed", "closed", "retained") or error else "ok",
        "figures": [
            {"label": "in force", "value": "yes" if section.get("in_force") else "no", "url": ruleset_url},
            {"label": "rules", "value": section.get("rules", "—"), "url": changelist("rules_app.rule")},
            {"label": "file", "value": f.get("path") or "none", "url": ruleset_url},
            {"label": "last load", "value": f.get("status", "—"), "url": ruleset_url},
            {"label": "loaded", "value": age_text(since(f.get("loaded_at"))) + " ago" if f.get("loaded_at") else "—"},
        ],
        "error": error,
        "error_at": {"line": int(at.group(1)), "column": int(at.group(2))} if at else None,
        "more": {k: v for k, v in section.items() if k not in RULES_SHOWN and _scalar(v)},
        "refusing_all": section.get("refusing_all"),
    }


def plugins_card(section: dict) -> dict:
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.selectors import plugin_log_tail
    if "error" in section and len(section) == 1:
        return {"title": "Plugins", "error": section["error"]}
    pks = dict(Plugin.objects.values_list("plugin_id", "pk"))
    rows = []
    for p in section.get("plugins", []):
        pk = pks.get(p.get("plugin_id"))
        tail = plugin_log_tail(p.get("plugin_id")) if p.get("plugin_id") else None
        rows.append({
            "id": p.get("plugin_id"), "url": change("plugins_app.plugin", pk) if pk else None,
            "state": p.get("state", "—"), "reason": p.get("state_reason") or p.get("disabled_reason") or "",
            "heartbeat_age": age_text(since(p.get("last_heartbeat"))),
            "circuit": p.get("circuit", "—"), "restarts": p.get("restarts", "—"),
            "dead_letters": p.get("dead_letters", 0),
            "dead_url": changelist("plugins_app.outbounddelivery", state__exact="dead_letter",
                                   plugin__id__exact=pk) if pk else None,
            "tone": "bad" if p.get("state") in ("disabled", "cooldown", "backoff") else "ok",
            "log_tail": tail, "log_tail_text": "\n".join(tail or []),
        })
    return {"title": "Plugins", "rows": rows, "url": changelist("plugins_app.plugin"),
            "tone": "bad" if any(r["tone"] == "bad" for r in rows) else "ok"}


def cron_card(section: dict) -> dict:
    if "error" in section and len(section) == 1:
        return {"title": "Cron", "error": section["error"]}
    jobs = section.get("jobs", [])
    upcoming = sorted((j for j in jobs if j.get("next_slot")), key=lambda j: j["next_slot"])[:5]
    failures = section.get("recent_failures", [])
    return {
        "title": "Cron",
        "tone": "bad" if failures else "ok",
        "figures": [
            {"label": "cron", "value": "running" if section.get("running") else "not running",
             "url": changelist("cron_app.cronsettings")},
            {"label": "active runs", "value": section.get("active_runs", "—"),
             "url": changelist("cron_app.cronrun", state__in="waiting,queued,running")},
            {"label": "jobs", "value": len(jobs), "url": changelist("cron_app.cronjob")},
        ],
        "next_runs": [{"job": j["id"], "at": j["next_slot"], "url": changelist("cron_app.cronrun", job_name=j["id"])}
                      for j in upcoming],
        "failures": [{**f, "url": change("cron_app.cronrun", f["id"])} for f in failures],
        "failures_url": changelist("cron_app.cronrun", state__in="failed,timed_out,interrupted"),
    }


def turns_card() -> dict:
    from channels_app.selectors import turns_live_overview
    t = turns_live_overview()
    return {
        "title": "Turns",
        "tone": "ok",
        "figures": [
            {"label": "running", "value": t["running"]["count"],
             "url": changelist("channels_app.turn", state__exact="running")},
            {"label": "oldest running", "value": age_text(t["running"]["oldest_age_secs"])},
            {"label": "queued", "value": t["queued"]["count"],
             "url": changelist("channels_app.turn", state__exact="accepted")},
            {"label": "oldest queued", "value": age_text(t["queued"]["oldest_age_secs"])},
        ],
        "running": [{"turn_id": r["turn_id"], "model": r["model"], "age": age_text(r["age_secs"]),
                     "stopping": r["cancel_requested"], "url": change("channels_app.turn", r["pk"])}
                    for r in t["oldest_running"]],
    }


def deliveries_card(plugins_section: dict) -> dict:
    plugins = plugins_section.get("plugins", []) if isinstance(plugins_section, dict) else []
    pending = sum(p.get("pending", 0) or 0 for p in plugins)
    dead = sum(p.get("dead_letters", 0) or 0 for p in plugins)
    return {
        "title": "Deliveries",
        "tone": "bad" if dead else "ok",
        "figures": [
            {"label": "pending", "value": pending,
             "url": changelist("plugins_app.outbounddelivery", state__exact="pending")},
            {"label": "in flight", "value": sum(p.get("in_flight", 0) or 0 for p in plugins),
             "url": changelist("plugins_app.outbounddelivery", state__exact="in_flight")},
            {"label": "dead letters", "value": dead,
             "url": changelist("plugins_app.outbounddelivery", state__exact="dead_letter")},
        ],
    }


def events_card() -> dict:
    from channels_app.selectors import events_retained
    e = events_retained()
    return {"title": "Events retained", "tone": "ok", "figures": [
        {"label": "events", "value": e["count"], "url": changelist("channels_app.event")},
        {"label": "oldest", "value": age_text(e["oldest_age_secs"])},
    ]}


def health_board() -> dict:
    """Every card of the board, in reading order."""
    from channels_app.status import status_report
    status = status_report()["status"]
    plugins = status.get("plugins", {})
    return {
        "mode": status.get("mode"),
        "cards": [rules_card(status.get("rules", {})), plugins_card(plugins), cron_card(status.get("cron", {})),
                  turns_card(), deliveries_card(plugins), events_card()],
        "read_at": timezone.now(),
    }
