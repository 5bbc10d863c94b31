"""The supervisor loop: keeps the running workers equal to the desired set.

No Django here: the caller passes a ``desired`` callable (read afresh on every
step, so an edit, addition, disable or enable in the admin takes effect without
a restart), an optional ``heartbeat`` lookup, and an ``on_state`` callback that
records each plugin's state and reason where the admin can show them.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .policy import (
    DISABLED, HEARTBEAT_OVERDUE, RUNNING, STOPPED, STOPPING,
    Action, RestartPolicy, SupervisionLimits, heartbeat_overdue,
)
from ..sdk.outbox import STATE_DIR_ENV, refusal_path_for
from ..sdk.worker import EXIT_CHANNEL_REFUSED, TOKEN_FD_ENV
from .process import (
    DEFAULT_LOG_MAX_BYTES, KILL_WAIT_SECS, ProcStat, ReapedWorker, WorkerHandle, WorkerSpec, pid_alive,
    pid_file_path, reap_stale,
)
from ugent_common import metrics

try:
    import fcntl
except ImportError:  # not on Unix: no supervisor lock
    fcntl = None

logger = logging.getLogger(__name__)

ENV_BRIDGE_SOCKET = "UGENT_BRIDGE_SOCKET"
ENV_PLUGIN_ID = "UGENT_PLUGIN_ID"
# The token is never in the worker's environment, which any process of the same user can read
# (/proc/<pid>/environ): this variable names the fd of an inherited pipe that holds it.
ENV_PLUGIN_TOKEN_FD = TOKEN_FD_ENV

SPEC_CHANGED = "spec changed"
REMOVED = "disabled or removed"
SHUTDOWN = "supervisor stopped"

LOCK_FILE = "supervisor.lock"

# A SIGKILLed worker is normally gone at once: reaped within the step that killed it, else looked
# at again by the next steps, so a worker stuck in the kernel never holds the loop longer than this.
_KILL_REAP_SECS = 0.1


@dataclass(frozen=True)
class DesiredWorker:
    """One plugin that should run: its spec (env = its resolved env refs) and its limits."""

    spec: WorkerSpec
    limits: SupervisionLimits = field(default_factory=SupervisionLimits)

    @property
    def plugin_id(self) -> str:
        return self.spec.plugin_id


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of one plugin's supervision, for status pages and tests."""

    plugin_id: str
    state: str
    reason: str
    pid: int | None
    starts: int
    restart_at: float | None


class SupervisorAlreadyRunning(RuntimeError):
    """Another supervisor holds the lock on this pid directory."""


class _Slot:
    def __init__(self, desired: DesiredWorker, policy: RestartPolicy):
        self.plugin_id = desired.plugin_id
        self.desired: DesiredWorker | None = desired
        self.policy = policy
        self.handle: WorkerHandle | None = None
        self.started_wall = 0.0
        self.last_heartbeat: float | None = None
        self.stop_deadline: float | None = None
        self.stop_cause: str | None = None
        self.killed_at: float | None = None  # SIGKILL sent to a worker not yet reaped
        self.unkillable = False  # and kill_wait has passed since: said once
        self.restart_at: float | None = None
        self.state = ""
        self.reason = ""
        self.starts = 0


StateCallback = Callable[[str, str, str], None]


