"""lance_embedded's backfill on the real daemon (rundaemon embedded; uvicorn and a Celery worker in servers
mode): facts saved while sqlite_fts was in force have no vector; after ugent.toml switches to
lance_embedded, the first recall enqueues plugins_app.tasks.memory_vector_backfill, which embeds them off
the turn, and recall then finds them by meaning, for their user only."""
from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tests.support.daemon import Daemon


@pytest.fixture(scope="module")
def switched_daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("backfill-daemon")
    config = tmp / "ugent.toml"
    config.write_text('[memory]\nbackend = "sqlite_fts"\n')
    d = Daemon(tmp, extra_env={"UGENT_CONFIG": str(config), "UGENT_CONFIG_RECHECK_SECS": "0.2"}).start()
    d.config = config
    try:
        yield d
    finally:
        d.close()


def recall(daemon, user: str, text: str) -> dict:
    resp = httpx.post(daemon.base + "/v1/ugent/commands", json={"command": f"/recall {text}", "user": user},
                      headers={"x-api-key": daemon.key}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


def facts(daemon, user: str) -> list[tuple[str, bool]]:
    return sorted((t, e is not None) for t, e in daemon.sql(
        "SELECT text, embedding FROM plugins_app_memoryfact WHERE actor_key LIKE ?", (f"%:{user}",)))


def test_facts_saved_before_the_switch_are_embedded_off_the_turn_and_recalled_by_meaning(switched_daemon):
    d = switched_daemon
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(base_url=d.base + "/v1", api_key=d.key, max_retries=2)
    client.chat.completions.create(model="scripted", user=alice,
                                   messages=[{"role": "user", "content": "I live in Porto and I work as a nurse"}])
    deadline = time.monotonic() + 30
    while len(facts(d, alice)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert facts(d, alice) == [("User lives in Porto.", False), ("User works as a nurse.", False)]

    d.config.write_text('[memory]\nbackend = "lance_embedded"\n')
    found, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        body = recall(d, alice, "In which city do I live?")  # found by its vector (the backend has no other)
        found = [f["text"] for f in body["facts"]] if body["backend"] == "lance_embedded" else []
        if "User lives in Porto." in found:
            break
        time.sleep(0.5)
    assert "User lives in Porto." in found
    assert facts(d, alice) == [("User lives in Porto.", True), ("User works as a nurse.", True)]
    assert recall(d, bob, "In which city do I live?")["facts"] == []  # alice's vectors are not bob's
