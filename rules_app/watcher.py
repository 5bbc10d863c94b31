"""Hold the current rule set and keep it in step with the rules file.

:class:`RuleEngineHolder` loads the rules file at start (failing open, or
closed with ``[rules] on_error = "closed"``), reloads it when it changes, and,
when there was no file at start, polls the discovery locations so that a
rules.toml created later is picked up. Every step is a plain method
(:meth:`~RuleEngineHolder.start`, :meth:`~RuleEngineHolder.reload_once`,
:meth:`~RuleEngineHolder.check_discovery_once`) so tests and the REPL's
``/reload`` can drive it without the thread; :meth:`~RuleEngineHolder.start_watching`
runs them on a background thread using watchfiles.

Pure Python, no Django.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import watchfiles

from ugent_common.filestat import file_signature

from .discovery import (
    ON_ERROR_CLOSED,
    ON_ERROR_OPEN,
    Discovery,
    PathLike,
    TrustCheck,
    discover_rules_file,
    rules_on_error,
)
from .engine import (
    LOG_AUTO_RELOAD_FAILED,
    LOG_FAILED_LOAD,
    LOG_FAILED_LOAD_CLOSED,
    LOG_RULE_SET_AUTO_RELOADED,
    LOG_RULE_SET_LOADED,
    LOG_WATCH_DISABLED,
    Explanation,
    Match,
    MessageFacts,
    CompiledRuleSet,
    RuleSetError,
    WorkflowCheck,
    load_rules_file,
)

logger = logging.getLogger("ugent.rules")

#: Seconds between looks at the discovery locations; the spec promises pick-up within five.
DEFAULT_POLL_INTERVAL = 2.0
DEFAULT_DEBOUNCE_MS = 300


class RuleEngineHolder:
    """Thread-safe owner of the current :class:`CompiledRuleSet` and of the watcher thread."""

    def __init__(
        self,
        discover: Callable[[], Discovery],
        *,
        workflow_check: Optional[WorkflowCheck] = None,
        on_error: str = ON_ERROR_OPEN,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        debounce_ms: int = DEFAULT_DEBOUNCE_MS,
    ):
        """``discover`` returns where the rules file is (see :mod:`rules_app.discovery`).

        ``workflow_check`` is called at every load with each StartWorkflow
        rule's workflow name and returns a drop reason or None.
        """
        if on_error not in (ON_ERROR_OPEN, ON_ERROR_CLOSED):
            raise ValueError(f"on_error must be 'open' or 'closed', not {on_error!r}")
        self._discover = discover
        self._workflow_check = workflow_check
        self.on_error = on_error
        self.poll_interval = poll_interval
        self.debounce_ms = debounce_ms
        self._lock = threading.RLock()
        self._ruleset = CompiledRuleSet.empty()
        self._path: Optional[Path] = None
        self._pollable = True
        self._loaded_sig: Optional[tuple[int, int, int, int]] = None
        self._last_warnings: tuple[str, ...] = ()
        self.last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_workspace(
        cls,
        workspace: PathLike,
        config: Optional[Mapping[str, Any]] = None,
        *,
        home: Optional[PathLike] = None,
        is_trusted: TrustCheck,
        workflow_check: Optional[WorkflowCheck] = None,
        **kwargs: Any,
    ) -> "RuleEngineHolder":
        """Build a holder that discovers the rules file from ugent.toml ``config`` for ``workspace``."""
        on_error, warning = rules_on_error(config)
        if warning:
            logger.warning(warning)
        return cls(
            lambda: discover_rules_file(workspace, config, home=home, is_trusted=is_trusted),
            workflow_check=workflow_check,
            on_error=on_error,
            **kwargs,
        )

    # -- state ---------------------------------------------------------------

    @property
    def ruleset(self) -> CompiledRuleSet:
        """The rule set in force now."""
        with self._lock:
            return self._ruleset

    @property
    def path(self) -> Optional[Path]:
        """The rules file being watched, or None (no engine / watch disabled)."""
        with self._lock:
            return self._path

    @property
    def watching(self) -> bool:
        """True when a rules file is loaded and watched for edits."""
        return self.path is not None

    def evaluate(self, message: MessageFacts) -> Match:
        """Evaluate ``message`` against the rule set in force."""
        return self.ruleset.evaluate(message)

    def explain(self, message: MessageFacts) -> Explanation:
        """Explain how the rule set in force decides ``message``."""
        return self.ruleset.explain(message)

    def dry_run(self, text: str) -> str:
        """The ``[dry-run]`` line for ``text`` against the rule set in force."""
        return self.ruleset.dry_run(text)

    # -- steps ---------------------------------------------------------------

    def _log_warnings(self, found: Discovery) -> None:
        # Polling repeats discovery every few seconds; say each warning once until it changes.
        if found.warnings != self._last_warnings:
            for w in found.warnings:
                if w not in self._last_warnings:
                    logger.warning(w)
            self._last_warnings = found.warnings

    def _load(self, path: Path, *, refuse_empty: bool = False) -> CompiledRuleSet:
        return load_rules_file(path, workflow_check=self._workflow_check, refuse_empty=refuse_empty).ruleset

    def _first_load(self, path: Path) -> None:
        sig = file_signature(path)
        try:
            ruleset = self._load(path)
        except RuleSetError as exc:
            self.last_error = str(exc)
            if self.on_error == ON_ERROR_CLOSED:
                logger.error("%s (error=%s)", LOG_FAILED_LOAD_CLOSED, exc)
                ruleset = CompiledRuleSet.closed(str(exc), source=str(path))
            else:
                logger.error("%s (error=%s)", LOG_FAILED_LOAD, exc)
                ruleset = CompiledRuleSet.empty()
        else:
            self.last_error = None
            logger.info(LOG_RULE_SET_LOADED, len(ruleset))
        with self._lock:
            self._ruleset = ruleset
            self._path = path
            self._loaded_sig = sig

    def start(self) -> CompiledRuleSet:
        """Discover and load the rules file once, as at daemon start. Returns the rule set in force.

        A file that cannot be read or parsed logs ``failed to load rule set —
        starting with empty rules (fail-open)`` with the error (or refuses every
        message under ``on_error = "closed"``) and is still watched. No file logs
        ``rule engine watch disabled``.
        """
        found = self._discover()
        self._log_warnings(found)
        with self._lock:
            self._pollable = found.pollable
        if found.path is None:
            with self._lock:
                self._ruleset = CompiledRuleSet.empty()
                self._path = None
                self._loaded_sig = None
            logger.info(LOG_WATCH_DISABLED)
        else:
            self._first_load(found.path)
        return self.ruleset

    def reload_once(self) -> bool:
        """Re-read the watched file. Returns True when the new rules replaced the old ones.

        Logs ``rule set auto-reloaded (rules=N)``, or ``rule set auto-reload
        failed — retaining previous rule set`` with the error and keeps the
        rules in force: for a file that does not parse, and for one left blank
        or with comments alone (at start such a file is no rules). Does nothing (returns False) while no file is watched.
        """
        path = self.path
        if path is None:
            return False
        sig = file_signature(path)
        try:
            # an edit that leaves the file blank (or comments alone) is more likely a write caught half-way than a
            # wish to drop every rule, which `rules = []` says: it keeps the rules in force, as a broken edit does
            ruleset = self._load(path, refuse_empty=True)
        except RuleSetError as exc:
            self.last_error = str(exc)
            with self._lock:
                self._loaded_sig = sig
            logger.warning("%s (error=%s)", LOG_AUTO_RELOAD_FAILED, exc)
            return False
        self.last_error = None
        with self._lock:
            self._ruleset = ruleset
            self._loaded_sig = sig
        logger.info(LOG_RULE_SET_AUTO_RELOADED, len(ruleset))
        return True

    def check_discovery_once(self) -> bool:
        """When no file is watched, look in the discovery locations again; load one that appeared.

        Returns True when a file was picked up. A ``[rules] file`` path that did not exist is not
        polled (it needs a restart or an edit to ugent.toml), as the spec says; one inside the workspace
        that was skipped as untrusted is, so an approval loads it (``Discovery.pollable``).
        """
        with self._lock:
            if self._path is not None or not self._pollable:
                return False
        found = self._discover()
        self._log_warnings(found)
        if found.path is None:
            return False
        self._first_load(found.path)
        return True

    def check_changed_once(self) -> bool:
        """Reload when the watched file's stat differs from the last load (a missed-event safety net)."""
        path = self.path
        if path is None:
            return False
        with self._lock:
            loaded = self._loaded_sig
        if file_signature(path) == loaded:
            return False
        return self.reload_once()

    def check_config_once(self) -> bool:
        """Look again at what says where the rules file is (ugent.toml); True when the file changed.

        The base holder has no such source: its ``discover`` is fixed. Subclasses re-discover here.
        """
        return False

    def reload(self) -> bool:
        """Manual reload (the REPL's ``/reload``): pick up a new file or re-read the watched one."""
        if self.path is None:
            return self.check_discovery_once()
        return self.reload_once()

    # -- thread --------------------------------------------------------------

    def start_watching(self) -> threading.Thread:
        """Start the watcher thread (call :meth:`start` first). Idempotent."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self._thread
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ugent-rules-watch", daemon=True)
            self._thread.start()
            return self._thread

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the watcher thread and wait for it to end."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            path = self.path
            try:
                if path is None:
                    if not self.check_config_once():
                        self.check_discovery_once()
                    if self.path is None:
                        self._stop.wait(self.poll_interval)
                    continue
                self._watch(path)
            except Exception:  # the watcher must outlive a vanished directory, a notify error, a database
                # that is down while discovery asks it whether a workspace is trusted: it looks again later
                logger.exception("rule engine watch error (path=%s); retrying", path)
                self._stop.wait(self.poll_interval)

    def _watch(self, path: Path) -> None:
        name = path.name

        def only_the_file(_change: watchfiles.Change, changed: str) -> bool:
            return os.path.basename(changed) == name

        for changes in watchfiles.watch(
            path.parent,
            watch_filter=only_the_file,
            debounce=self.debounce_ms,
            stop_event=self._stop,
            rust_timeout=max(100, int(self.poll_interval * 1000)),
            yield_on_timeout=True,
            recursive=False,
            raise_interrupt=False,
        ):
            if self._stop.is_set():
                return
            if changes:
                self.reload_once()
            elif not self.check_config_once():
                self.check_changed_once()
            if self.path != path:
                return  # ugent.toml named another file (or none): watch that instead
