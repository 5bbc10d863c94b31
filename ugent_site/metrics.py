"""GET /metrics: the Prometheus text format, for an operator key or on a listener of its own.

What processes count (requests, turn durations and time to first token, turns by end state, plugin
restarts, rule decisions) is in ugent_common/metrics.py. What the database holds is read here at
scrape time, once per scrape whichever process answers: turns queued and running (the queue
depth), deliveries by state, plugins by state, events retained.

Servers mode: with ``PROMETHEUS_MULTIPROC_DIR`` set (one empty directory, the same for every web
process, worker and the supervisor, emptied before they start), a scrape sums every process's
counts (prometheus_client's multiprocess mode). Without it, each process answers its own.

``UGENT_METRICS_BIND=host:port``: rundaemon also serves the same page there, with no key (a listener
for a scraper on a private network); /metrics on the API port keeps asking for an operator key.
"""
from __future__ import annotations

import logging
import os

from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("ugent.metrics")


class DatabaseCollector:
    """Figures the database holds, read at each scrape."""

    def collect(self):
        from django.db import close_old_connections
        from django.db.models import Count

        from channels_app.models import Event, Turn, TurnState
        from plugins_app.channel.models import DeliveryState, OutboundDelivery, Plugin, PluginState
        close_old_connections()
        turns = dict(Turn.objects.live().values_list("state").annotate(n=Count("id")).order_by())
        queue = GaugeMetricFamily("ugent_turn_queue_depth", "Turns accepted and waiting to start.")
        queue.add_metric([], turns.get(TurnState.ACCEPTED, 0))
        yield queue
        running = GaugeMetricFamily("ugent_turns_running", "Turns running now.")
        running.add_metric([], turns.get(TurnState.RUNNING, 0))
        yield running
        by_state = dict(OutboundDelivery.objects.values_list("state").annotate(n=Count("id")))
        deliveries = GaugeMetricFamily("ugent_deliveries", "Outbound deliveries to channel plugins, by state.",
                                       labels=["state"])
        for state in DeliveryState.values:
            deliveries.add_metric([state], by_state.get(state, 0))
        yield deliveries
        plugin_states = dict(Plugin.objects.values_list("state").annotate(n=Count("id")))
        plugins = GaugeMetricFamily("ugent_plugins", "Channel plugins, by state.", labels=["state"])
        for state in PluginState.values:
            plugins.add_metric([state], plugin_states.get(state, 0))
        yield plugins
        events = GaugeMetricFamily("ugent_events_retained", "Events the durable log holds.")
        events.add_metric([], Event.objects.count())
        yield events


_database = CollectorRegistry(auto_describe=False)
_database.register(DatabaseCollector())


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def exposition() -> bytes:
    """The whole page: every process's counts (or this one's), then the database's figures."""
    if multiprocess():
        from prometheus_client import multiprocess as mp
        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
        counts = generate_latest(registry)
    else:
        counts = generate_latest(REGISTRY)
    try:
        figures = generate_latest(_database)
    except Exception:  # the database is down: the counts still answer, and the log says why
        log.warning("metrics: could not read the database's figures", exc_info=True)
        figures = b""
    return counts + figures


@require_GET
def metrics_view(request):
    """GET /metrics, for operator keys (x-api-key or Authorization: Bearer)."""
    from channels_app.auth import authenticate_headers
    from channels_app.errors import ApplicationError, error_response
    try:
        principal = authenticate_headers(request.headers)
    except ApplicationError as exc:
        return error_response(exc)
    request.user = principal
    if not principal.has_operator_key:
        return error_response(ApplicationError("This endpoint answers operator keys only.", status=403,
                                               code="permission_denied"))
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)


class MetricsListener:
    """rundaemon's separate listener on UGENT_METRICS_BIND (no key: bind it where only the scraper reaches)."""

    def __init__(self, bind: str):
        host, _, port = bind.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.server = self.thread = None

    def start(self):
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        import threading

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args):
                pass

        def app(environ, start_response):
            if environ.get("PATH_INFO") not in ("/metrics", "/"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"Not found: the metrics are at /metrics\n"]
            from django.db import close_old_connections
            try:
                body = exposition()
            finally:
                close_old_connections()
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [body]

        self.server = make_server(self.host, self.port, app, handler_class=Quiet)
        self.thread = threading.Thread(target=self.server.serve_forever, name="ugent-metrics", daemon=True)
        self.thread.start()
        log.info("metrics on http://%s:%s/metrics (UGENT_METRICS_BIND, no key)", self.host, self.port)

    def stop(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __repr__(self):
        return f"MetricsListener({self.host}:{self.port})"


def background_services(mode: str) -> list:
    bind = getattr(settings, "UGENT_METRICS_BIND", "")
    return [MetricsListener(bind)] if bind else []
