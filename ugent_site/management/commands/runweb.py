"""Servers mode's web process: the API and the admin, over Redis and PostgreSQL, one of several behind
a proxy (docs/deploy.md). Turns run on the Celery workers; this process takes messages and serves
streams from the log.

    python manage.py runweb [--bind 127.0.0.1] [--port 8787]

The same server as rundaemon's (ugent_site/webserver.py), so a stop answers the requests it cancels:
uvicorn's own CLI ends the process before they do, and a client whose message was accepted sent it
again.
"""
from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Run one servers-mode web process: the web API and the admin (turns run on Celery workers)."

    def add_arguments(self, parser):
        parser.add_argument("--bind", default=settings.UGENT_WEB_BIND)
        parser.add_argument("--port", type=int, default=settings.UGENT_WEB_PORT)

    def handle(self, *args, **opts):
        if not settings.REDIS_URL:  # embedded mode: turns run in rundaemon's process, which this is not
            raise CommandError("runweb is servers mode's web process and needs REDIS_URL; "
                               "in embedded mode run: python manage.py rundaemon")
        from ugent_site.webserver import serve
        serve(opts["bind"], opts["port"])
