"""The supervisor wired to the Plugin rows: one bridge per plugin, the Django hub, state in the admin.

``PluginRuntime`` is what ``manage.py runsupervisor`` runs and what
``rundaemon`` runs in embedded mode (``SupervisorService``, its own long-lived
thread: a worker's parent-death signal is tied to the thread that spawned it).

* ``desired()`` re-reads the enabled rows on every step, so an edit, an added,
  disabled or enabled plugin in the admin takes effect without a restart;
* each plugin gets a ``BridgeServer`` on ``<run dir>/<plugin>.sock`` (mode
  0600), all served by one asyncio loop in a thread, and a fresh token per
  worker start (``token_issuer`` -> ``set_token``);
* ``on_state`` writes state and reason to the row; the circuit breaker's
  ``disabled`` turns ``enabled`` off with the reason, so the plugin stays down;
* the watchdog reads heartbeats from the hub.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import threading
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections

from plugins_app.channel import conf, selectors, services
from plugins_app.channel.bridge import BridgeServer
from plugins_app.channel.hub import DjangoHub
from plugins_app.channel.sdk.outbox import STATE_DIR_ENV
from plugins_app.channel.supervisor import DesiredWorker, SupervisionLimits, Supervisor, WorkerSpec
from plugins_app.channel.supervisor.core import ENV_BRIDGE_SOCKET
from ugent_common.logs import warn_repeating

log = logging.getLogger("ugent.plugins")
_PID_IN_REASON = re.compile(r"^pid (\d+)$")


class BridgeLoop:
    """One asyncio loop in a daemon thread serving every plugin's bridge."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="plugin-bridges", daemon=True)
        self.thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # The hub's ORM calls ran in this loop's executor threads, each holding a database
            # connection: end the threads (and so their connections) with the loop, or every
            # runtime started and stopped in one process (tests, a re-created runtime) leaks them.
            try:
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()

    def run(self, coro, timeout: float | None = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class PluginRuntime:
    """Supervisor + bridges + hub for the Plugin rows. Call ``run``/``step``/``shutdown`` from one thread."""

    def __init__(self, *, run_dir: str | os.PathLike | None = None, pid_dir: str | os.PathLike | None = None,
                 log_dir: str | os.PathLike | None = None, state_dir: str | os.PathLike | None = None,
                 interval: float | None = None, limits: dict | None = None, environ: dict | None = None):
        self.run_dir = Path(run_dir or conf.RUN_DIR)
        self.state_dir = Path(state_dir or conf.STATE_DIR)
        self.limits = {**conf.supervision_overrides(), **(limits or {})}
        self.environ = environ
        self.hub = DjangoHub()
        self.bridges: dict[str, BridgeServer] = {}
        self._loop: BridgeLoop | None = None
        self.supervisor = Supervisor(
            self.desired, pid_dir=pid_dir or conf.PID_DIR, log_dir=log_dir or conf.LOG_DIR,
            heartbeat=self.hub.last_heartbeat, on_state=self.on_state, bridge_socket=None,
            token_issuer=self.issue_token, interval=conf.SUPERVISOR_INTERVAL if interval is None else interval,
            reap_grace=conf.REAP_GRACE_SECS, log_max_bytes=conf.LOG_MAX_BYTES)

    # --- what should run -----------------------------------------------------------------

    def socket_path(self, plugin_id: str) -> str:
        return str(self.run_dir / f"{plugin_id}.sock")

    def desired(self) -> list[DesiredWorker]:
        close_old_connections()
        out = []
        try:
            for plugin in selectors.plugins_enabled():
                argv = selectors.plugin_argv(plugin)
                if argv is None:
                    warn_repeating(log, "plugin %s: no command, and kind %s is not installed: not started",
                                   plugin.plugin_id, plugin.kind)
                    continue
                env, missing = selectors.plugin_environment(plugin, self.environ)
                if missing:
                    # desired() runs every supervisor tick (0.5 s): say it once, then every five minutes
                    warn_repeating(log, "plugin %s: environment not set: %s", plugin.plugin_id,
                                   ", ".join(missing), key=("environment not set", plugin.plugin_id,
                                                            tuple(missing)))
                self._ensure_bridge(plugin.plugin_id)
                env[ENV_BRIDGE_SOCKET] = self.socket_path(plugin.plugin_id)
                env[STATE_DIR_ENV] = str(self.state_dir)
                if plugin.workspace:
                    env["UGENT_PLUGIN_WORKSPACE"] = plugin.workspace
                spec = WorkerSpec(plugin.plugin_id, argv[0], argv[1], env=env, cwd=str(settings.BASE_DIR),
                                  memory_max_mb=selectors.plugin_memory_max_mb(plugin.memory_max_mb))
                limits = SupervisionLimits(heartbeat_secs=plugin.heartbeat_secs, **self.limits)
                out.append(DesiredWorker(spec, limits))
        finally:
            close_old_connections()
        self._close_unused_bridges({d.plugin_id for d in out})
        return out

    def _ensure_bridge(self, plugin_id: str) -> None:
        if plugin_id in self.bridges:
            return
        if self._loop is None:
            self._loop = BridgeLoop()
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        bridge = BridgeServer(socket_path=self.socket_path(plugin_id), plugin_id=plugin_id,
                              token=secrets.token_urlsafe(32), hub=self.hub, submit_rate=conf.SUBMIT_RATE,
                              submit_burst=conf.SUBMIT_BURST)
        self._loop.run(bridge.start())
        self.bridges[plugin_id] = bridge

    def _close_unused_bridges(self, wanted: set[str]) -> None:
        running = set(self.supervisor.status())
        for plugin_id in list(self.bridges):
            if plugin_id not in wanted and plugin_id not in running:
                bridge = self.bridges.pop(plugin_id)
                try:
                    self._loop.run(bridge.close())
                except Exception:
                    log.exception("plugin %s: bridge did not close cleanly", plugin_id)

    # --- supervisor callbacks --------------------------------------------------------------

    def issue_token(self, plugin_id: str) -> str:
        token = secrets.token_urlsafe(32)
        bridge = self.bridges.get(plugin_id)
        if bridge is not None:
            self._loop.loop.call_soon_threadsafe(bridge.set_token, token)
        return token

    def on_state(self, plugin_id: str, state: str, reason: str) -> None:
        match = _PID_IN_REASON.match(reason)
        try:
            services.plugin_state_record(plugin_id=plugin_id, state=state, reason=reason,
                                         pid=int(match.group(1)) if match else None)
        finally:
            close_old_connections()

    # --- running --------------------------------------------------------------------------

    def start(self) -> None:
        self.supervisor.start()

    def step(self) -> None:
        self.supervisor.step()

    def run(self, stop_event: threading.Event) -> None:
        try:
            self.supervisor.run(stop_event)
        finally:
            self.close_bridges()

    def shutdown(self) -> None:
        try:
            self.supervisor.shutdown()
        finally:
            self.close_bridges()

    def close_bridges(self) -> None:
        for plugin_id, bridge in list(self.bridges.items()):
            try:
                self._loop.run(bridge.close())
            except Exception:
                log.exception("plugin %s: bridge did not close cleanly", plugin_id)
        self.bridges.clear()
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        close_old_connections()


class SupervisorService:
    """rundaemon's background service (embedded mode): the runtime in its own long-lived thread."""

    def __init__(self, **runtime_kwargs):
        self.runtime_kwargs = runtime_kwargs
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.runtime: PluginRuntime | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="plugin-supervisor", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.runtime = PluginRuntime(**self.runtime_kwargs)
            self.runtime.run(self.stop_event)
        except Exception:
            log.exception("the plugin supervisor stopped")
        finally:
            close_old_connections()

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)
