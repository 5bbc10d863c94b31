"""The ASGI handler of the /v1/ API: Django's, without the per-request thread hops.

Under ASGI, Django runs every `MiddlewareMixin` middleware's process_request and
process_response, the request_started signal and response.close() through
`sync_to_async(thread_sensitive=True)`, which inside a request's
ThreadSensitiveContext means a new thread per request. For the chat API that
was about a quarter of the web loop's time (py-spy, bench/chat_latency.py).

Every /v1/ endpoint authenticates with an API key (channels_app.auth), so the
session, auth, message and CSRF middleware have nothing to do there. This
handler keeps Django's URL resolution, views and exception handling, runs one
async-native middleware that sets the headers SecurityMiddleware,
XFrameOptionsMiddleware and CommonMiddleware would, and sends no
request_started/request_finished signals: the async views reach the database
only through their own executor threads, which close stale connections
themselves (close_old_connections).

Sync views (the DRF endpoints) run on a small pool of long-lived threads, one
per request as thread-sensitive code expects, instead of a new thread per
request: a new thread meant a new database connection on every request (on
PostgreSQL, a new backend). Each call on those threads closes stale
connections before and after, as the request signals would. The admin and
everything else keep the full stack.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.core.exceptions import DisallowedHost, RequestAborted
from django.core.handlers.asgi import get_script_prefix
from django.db import InterfaceError, OperationalError
from django.urls import set_script_prefix

from ugent_common.dbconn import call_with_fresh_connections

log = logging.getLogger("ugent.requests")
API_PREFIX = "/v1/"
#: Long-lived threads the API's sync views run on (requests take them in turn).
SYNC_VIEW_THREADS = 8


class _SyncViewThread(ThreadPoolExecutor):
    """One thread a request's thread-sensitive calls run on; its database connection outlives the request."""

    def __init__(self, index: int):
        super().__init__(max_workers=1, thread_name_prefix=f"ugent-api-{index}")

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(call_with_fresh_connections, fn, *args, **kwargs)


_PAGE_ERRORS = {400: ("Invalid Host header.", "invalid_host"),
                404: ("No such endpoint.", "not_found"),
                405: ("This endpoint does not take that method.", "method_not_allowed"),
                500: ("The server failed to answer this request.", "server_error"),
                503: ("The server is shutting down: send the request again.", "server_shutting_down")}
#: A request whose database went away (a PostgreSQL restart): a 503 the client may retry, not a 500 page.
DATABASE_UNAVAILABLE = ("The database is unavailable: send the request again.", "database_unavailable")
#: The server's own 5xx to a chat request whose message was accepted: a resend would run it again.
ACCEPTED_NOT_AGAIN = ("this message was accepted as turn {turn_id} and may already have acted: do not send it "
                      "again; its receipt (GET /v1/ugent/receipt) or the conversation's snapshot says where it "
                      "stands.")
_ACCEPTED_ERRORS = {"server_shutting_down": "The server is shutting down: ",
                    "database_unavailable": "The database is unavailable: ",
                    "server_error": "The server failed to answer this request: "}


def _error_object(status: int, message_code: tuple[str, str] | None = None):
    """Django's HTML error pages as the API's OpenAI-style error objects."""
    from channels_app.errors import ApplicationError, error_response
    message, code = message_code or _PAGE_ERRORS[status]
    return error_response(ApplicationError(message, status=status, code=code))


def _server_error(status: int, scope, message_code: tuple[str, str] | None = None):
    """A 5xx of the server's own (a shutdown, the database away, a crash): one the client may retry, unless
    the request is a chat message already accepted (channels_app.services.ACCEPTED_TURN_SCOPE_KEY): then it
    says so and carries x-should-retry: false, the turn's id and its conversation's."""
    from channels_app.services import ACCEPTED_TURN_SCOPE_KEY, accepted_turn_headers
    message, code = message_code or _PAGE_ERRORS[status]
    accepted = scope.get(ACCEPTED_TURN_SCOPE_KEY) if scope is not None else None
    if accepted is None:
        response = _error_object(status, (message, code))
        if status == 503:
            response["Retry-After"] = "1"
        return response
    turn_id, conversation_id = accepted
    response = _error_object(status, (_ACCEPTED_ERRORS[code] + ACCEPTED_NOT_AGAIN.format(turn_id=turn_id), code))
    for k, v in accepted_turn_headers(turn_id, conversation_id).items():
        response[k] = v
    return response


