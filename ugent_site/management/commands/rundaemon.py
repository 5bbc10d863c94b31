"""Embedded mode in one process: the ASGI server, a Celery worker on the in-process broker, and beat.

    python manage.py rundaemon [--bind 127.0.0.1] [--port 8787] [--no-migrate]

The ASGI server is uvicorn (httptools, uvloop; ugent_site/webserver.py, as `runweb`
runs it in servers mode): on the chat bench it costs about half of what daphne's
Twisted HTTP stack did per request (docs/performance.md). SIGTERM/SIGINT stop it
(open streams get webserver.SHUTDOWN_GRACE_SECONDS to end; clients resume them
from the durable log); the worker and beat then drain and stop.
"""
from __future__ import annotations

import logging
import threading
from contextlib import ExitStack

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

log = logging.getLogger("ugent.daemon")


class Command(BaseCommand):
    help = "Run UGENT in one process: the web API, the turn worker and the scheduler."

    def add_arguments(self, parser):
        parser.add_argument("--bind", default=settings.UGENT_WEB_BIND)
        parser.add_argument("--port", type=int, default=settings.UGENT_WEB_PORT)
        parser.add_argument("--no-migrate", action="store_true", help="Do not apply migrations first.")
        parser.add_argument("--concurrency", type=int, default=8, help="Turns that run at once.")
        parser.add_argument("--no-beat", action="store_true")

    def handle(self, *args, **opts):
        import sys
        # One process hosts the web loop, executor threads and the turn worker: hand the GIL over
        # sooner than the default 5 ms so a woken thread does not wait out another's slice.
        sys.setswitchinterval(0.0005)
        from ugent_site import memstats
        memstats.start(settings.UGENT_MEMSTATS, settings.VAR_DIR / "memstats")
        # ...and keep those threads on one core (UGENT_CPU_AFFINITY, ugent_common/affinity.py).
        from ugent_common import affinity
        cpus = affinity.pin(settings.UGENT_CPU_AFFINITY)
        if cpus is not None:
            log.info("threads kept on CPU %s (UGENT_CPU_AFFINITY=%s)", ",".join(map(str, sorted(cpus))),
                     settings.UGENT_CPU_AFFINITY)
        if opts["no_migrate"]:  # first: with tables missing it says to migrate, and writes nothing (no key file)
            from django.apps import apps
            from ugent_common.dbconn import tables_required
            tables_required(*apps.get_models())
        self.ensure_operator_key()  # then: a key file it cannot make stops it before anything starts
        if not opts["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        from ugent_site.staticfiles import static_collect_if_changed
        if static_collect_if_changed():
            log.info("collected the admin's static files into %s", settings.STATIC_ROOT)
        from channels_app.runner import turns_recover_interrupted, turns_requeue_accepted
        from plugins_app.agent.profiles import profiles_ensure_defaults
        profiles_ensure_defaults()
        # Engine discovery and the notes index, in the background beside the rest of the start-up.
        from plugins_app.agent.warm import warm_start
        warming = warm_start()
        from channels_app.streams import retention_schedule_ensure
        retention_schedule_ensure()
        interrupted = turns_recover_interrupted()
        if interrupted:
            log.warning("marked %d turn(s) interrupted: the process running them stopped", interrupted)

        # Whatever has started stops again, last started first, however the start-up or the server ends.
        stack = ExitStack()
        try:
            worker = self.start_worker(opts["concurrency"])
            stack.callback(_quietly(lambda: worker.stop(in_sighandler=False), "the Celery worker"))
            from channels_app import dispatch
            # Turns accepted here run on this process's turn threads when the broker is in-process too
            # (channels_app.dispatch.LocalTurnPool); with a Redis broker any worker may take them.
            if not settings.REDIS_URL:
                dispatch.local_turn_pool_start(opts["concurrency"])
                stack.callback(_quietly(dispatch.local_turn_pool_stop, "the turn threads"))
            if not (opts["no_beat"] or settings.REDIS_URL):
                beat = self.start_beat()
                stack.callback(_quietly(beat.stop, "beat"))
            self.start_background_services(stack)
            if warming is not None:
                # The listener opens once the engines are warm (or the wait is over): the first turn after
                # /v1/health answers finds discovery done and the notes index built.
                warming.join(settings.UGENT_WARM_WAIT_SECS)
                if warming.is_alive():
                    log.warning("engines still warming after %.0f s: opening the API anyway",
                                settings.UGENT_WARM_WAIT_SECS)
            requeued = turns_requeue_accepted()
            if requeued:
                log.info("re-queued %d accepted turn(s)", requeued)
            self.stdout.write(f"UGENT daemon ({settings.UGENT_MODE} mode) on "
                              f"http://{opts['bind']}:{opts['port']}/v1")
            self.print_admin(opts["bind"], opts["port"])
            self.stdout.flush()
            self.run_http(opts["bind"], opts["port"])
        finally:
            self.stdout.write("UGENT daemon stopping")
            stack.close()
            self.stdout.write("UGENT daemon stopped")

    def print_admin(self, bind: str, port: int) -> None:
        """Where the admin is, and (until one exists) the one command that creates its first account."""
        from django.contrib.auth import get_user_model
        host = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
        self.stdout.write(f"Admin: http://{host}:{port}/admin/")
        if not get_user_model().objects.filter(is_superuser=True, is_active=True).exists():
            self.stdout.write("No admin account yet. Create one with:\n  python manage.py createsuperuser")

    def ensure_operator_key(self):
        """A fresh install gets an operator key of its own, kept in var/ (mode 0600); a key file that is
        empty, or whose directory is missing, is a one-line error naming it."""
        if settings.UGENT_WEB_API_KEY:
            return
        from ugent_site.operator_key import OperatorKeyError, operator_key_create
        path = settings.UGENT_WEB_API_KEY_FILE
        try:
            key = operator_key_create(path=path)
        except OperatorKeyError as exc:
            raise CommandError(str(exc)) from None
        settings.UGENT_WEB_API_KEY = key
        self.stdout.write(f"Generated an operator API key (kept in {path}):\n  {key}")

    def start_background_services(self, stack: ExitStack) -> None:
        """Each app may offer long-running services (rule watcher, plugin supervisor): an AppConfig
        method `background_services(mode)` returning objects with start() and stop(), started in the
        apps' order unless a service names an earlier `start_order` (default 100)."""
        from django.apps import apps
        services = []
        for app_config in apps.get_app_configs():
            factory = getattr(app_config, "background_services", None)
            if callable(factory):
                services.extend(factory("embedded"))
        for service in sorted(services, key=lambda s: getattr(s, "start_order", 100)):
            service.start()
            stack.callback(_quietly(service.stop, f"background service {service!r}"))

    def start_worker(self, concurrency: int):
        from ugent_site.celery import app
        worker = app.WorkController(pool_cls="threads", concurrency=concurrency, loglevel="WARNING",
                                    without_heartbeat=True, without_mingle=True, without_gossip=True,
                                    hostname=f"embedded@{settings.UGENT_WEB_BIND}")
        thread = threading.Thread(target=worker.start, name="celery-worker", daemon=True)
        thread.start()
        return worker

    def start_beat(self):
        from celery.beat import EmbeddedService

        from ugent_site.celery import app
        beat = EmbeddedService(app, thread=True, scheduler_cls=settings.CELERY_BEAT_SCHEDULER)
        beat.start()
        return beat

    def run_http(self, bind: str, port: int):
        from ugent_site.webserver import serve
        serve(bind, port)


def _quietly(stop, what):
    def call():
        try:
            stop()
        except Exception:
            log.exception("failed to stop %s", what)
    return call