class Supervisor:
    """Starts, watches, restarts and stops plugin workers; one ``step()`` per pass.

    ``desired()`` returns the ``DesiredWorker``s that should run now. A spec that
    changed restarts its worker (and clears its breaker); a plugin that left the
    set is stopped; a new one is started. If ``desired()`` raises, the step keeps
    the current workers.

    ``heartbeat(plugin_id)`` returns the last heartbeat as a ``wall_clock``
    timestamp (epoch seconds) or None; without it the watchdog is off.

    ``on_state(plugin_id, state, reason)`` is called on every change, with
    state one of running, stopping, backoff, cooldown, disabled, stopped. On
    ``disabled`` (the circuit breaker) the caller should take the plugin out of
    the desired set (``enabled = False`` with the reason), so it stays down across
    supervisor restarts; enabling it again puts it back with a clean breaker. A
    plugin the breaker disabled that stays in the set also stays down, until its
    spec changes or it leaves the set and comes back.

    ``token_issuer(plugin_id)`` is called before every start and returns the
    per-start token (default: a random token). The worker reads it from an
    inherited pipe whose fd ``UGENT_PLUGIN_TOKEN_FD`` names, never from its
    environment; it also gets ``UGENT_PLUGIN_ID`` and, with ``bridge_socket``,
    ``UGENT_BRIDGE_SOCKET``.

    One worker cannot hold up the others: after a stop's SIGKILL the loop waits
    for the worker a moment only, then looks again on each step. One still alive
    ``kill_wait`` seconds after it (uninterruptible sleep) is logged and stays
    ``stopping``; it is started again only once it has exited. Likewise a worker
    a crashed supervisor left that survives ``reap_stale``'s SIGKILL: its plugin
    waits, ``stopping``, until that process is gone.

    Threads and signals: call ``run``/``step``/``shutdown`` from one long-lived
    thread, because a worker's parent-death signal fires when the thread that
    spawned it exits. Signal handlers are the caller's: make them set the
    ``stop_event`` given to ``run``, which then finishes its step and stops every
    worker in two phases::

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        Supervisor(desired, pid_dir=..., log_dir=...).run(stop)
    """

    def __init__(self, desired: Callable[[], Iterable[DesiredWorker]], *,
                 pid_dir: str | os.PathLike, log_dir: str | os.PathLike,
                 heartbeat: Callable[[str], float | None] | None = None,
                 on_state: StateCallback | None = None,
                 bridge_socket: str | os.PathLike | None = None,
                 token_issuer: Callable[[str], str] | None = None,
                 interval: float = 0.5, reap_grace: float = 2.0, kill_wait: float = KILL_WAIT_SECS,
                 log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.desired = desired
        self.pid_dir = Path(pid_dir)
        self.log_dir = Path(log_dir)
        self.log_max_bytes = log_max_bytes
        self.heartbeat = heartbeat
        self.on_state = on_state
        self.bridge_socket = str(bridge_socket) if bridge_socket is not None else None
        self.token_issuer = token_issuer or (lambda _plugin_id: secrets.token_urlsafe(32))
        self.interval = interval
        self.reap_grace = reap_grace
        self.kill_wait = kill_wait
        self.clock = clock
        self.wall_clock = wall_clock
        self.reaped: list[ReapedWorker] = []
        # plugin -> processes of a crashed supervisor's worker that SIGKILL did not end (yet)
        self._survivors: dict[str, tuple[ProcStat, ...]] = {}
        self._slots: dict[str, _Slot] = {}
        self._started = False
        self._lock_fd: int | None = None
        self._thread: int | None = None

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Take the pid-directory lock and reap workers left by a crashed supervisor."""
        if self._started:
            return
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        self.reaped = reap_stale(self.pid_dir, grace=self.reap_grace, kill_wait=self.kill_wait)
        self._survivors = {r.plugin_id: r.survivors for r in self.reaped if r.survivors}
        self._started = True

    def run(self, stop_event: threading.Event, interval: float | None = None) -> None:
        """Step until ``stop_event`` is set, then stop every worker."""
        self.start()
        try:
            while not stop_event.is_set():
                try:
                    self.step()
                except Exception:
                    logger.exception("supervisor step failed")
                stop_event.wait(self.interval if interval is None else interval)
        finally:
            self.shutdown()

    def step(self) -> None:
        """One pass: reconcile with ``desired()``, reap exits, apply the policy, run the watchdog."""
        self.start()
        self._check_thread()
        now = self.clock()
        desired = self._read_desired()
        if desired is not None:
            self._reconcile(desired, now)
        for slot in list(self._slots.values()):
            self._advance(slot, now)

    def shutdown(self, grace: float | None = None) -> None:
        """Two-phase stop of every worker: SIGTERM to each group, one shared grace, SIGKILL to each,
        and one shared wait of at most ``kill_wait`` for them to die."""
        live = [s for s in self._slots.values() if s.handle is not None]
        for slot in live:
            slot.handle.send_signal(signal.SIGTERM)
        if grace is None:
            grace = max((s.policy.limits.stop_grace_secs for s in live), default=0.0)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not all(s.handle.stopped() for s in live):
            time.sleep(0.02)
        for slot in live:
            slot.handle.kill(wait=0)
        deadline = time.monotonic() + self.kill_wait
        while time.monotonic() < deadline and any(s.handle.poll() is None for s in live):
            time.sleep(0.02)
        for slot in live:
            handle, slot.handle = slot.handle, None
            if handle.poll() is None:
                logger.error("plugin %s worker pid %s did not die after SIGKILL; left to exit by itself "
                             "(its pid file stays: the next supervisor reaps it)", slot.plugin_id, handle.pid)
                handle.detach()  # kill on drop would only send the same SIGKILL and wait again
        for slot in self._slots.values():
            if slot.state != DISABLED:
                self._set_state(slot, STOPPED, SHUTDOWN)
        self._slots.clear()
        self._unlock()
        self._started = False

    def status(self) -> dict[str, WorkerStatus]:
        """Each slot's state. Safe from another thread than the one stepping (the slots are copied in one go:
        iterating the dict itself raised "dictionary changed size during iteration" when a step added a slot)."""
        return {pid: WorkerStatus(plugin_id=pid, state=s.state, reason=s.reason,
                                  pid=s.handle.pid if s.handle else None, starts=s.starts,
                                  restart_at=s.restart_at)
                for pid, s in list(self._slots.items())}

    # --- one step ----------------------------------------------------------

    def _read_desired(self) -> dict[str, DesiredWorker] | None:
        try:
            items = list(self.desired())
        except Exception:
            logger.exception("could not read the desired plugins; keeping the current workers")
            return None
        out: dict[str, DesiredWorker] = {}
        for item in items:
            if item.plugin_id in out:
                logger.error("plugin %s is listed twice; starting the first", item.plugin_id)
                continue
            out[item.plugin_id] = item
        return out

    def _reconcile(self, desired: dict[str, DesiredWorker], now: float) -> None:
        for plugin_id, want in desired.items():
            slot = self._slots.get(plugin_id)
            if slot is None:
                slot = self._slots[plugin_id] = _Slot(want, RestartPolicy(want.limits, self.clock))
                slot.restart_at = now
                continue
            if slot.desired is None or slot.desired.spec != want.spec:
                slot.desired = want
                slot.policy.limits = want.limits
                slot.policy.reset()
                if slot.handle is None:
                    slot.restart_at = now
                elif slot.stop_deadline is None:
                    self._begin_stop(slot, SPEC_CHANGED, now)
                else:
                    slot.stop_cause = SPEC_CHANGED
            elif slot.desired.limits != want.limits:
                slot.desired = want
                slot.policy.limits = want.limits
        for plugin_id, slot in self._slots.items():
            if plugin_id not in desired and slot.desired is not None:
                slot.desired = None
                if slot.handle is not None and slot.stop_deadline is None:
                    self._begin_stop(slot, REMOVED, now)
                elif slot.handle is not None:
                    slot.stop_cause = REMOVED

    def _advance(self, slot: _Slot, now: float) -> None:
        handle = slot.handle
        if handle is not None and slot.stop_deadline is not None:
            if handle.stopped():
                code = handle.poll()
            elif slot.killed_at is not None:
                # SIGKILLed on an earlier step and not reaped yet: look again, never wait for it
                code = handle.poll()
                if code is None:
                    if not slot.unkillable and now - slot.killed_at >= self.kill_wait:
                        self._unkillable(slot, handle)
                    return
                if slot.unkillable:
                    logger.warning("plugin %s worker pid %s exited at last (%s)", slot.plugin_id, handle.pid, code)
            elif now >= slot.stop_deadline:
                slot.killed_at = now
                code = handle.kill(wait=min(self.kill_wait, _KILL_REAP_SECS))
                if code is None:
                    return
            else:
                return
            self._after_stop(slot, code, now)
        elif handle is not None:
            code = handle.poll()
            if code is None:
                self._watchdog(slot, now)
                return
            slot.handle = None
            logger.warning("plugin %s worker pid %s exited (%s)", slot.plugin_id, handle.pid, code)
            self._apply(slot, slot.policy.on_exit(code, now, refused=self._refusal(slot, code)))

        if slot.desired is None:
            self._forget(slot)
            return
        if not slot.policy.disabled and slot.restart_at is not None and now >= slot.restart_at \
                and self._survivors_gone(slot):
            self._spawn(slot, now)

    def _unkillable(self, slot: _Slot, handle: WorkerHandle) -> None:
        slot.unkillable = True
        logger.error("plugin %s worker pid %s did not die within %g s of SIGKILL (uninterruptible sleep?); "
                     "it is not started again until it has exited", slot.plugin_id, handle.pid, self.kill_wait)
        self._set_state(slot, STOPPING, f"pid {handle.pid} did not die after SIGKILL; waiting for it to exit")

    def _survivors_gone(self, slot: _Slot) -> bool:
        """No process of this plugin's worker that a crashed supervisor left is alive (reap_stale's SIGKILL
        did not end it at once): else the plugin waits, rather than run twice."""
        left = self._survivors.get(slot.plugin_id)
        if not left:
            return True
        left = tuple(st for st in left if pid_alive(st.pid, st.start_time))
        if left:
            self._survivors[slot.plugin_id] = left
            pids = ", ".join(str(st.pid) for st in left)
            self._set_state(slot, STOPPING, f"pid {pids} of the previous supervisor's worker did not die "
                                            f"after SIGKILL; waiting for it to exit")
            return False
        del self._survivors[slot.plugin_id]
        # the stale pid file reap_stale kept for them: nothing of that worker is left
        pid_file_path(self.pid_dir, slot.plugin_id).unlink(missing_ok=True)
        logger.warning("plugin %s: the previous supervisor's worker has exited; starting it", slot.plugin_id)
        return True

    def _after_stop(self, slot: _Slot, code: int | None, now: float) -> None:
        cause = slot.stop_cause
        slot.handle = None
        slot.stop_deadline = slot.stop_cause = slot.killed_at = None
        slot.unkillable = False
        if slot.desired is None:
            return
        if cause == HEARTBEAT_OVERDUE:
            beat, start = slot.last_heartbeat, slot.started_wall
            healthy = beat - start if beat is not None and beat >= start else 0.0
            self._apply(slot, slot.policy.on_exit(code, now, cause=cause, healthy_secs=healthy))
        else:
            slot.restart_at = now

    def _refusal(self, slot: _Slot, code: int | None) -> str | None:
        """The reason a worker that exited with EXIT_CHANNEL_REFUSED left beside its outbox."""
        if code != EXIT_CHANNEL_REFUSED or slot.desired is None:
            return None
        path = refusal_path_for(slot.plugin_id, slot.desired.spec.env.get(STATE_DIR_ENV))
        try:
            return path.read_text().strip() or "no reason given"
        except OSError:
            return "no reason given"

    def _forget(self, slot: _Slot) -> None:
        del self._slots[slot.plugin_id]
        # A breaker-disabled plugin leaving the set keeps "disabled" and its reason.
        if slot.state != DISABLED:
            self._set_state(slot, STOPPED, REMOVED)

    def _watchdog(self, slot: _Slot, now: float) -> None:
        limits = slot.policy.limits
        if self.heartbeat is None or limits.heartbeat_secs <= 0:
            return
        wall = self.wall_clock()
        # No heartbeat can be overdue inside the first window: spare the lookup.
        if wall < slot.started_wall + limits.heartbeat_misses * limits.heartbeat_secs:
            return
        plugin_id = slot.plugin_id
        try:
            last = self.heartbeat(plugin_id)
        except Exception:
            logger.exception("heartbeat lookup failed for plugin %s", plugin_id)
            return
        slot.last_heartbeat = last
        if heartbeat_overdue(limits, wall, slot.started_wall, last):
            logger.warning("plugin %s worker pid %s missed its heartbeats; restarting",
                           plugin_id, slot.handle.pid)
            self._begin_stop(slot, HEARTBEAT_OVERDUE, now)

    def _begin_stop(self, slot: _Slot, cause: str, now: float) -> None:
        slot.handle.send_signal(signal.SIGTERM)
        slot.stop_deadline = now + slot.policy.limits.stop_grace_secs
        slot.stop_cause = cause
        self._set_state(slot, STOPPING, cause)

    def _spawn(self, slot: _Slot, now: float) -> None:
        spec = slot.desired.spec
        env = {ENV_PLUGIN_ID: spec.plugin_id}
        if self.bridge_socket is not None:
            env[ENV_BRIDGE_SOCKET] = self.bridge_socket
        slot.restart_at = None
        slot.policy.on_start(now)
        try:
            token = self.token_issuer(spec.plugin_id)
            handle = WorkerHandle.spawn(spec.with_env(env), log_dir=self.log_dir, pid_dir=self.pid_dir,
                                        log_max_bytes=self.log_max_bytes, secret_fds={ENV_PLUGIN_TOKEN_FD: token})
        except Exception as exc:
            logger.error("plugin %s could not start: %s", spec.plugin_id, exc)
            self._apply(slot, slot.policy.on_exit(None, now, cause=f"start failed: {exc}"))
            return
        slot.handle = handle
        slot.started_wall = self.wall_clock()
        slot.last_heartbeat = None
        slot.starts += 1
        if slot.starts > 1:
            metrics.plugin_restarted(spec.plugin_id)
        logger.info("plugin %s started, pid %s", spec.plugin_id, handle.pid)
        self._set_state(slot, RUNNING, f"pid {handle.pid}")

    def _apply(self, slot: _Slot, action: Action) -> None:
        slot.restart_at = action.restart_at
        if action.state == DISABLED:
            logger.error("plugin %s disabled: %s", slot.plugin_id, action.reason)
        self._set_state(slot, action.state, action.reason)

    def _set_state(self, slot: _Slot, state: str, reason: str) -> None:
        if (slot.state, slot.reason) == (state, reason):
            return
        slot.state, slot.reason = state, reason
        if self.on_state is None:
            return
        try:
            self.on_state(slot.plugin_id, state, reason)
        except Exception:
            logger.exception("on_state callback failed for plugin %s", slot.plugin_id)

    # --- plumbing ----------------------------------------------------------

    def _check_thread(self) -> None:
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
        elif self._thread != ident:
            logger.warning("supervisor stepped from another thread: workers die when "
                           "their spawning thread exits (PR_SET_PDEATHSIG)")
            self._thread = ident

    def _lock(self) -> None:
        if fcntl is None or self._lock_fd is not None:
            return
        fd = os.open(self.pid_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SupervisorAlreadyRunning(f"another supervisor holds {self.pid_dir / LOCK_FILE}")
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
