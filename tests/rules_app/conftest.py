"""A workspace and a home of the test's own, with this process's rule engine reset around each test."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from rules_app.runtime import runtime


class Site:
    """Where the rules live for one test: write files, approve the workspace, send messages."""

    def __init__(self, tmp_path: Path, settings):
        self.ws = tmp_path / "ws"
        self.home = tmp_path / "home"
        self.ws.mkdir()
        self.home.mkdir()
        self.settings = settings
        settings.UGENT_WORKSPACE = str(self.ws)
        settings.UGENT_HOME = str(self.home)
        settings.UGENT_CONFIG = ""
        settings.UGENT_RULES_POLL_INTERVAL = 0.2
        settings.UGENT_ROUTING_RECHECK_SECONDS = 0.0

    def write(self, text: str, name: str = "rules.toml", where: Path | None = None) -> Path:
        path = (where or self.ws) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # atomic, as an editor saves
        return path

    def config(self, text: str) -> Path:
        return self.write(text, "ugent.toml")

    def approve(self) -> None:
        from rules_app.services import workspace_trust_approve
        workspace_trust_approve(path=self.ws)

    def rules(self, text: str, *, trusted: bool = True) -> Path:
        """Write <workspace>/rules.toml (trusted by default) and restart the rule engine on it."""
        if trusted:
            self.approve()
        path = self.write(text)
        runtime.reset()
        return path

    def reset(self) -> None:
        runtime.reset()


@pytest.fixture
def site(tmp_path, settings, transactional_db):
    settings.UGENT_RULES_WATCH = True  # the daemon's rules watcher, which these tests watch at work
    runtime.reset()
    s = Site(tmp_path, settings)
    yield s
    runtime.reset()  # stops the watcher thread before the test database goes away


@pytest.fixture
def no_cron(monkeypatch):
    """Cron is not running here (UGENT_CRON_ENABLED=false): StartWorkflow answers so, and no
    StartWorkflow rule is dropped as the rules load."""
    monkeypatch.setattr("cron_app.conf.CRON_ENABLED_HERE", False)


class FakeCron:
    """cron_app.services' two functions the rule engine calls: rule-triggered jobs by name, calls recorded."""

    def __init__(self):
        self.jobs: dict[str, str | None] = {}  # name -> None (startable) or the reason it is not
        self.calls: list[dict] = []
        self.answer = "Started workflow '{workflow}'. Its result goes to the workflow's destinations."

    def rule_trigger_reason(self, workflow: str):
        if workflow not in self.jobs:
            return "no such job"
        return self.jobs[workflow]

    def workflow_start(self, *, workflow: str, inject_context: bool, ctx):
        reason = self.rule_trigger_reason(workflow)
        if reason is not None:
            return f"Workflow '{workflow}' could not start: {reason}."
        self.calls.append({"workflow": workflow, "inject_context": inject_context, "text": ctx.text,
                           "actor": ctx.actor_key, "limits": dict(ctx.limits)})
        return self.answer.format(workflow=workflow)


@pytest.fixture
def fake_cron(monkeypatch):
    """The real cron_app.services with its rule engine interface answered by a FakeCron (looked up
    at each call, so a test may replace the fake's methods)."""
    from cron_app import services
    cron = FakeCron()
    monkeypatch.setattr(services, "rule_trigger_reason", lambda workflow: cron.rule_trigger_reason(workflow))
    monkeypatch.setattr(services, "workflow_start", lambda **kw: cron.workflow_start(**kw))
    return cron


def answer(resp) -> str:
    assert resp.status_code == 200, resp.content
    return resp.json()["choices"][0]["message"]["content"]


def submit(text: str, *, channel: str = "slack", user_id: str = "U1", conversation_id: str = "C1",
           source_type: str = "user", **kw):
    """A plugin channel's message, through the one message path a channel worker uses."""
    from channels_app import services
    actor = services.channel_actor_resolve(channel=channel, user_id=user_id)
    return services.message_submit(inbound=services.Submission(
        actor=actor, text=text, channel=channel, conversation_id=conversation_id,
        source_type=source_type, **kw))


def wait_for(predicate, timeout: float = 6.0, step: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.fixture
def rules_log(caplog):
    caplog.set_level(logging.INFO, logger="ugent.rules")
    caplog.set_level(logging.INFO, logger="ugent.routing")
    return caplog
