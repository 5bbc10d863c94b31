"""bench/scratch.py's LoopClient, the client of the in-process benches' turns (bench/memory.py,
bench/tool_loop.py, bench/code_context.py): the API's threads, and the database connections they hold,
last from request to request, as in a daemon. Django's sync test Client runs each request on an event loop
of its own whose executor threads end with it, so every turn opened a new connection: on PostgreSQL a new
backend with cold caches, which put about 7 ms on each of bench/memory.py's turns there."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from django.db.backends.signals import connection_created
from django.test import Client

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 8


def bench_scratch():
    """bench/scratch.py, loaded under a name of its own: not `scratch` in sys.modules, which a bench script
    importing it as itself would then find (tests/test_repository.py checks bench names stay off imports)."""
    spec = importlib.util.spec_from_file_location("ugent_bench_scratch", ROOT / "bench" / "scratch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def connections_opened(post) -> int:
    """How many database connections REQUESTS chat requests (a key nobody holds: looked up, refused) open."""
    opened = []

    def note(sender, connection, **kwargs):
        opened.append(connection.alias)

    connection_created.connect(note)
    try:
        for _ in range(REQUESTS):
            r = post("/v1/chat/completions", data="{}", content_type="application/json")
            assert r.status_code == 401, r.content
    finally:
        connection_created.disconnect(note)
    return len(opened)


@pytest.mark.django_db(transaction=True)
def test_the_benches_client_keeps_its_connections_from_request_to_request():
    client = bench_scratch().LoopClient(headers={"x-api-key": "ugk_nobody_holds_this"})
    try:
        kept = connections_opened(client.post)
    finally:
        client.close()
    # the sync test client, for the contrast the benches were measured against: one connection a request
    plain = connections_opened(Client(headers={"x-api-key": "ugk_nobody_holds_this"}).post)
    assert plain == REQUESTS
    # a few at most, whatever the request count: the loop's executor may start another thread or two when the
    # machine is loaded (CI saw 3 once, 2026-12-06), never one a request
    assert 1 <= kept <= 3