def database_unavailable_as_503(get_response):
    """A view that lost its database answers 503 `database_unavailable` (Retry-After: 1) with one log line,
    instead of Django's 500 page and a traceback. The view's connection is marked unusable by Django,
    so the thread's next request opens a new one (CONN_HEALTH_CHECKS): no restart is needed."""

    async def middleware(request):
        try:
            return await get_response(request)
        except (OperationalError, InterfaceError) as exc:  # psycopg's AdminShutdown, a refused connection, ...
            log.warning("database unavailable (method=%s, path=%s): %s", request.method, request.path,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            response = _server_error(503, getattr(request, "scope", None), DATABASE_UNAVAILABLE)
            return response

    return middleware


def api_headers(get_response):
    """What the full stack's middleware would check and set on an API response: ALLOWED_HOSTS
    (CommonMiddleware), the SSL redirect and HSTS, nosniff, Referrer-Policy and COOP
    (SecurityMiddleware, whose own checks are called directly: they do no I/O), X-Frame-Options."""
    from django.middleware.security import SecurityMiddleware
    security = SecurityMiddleware(get_response)  # settings are read here, as the full stack reads them

    async def middleware(request):
        try:
            request.get_host()  # ALLOWED_HOSTS, as CommonMiddleware checks it on the full stack
        except DisallowedHost:
            response = _error_object(400)
        else:
            response = security.process_request(request) or await get_response(request)
        if response.status_code in (404, 405, 500) and response.get("Content-Type", "").startswith("text/html"):
            page, response = response, (_server_error(500, getattr(request, "scope", None))
                                        if response.status_code == 500 else _error_object(response.status_code))
            if "Allow" in page:
                response["Allow"] = page["Allow"]
        security.process_response(request, response)
        response.headers.setdefault("X-Frame-Options", getattr(settings, "X_FRAME_OPTIONS", "DENY"))
        if not response.streaming and "Content-Length" not in response:
            response.headers["Content-Length"] = str(len(response.content))
        return response

    return middleware


class ApiHandler(ASGIHandler):
    def __init__(self):
        super().__init__()
        self._threads = [_SyncViewThread(i) for i in range(SYNC_VIEW_THREADS)]
        self._busy = [0] * SYNC_VIEW_THREADS  # requests on each thread now (the event loop's own count)
        self._turn = itertools.count()

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=True)
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        from ugent_site.middleware import request_log
        self._middleware_chain = request_log(api_headers(convert_exception_to_response(
            database_unavailable_as_503(self._get_response_async))))

    async def __call__(self, scope, receive, send):
        # The least busy thread (ties in turn), so a request stuck on a lock holds up no other while
        # a thread is free.
        start = next(self._turn)
        index = min(range(len(self._threads)), key=lambda i: (self._busy[i], (i - start) % len(self._threads)))
        self._busy[index] += 1
        try:
            async with ThreadSensitiveContext(executor=self._threads[index]):
                await self.handle(scope, receive, send)
        finally:
            self._busy[index] -= 1

    async def send_response(self, response, send):
        """Django's, and an event stream's sink gets the response's send: while the stream waits caught
        up, its process's reader writes each batch to it without resuming the stream (channels_app.fanout)."""
        sink = getattr(response, "ugent_sink", None)
        if sink is not None:
            sink.send = send
        await super().send_response(response, send)

    async def handle(self, scope, receive, send):
        """Django's ASGIHandler.handle without the signal sends and the thread hop to close."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            return

        async def process_request():
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass
            return response

        tasks = [asyncio.create_task(self.listen_for_disconnect(receive)),
                 asyncio.create_task(process_request())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping: take both down with the request
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            body_file.close()
            raise
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
            else:
                task.cancel()  # a view may handle its cancellation (a stream whose client left)
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            pass
        else:
            for closer in response._resource_closers:
                try:
                    closer()
                except Exception:
                    pass
            response.closed = True
        body_file.close()


def _path_of(scope) -> str:
    """The request's path below the app's root path (a proxy's prefix)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def route(api_app, default_app):
    """An ASGI app sending /v1/ to the API handler and the rest to Django's full stack."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and _path_of(scope).startswith(API_PREFIX):
            return await _ended_on_cancel(api_app, scope, receive, send)
        return await default_app(scope, receive, send)

    return app


def websocket_route(consumers: dict):
    """An ASGI app for WebSockets: each path of `consumers` to its consumer; the handshake to any other path
    is refused (closed before it is accepted: an HTTP 403 to the client)."""

    async def app(scope, receive, send):
        consumer = consumers.get(_path_of(scope).rstrip("/") or "/")
        if consumer is not None:
            return await consumer(scope, receive, send)
        message = await receive()
        if message["type"] == "websocket.connect":
            await send({"type": "websocket.close", "code": 1008})

    return app


async def _ended_on_cancel(api_app, scope, receive, send):
    """Run an API request; if the server cancels it (what is still open when its shutdown grace ends:
    an event stream never ends by itself), end the response properly instead of leaving it cut.

    A stream gets its last chunk (its client resumes from the durable log, by cursor); a request that
    had not answered yet gets a 503: one it may retry, or, if its message was accepted (the chat view
    marks the scope, waiting for an accept the cancel interrupted), one naming the turn, not to resend."""
    state = {"started": False, "done": False}

    async def tracked(message):
        if message["type"] == "http.response.start":
            state["started"] = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            state["done"] = True
        await send(message)

    try:
        return await api_app(scope, receive, tracked)
    except asyncio.CancelledError:
        if state["done"]:
            return None
        try:
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                response = _server_error(503, scope)
                response["Content-Length"] = str(len(response.content))
                response["Connection"] = "close"
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.items()]})
                await send({"type": "http.response.body", "body": response.content, "more_body": False})
        except Exception:
            pass  # the connection is gone already
        return None
