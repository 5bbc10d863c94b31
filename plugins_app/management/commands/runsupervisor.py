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

from django.core.management.base import BaseCommand

from plugins_app.channel.runtime import PluginRuntime


class Command(BaseCommand):
    help = "Run the channel plugin supervisor and the plugins' bridges."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=None, help="Seconds between supervisor steps.")

    def handle(self, *args, **opts):
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        runtime = PluginRuntime(interval=opts["interval"])
        self.stdout.write("plugin supervisor running")
        self.stdout.flush()
        runtime.run(stop)
        self.stdout.write("plugin supervisor stopped")
