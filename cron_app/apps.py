import logging
import threading

from django.apps import AppConfig

log = logging.getLogger("ugent.cron")


_watcher = None
_watcher_lock = threading.Lock()


def _watch_cron_file():
    """Import UGENT_CRON_FILE now and whenever it changes (cron_app/filewatch.py): one watcher a process,
    whichever starts it first (the embedded daemon runs beat inside it too). None when no file is set."""
    from cron_app import conf
    from cron_app.filewatch import CronFileWatcher
    global _watcher
    path = conf.cron_file_watched()
    if not path:
        return None
    with _watcher_lock:
        if _watcher is None:
            try:
                _watcher = CronFileWatcher(path, poll=conf.cron_watch_poll_secs()).start()
            except Exception:  # cron must not keep the daemon from starting
                log.exception("cron file watch could not start (path=%s)", path)
        return _watcher


def _unwatch_cron_file() -> None:
    global _watcher
    with _watcher_lock:
        watcher, _watcher = _watcher, None
    if watcher is not None:
        watcher.stop()


class CronStartup:
    """At an embedded daemon's start: import cron.toml if it changed (and watch it), recover runs a stopped
    process left, then run missed slots once."""

    #: Before the rule engine's start: its StartWorkflow rules are checked against the jobs as they load,
    #: and a rule naming a job new in cron.toml must find it imported (rundaemon's start_background_services).
    start_order = 10

    def start(self):
        from cron_app.services import cron_catch_up, cron_running, cron_runs_recover
        _watch_cron_file()
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
        _unwatch_cron_file()


def _on_beat_init(sender=None, **kwargs):
    """A beat process starting (servers mode) imports and watches cron.toml and runs the missed slots once,
    like the embedded daemon."""
    from django.db import close_old_connections

    from cron_app.services import cron_catch_up, cron_running
    from cron_app.tasks import cron_sweep_schedule_ensure
    _watch_cron_file()
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
