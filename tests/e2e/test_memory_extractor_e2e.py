"""The model extractor on the real daemon (rundaemon embedded; uvicorn and a Celery worker in servers mode),
driven by the official openai client: after the turn, the extraction task asks the OpenAI-compatible
server UGENT_LLM_BASE_URL names (the stub upstream on loopback) and saves what it found in the sender's
memory, and only theirs."""
from __future__ import annotations

import json
import time
import uuid

import openai
import pytest

from plugins_app.agent.memory.model_extract import EXTRACT_PROMPT
from tests.fakes.upstream import Script, run_stub_upstream
from tests.support.daemon import Daemon

SAID = "I've been vegetarian since 2019, and my sister Mia lives in Oslo"
REPLY = json.dumps([{"fact": "User is vegetarian.", "tier": "contextual", "message": 1},
                    {"fact": "User's sister Mia lives in Oslo.", "tier": "contextual", "message": 1}])


@pytest.fixture(scope="module")
def memory_daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory-daemon")
    config = tmp / "ugent.toml"
    config.write_text('[memory]\nbackend = "sqlite_fts"\nextractor = "openai-compatible"\n')
    def answer(request) -> Script:  # the facts for the message that states them, none for any other
        said = request.json["messages"][-1]["content"]
        return Script(answer=REPLY if "vegetarian" in said and "Message 1:" in said else "[]")

    with run_stub_upstream(answer) as url:
        d = Daemon(tmp, extra_env={"UGENT_CONFIG": str(config), "UGENT_LLM_BASE_URL": str(url)}).start()
        d.upstream = url
        try:
            yield d
        finally:
            d.close()


def facts(daemon, user: str) -> list[str]:
    return sorted(t for (t,) in daemon.sql("SELECT text FROM plugins_app_memoryfact WHERE actor_key LIKE ?",
                                           (f"%:{user}",)))


def test_the_model_finds_the_facts_after_the_turn_into_the_senders_memory_only(memory_daemon):
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(base_url=memory_daemon.base + "/v1", api_key=memory_daemon.key, max_retries=2)
    client.chat.completions.create(model="scripted", user=alice, messages=[{"role": "user", "content": SAID}])
    client.chat.completions.create(model="scripted", user=bob, messages=[{"role": "user", "content": "hello"}])
    deadline = time.monotonic() + 30
    while len(facts(memory_daemon, alice)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert facts(memory_daemon, alice) == ["User is vegetarian.", "User's sister Mia lives in Oslo."]
    asked = [r.json["messages"][-1]["content"] for r in memory_daemon.upstream.requests
             if r.json["messages"][0]["content"] == EXTRACT_PROMPT]
    assert f"Message 1:\n{SAID}" in asked
    deadline = time.monotonic() + 30  # bob's message is read by the model too: it states nothing
    while f"Message 1:\nhello" not in asked and time.monotonic() < deadline:
        time.sleep(0.2)
        asked = [r.json["messages"][-1]["content"] for r in memory_daemon.upstream.requests]
    assert "Message 1:\nhello" in asked
    owners = {key for (key,) in memory_daemon.sql("SELECT DISTINCT actor_key FROM plugins_app_memoryfact")}
    assert len(owners) == 1 and owners.pop().endswith(":" + alice)
