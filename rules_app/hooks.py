"""The two BeforeAgentTurn hooks: routing (priority 50) and the rule engine (priority 100).

Both run in channels_app's one message path for every channel, web and plugin
alike, inside the transaction that records the receipt, so they only decide (and
StartWorkflow starts a cron run); a HookStop they return is answered and recorded
like any other turn (receipt, messages, events). A RunNativeAction is not run here:
the hook returns a NativeAction and the turn runner runs the action as the turn once
the receipt has committed (a summariser may take seconds, and the receipt's
transaction holds the database's write lock in embedded mode). The two actions'
bodies are below, named in settings.UGENT_NATIVE_ACTIONS.
"""
from __future__ import annotations

import logging
from typing import Optional

from channels_app.hooks import HookContext, HookStop, NativeAction
from rules_app import engine
from rules_app.runtime import runtime
from rules_app.workflows import workflow_answer
from ugent_common import metrics

log = logging.getLogger("ugent.rules")

#: The ``decided_by`` of a refusal under ``on_error = "closed"``.
CLOSED_DECIDED_BY = "rule engine (on_error = closed)"
#: Channels whose messages are the daemon's own, not a sender's: a cron job's task prompts. Neither
#: routing nor rules apply to them (a channel allowlist must not silence every cron job).
INTERNAL_CHANNELS = frozenset({"cron"})


def message_from(ctx: HookContext) -> engine.MessageFacts:
    """The facts a rule can match; an empty field is a field the message does not carry."""
    return engine.MessageFacts(text=ctx.text, channel=ctx.channel or None, source_type=ctx.source_type or None,
                          user_id=ctx.user_id or None, conversation_id=ctx.conversation_id or None,
                          input_mode=ctx.input_mode or None)


# --- routing -------------------------------------------------------------------------------

def routing_hook(ctx: HookContext) -> Optional[HookStop]:
    """Rewrite, tag, narrow tools, inject context, or reject (routing.toml)."""
    if ctx.channel in INTERNAL_CHANNELS:
        return None
    table = runtime.routing_table()
    if not len(table):
        return None
    outcome = table.route(message_from(ctx))
    if outcome.rejected:
        route = outcome.matched[-1]
        return HookStop(outcome.rejection, state="refused", reason=f"rejected by route '{route}'",
                        decided_by=route)
    if outcome.text is not None:
        ctx.text = outcome.text
    for tag in outcome.tags:
        if tag not in ctx.tags:
            ctx.tags.append(tag)
    if outcome.allowed_tools is not None:
        # narrow only: what the request allowed (None = every tool) intersected with the routes' set
        narrowed = (sorted(outcome.allowed_tools) if ctx.allowed_tools is None
                    else outcome.narrow_tools(ctx.allowed_tools))
        ctx.allowed_tools = narrowed
        ctx.limits["allowed_tools"] = narrowed
    ctx.injected_context.extend(outcome.context)
    if outcome.delegate_research and not ctx.delegate_research:
        ctx.delegate_research = outcome.delegate_research  # the turn delegates it, under its own limits
    return None


# --- the rule engine -----------------------------------------------------------------------

def rule_engine_hook(ctx: HookContext) -> Optional[HookStop | NativeAction]:
    """Evaluate the rules in force and apply the first matching rule's decision."""
    if ctx.channel in INTERNAL_CHANNELS:
        return None
    ruleset = runtime.ruleset()
    if not ruleset.rules and not ruleset.is_closed:
        return None
    match = ruleset.evaluate(message_from(ctx))
    if match.refused:
        metrics.rule_decided(rule=CLOSED_DECIDED_BY, decision="refused")
        return HookStop(engine.CLOSED_ANSWER, state="refused", reason=f"rule set failed to load: "
                        f"{ruleset.closed_error}", decided_by=CLOSED_DECIDED_BY)
    if match.rule is None:
        return None
    name, decision = match.rule.name, match.decision
    metrics.rule_decided(rule=name, decision=type(decision).__name__)
    if isinstance(decision, engine.PassToDefaultAgent):
        return None
    if isinstance(decision, engine.Ignore):
        return HookStop(engine.IGNORED_ANSWER, state="refused", reason=f"ignored by rule '{name}'",
                        decided_by=name)
    if isinstance(decision, engine.StartWorkflow):
        return HookStop(workflow_answer(ctx, decision), state="completed",
                        reason=f"rule '{name}' started workflow '{decision.workflow}'", decided_by=name)
    if isinstance(decision, engine.RunNativeAction):  # the turn runs it, once the receipt commits
        return NativeAction(decision.action, reason=f"rule '{name}' ran {decision.action}", decided_by=name)
    return None  # pragma: no cover - the engine knows no other decision


# --- the native actions, run by the turn runner as the turn ------------------------------------
# Each gets the running turn (its conversation, actor, profile, opt-outs, input mode, and the
# message's text in context["text"]) and whether the message was its conversation's first; each
# answers with its text, its own failure text when it fails (logged), and is safe to run again.

def compact_conversation_action(*, turn, first_message: bool = False) -> str:
    """compact_conversation: the hub's compaction, as /compress runs it, with the turn's own message
    kept out of it (it is this exchange); the summariser is the turn's profile's."""
    from channels_app import compaction
    try:
        return compaction.conversation_compact(conversation=turn.conversation, trigger=compaction.RULE,
                                               profile=turn.profile, turn=turn, first_message=first_message).text
    except Exception:
        log.exception("compact_conversation failed")
        return compaction.COMPACT_FAILED


def extract_memory_action(*, turn, first_message: bool = False) -> str:
    """extract_memory: the sender's facts from the conversation's latest exchanges and the message."""
    from rules_app import services
    try:
        return services.memory_extract(turn=turn, first_message=first_message)
    except Exception:
        log.exception("extract_memory failed")
        return engine.MEMORY_SAVE_FAILED
