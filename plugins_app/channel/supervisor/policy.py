"""The restart policy: backoff in cooldown rounds, a circuit breaker, a heartbeat watchdog.

Pure state, no processes and no Django; time comes in as arguments or from an
injectable clock, so a test drives it with a fake clock.

A *round* is a run of quick failures. Within a round the worker is restarted
after ``backoff_initial_secs``, then that times ``backoff_factor`` (1 s, 2 s,
4 s, ... capped at ``backoff_max_secs``), ``restarts_per_round`` times. The
next failure ends the round: that is a *cooldown round*, and the worker waits
``cooldown_secs`` before the next round begins. When ``breaker_rounds`` (3)
cooldown rounds end in a row, the circuit breaker trips instead: the plugin is
disabled and stays down until someone enables it again. A run that stays up
for ``stable_secs`` or longer clears both counts, so only consecutive rounds
trip the breaker.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable

RUNNING = "running"
STOPPING = "stopping"
BACKOFF = "backoff"
COOLDOWN = "cooldown"
DISABLED = "disabled"
STOPPED = "stopped"

HEARTBEAT_OVERDUE = "heartbeat overdue"


@dataclass(frozen=True)
class SupervisionLimits:
    """Per-plugin timings of supervision; every one is configurable so tests run fast."""

    heartbeat_secs: float = 30.0  # 0 turns the watchdog off for this plugin
    heartbeat_misses: int = 3
    startup_grace_secs: float = 10.0
    backoff_initial_secs: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_secs: float = 60.0
    restarts_per_round: int = 5
    cooldown_secs: float = 60.0
    breaker_rounds: int = 3
    stable_secs: float = 60.0
    stop_grace_secs: float = 5.0


@dataclass(frozen=True)
class Action:
    """What to do after a worker exited: restart at ``restart_at``, or stay disabled."""

    state: str  # BACKOFF, COOLDOWN or DISABLED
    restart_at: float | None
    reason: str

    @property
    def disable(self) -> bool:
        return self.state == DISABLED


def describe_exit(code: int | None, cause: str | None = None) -> str:
    """``exit code 1``, ``signal SIGSEGV``, or the cause given (``heartbeat overdue``)."""
    if cause:
        return cause
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def heartbeat_deadline(limits: SupervisionLimits, started_at: float,
                       last_heartbeat: float | None) -> float | None:
    """When a worker started at ``started_at`` becomes overdue; None with the watchdog off.

    A heartbeat older than the start belongs to an earlier run and is ignored; until
    the first one, the worker gets ``startup_grace_secs`` on top of the usual window.
    """
    if limits.heartbeat_secs <= 0:
        return None
    window = limits.heartbeat_misses * limits.heartbeat_secs
    if last_heartbeat is None or last_heartbeat < started_at:
        return started_at + limits.startup_grace_secs + window
    return last_heartbeat + window


def heartbeat_overdue(limits: SupervisionLimits, now: float, started_at: float,
                      last_heartbeat: float | None) -> bool:
    """The worker has not heartbeat in time and must be restarted."""
    deadline = heartbeat_deadline(limits, started_at, last_heartbeat)
    return deadline is not None and now >= deadline


class RestartPolicy:
    """One plugin's restart state machine; ``on_exit`` answers with an ``Action``."""

    def __init__(self, limits: SupervisionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits or SupervisionLimits()
        self.clock = clock
        self.failures_in_round = 0
        self.cooldown_rounds = 0
        self.started_at: float | None = None
        self.disabled_reason: str | None = None

    @property
    def disabled(self) -> bool:
        return self.disabled_reason is not None

    def reset(self) -> None:
        """Forget all failures and re-enable (an edit, or the admin's enable action)."""
        self.failures_in_round = 0
        self.cooldown_rounds = 0
        self.started_at = None
        self.disabled_reason = None

    def on_start(self, now: float | None = None) -> None:
        self.started_at = self.clock() if now is None else now

    def on_exit(self, code: int | None = None, now: float | None = None, *,
                cause: str | None = None, healthy_secs: float | None = None,
                refused: str | None = None) -> Action:
        """The worker exited with ``code`` (or was stopped for ``cause``): restart when, or disable.

        ``healthy_secs`` is how long the run was sound, if less than its whole
        length: a worker stopped for missed heartbeats was healthy only until its
        last beat, so one that never beats cannot pass for stable.
        """
        now = self.clock() if now is None else now
        lim = self.limits
        ran = now - self.started_at if self.started_at is not None else 0.0
        if healthy_secs is not None:
            ran = min(ran, healthy_secs)
        self.started_at = None
        what = describe_exit(code, cause)
        if refused is not None:
            # The platform refused the worker (bad token, revoked, a second poller): restarting
            # cannot help, and retrying in a loop would hammer the platform. The operator must act.
            self.disabled_reason = f"the channel refused the worker: {refused}"
            return Action(DISABLED, None, self.disabled_reason)
        if ran >= lim.stable_secs:
            self.failures_in_round = 0
            self.cooldown_rounds = 0

        self.failures_in_round += 1
        if self.failures_in_round <= lim.restarts_per_round:
            delay = min(lim.backoff_initial_secs * lim.backoff_factor ** (self.failures_in_round - 1),
                        lim.backoff_max_secs)
            return Action(BACKOFF, now + delay,
                          f"{what}; restart {self.failures_in_round}/{lim.restarts_per_round} "
                          f"in {delay:g} s")

        self.failures_in_round = 0
        self.cooldown_rounds += 1
        if self.cooldown_rounds >= lim.breaker_rounds:
            self.disabled_reason = (f"circuit breaker: {self.cooldown_rounds} consecutive "
                                    f"cooldown rounds (last {what})")
            return Action(DISABLED, None, self.disabled_reason)
        return Action(COOLDOWN, now + lim.cooldown_secs,
                      f"{what}; cooldown round {self.cooldown_rounds}/{lim.breaker_rounds}, "
                      f"restart in {lim.cooldown_secs:g} s")

    def heartbeat_overdue(self, now: float, started_at: float, last_heartbeat: float | None) -> bool:
        return heartbeat_overdue(self.limits, now, started_at, last_heartbeat)
