"""ugent_site.api_handler: /v1/ through Django's ASGI handler without the middleware hops.

The ASGI application is driven directly (an http scope, a receive that gives one http.request and
then waits for a disconnect, a send that collects the messages), so what is checked is what a
server would put on the wire. The views reach the database from executor threads: the tests use
transactional databases so those threads see the rows.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.urls import include, path

from tests.conftest import APP_KEY, OPERATOR_KEY

pytestmark = pytest.mark.django_db(transaction=True)


# --- a URLconf for the handler's own behaviour (views that raise, stream) ---------------------------

stream_state: dict = {}


def _boom(request):
    raise RuntimeError("boom")


def _missing(request):
    raise Http404("no such thing")


def _framed(request):
    resp = HttpResponse(b"framed")
    resp["X-Frame-Options"] = "SAMEORIGIN"
    return resp


async def _slow_stream(request):
    async def chunks():
        stream_state["sent"] = 0
        try:
            for i in range(2000):
                stream_state["sent"] += 1
                yield f"chunk {i}\n".encode()
                await asyncio.sleep(0.01)
            stream_state["finished"] = True
        except asyncio.CancelledError:
            stream_state["cancelled"] = True
            raise
        finally:
            stream_state["closed"] = True

    return StreamingHttpResponse(chunks(), content_type="text/plain")


async def _short_stream(request):
    async def chunks():
        for part in (b"one,", b"two,", b"three"):
            yield part

    return StreamingHttpResponse(chunks(), content_type="text/plain")


def _accepted(request):
    """A chat request's view once its message is accepted (channels_app.api.ChatCompletionApi)."""
    from channels_app.api import _mark_accepted
    _mark_accepted(request, "turn-accepted-1", "conv-accepted-1")


def _db_gone(request):
    from django.db import OperationalError
    if request.GET.get("accepted"):
        _accepted(request)
    raise OperationalError("the database went away")


def _accepted_then_boom(request):
    _accepted(request)
    raise RuntimeError("boom")


urlpatterns = [
    path("v1/test/db-gone", _db_gone),
    path("v1/test/accepted-boom", _accepted_then_boom),
    path("v1/test/boom", _boom),
    path("v1/test/missing", _missing),
    path("v1/test/framed", _framed),
    path("v1/test/slow-stream", _slow_stream),
    path("v1/test/short-stream", _short_stream),
    path("", include("ugent_site.urls")),
]


@pytest.fixture
def test_urls(settings):
    settings.ROOT_URLCONF = __name__


# --- the ASGI driver ---------------------------------------------------------------------------

class Reply:
    def __init__(self, messages: list[dict]):
        self.messages = messages
        start = [m for m in messages if m["type"] == "http.response.start"]
        assert len(start) == 1, messages
        self.status = start[0]["status"]
        self.header_list = [(k.decode().lower(), v.decode()) for k, v in start[0].get("headers", [])]
        self.body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")

    def header(self, name: str) -> str | None:
        values = self.headers_named(name)
        return values[0] if values else None

    def headers_named(self, name: str) -> list[str]:
        return [v for k, v in self.header_list if k == name.lower()]

    def json(self):
        return json.loads(self.body)


