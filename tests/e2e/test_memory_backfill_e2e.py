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
    client.chat.completions.create(model="scripted", user=bob,  # bob holds a fact: his recall searches
                                   messages=[{"role": "user", "content": "I work as a cellist"}])
    deadline = time.monotonic() + 30
    while (len(facts(d, alice)) < 2 or not facts(d, bob)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert facts(d, alice) == [("User lives in Porto.", False), ("User works as a nurse.", False)]
    assert facts(d, bob) == [("User works as a cellist.", False)]

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
    deadline = time.monotonic() + 60
    while not facts(d, bob)[0][1]:
        assert time.monotonic() < deadline, "bob's fact was not embedded"
        time.sleep(0.2)
    assert recall(d, bob, "In which city do I live?")["facts"] == []  # alice's vectors are not bob's
    assert [f["text"] for f in recall(d, bob, "Which instrument do I play?")["facts"]] == ["User works as a cellist."]


FACTS = 640  # ten batches of the backfill's 64: several seconds of one core, to kill it in the middle of


@pytest.fixture
def daemon_with_facts(tmp_path):
    config = tmp_path / "ugent.toml"
    config.write_text('[memory]\nbackend = "sqlite_fts"\n')
    d = Daemon(tmp_path, extra_env={"UGENT_CONFIG": str(config), "UGENT_CONFIG_RECHECK_SECS": "0.2"}).start()
    d.config = config
    d.alice = f"alice-{uuid.uuid4().hex[:6]}"
    d.manage("shell", "-c", (
        "from plugins_app.agent.memory.models import MemoryFact as F;"
        f"F.objects.bulk_create([F(actor_key='web:{d.alice}', text=f'User keeps note number {{i}} about garden "
        f"plants.', normalized=f'user keeps note number {{i}} about garden plants') for i in range({FACTS})])"))
    try:
        yield d
    finally:
        d.close()


def embedded_count(d) -> int:
    return d.sql("SELECT count(*) FROM plugins_app_memoryfact WHERE embedding IS NOT NULL")[0][0]


def test_a_backfill_killed_midway_resumes_after_the_restart_with_nothing_lost_or_doubled(daemon_with_facts):
    """kill -9 the process embedding the facts (the daemon in embedded mode, the worker in servers mode)
    in the middle of its batches; after the restart a turn's recall asks again, and every fact ends with one vector
    in its row and one row in the LanceDB table."""
    d = daemon_with_facts
    assert embedded_count(d) == 0
    d.config.write_text('[memory]\nbackend = "lance_embedded"\n')
    deadline = time.monotonic() + 60
    while recall(d, d.alice, "Which plants are in my garden?")["backend"] != "lance_embedded":
        assert time.monotonic() < deadline, "the daemon did not switch to lance_embedded"
        time.sleep(0.2)
    deadline = time.monotonic() + 120
    while embedded_count(d) < 64:  # the first batch is in
        assert time.monotonic() < deadline, "the backfill did not start"
        time.sleep(0.05)
    d.kill_worker()
    cut_at = embedded_count(d)
    assert cut_at < FACTS, "the backfill finished before the kill: nothing to resume"
    if d.servers:
        d.spawn_worker()
    else:
        d.spawn()
    client = openai.OpenAI(base_url=d.base + "/v1", api_key=d.key, max_retries=2)
    deadline = time.monotonic() + 180
    while embedded_count(d) < FACTS:  # a turn's recall (in the restarted process) asks again
        assert time.monotonic() < deadline, f"{embedded_count(d)} of {FACTS} facts embedded after the restart"
        client.chat.completions.create(model="scripted", user=d.alice, extra_body={"ugent_disable_memory_write": True},
                                       messages=[{"role": "user", "content": "Which plants are in my garden?"}])
        time.sleep(1)
    import lancedb
    table = lancedb.connect(str(d.tmp / "var" / "memory.lance")).open_table("memory_facts")
    ids = table.to_arrow().column("id").to_pylist()
    assert len(ids) == len(set(ids)) == FACTS  # one vector each: none lost, none doubled
    assert set(ids) == {i for (i,) in d.sql("SELECT id FROM plugins_app_memoryfact")}
    assert recall(d, d.alice, "Which plants are in my garden?")["facts"]
