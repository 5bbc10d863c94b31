"""Cron fixtures: jobs from cron.toml text, and a StartWorkflow hook for the chat path.

`start_workflow_rule` stands in for the rule engine's StartWorkflow decision when the rules
engineer's hook ("rules") is not registered: a message starting with its prefix is stopped and
answered with `workflow_start(...)`, exactly as the rule engine's hook calls it.
"""
from __future__ import annotations

import pytest

from channels_app import hooks

SEED_CRON_TOML = '''
# cron.toml
enabled = true

[[jobs]]
id = "digest"
enabled = true
rule_trigger = true        # a rule may start it; no schedule, so only a rule does

[[jobs.tasks]]
id = "summarise"
prompt = "Summarise what the sender asked for, in one line."
'''


def import_cron(text: str):
    from cron_app.services import cron_config_import
    from cron_app.tomlio import parse_cron_toml
    return cron_config_import(config=parse_cron_toml(text))


@pytest.fixture
def cron_toml():
    return import_cron


@pytest.fixture
def seed_job(tcast):
    import_cron(SEED_CRON_TOML)
    return tcast


class StartWorkflowRule:
    """`prefix` → StartWorkflow(workflow, inject_context), registered at the rule engine's priority."""

    def __init__(self):
        self.rules: list[tuple[str, str, bool]] = []
        self.contexts = []
        self.barrier = None  # all senders reach workflow_start together, inside their transactions

    def add(self, prefix: str, workflow: str, inject_context: bool = False):
        self.rules.append((prefix.lower(), workflow, inject_context))

    def __call__(self, ctx):
        from cron_app.services import workflow_start
        if ctx.channel == "cron":
            return None
        for prefix, workflow, inject in self.rules:
            if (ctx.text or "").lower().startswith(prefix):
                self.contexts.append(ctx)
                if self.barrier is not None:
                    self.barrier.wait(30)
                return hooks.HookStop(answer=workflow_start(workflow=workflow, inject_context=inject, ctx=ctx),
                                      decided_by="rule:test")
        return None


@pytest.fixture
def start_rule():
    rule = StartWorkflowRule()
    hooks.register("cron-test-start-workflow", hooks.RULE_ENGINE_PRIORITY + 1, rule)
    yield rule
    hooks.unregister("cron-test-start-workflow")


@pytest.fixture
def no_enqueue(monkeypatch):
    """Runs are claimed but their task is not sent: they stay queued, holding their place."""
    from cron_app import services
    sent: list[int] = []
    monkeypatch.setattr(services, "_enqueue", sent.append)
    return sent


def submit(actor, text, *, channel="web", conversation_id=None, caller=None, client_id="", **limits):
    from channels_app.services import Submission, message_submit
    return message_submit(inbound=Submission(actor=actor, caller=caller, text=text, channel=channel,
                                                 client_id=client_id, conversation_id=conversation_id, **limits))


def web_actor(cast, name="alice"):
    from channels_app.services import actor_resolve
    return actor_resolve(caller=cast.operator, user=name)


@pytest.fixture
def real_rules(tmp_path, settings):
    """The rule engine's own hook, on a rules.toml in a trusted workspace of the test's own."""
    from rules_app.runtime import runtime
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    settings.UGENT_WORKSPACE, settings.UGENT_HOME, settings.UGENT_CONFIG = str(ws), str(home), ""
    settings.UGENT_RULES_WATCH = False

    def load(text: str):
        from rules_app.services import workspace_trust_approve
        workspace_trust_approve(path=ws)
        (ws / "rules.toml").write_text(text)
        runtime.reset()

    runtime.reset()
    yield load
    runtime.reset()


def run_to_end(run_pk: int, *, steps: int = 20):
    """Take a run's steps by hand (its task was not sent: `no_enqueue`), as the worker would, until it ends.

    With eager Celery each turn runs when its step commits; the turn's end queues the next step,
    which `no_enqueue` records instead of sending, so each call here is one step."""
    from cron_app import services
    from cron_app.models import FINAL_RUN_STATES, CronRun
    for _ in range(steps):
        services.cron_run_advance(run_pk=run_pk)
        if CronRun.objects.get(pk=run_pk).state in FINAL_RUN_STATES:
            return CronRun.objects.get(pk=run_pk)
    raise AssertionError(f"run {run_pk} did not end in {steps} steps")
