"""One log line and one count per API request.

    request (method=POST, path=/v1/chat/completions, status=200, ms=41.2, caller=crm, actor=web:alice, turn=turn-…)

Runs outermost on both stacks: first in settings.MIDDLEWARE (the full stack: the admin, the test
client) and around the lean /v1/ handler's chain (ugent_site/api_handler.py). The caller is the key's
caller (request.user, a channels_app Principal, once DRF or the chat view authenticated it), the
actor and turn what the view noted (``request.ugent_actor``, the ``x-ugent-turn-id`` header). A
stream is logged when it closes, so its ms is the stream's whole length. Only /v1/ requests and
/metrics are logged and counted; the admin's pages are not API requests.
"""
from __future__ import annotations

import logging
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

from ugent_common import metrics

log = logging.getLogger("ugent.requests")
LOGGED_PREFIXES = ("/v1/", "/metrics")


def _caller(request) -> str:
    user = getattr(request, "user", None)
    caller = getattr(user, "caller", None)
    if caller is not None:
        return caller.name
    return "-"


def _endpoint(request) -> str:
    match = getattr(request, "resolver_match", None)
    route = getattr(match, "route", None) if match is not None else None
    return "/" + route if route else "unmatched"


def request_report(request, response, started: float) -> None:
    """Log the request's line and count it; a failure here never reaches the client."""
    try:
        ms = round((time.monotonic() - started) * 1000, 1)
        fields = {"method": request.method, "path": request.path, "status": response.status_code, "ms": ms,
                  "caller": _caller(request), "actor": getattr(request, "ugent_actor", None) or "-",
                  "turn": response.get("x-ugent-turn-id") or getattr(request, "ugent_turn_id", None) or "-"}
        log.info("request (method=%s, path=%s, status=%s, ms=%s, caller=%s, actor=%s, turn=%s)",
                 *fields.values(), extra=fields)
        metrics.request_answered(endpoint=_endpoint(request), method=request.method,
                                 status=response.status_code, seconds=ms / 1000)
    except Exception:
        log.warning("could not report a request", exc_info=True)


def _watch(request, response, started: float):
    if not request.path.startswith(LOGGED_PREFIXES):
        return response
    if getattr(response, "streaming", False):
        response._resource_closers.append(lambda: request_report(request, response, started))
    else:
        request_report(request, response, started)
    return response


class RequestLogMiddleware:
    """The line and the count, for the full stack (sync or async)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        started = time.monotonic()
        return _watch(request, self.get_response(request), started)

    async def __acall__(self, request):
        started = time.monotonic()
        return _watch(request, await self.get_response(request), started)


def request_log(get_response):
    """The same around an async chain (the lean /v1/ handler)."""

    async def middleware(request):
        started = time.monotonic()
        return _watch(request, await get_response(request), started)

    return middleware
