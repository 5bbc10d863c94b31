"""An engine whose constructor never returns holds up only its own callers, for at most
UGENT_PLUGIN_START_TIMEOUT, and never the other engines (plugins_app.agent.engines.registry._kept).

Before, the registry built every engine under its one lock: a chat engine, matcher, NLI engine or
summariser that hung in its constructor (a model server that never answers at start, say) blocked every
turn of every profile, every question reply and the status page, for ever.
"""
from __future__ import annotations

import threading
import types

import pytest

from plugins_app.agent.engines import registry
from plugins_app.agent.engines.base import EngineError
from ugent_common import bounded

pytestmark = pytest.mark.mode_free  # no database: profiles are plain objects, engines test classes

WAIT = 10.0  # the most a step may take before the test calls it stuck (not a measurement)
gate = threading.Event()
entered = threading.Event()


class HangingEngine:
    def __init__(self, config=None):
        entered.set()
        gate.wait(60)
        self.config = config


class QuickEngine:
    def __init__(self, config=None):
        self.config = config


def profile(pk: int, provider: str):
    return types.SimpleNamespace(pk=pk, updated_at=1, provider=provider, config={}, system_prompt="")


@pytest.fixture(autouse=True)
def engines(monkeypatch):
    monkeypatch.setitem(registry._extra, "hangs", HangingEngine)
    monkeypatch.setitem(registry._extra, "quick", QuickEngine)
    gate.clear()
    entered.clear()
    registry.reset()
    yield
    gate.set()  # the hung constructors return, and their threads end
    registry.reset()


def in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_hung_constructor_holds_up_neither_other_engines_nor_other_profiles(settings):
    settings.UGENT_PLUGIN_START_TIMEOUT = 30
    hung, _ = in_thread(lambda: registry.engine_for_profile(profile(1, "hangs")))
    assert entered.wait(WAIT)
    quick, box = in_thread(lambda: registry.engine_for_profile(profile(2, "quick")))
    quick.join(WAIT)
    assert not quick.is_alive() and isinstance(box.get("value"), QuickEngine), box
    matcher, box = in_thread(registry.option_matcher)
    matcher.join(WAIT)
    assert not matcher.is_alive() and "value" in box, box
    assert hung.is_alive()  # still waiting for its own engine, alone


def test_a_start_past_its_time_is_refused_then_tried_again(settings, monkeypatch):
    settings.UGENT_PLUGIN_START_TIMEOUT = 0.3
    now = [1000.0]
    monkeypatch.setattr(registry, "_clock", lambda: now[0])
    with pytest.raises(EngineError) as first:
        registry.engine_for_profile(profile(1, "hangs"))
    assert first.value.code == "engine_unavailable"
    assert first.value.message == ("The chat engine 'hangs' did not start within 0.3 s "
                                   "(UGENT_PLUGIN_START_TIMEOUT).")
    entered.clear()
    with pytest.raises(EngineError) as again:  # at once, without a second thread in the constructor
        registry.engine_for_profile(profile(1, "hangs"))
    assert again.value.message.endswith("; it is tried again 30 s after that attempt.")
    assert not entered.is_set()
    assert bounded.overrunning("start:") == {"start:chat engine 'hangs'": 1}
    gate.set()  # the engine's server answers at last
    now[0] += registry.BUILD_RETRY_SECS
    assert isinstance(registry.engine_for_profile(profile(1, "hangs")), HangingEngine)


def test_a_constructors_own_error_reaches_its_caller_each_time(settings):
    class Broken:
        def __init__(self, config=None):
            raise ValueError("no api_key")
    registry._extra["broken"] = Broken
    try:
        for _ in range(2):  # not remembered: a fixed profile works at its next turn
            with pytest.raises(ValueError, match="no api_key"):
                registry.engine_for_profile(profile(3, "broken"))
    finally:
        del registry._extra["broken"]


def test_a_new_profile_version_replaces_the_old_engine_and_closes_it(settings):
    closed = []

    class Closing(QuickEngine):
        def close(self):
            closed.append(self)
    registry._extra["closing"] = Closing
    try:
        p = profile(4, "closing")
        first = registry.engine_for_profile(p)
        assert registry.engine_for_profile(p) is first
        p.updated_at = 2
        second = registry.engine_for_profile(p)
        assert second is not first and closed == [first]
    finally:
        del registry._extra["closing"]


def overrun_gone() -> None:
    for _ in range(int(WAIT / 0.02)):
        if not bounded.overrunning("start:"):
            return
        threading.Event().wait(0.02)
    assert bounded.overrunning("start:") == {}


def test_an_engine_slower_to_start_than_the_timeout_is_kept_once_it_has_started(settings):
    # A local model loading for longer than UGENT_PLUGIN_START_TIMEOUT: the turn that started it fails, and
    # the engine it built is kept when it is done. Dropped, each later try started it from nothing and ran out
    # of time again: it never came up (and each dropped one was never closed).
    settings.UGENT_PLUGIN_START_TIMEOUT = 0.2
    with pytest.raises(EngineError):
        registry.engine_for_profile(profile(6, "hangs"))
    gate.set()  # loaded at last
    overrun_gone()
    engine = registry.engine_for_profile(profile(6, "hangs"))  # at once: not refused for BUILD_RETRY_SECS
    assert isinstance(engine, HangingEngine)
    assert registry.engine_for_profile(profile(6, "hangs")) is engine


def test_a_late_start_after_a_reset_is_closed_not_kept(settings):
    closed = []

    class Closing(HangingEngine):
        def close(self):
            closed.append(self)
    registry._extra["closing-late"] = Closing
    try:
        settings.UGENT_PLUGIN_START_TIMEOUT = 0.2
        with pytest.raises(EngineError):
            registry.engine_for_profile(profile(7, "closing-late"))
        registry.reset()  # (the tests' fixture, a shutdown): nobody takes the engine when it is done
        gate.set()
        overrun_gone()
        assert len(closed) == 1 and not [e for e in registry._instances.values() if isinstance(e, Closing)]
    finally:
        del registry._extra["closing-late"]


def test_an_older_version_of_a_profile_never_closes_the_newer_versions_engine(settings):
    # A turn that read its profile before an edit asks for the old version's engine after the new one is kept
    # (in use by the turns after the edit), or the old version's slow build ends after it: either closed the
    # newer engine under its turns and put the old one in its place.
    closed = []

    class Closing(HangingEngine):
        def close(self):
            closed.append(self)
    registry._extra["versions"] = Closing

    def version(updated_at):
        return types.SimpleNamespace(pk=9, updated_at=updated_at, provider="versions", config={}, system_prompt="")
    try:
        settings.UGENT_PLUGIN_START_TIMEOUT = 0.2
        with pytest.raises(EngineError):  # version 1 starts slowly...
            registry.engine_for_profile(version(1))
        gate.set()  # (every start from now on is quick)
        newer = registry.engine_for_profile(version(2))  # ...the profile is edited meanwhile...
        overrun_gone()  # ...and version 1's start ends after version 2's
        assert registry.engine_for_profile(version(1)) is not newer  # a stale turn's own, at most
        assert newer not in closed
        assert registry.engine_for_profile(version(2)) is newer
        assert registry.engine_for_profile(version(3)) is not newer and closed[-1] is newer  # a real edit still does
    finally:
        del registry._extra["versions"]
