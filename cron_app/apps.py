import logging

from django.apps import AppConfig

log = logging.getLogger("ugent.cron")


class CronStartup:
    """At an embedded daemon's start: recover runs a stopped process left, then run missed slots once."""

    def start(self):
        from cron_app.services import cron_catch_up, cron_running, cron_runs_recover
        try:
            recovered = cron_runs_recover()
            if recovered["resumed"] or recovered["requeued"]:
                log.warning("cron runs recovered (resumed=%d, requeued=%d)", recovered["resumed"],
                            recovered["requeued"])
            if cron_running():
                cron_catch_up()
        except Exception:  # cron must not keep the daemon from starting
            log.exception("cron start-up failed")

    def stop(self):
        pass


def _on_beat_init(sender=None, **kwargs):
    """A beat process starting (servers mode) runs the missed slots once, like the embedded daemon."""
    from django.db import close_old_connections

    from cron_app.services import cron_catch_up, cron_running
    from cron_app.tasks import cron_sweep_schedule_ensure
    try:
        cron_sweep_schedule_ensure()
        if cron_running():
            cron_catch_up()
    except Exception:
        log.exception("cron catch-up at beat start failed")
    finally:
        close_old_connections()


class CronAppConfig(AppConfig):
    name = "cron_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Cron jobs and workflows"

    def ready(self):
        from celery.signals import beat_init

        beat_init.connect(_on_beat_init, dispatch_uid="cron_app.catch_up")
        from cron_app import tools
        tools.register()  # the scheduled_jobs toolbox (offered to turns whose tools are not narrowed)
        # a run moves on when one of its turns ends, whatever the end (no task waits for a turn):
        # cron_app.services.cron_turn_ended is named in settings.UGENT_AFTER_TURN_HOOKS

    def background_services(self, mode):
        return [CronStartup()]


def status_section() -> dict:
    """The cron section of GET /v1/ugent/status (named in settings)."""
    from cron_app.selectors import cron_active_runs_count, cron_jobs_overview, cron_recent_failures
    from cron_app.services import cron_running
    return {"running": cron_running(), "active_runs": cron_active_runs_count(), "jobs": cron_jobs_overview(),
            "recent_failures": cron_recent_failures()}
