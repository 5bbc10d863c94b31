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
