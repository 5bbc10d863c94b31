"""Servers mode: work no sender waits for (memory extraction here) goes to the deployment's background queue,
so a worker that takes turns alone (`-Q <queue>`) never has its threads held by it, and a worker of the
background queue (`-Q <queue>-background`) does it (ugent_site/settings.py, docs/deploy.md "Queues").

The model extractor asks a stub upstream that holds its answer until the test lets it go. With one thread in
each worker, a second message is answered while the first one's extraction is still held; once let go, the
facts land in the sender's memory. On one worker taking both queues with one thread, the second message
would wait for the extraction."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest

from tests.fakes.upstream import Script, run_stub_upstream
from tests.support.daemon import Daemon

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="servers mode: Celery workers and queues")

SAID = "I've been vegetarian since 2019"
REPLY = json.dumps([{"fact": "User is vegetarian.", "tier": "contextual", "message": 1}])
#: What the extractor logs when the model does not answer within its time (model_extract.EXTRACT_TIMEOUT_SECS).
GAVE_UP = "memory: the model extractor failed"


def chat(d: Daemon, user: str, text: str) -> httpx.Response:
    return httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key}, timeout=60,
                      json={"model": "scripted", "user": user, "messages": [{"role": "user", "content": text}]})


def facts(d: Daemon, user: str) -> list[str]:
    return sorted(t for (t,) in d.sql("SELECT text FROM plugins_app_memoryfact WHERE actor_key LIKE ?", (f"%:{user}",)))


def test_a_held_extraction_on_the_background_worker_delays_no_turn(tmp_path):
    release, asked = threading.Event(), threading.Event()

    asked_texts: list[str] = []

    def answer(request) -> Script:
        said = request.json["messages"][-1]["content"]
        asked_texts.append(said)
        if "vegetarian" in said:
            asked.set()
            release.wait(60)  # the model takes its time: the background worker's one thread is held
            return Script(answer=REPLY)
        return Script(answer="[]")

    config = tmp_path / "ugent.toml"
    config.write_text('[memory]\nbackend = "sqlite_fts"\nextractor = "openai-compatible"\n')
    with run_stub_upstream(answer) as url:
        d = Daemon(tmp_path, extra_env={"UGENT_CONFIG": str(config), "UGENT_LLM_BASE_URL": str(url)})
        try:
            d.prepare()
            queue = d.env["UGENT_CELERY_QUEUE"]
            d.spawn_worker(queues=queue, concurrency=1)
            d.spawn_worker(queues=f"{queue}-background", concurrency=1)
            d.spawn(worker=False)
            alice = f"alice-{uuid.uuid4().hex[:6]}"

            first = chat(d, alice, SAID)
            assert first.status_code == 200, first.text
            assert asked.wait(30), "the extraction never asked the model"
            # the extraction now holds the background worker's only thread; the turn worker is free
            second = chat(d, alice, "script:answer=still here")
            assert second.status_code == 200, second.text
            assert second.json()["choices"][0]["message"]["content"] == "still here"
            # answered while the extraction still waited on the model: it has neither saved nor given up. (One
            # worker taking both queues with one thread answers only once the extractor gives up on the model,
            # at its 30 s, and logs so: seen, this assertion failing.)
            assert facts(d, alice) == []
            assert GAVE_UP not in (d.tmp / "daemon.log").read_text()

            release.set()
            deadline = time.monotonic() + 30
            while not facts(d, alice) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert facts(d, alice) == ["User is vegetarian."]
            # and the second message's extraction, queued behind the held one, is taken by the background worker
            deadline = time.monotonic() + 30
            while not any("still here" in said for said in asked_texts) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert any("still here" in said for said in asked_texts)
        finally:
            release.set()
            d.close()
