"""Run the channel plugin supervisor (servers mode; rundaemon runs it itself in embedded mode).

    python manage.py runsupervisor [--interval 0.5]

Starts every enabled plugin's worker with its bridge, keeps them equal to the
Plugin rows (admin edits take effect without a restart), restarts with backoff,
trips the circuit breaker, and reaps workers a crashed supervisor left behind.
SIGTERM/SIGINT set a flag: the loop finishes its step, then stops every worker
in two phases (SIGTERM to each group, a grace period, SIGKILL).
"""
from __future__ import annotations

import signal
import threading

from django.core.management.base import BaseCommand, CommandError

from plugins_app.channel.runtime import PluginRuntime
from plugins_app.channel.supervisor import SupervisorAlreadyRunning


class Command(BaseCommand):
    help = "Run the channel plugin supervisor and the plugins' bridges."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=None, help="Seconds between supervisor steps.")

    def handle(self, *args, **opts):
        from ugent_common.dbconn import tables_required
        # else its loop logged "no such table" every step, forever; a database not up yet is waited for, as before
        tables_required("plugins_app", unreachable_ok=True)
        runtime = PluginRuntime(interval=opts["interval"])
        try:  # the pid directory's lock first: a second supervisor says so in one line, having started nothing
            runtime.supervisor.start()
        except SupervisorAlreadyRunning as exc:
            raise CommandError(f"{exc}: one supervisor runs per pid directory; this one did not start") from None
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        self.stdout.write("plugin supervisor running")
        self.stdout.flush()
        runtime.run(stop)
        self.stdout.write("plugin supervisor stopped")
