"""The rule engine's link to the cron room, looked up at call time.

cron_app offers (when it exists) two functions in ``cron_app.services``:

* ``rule_trigger_reason(workflow: str) -> str | None``: None when the job
  exists, is enabled and has ``rule_trigger = true``; else the reason, worded
  to follow "Workflow 'NAME' could not start: " (no final full stop);
* ``workflow_start(*, workflow: str, inject_context: bool, ctx: HookContext) -> str``:
  start the job for the sender and return the answer the sender gets.

Until they exist, no StartWorkflow rule is dropped for its workflow, and one
that fires answers "Workflow 'NAME' could not start: cron is not running here."
"""
from __future__ import annotations

import importlib
import logging
from typing import Callable, Optional

from rules_app.engine import DROP_WORKFLOW_NOT_TRIGGER

log = logging.getLogger("ugent.rules")

CRON_SERVICES = "cron_app.services"


def cron_function(name: str) -> Optional[Callable]:
    """``cron_app.services.<name>`` if cron_app offers it now, else None."""
    try:
        module = importlib.import_module(CRON_SERVICES)
    except ImportError:
        return None
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


def workflow_trigger_reason(workflow: str) -> Optional[str]:
    """Why ``workflow`` cannot be started by a rule now, or None (also None while cron is absent)."""
    fn = cron_function("rule_trigger_reason")
    if fn is None:
        return None
    return fn(workflow)


def workflow_check(workflow: str) -> Optional[str]:
    """The load-time check: a drop reason for a workflow that is not a rule-triggered cron job.

    While cron_app offers no ``rule_trigger_reason`` nothing is dropped: the
    rule stays, and answers that cron is not running when it fires.
    """
    try:
        reason = workflow_trigger_reason(workflow)
    except Exception:  # a broken cron room must not refuse the whole rules file
        log.exception("workflow check failed (workflow=%s); rule kept", workflow)
        return None
    if reason is None:
        return None
    return DROP_WORKFLOW_NOT_TRIGGER.format(workflow=workflow)
