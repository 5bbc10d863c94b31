"""Warming at start (issue #12, item 10): discovery and the notes index are ready before the first turn."""
from __future__ import annotations

import httpx
import pytest

from plugins_app.agent import warm
from plugins_app.agent.engines import registry
from plugins_app.agent.engines.notes import NotesChatEngine
from tests.support.daemon import ROOT, Daemon


@pytest.fixture
def undiscovered(monkeypatch):
    monkeypatch.setattr(registry, "_discovered", None)


@pytest.mark.django_db
def test_warming_scans_the_engines_and_builds_each_profiles_notes_index(undiscovered, tmp_path):
    from plugins_app.agent.models import AgentProfile
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "ports.md").write_text("# Ports\n\nThe daemon listens on port 8787.\n")
    profile = AgentProfile.objects.create(name="notes", provider="ugent-notes", is_default=True,
                                          config={"path": str(tmp_path / "notes")})
    AgentProfile.objects.create(name="gone", provider="not-installed-anywhere")
    report = warm.engines_warm()
    assert "ugent-notes" in report["engines"] and registry._discovered is not None
    assert profile.qualified_name in report["warmed"]
    assert list(report["failed"]) == ["not-installed-anywhere:default@gone"]
    engine = registry.engine_for_profile(profile)
    assert isinstance(engine, NotesChatEngine) and engine.index._built  # the index was built before any question
    assert engine.answer([{"role": "user", "content": "which port?"}]).text.startswith("From ports.md")


def test_a_turn_before_the_scan_loads_only_its_own_engine(undiscovered):
    assert registry.engine_class("ugent-notes") is NotesChatEngine
    assert registry._discovered is None  # no full scan was needed
    with pytest.raises(LookupError):
        registry.engine_class("not-installed-anywhere")
    assert registry._discovered is not None  # an unknown name is looked for in the full scan


def test_warming_is_off_when_the_setting_says_so(settings):
    settings.UGENT_WARM_AT_START = False
    assert warm.warm_start() is None


def test_rundaemon_opens_its_api_only_once_the_engines_are_warm(tmp_path):
    d = Daemon(tmp_path, servers=False, extra_env={"UGENT_LLM_BASE_URL": ""})
    try:
        (tmp_path / "workspace").mkdir()
        d.manage("migrate", "--noinput")
        d.manage("shell", "-c", "from plugins_app.models import AgentProfile as P; "
                 f"P.objects.create(name='ugent-notes', provider='ugent-notes', is_default=True, "
                 f"config={{'path': '{ROOT / 'workspace' / 'notes'}'}})")
        d.spawn()  # returns once /v1/health answers
        log = (tmp_path / "daemon.log").read_text()
        assert "engines warmed in" in log and "profiles ready: ugent-notes:default@ugent-notes" in log, log[-2000:]
        r = httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key}, timeout=60,
                       json={"messages": [{"role": "user", "content": "What is UGENT?"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("From ")
    finally:
        d.close()


# --- servers mode: health waits for a warm worker ---------------------------------------------------

@pytest.fixture
def servers_health(settings, monkeypatch):
    import os
    import uuid
    settings.UGENT_MODE = "servers"
    settings.UGENT_WARM_AT_START = True
    settings.REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    settings.CELERY_TASK_DEFAULT_QUEUE = "ugent-warm-" + uuid.uuid4().hex[:8]
    monkeypatch.setattr(warm, "_seen_warm", False)
    monkeypatch.setattr(warm, "_first_asked", None)
    client = warm._redis()
    yield client
    client.delete(warm._warm_key())


@pytest.mark.django_db
def test_servers_health_says_warming_until_a_worker_of_its_queue_has_warmed(servers_health, settings, client):
    settings.UGENT_WARM_WAIT_SECS = 300
    r = client.get("/v1/health")
    assert r.status_code == 503 and r.json() == {"status": "warming", "mode": "servers"}
    servers_health.set("ugent:warm:some-other-queue", "w", ex=30)  # another deployment's worker is not ours
    try:
        assert client.get("/v1/health").status_code == 503
    finally:
        servers_health.delete("ugent:warm:some-other-queue")
    servers_health.set(warm._warm_key(), "worker-1", ex=30)
    r = client.get("/v1/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "mode": "servers"}
    servers_health.delete(warm._warm_key())  # once seen warm, this process no longer asks
    assert client.get("/v1/health").status_code == 200


@pytest.mark.django_db
def test_servers_health_gives_up_waiting_after_the_bound(servers_health, settings, client):
    settings.UGENT_WARM_WAIT_SECS = 0
    assert client.get("/v1/health").status_code == 200  # no worker at all: health is not held forever


@pytest.mark.django_db
def test_servers_health_is_plain_when_warming_is_off(servers_health, settings, client):
    settings.UGENT_WARM_AT_START = False
    assert client.get("/v1/health").status_code == 200


def test_a_servers_worker_marks_its_queue_warm_and_health_waits_for_it(tmp_path):
    import os
    import redis
    env_redis = os.environ.get("REDIS_URL")
    if not env_redis:
        pytest.skip("servers mode (REDIS_URL) only: the test-servers run covers it")
    d = Daemon(tmp_path, servers=True, extra_env={"UGENT_LLM_BASE_URL": ""})
    try:
        d.start()  # returns once /v1/health answers 200
        queue = d.env["UGENT_CELERY_QUEUE"]
        mark = redis.Redis.from_url(env_redis).get(f"ugent:warm:{queue}")
        assert mark is not None  # health answered because a worker of this queue had warmed
        log = (tmp_path / "daemon.log").read_text()
        assert "engines warmed in" in log, log[-2000:]
    finally:
        d.close()
