"""Plugin engines that do not return until their test lets them go: a plugin call that hangs (and, beside
them, ones that raise: a plugin call that fails).

Each blocks on its class's `Gate` (`entered` is set once it is called) until the test sets `release`, or
for BOUND seconds at most: a test run without the fix it checks fails then, it never hangs for ever. Register
one with `blocked(registry_register, name, cls)`, which also lets every call go and waits for its thread's
end (ugent_common.bounded's count of calls past their limit back at zero) when the test ends.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from ovos_plugin_manager.templates.agents import (ChatSummarizerEngine, NaturalLanguageInferenceEngine,
                                                  OptionMatcherEngine, YesNoEngine)

from ugent_common import bounded

BOUND = 30.0


class Gate:
    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def wait(self) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait(BOUND)


class BlockedOptionMatcher(OptionMatcherEngine):
    """Picks the last option, once let go."""
    gate = Gate()

    def match_option(self, utterance, options, lang=None):
        type(self).gate.wait()
        return options[-1] if options else None


class BlockedYesNo(YesNoEngine):
    """Says yes, once let go."""
    gate = Gate()

    def yes_or_no(self, question, response, lang=None):
        type(self).gate.wait()
        return True


class FailingOptionMatcher(OptionMatcherEngine):
    """Raises, as a plugin with a bug does."""
    gate = Gate()

    def match_option(self, utterance, options, lang=None):
        raise RuntimeError("the matcher broke")


class FailingYesNo(YesNoEngine):
    """Raises, as a plugin with a bug does."""
    gate = Gate()

    def yes_or_no(self, question, response, lang=None):
        raise RuntimeError("the yes/no engine broke")


class BlockedNLI(NaturalLanguageInferenceEngine):
    """Finds every sentence entailed, once let go."""
    gate = Gate()

    def predict_entailment(self, premise, hypothesis, lang=None):
        type(self).gate.wait()
        return True


class BlockedSummarizer(ChatSummarizerEngine):
    """Summarises, once let go."""
    gate = Gate()

    def summarize(self, messages, lang=None):
        type(self).gate.wait()
        return "- a summary the blocked summariser finished"


def wait_no_overrun(prefix: str, timeout: float = BOUND + 5) -> None:
    """Until no call of an owner starting with `prefix` runs past its time limit any more."""
    deadline = time.monotonic() + timeout
    while bounded.overrunning(prefix) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bounded.overrunning(prefix) == {}, bounded.overrunning(prefix)


def wait_calls(gate: Gate, count: int, timeout: float = 10.0) -> None:
    """Until `count` calls have entered the gate's engine (each now waits there)."""
    deadline = time.monotonic() + timeout
    while gate.calls < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.calls >= count, f"{gate.calls} of {count} calls entered"


def within(fn, gate: Gate, bound: float = 15.0):
    """fn()'s value, fn run on a thread of its own and given `bound` seconds: still running then (waiting on a
    blocked engine), the gate is opened, fn is waited for, and the test fails."""
    from django.db import connection
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            box["error"] = exc
        finally:
            connection.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    hung = thread.is_alive()
    if hung:
        gate.release.set()
        thread.join(BOUND + 5)
    assert not hung, f"still waiting on the blocked engine after {bound:g} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@contextmanager
def blocked(cls, register, name: str, forget=lambda: None):
    """`cls` registered as `name` (`register(name, cls)`) with a new gate; on the way out every call is let
    go, `forget()` drops the registration, and the calls' threads are waited for."""
    cls.gate = gate = Gate()
    register(name, cls)
    try:
        yield gate
    finally:
        gate.release.set()
        forget()
        wait_no_overrun("")


@contextmanager
def blocked_engine(cls, name: str):
    """`blocked` for the registry's helper engines (an option matcher, a yes/no engine, an NLI engine)."""
    from plugins_app.agent.engines import registry

    def forget():
        registry._extra.pop(name, None)
        instances = getattr(registry, "_instances", {})
        for key in [k for k in list(instances) if isinstance(k, tuple) and name in k]:
            instances.pop(key, None)
    with blocked(cls, registry.register_engine, name, forget) as gate:
        yield gate


@contextmanager
def blocked_summarizer(name: str):
    """`blocked` for a chat summariser (registry.register_summarizer)."""
    from plugins_app.agent.engines import registry
    with blocked(BlockedSummarizer, registry.register_summarizer, name,
                 lambda: registry._extra_summarizers.pop(name, None)) as gate:
        yield gate