def _scope(method: str, path_: str, headers: dict | None, query: str = "", scheme: str = "http") -> dict:
    raw = [(b"host", b"testserver")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": scheme, "path": path_, "raw_path": path_.encode(),
            "query_string": query.encode(), "root_path": "", "headers": raw,
            "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


async def _drive(app, scope, body: bytes, disconnect_after_body: bool):
    sent: list[dict] = []
    gone = asyncio.Event()
    requested = [False]

    async def receive():
        if not requested[0]:
            requested[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if disconnect_after_body and message["type"] == "http.response.body" and message.get("body"):
            gone.set()  # the client leaves once the first part of the body arrived

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return sent


def call(method: str, path_: str, *, headers: dict | None = None, body: bytes = b"", query: str = "",
         app=None, disconnect_after_body: bool = False, scheme: str = "http") -> Reply:
    if app is None:
        from ugent_site.asgi import application as app
    scope = _scope(method, path_, headers, query, scheme)
    return Reply(asyncio.run(_drive(app, scope, body, disconnect_after_body)))


def full_stack():
    from ugent_site.asgi import django_asgi_app
    return django_asgi_app


def chat_body(**extra) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi there"}], "stream": False}
    body.update(extra)
    return json.dumps(body).encode()


# --- /v1/ through the lean handler ---------------------------------------------------------------

def test_health_carries_the_security_headers_and_content_length():
    r = call("GET", "/v1/health")
    assert r.status == 200
    assert r.json()["status"] == "ok"
    assert r.header("x-content-type-options") == "nosniff"
    assert r.header("x-frame-options") == "DENY"
    assert r.header("referrer-policy") == "same-origin"
    assert r.header("content-length") == str(len(r.body))
    assert r.header("content-type").startswith("application/json")
    # Each header once.
    names = [k for k, _ in r.header_list]
    assert len(names) == len(set(names)), names


def test_chat_without_a_key_is_an_openai_style_401():
    r = call("POST", "/v1/chat/completions", body=chat_body(), headers={"content-type": "application/json"})
    assert r.status == 401
    err = r.json()["error"]
    assert err["message"] and err["code"] == "missing_api_key"
    assert err["type"] == "authentication_error"
    assert r.header("content-length") == str(len(r.body))
    assert r.header("x-content-type-options") == "nosniff"


def test_chat_with_a_wrong_key_is_401_invalid_api_key():
    r = call("POST", "/v1/chat/completions", body=chat_body(),
             headers={"content-type": "application/json", "authorization": "Bearer ugk_not_a_key"})
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_chat_turn_runs_through_the_lean_handler(tcast):
    r = call("POST", "/v1/chat/completions", body=chat_body(user="alice", conversation_id="asgi-1"),
             headers={"content-type": "application/json", "x-api-key": OPERATOR_KEY})
    assert r.status == 200, r.body
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "echo: hi there (history=0)"
    assert r.header("x-ugent-turn-id") == body["ugent_turn_id"]
    assert r.header("content-length") == str(len(r.body))
    from channels_app.models import Receipt
    assert Receipt.objects.get().state == "completed"


def test_drf_views_authenticate_with_the_key(tcast):
    ok = call("GET", "/v1/models", headers={"x-api-key": APP_KEY})
    assert ok.status == 200 and ok.json()["object"] == "list"
    refused = call("GET", "/v1/models")
    assert refused.status == 401 and "error" in refused.json()
    assert refused.header("x-frame-options") == "DENY"


def test_unknown_v1_path_is_404():
    r = call("GET", "/v1/no-such-endpoint")
    assert r.status == 404
    assert r.header("content-length") == str(len(r.body))
    assert r.header("x-content-type-options") == "nosniff"


def test_v1_responses_set_no_cookie_and_do_not_vary_on_it():
    # A stale session cookie: the session middleware would delete it (Set-Cookie, Vary: Cookie).
    # (The CSRF cookie is well formed: Django's default error views, decorated with requires_csrf_token,
    # would replace a malformed one even here.)
    cookie = {"cookie": "sessionid=stale; csrftoken=" + "a" * 32}
    for method, path_, body in (("GET", "/v1/health", b""), ("GET", "/v1/no-such-endpoint", b""),
                                ("POST", "/v1/chat/completions", chat_body())):
        r = call(method, path_, headers={**cookie, "content-type": "application/json"}, body=body)
        assert r.headers_named("set-cookie") == [], (path_, r.header_list)
        assert "cookie" not in (r.header("vary") or "").lower(), (path_, r.header_list)
    # The same request through Django's full stack does get the session middleware's answer,
    # so the absence above is the lean handler's doing.
    full = call("GET", "/v1/health", headers=cookie, app=full_stack())
    assert full.status == 200
    assert any(c.startswith("sessionid=") for c in full.headers_named("set-cookie"))
    assert "cookie" in (full.header("vary") or "").lower()


def test_v1_with_the_lean_handler_sends_no_request_signals():
    from django.core import signals
    seen = []

    def started(**kwargs):
        seen.append("started")

    def finished(**kwargs):
        seen.append("finished")

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        assert call("GET", "/v1/health").status == 200
        assert seen == []
        # The rest of the site goes through the full handler, which sends them.
        assert call("GET", "/admin/login/").status == 200
        assert "started" in seen and "finished" in seen
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)


# --- everything else through Django's full stack -----------------------------------------------

def test_admin_login_goes_through_the_full_stack():
    r = call("GET", "/admin/login/")
    assert r.status == 200
    cookies = r.headers_named("set-cookie")
    assert any(c.startswith("csrftoken=") for c in cookies), r.header_list
    assert "cookie" in (r.header("vary") or "").lower()
    assert b"csrfmiddlewaretoken" in r.body
    assert r.header("x-frame-options") == "DENY"


def test_admin_post_without_csrf_token_is_refused():
    r = call("POST", "/admin/login/", body=b"username=a&password=b",
             headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status == 403


def test_admin_redirects_to_the_login_page():
    r = call("GET", "/admin/")
    assert r.status == 302
    assert r.header("location").startswith("/admin/login/")


# --- the handler's own behaviour ---------------------------------------------------------------

def test_a_view_exception_becomes_a_500_response(test_urls, caplog):
    r = call("GET", "/v1/test/boom")
    assert r.status == 500
    assert r.header("content-length") == str(len(r.body))
    assert r.header("x-content-type-options") == "nosniff"


def test_the_database_away_before_a_message_was_accepted_is_a_503_the_client_may_retry(test_urls):
    r = call("GET", "/v1/test/db-gone")
    assert r.status == 503 and r.json()["error"]["code"] == "database_unavailable"
    assert r.header("retry-after") == "1" and r.header("x-should-retry") is None


def test_a_5xx_after_a_message_was_accepted_says_so_and_is_not_retried(test_urls, caplog):
    """Once a chat message is accepted its turn may act: the server's own 503 and 500 say not to send it
    again (x-should-retry: false, for the openai client's retries of 5xx) and name the turn."""
    for path_, query, status, code in (("/v1/test/db-gone", "accepted=1", 503, "database_unavailable"),
                                       ("/v1/test/accepted-boom", "", 500, "server_error")):
        r = call("GET", path_, query=query)
        assert r.status == status and r.json()["error"]["code"] == code
        assert r.header("x-should-retry") == "false" and r.header("x-ugent-turn-id") == "turn-accepted-1"
        assert r.header("x-ugent-conversation-id") == "conv-accepted-1"
        assert r.header("retry-after") is None
        assert "accepted as turn turn-accepted-1" in r.json()["error"]["message"]
        assert "do not send it again" in r.json()["error"]["message"]


def test_http404_from_a_view_is_404(test_urls):
    r = call("GET", "/v1/test/missing")
    assert r.status == 404


def test_a_view_own_x_frame_options_is_kept(test_urls):
    r = call("GET", "/v1/test/framed")
    assert r.status == 200 and r.body == b"framed"
    assert r.headers_named("x-frame-options") == ["SAMEORIGIN"]


def test_a_streamed_response_is_sent_whole_without_content_length(test_urls):
    r = call("GET", "/v1/test/short-stream")
    assert r.status == 200
    assert r.body == b"one,two,three"
    assert r.header("content-length") is None
    assert r.header("x-content-type-options") == "nosniff"
    assert r.messages[-1]["type"] == "http.response.body" and not r.messages[-1].get("more_body")


def test_a_client_that_leaves_cancels_the_stream(test_urls):
    stream_state.clear()
    r = call("GET", "/v1/test/slow-stream", disconnect_after_body=True)
    assert r.status == 200 and r.body.startswith(b"chunk 0\n")
    assert stream_state.get("cancelled") is True
    assert stream_state.get("closed") is True
    assert "finished" not in stream_state


def test_route_dispatches_by_path_and_type():
    from ugent_site.api_handler import route
    calls = []

    def app(name):
        async def inner(scope, receive, send):
            calls.append((name, scope["type"], scope.get("path")))
        return inner

    routed = route(app("api"), app("django"))

    async def go():
        for scope in ({"type": "http", "path": "/v1/health"}, {"type": "http", "path": "/v1/x/y"},
                      {"type": "http", "path": "/admin/login/"}, {"type": "http", "path": "/v1"},
                      {"type": "http", "path": "/v1x/"}, {"type": "websocket", "path": "/v1/live"},
                      {"type": "http", "path": "/"}):
            await routed(scope, None, None)

    asyncio.run(go())
    assert calls == [("api", "http", "/v1/health"), ("api", "http", "/v1/x/y"),
                     ("django", "http", "/admin/login/"), ("django", "http", "/v1"),
                     ("django", "http", "/v1x/"), ("django", "websocket", "/v1/live"),
                     ("django", "http", "/")]


def test_the_asgi_application_uses_the_api_handler_for_v1():
    from ugent_site import asgi
    from ugent_site.api_handler import ApiHandler, api_headers
    http = asgi.application.application_mapping["http"]
    closure = {c.cell_contents.__class__ for c in http.__closure__}
    assert ApiHandler in closure
    handler = next(c.cell_contents for c in http.__closure__ if isinstance(c.cell_contents, ApiHandler))
    assert handler._view_middleware == [] and handler._exception_middleware == []
    # outermost the request's log line and count (ugent_site.middleware), then the API's headers
    from ugent_site.middleware import request_log
    assert handler._middleware_chain.__qualname__ == request_log(lambda request: None).__qualname__
    assert api_headers(lambda request: None).__qualname__ in {
        c.cell_contents.__qualname__ for c in handler._middleware_chain.__closure__}


def _thread_name(request):
    import threading
    return HttpResponse(threading.current_thread().name.encode())


urlpatterns.insert(0, path("v1/test/thread", _thread_name))


def test_sync_views_run_on_the_handlers_long_lived_threads_not_a_thread_per_request(test_urls):
    """A thread per request meant a database connection per request; the pool keeps both."""
    from ugent_site import api_handler
    names = {call("GET", "/v1/test/thread").body.decode() for _ in range(3 * api_handler.SYNC_VIEW_THREADS)}
    assert all(n.startswith("ugent-api-") for n in names), names
    assert len(names) <= api_handler.SYNC_VIEW_THREADS


def test_the_api_prefix_is_found_under_a_root_path():
    from ugent_site.api_handler import route
    seen = []

    async def api(scope, receive, send):
        seen.append("api")

    async def full(scope, receive, send):
        seen.append("full")
    app = route(api, full)
    asyncio.run(app({"type": "http", "path": "/ugent/v1/models", "root_path": "/ugent"}, None, None))
    asyncio.run(app({"type": "http", "path": "/ugent/admin/", "root_path": "/ugent"}, None, None))
    assert seen == ["api", "full"]


def test_api_responses_carry_the_cross_origin_opener_policy_as_the_full_stack_does():
    assert call("GET", "/v1/health").header("cross-origin-opener-policy") == "same-origin"


@pytest.mark.parametrize("method,path_,status,code", [("GET", "/v1/no-such-endpoint", 404, "not_found"),
                                                      ("GET", "/v1/test/boom", 500, "server_error")])
def test_an_api_page_error_is_an_openai_style_error_object(test_urls, method, path_, status, code):
    r = call(method, path_)
    assert r.status == status
    assert r.header("content-type") == "application/json"
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err and "param" in err


def test_a_host_outside_allowed_hosts_is_refused_on_the_api_as_on_the_full_stack(settings):
    settings.ALLOWED_HOSTS = ["api.example.com"]
    r = call("GET", "/v1/health")  # Host: testserver
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_host"
    settings.ALLOWED_HOSTS = ["testserver"]
    assert call("GET", "/v1/health").status == 200


def test_a_405_keeps_its_allow_header():
    r = call("GET", "/v1/chat/completions")
    assert r.status == 405 and "POST" in (r.header("allow") or "")


def test_a_request_waiting_on_a_sync_thread_does_not_hold_up_the_next_request():
    """Requests take the least busy thread: with one held, the others still answer."""
    import threading as th

    from ugent_site.api_handler import ApiHandler
    handler = ApiHandler()
    gate = th.Event()

    async def scenario():
        handler._busy[0] = 1  # thread 0 is taken by a request that waits
        handler._threads[0].submit(gate.wait, 60)
        try:  # on the held thread it would wait out the gate: the 5 s limit fails the test first
            sent = await asyncio.wait_for(_drive(handler, _scope("GET", "/v1/health", None), b"", False), 5)
            return Reply(sent)
        finally:
            gate.set()
    r = asyncio.run(scenario())
    assert r.status == 200


def _fresh_api_app():
    """The API handler built now, so it reads the settings a test changed (as a new process would)."""
    from ugent_site.api_handler import ApiHandler, route
    return route(ApiHandler(), full_stack())


def test_the_api_follows_secure_ssl_redirect_as_the_full_stack_does(settings):
    settings.SECURE_SSL_REDIRECT = True
    app = _fresh_api_app()
    r = call("GET", "/v1/health", query="x=1", app=app)
    assert r.status == 301 and r.header("location") == "https://testserver/v1/health?x=1"
    assert call("GET", "/v1/health", app=app, scheme="https").status == 200


def test_the_api_sends_hsts_on_secure_requests_only(settings):
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    app = _fresh_api_app()
    secure = call("GET", "/v1/health", app=app, scheme="https")
    assert secure.header("strict-transport-security") == "max-age=3600; includeSubDomains"
    assert call("GET", "/v1/health", app=app).header("strict-transport-security") is None
    # off by default, as on the full stack
    settings.SECURE_HSTS_SECONDS = 0
    assert call("GET", "/v1/health", app=_fresh_api_app(), scheme="https").header("strict-transport-security") is None
