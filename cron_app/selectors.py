"""Reads of cron: what `cron status`, the status page and the admin show."""
from __future__ import annotations

from django.db.models import Count, Q
from django.utils import timezone

from cron_app.models import ACTIVE_STATES, CronJob, CronRun
from cron_app.schedule import ScheduleError, slot_at_or_before, slot_after


def cron_jobs_overview() -> list[dict]:
    """Each job with its active run count and its last run."""
    jobs = (CronJob.objects.annotate(active=Count("runs", filter=Q(runs__state__in=ACTIVE_STATES)))
            .order_by("position", "name"))
    out = []
    for job in jobs:  # a handful of jobs: one query each for the last run is fine
        run = CronRun.objects.filter(job_name=job.name).order_by("-id").first()
        prev = nxt = None
        if job.schedule:
            try:
                now = timezone.now()
                prev = slot_at_or_before(job.schedule, job.timezone, now)
                nxt = slot_after(job.schedule, job.timezone, now) if job.enabled else None
            except ScheduleError:
                prev = nxt = None
        out.append({"id": job.name, "enabled": job.enabled, "rule_trigger": job.rule_trigger,
                    "schedule": job.schedule, "timezone": job.timezone, "overlap": job.overlap,
                    "max_concurrent_runs": job.max_concurrent_runs, "catch_up": job.catch_up,
                    "active_runs": job.active, "last_slot": prev.isoformat() if prev else None,
                    "next_slot": nxt.isoformat() if nxt else None,
                    "last_run": ({"id": run.pk, "trigger": run.trigger, "state": run.state,
                                  "error": run.error} if run else None)})
    return out


def cron_active_runs_count() -> int:
    return CronRun.objects.filter(state__in=ACTIVE_STATES).count()


FAILED_RUN_STATES = ("failed", "timed_out", "interrupted")


def cron_recent_failures(*, limit: int = 5) -> list[dict]:
    """The latest runs that ended badly (failed, timed out, interrupted), newest first."""
    return [{"id": r["pk"], "job": r["job_name"], "state": r["state"], "error": r["error"],
             "finished_at": r["finished_at"].isoformat() if r["finished_at"] else None}
            for r in CronRun.objects.filter(state__in=FAILED_RUN_STATES).order_by("-id")
            .values("pk", "job_name", "state", "error", "finished_at")[:limit]]
