"""Reads of cron: what `cron status`, the status page and the admin show."""
from __future__ import annotations

from django.db.models import Count, Q
from django.utils import timezone

from cron_app.models import ACTIVE_STATES, CronJob, CronRun
from cron_app.schedule import ScheduleError, slot_at_or_before


def cron_jobs_overview() -> list[dict]:
    """Each job with its active run count and its last run."""
    jobs = (CronJob.objects.annotate(active=Count("runs", filter=Q(runs__state__in=ACTIVE_STATES)))
            .order_by("position", "name"))
    out = []
    for job in jobs:  # a handful of jobs: one query each for the last run is fine
        run = CronRun.objects.filter(job_name=job.name).order_by("-id").first()
        prev = None
        if job.schedule:
            try:
                prev = slot_at_or_before(job.schedule, job.timezone, timezone.now())
            except ScheduleError:
                prev = None
        out.append({"id": job.name, "enabled": job.enabled, "rule_trigger": job.rule_trigger,
                    "schedule": job.schedule, "timezone": job.timezone, "overlap": job.overlap,
                    "max_concurrent_runs": job.max_concurrent_runs, "catch_up": job.catch_up,
                    "active_runs": job.active, "last_slot": prev.isoformat() if prev else None,
                    "last_run": ({"id": run.pk, "trigger": run.trigger, "state": run.state,
                                  "error": run.error} if run else None)})
    return out


def cron_active_runs_count() -> int:
    return CronRun.objects.filter(state__in=ACTIVE_STATES).count()
