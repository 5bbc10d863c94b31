"""StartWorkflow's side of the rule engine: the one-way link rules → cron.

The rule engine stands above cron: it calls `cron_app.services` directly (cron imports nothing
of the rules). At load a StartWorkflow rule is checked against the cron jobs (`workflow_check`);
when it fires, cron starts the run and words the answer (`workflow_answer`).
"""
from __future__ import annotations

import logging
from typing import Optional

from django.db import transaction

from channels_app.hooks import HookContext
from channels_app.models import INPUT_MODES
from cron_app import messages as cron_messages
from cron_app import services as cron_services
from rules_app import engine

log = logging.getLogger("ugent.rules")

#: Said when cron_app's workflow_start raised: the seed's "could not start: <reason>".
WORKFLOW_START_ERROR_REASON = "it failed to start; the log says why"


def workflow_answer(ctx: HookContext, decision: engine.StartWorkflow) -> str:
    """Start the rule-triggered cron job through cron_app and return the sender's answer."""
    workflow = decision.workflow
    if ctx.input_mode in INPUT_MODES and not ctx.limits.get("disable_memory_write"):
        # speech stays out of memory: the run a spoken message starts writes none either
        from dataclasses import replace
        ctx = replace(ctx, limits={**ctx.limits, "disable_memory_write": True})
    try:
        with transaction.atomic():  # a failing cron call must not spoil the receipt's transaction
            # cron checks the job again as the rule fires (a job that opted out since is refused)
            return cron_services.workflow_start(workflow=workflow, inject_context=decision.inject_context,
                                                ctx=ctx)
    except Exception:
        log.exception("workflow start failed (workflow=%s)", workflow)
        return cron_messages.WORKFLOW_COULD_NOT_START.format(workflow=workflow,
                                                             reason=WORKFLOW_START_ERROR_REASON)


def workflow_check(workflow: str) -> Optional[str]:
    """The load-time check of a StartWorkflow rule: a drop reason, or None to keep it.

    Kept while cron is not running here: the rule then answers "cron is not running here" when it
    fires, and keeps working once cron is switched on. A broken cron check keeps the rule too
    (it must not refuse the whole rules file); cron checks the job again when the rule fires.
    """
    try:
        if not cron_services.cron_running():
            return None
        reason = cron_services.rule_trigger_reason(workflow)
    except Exception:
        log.exception("workflow check failed (workflow=%s); rule kept", workflow)
        return None
    if reason is None:
        return None
    return engine.DROP_WORKFLOW_NOT_TRIGGER.format(workflow=workflow)
