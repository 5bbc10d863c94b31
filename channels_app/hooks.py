"""The hook point before the agent turn (BeforeAgentTurn).

Routing registers at priority 50 and the rule engine at 100; lower runs first.
A hook may change the context (text, tags, tool narrowing, injected context), stop the message
with an answer (HookStop: recorded at once, no agent turn runs), or ask for a native action
(NativeAction: the turn runs the action instead of the agent, after the receipt commits).

The hub imports no app that plugs into it: the hooks are named in settings by dotted path
(`UGENT_BEFORE_TURN_HOOKS`, `UGENT_AFTER_TURN_HOOKS`, `UGENT_QUESTION_ASKED_HOOKS`) and imported on first use, so the arrow
points from rules, cron and channel plugins to the hub and never back. `register` adds one at run
time (tests, benches). The native actions a NativeAction names are found the same way
(`UGENT_NATIVE_ACTIONS`, `register_native_action`).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from django.conf import settings
from django.utils.module_loading import import_string

ROUTING_PRIORITY = 50
RULE_ENGINE_PRIORITY = 100


@dataclass
class HookContext:
    text: str
    channel: str
    source_type: str
    user_id: str
    conversation_id: str
    input_mode: Optional[str]
    actor_key: str
    conversation: object = None  # the Conversation row
    actor: object = None  # the Actor row
    receipt: object = None  # the Receipt row, already created
    is_first_message: bool = False
    tags: list = field(default_factory=list)
    injected_context: list = field(default_factory=list)
    allowed_tools: Optional[list] = None  # None: no narrowing
    limits: dict = field(default_factory=dict)  # the turn's opt-outs, for work a hook starts
    delegate_research: Optional[str] = None  # routing's delegate-research: a task the turn runs first


@dataclass
class HookStop:
    """Stop the message here and answer the sender with `answer`."""

    answer: str
    state: str = "completed"  # a receipt state: completed or refused
    reason: str = ""
    decided_by: str = ""


@dataclass
class NativeAction:
    """Answer the message with a native action (a rule's RunNativeAction): no agent runs, the turn
    runner runs the action as the turn, after the receipt commits, outside any transaction (an
    action may take seconds: a summariser's model call). `reason` and `decided_by` are recorded as
    a HookStop's are; its answer is what the action returns."""

    action: str
    reason: str = ""
    decided_by: str = ""


Hook = Callable[[HookContext], Optional["HookStop | NativeAction"]]
_hooks: list[tuple[int, int, str, Hook]] = []
_loaded = False
_load_lock = threading.Lock()


def _ensure_loaded() -> None:
    """Import the hooks settings name, once per process."""
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if _loaded:
            return
        for name, priority, path in getattr(settings, "UGENT_BEFORE_TURN_HOOKS", ()):
            _insert(name, priority, import_string(path))
        for name, path in getattr(settings, "UGENT_AFTER_TURN_HOOKS", {}).items():
            _after.setdefault(name, import_string(path))
        for name, path in getattr(settings, "UGENT_AFTER_TURN_PROBES", {}).items():
            if name in _after:
                _after_probes.setdefault(name, import_string(path))
        for name, path in getattr(settings, "UGENT_QUESTION_ASKED_HOOKS", {}).items():
            _asked.setdefault(name, import_string(path))
        for name, path in getattr(settings, "UGENT_NATIVE_ACTIONS", {}).items():
            _actions.setdefault(name, import_string(path))
        _loaded = True


def _insert(name: str, priority: int, hook: Hook) -> None:
    _hooks[:] = [h for h in _hooks if h[2] != name]
    bisect.insort(_hooks, (priority, len(_hooks), name, hook), key=lambda h: (h[0], h[1]))


def register(name: str, priority: int, hook: Hook) -> None:
    """Register (or replace) a named hook at run time, beside the ones settings name."""
    _ensure_loaded()
    _insert(name, priority, hook)


def unregister(name: str) -> None:
    _ensure_loaded()
    _hooks[:] = [h for h in _hooks if h[2] != name]


def run_before_agent_turn(ctx: HookContext) -> Optional[HookStop | NativeAction]:
    _ensure_loaded()
    for _priority, _order, _name, hook in list(_hooks):
        stop = hook(ctx)
        if stop is not None:
            return stop
    return None


def registered() -> list[tuple[int, str]]:
    _ensure_loaded()
    return [(p, n) for p, _o, n, _h in _hooks]


# --- after the turn ------------------------------------------------------------------------
# Called inside the transaction that records a turn's end (completed, failed, cancelled, or
# stopped by a hook), so work such as a channel's outbound delivery row commits with it.
AfterTurn = Callable[..., None]
_after: dict[str, AfterTurn] = {}
# A hook's probe: probe(turn=, state=) -> a ugent_common.rows.Step, or None. The end of a turn sends the
# step with its first round trip and calls the hook with `probed=` its result (after_turn_probes).
_after_probes: dict[str, Callable] = {}


def register_after_turn(name: str, fn: AfterTurn, probe: Callable | None = None) -> None:
    """fn(turn=Turn, state=str, answer=str) runs in the turn's final transaction. With `probe`, fn is
    also given `probed=` what the probe's statement found (None: the probe sent nothing)."""
    _ensure_loaded()
    _after[name] = fn
    if probe is None:
        _after_probes.pop(name, None)
    else:
        _after_probes[name] = probe


def unregister_after_turn(name: str) -> None:
    _ensure_loaded()
    _after.pop(name, None)
    _after_probes.pop(name, None)


def after_turn_probes(*, turn, state: str) -> dict:
    """The statements after-turn hooks need first, so the end's first round trip carries them: by hook
    name, (the hook, its probe's step), for the hooks whose probe sent one."""
    _ensure_loaded()
    found = {}
    for name, probe in list(_after_probes.items()):
        fn = _after.get(name)
        step = probe(turn=turn, state=state) if fn is not None else None
        if step is not None:
            found[name] = (fn, step)
    return found


def run_after_turn(*, turn, state: str, answer: str, probed: dict | None = None) -> None:
    """`probed`: by hook name, (the hook, what its probe's step found), from the end's first round trip.
    A hook is given its result only if it is still the hook that probe was asked for."""
    _ensure_loaded()
    for name, fn in list(_after.items()):
        seen = probed.get(name) if probed else None
        if seen is not None and seen[0] is fn:
            fn(turn=turn, state=state, answer=answer, probed=seen[1])
        else:
            fn(turn=turn, state=state, answer=answer)


# --- a question asked ----------------------------------------------------------------------
# Called inside the transaction that records a question a turn asks (channels_app.questions), so
# work such as a channel's delivery of the question commits with it. A hook must be idempotent on
# the question's request_id: the same question may be handed to it twice.
QuestionAsked = Callable[..., None]
_asked: dict[str, QuestionAsked] = {}


def register_question_asked(name: str, fn: QuestionAsked) -> None:
    """fn(question=Question) runs in the transaction that records the question."""
    _ensure_loaded()
    _asked[name] = fn


def unregister_question_asked(name: str) -> None:
    _ensure_loaded()
    _asked.pop(name, None)


def run_question_asked(*, question) -> None:
    _ensure_loaded()
    for fn in list(_asked.values()):
        fn(question=question)


# --- native actions ------------------------------------------------------------------------
# What a NativeAction names, run by the turn runner as the turn (channels_app.runner). Found like
# the hooks above, by dotted path in settings (UGENT_NATIVE_ACTIONS) imported on first use, so the
# hub never imports the room that implements them, and tests register more at run time. Settings
# rather than a registration in rules_app's AppConfig.ready: that is how every hook here is found,
# so the wiring stays in one place (drop an app and its lines from settings, the hub still works).
# fn(*, turn=Turn, first_message=bool) -> str: the answer. It runs outside any transaction, holds
# no lock while it works, and must be safe to run again for the same turn (a turn whose claim a
# crash undid runs again): compaction hides only what is still visible, memory merges a fact it has.
NativeActionRun = Callable[..., str]
_actions: dict[str, NativeActionRun] = {}


def register_native_action(name: str, fn: NativeActionRun) -> None:
    """Register (or replace) a native action at run time, beside the ones settings name."""
    _ensure_loaded()
    _actions[name] = fn


def unregister_native_action(name: str) -> None:
    _ensure_loaded()
    _actions.pop(name, None)


def native_action(name: str) -> Optional[NativeActionRun]:
    """The native action called `name`; None when none is installed here."""
    _ensure_loaded()
    return _actions.get(name)
