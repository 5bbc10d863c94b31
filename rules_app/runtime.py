"""One rule engine per process: the rules file's holder, the admin rules, and routing.

Each process that handles messages (a web process, a Celery worker, rundaemon)
builds its holder lazily on first use from discovery (``UGENT_WORKSPACE``,
``ugent.toml``'s ``[rules]``, trust from the WorkspaceTrust table) and watches
the file with the watcher thread, so every process sees an edit. Each load is
recorded in the file's RuleSet row (status, count, dropped rules, last error).
Admin-owned rules are compiled per process and recompiled when a rule set's
version changes: one small query per message, no restart, no notification.

Only a process that enforces the rules writes that record (``enforce_here()``: rundaemon,
the web processes, the Celery workers, the plugin supervisor), with its pid and a heartbeat
every UGENT_RULES_HEARTBEAT_SECONDS. Any other process (``manage.py rules status``, a shell)
that reads the file reads it for itself and never overwrites the daemon's record.
An edit to ugent.toml that changes ``[rules] file`` (or ``on_error``) is picked up by the
watcher within a poll interval: the new file is loaded and watched, no restart needed.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import tomllib
from pathlib import Path
from typing import Optional

from django.db import DatabaseError, close_old_connections, connection, transaction

from rules_app import conf
from rules_app.discovery import (Discovery, discover_routing_file, discover_rules_file,
                                 is_inside, rules_on_error)
from rules_app.engine import CompiledRuleSet, LoadResult, RuleSetError, StartWorkflow, parse_rules
from rules_app.routing import (LOG_ROUTING_FAILED, LOG_ROUTING_LOADED, LOG_ROUTING_RELOAD_FAILED, RoutingError,
                               RoutingTable, load_routing_file)
from rules_app.watcher import RuleEngineHolder
from ugent_common.config import EmptyFileError
from ugent_common.filestat import file_signature

log = logging.getLogger("ugent.rules")
routing_log = logging.getLogger("ugent.routing")

#: Admin rules sort after the file's rules of the same priority.
ADMIN_INDEX_OFFSET = 1_000_000

_enforcing = False


def enforce_here() -> None:
    """This process enforces the rules on the messages it handles: it records its loads (with its
    pid and a heartbeat) in the file's RuleSet row, which the admin and /v1/ugent/status show."""
    global _enforcing
    _enforcing = True


def enforcing() -> bool:
    """True in a process that enforces the rules (and so owns the recorded status)."""
    return _enforcing


def _config_signature():
    from django.conf import settings
    path = Path(settings.UGENT_CONFIG) if settings.UGENT_CONFIG else conf.workspace() / "ugent.toml"
    return (str(path), file_signature(path))


def _is_trusted(workspace: Path) -> bool:
    from rules_app.selectors import workspace_is_trusted
    return workspace_is_trusted(workspace)


class DjangoRuleEngineHolder(RuleEngineHolder):
    """The watcher's holder, recording every load in the database and re-checking workspace trust."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.workspace: Optional[Path] = None
        self.status = "missing"
        self.last_found: Optional[Discovery] = None
        self.last_result: Optional[LoadResult] = None
        self.last_raw: Optional[list] = None
        self.record_failures = 0
        self.pending_record = False
        self.read_only = False  # a command's own read: never recorded, whatever the process
        self.config_sig = None  # ugent.toml as last read (check_config_once)
        self.last_beat = float("-inf")
        real = self._discover

        def discover_and_keep() -> Discovery:
            found = real()
            self.last_found = found
            return found

        self._discover = discover_and_keep

    @classmethod
    def from_settings(cls) -> "DjangoRuleEngineHolder":
        from rules_app.workflows import workflow_check
        from ugent_common.config import load_config
        workspace, home = conf.workspace(), conf.home()
        config_sig = _config_signature()
        on_error, warning = rules_on_error(load_config())
        if warning:
            log.warning(warning)
        # ugent.toml is read at each discovery (cached until check_config_once sees it change)
        holder = cls(lambda: discover_rules_file(workspace, load_config(), home=home, is_trusted=_is_trusted),
                     workflow_check=workflow_check, on_error=on_error,
                     poll_interval=conf.rules_poll_interval())
        holder.workspace = workspace
        holder.config_sig = config_sig
        return holder

    def check_config_once(self) -> bool:
        """ugent.toml changed: a configuration reload, which rebuilds the rules as a start does (seed 002:
        "When UGENT starts, or rebuilds its runtime after a configuration reload, a rules file it cannot read
        or parse is logged as failed to load rule set …"): the file ``[rules] file`` names now (or
        discovery's) is loaded afresh and watched, under the ``on_error`` it says now. True when it was; a
        file that is empty, or cannot be read or parsed, changes nothing (its last good tables stay)."""
        self._db_step()
        self.beat_if_due()
        sig = _config_signature()
        if sig == self.config_sig:
            return False
        self.config_sig = sig
        # read it now, whatever the recheck interval; not reset_caches(), which would forget the last good
        # [web.auth] and so run a broken file's edit with no identity rules at all
        from ugent_common.config import config_held, config_recheck, load_config
        config_recheck()
        if config_held():  # empty, or cannot be read or parsed (a write caught half-way): the last good file
            return False  # is still in force (ugent.config says so), so are the rules it gave
        on_error, warning = rules_on_error(load_config())
        found = self._discover()
        if warning:
            log.warning(warning)
        log.info("ugent.toml changed: rules file now %s (on_error = %s)", found.path or found.configured_path
                 or "none", on_error)
        self.on_error = on_error
        self.start()
        return True

    # -- loading, with what the base class does not keep ---------------------------------

    def _load(self, path: Path, *, refuse_empty: bool = False) -> CompiledRuleSet:
        self._db_step()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RuleSetError(f"{path}: cannot read rules file: {exc}") from exc
        result = parse_rules(text, source=path, workflow_check=self._workflow_check, refuse_empty=refuse_empty)
        self.last_result = result
        self.last_raw = tomllib.loads(text).get("rules", [])
        return result.ruleset

    def start(self) -> CompiledRuleSet:
        ruleset = super().start()
        if self.path is None:
            self._set_no_file_status()
        self.record()
        return ruleset

    def _set_no_file_status(self) -> None:
        found = self.last_found
        self.status = "skipped" if found is not None and found.skipped_untrusted else "missing"
        self.last_result, self.last_raw = None, []

    def _first_load(self, path: Path) -> None:
        super()._first_load(path)
        if self.last_error is None:
            self.status = "loaded"
        else:
            self.status = "closed" if self.ruleset.is_closed else "failed"
            self.last_result, self.last_raw = None, []

    def reload_once(self) -> bool:
        self._db_step()
        before = self.status
        ok = super().reload_once()
        if self.path is None:
            return ok
        if ok:
            self.status = "loaded"
        elif self.last_error is not None:
            self.status = before if before in ("failed", "closed") else "retained"
        self.record(keep_rules=not ok)
        return ok

    def check_discovery_once(self) -> bool:
        self._db_step()
        self.beat_if_due()
        before = (self.status, self.last_found.warnings if self.last_found else ())
        picked = super().check_discovery_once()
        if picked:
            self.record()
        elif self.path is None and self.last_found is not None:
            self._set_no_file_status()
            if (self.status, self.last_found.warnings) != before:
                self.record()
        return picked

    def check_changed_once(self) -> bool:
        """Also drop a workspace file whose workspace is no longer trusted (revoked)."""
        self._db_step()
        path = self.path
        if path is not None and self.workspace is not None and is_inside(path, self.workspace):
            try:
                trusted = _is_trusted(self.workspace)
            except DatabaseError:
                log.exception("workspace trust check failed; keeping the rules in force")
                trusted = True
            if not trusted:
                self.start()
                return True
        self.record_if_pending()
        self.beat_if_due()
        return super().check_changed_once()

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            connection.close()

    def _db_step(self) -> None:
        if threading.current_thread() is self._thread:
            close_old_connections()

    # -- the database record -------------------------------------------------------------

    def load_record(self, *, keep_rules: bool = False):
        from rules_app.services import LoadRecord
        found = self.last_found
        dropped = [{"rule": d.name, "reason": d.reason} for d in (self.last_result.dropped if self.last_result else [])]
        path = self.path or (found.skipped_untrusted[0] if found and found.skipped_untrusted else None) \
            or (found.configured_path if found else None)
        return LoadRecord(status=self.status, path=str(path or ""),
                          rule_count=0 if self.ruleset.is_closed else len(self.ruleset), dropped=dropped,
                          last_error=self.last_error or "", warnings=list(found.warnings if found else ()),
                          on_error=self.on_error, raw_rules=None if keep_rules else (self.last_raw or []),
                          pid=os.getpid(), host=socket.gethostname())

    def record(self, *, keep_rules: bool = False) -> None:
        """Write this load to the file's RuleSet row; never breaks the message path or the watcher.

        Only where the rules are enforced (``enforce_here``): another process's read is its own."""
        from rules_app.services import rule_set_record_load
        if not enforcing() or self.read_only:
            return
        self.last_beat = time.monotonic()
        try:
            with transaction.atomic():
                rule_set_record_load(record=self.load_record(keep_rules=keep_rules))
        except Exception:  # the record is for the operator; the rules stay in force without it
            self.record_failures += 1
            self.pending_record = True
            log.exception("could not record the rule set's load status; trying again shortly")
        else:
            self.pending_record = False

    def record_if_pending(self) -> None:
        if self.pending_record:
            self.record(keep_rules=self.status == "retained")

    def beat_due(self) -> bool:
        return enforcing() and not self.read_only and time.monotonic() - self.last_beat >= conf.rules_heartbeat_seconds()

    def beat_if_due(self) -> None:
        if self.beat_due():
            self.beat()

    def beat(self) -> None:
        """The daemon's heartbeat on its record: these rules are still in force here."""
        from rules_app.services import rule_set_heartbeat
        if not enforcing() or self.read_only:
            return
        self.last_beat = time.monotonic()
        try:
            rule_set_heartbeat(pid=os.getpid(), host=socket.gethostname())
        except Exception:  # bookkeeping: the next beat tries again
            log.warning("could not write the rule engine's heartbeat", exc_info=True)


class RoutingHolder:
    """routing.toml for this process: re-discovered at most every few seconds, reloaded when it changes."""

    def __init__(self, discover, *, recheck: float):
        self._discover = discover
        self.recheck = recheck
        self._lock = threading.Lock()
        self._checked = float("-inf")
        self._sig = None
        self._warned: tuple = ()
        self.table = RoutingTable()
        self.path: Optional[Path] = None
        self.last_error: Optional[str] = None

    def current(self) -> RoutingTable:
        with self._lock:
            if time.monotonic() - self._checked >= self.recheck:
                self._checked = time.monotonic()
                self._refresh()
            return self.table

    def _refresh(self) -> None:
        found = self._discover()
        if found.warnings != self._warned:
            for w in found.warnings:
                if w not in self._warned:
                    routing_log.warning(w)
            self._warned = found.warnings
        sig = (found.path, file_signature(found.path) if found.path else None)
        if sig == self._sig:
            return
        # the file read before, changed: one that cannot be read or parsed, or is left blank or with comments
        # alone, is more likely a write caught half-way than a wish to drop every route (`routes = []` says
        # that), so the routes in force stay, as a watched rules file's do; a file found anew (at start, or
        # another location) fails open, and may be empty: no routes
        reload = found.path is not None and found.path == self.path
        self._sig, self.path = sig, found.path
        if found.path is None:
            self.table, self.last_error = RoutingTable(), None
            return
        try:
            self.table = load_routing_file(found.path, refuse_empty=reload)
        except (EmptyFileError, RoutingError) as exc:
            self.last_error = exc.held if isinstance(exc, EmptyFileError) else str(exc)
            if reload:
                routing_log.warning("%s (error=%s)", LOG_ROUTING_RELOAD_FAILED, self.last_error)
            else:
                routing_log.error("%s (error=%s)", LOG_ROUTING_FAILED, self.last_error)
                self.table = RoutingTable()
        else:
            routing_log.info(LOG_ROUTING_LOADED, len(self.table))
            self.last_error = None


class Runtime:
    """This process's rule engine: the file holder, the compiled admin rules, routing."""

    def __init__(self):
        self._lock = threading.RLock()
        self.watch: Optional[bool] = None  # None: UGENT_RULES_WATCH; commands set False
        self.holder: Optional[DjangoRuleEngineHolder] = None
        self.routing: Optional[RoutingHolder] = None
        self._admin_key = None
        self._admin_rules: tuple = ()
        self._combined_key = None
        self._combined = CompiledRuleSet.empty()

    def ensure(self) -> DjangoRuleEngineHolder:
        with self._lock:
            if self.holder is None:
                holder = DjangoRuleEngineHolder.from_settings()
                holder.start()
                if conf.rules_watch() if self.watch is None else self.watch:
                    holder.start_watching()
                self.holder = holder
            return self.holder

    def routing_table(self) -> RoutingTable:
        with self._lock:
            if self.routing is None:
                from ugent_common.config import load_config
                workspace, home, config = conf.workspace(), conf.home(), load_config()
                self.routing = RoutingHolder(
                    lambda: discover_routing_file(workspace, config, home=home, is_trusted=_is_trusted),
                    recheck=conf.routing_recheck_seconds())
            routing = self.routing
        return routing.current()

    def _admin_ruleset_rules(self, versions) -> tuple:
        from rules_app.workflows import workflow_check
        from rules_app.selectors import admin_rules
        key = tuple(v for v in versions if v[1] == "admin")
        if key == self._admin_key:
            return self._admin_rules
        compiled = []
        for i, rule in enumerate(admin_rules()):
            try:
                engine_rule, problem = rule.compile(ADMIN_INDEX_OFFSET + i)
            except RuleSetError as exc:  # saved past validation (raw SQL, an old row): drop, don't refuse all
                problem = str(exc)
            else:
                if problem is None and isinstance(engine_rule.decision, StartWorkflow):
                    problem = workflow_check(engine_rule.decision.workflow)
            if problem:
                log.error("rule dropped (rule=%s, reason=%s)", rule.name, problem)
                continue
            compiled.append(engine_rule)
        self._admin_key, self._admin_rules = key, tuple(compiled)
        return self._admin_rules

    def ruleset(self) -> CompiledRuleSet:
        """The rules in force in this process now: the file's, then the admin's."""
        from rules_app.selectors import rule_set_versions
        holder = self.ensure()
        versions = rule_set_versions()
        if not enforcing():
            pass  # a process that only reads the rules records nothing
        elif not any(v[1] == "file" for v in versions):
            holder.record()  # the row went away (a test flush, a manual delete): say it again
        else:
            holder.record_if_pending()
            if holder.beat_due():
                holder.last_beat = time.monotonic()
                transaction.on_commit(holder.beat)  # after the message's own transaction, never inside it
        file_rules = holder.ruleset
        with self._lock:
            admin = self._admin_ruleset_rules(versions)
            # the file's rule set itself in the key, not its id(): a reloaded set may be built at the address of
            # one freed since, and an id() key would then hand out the old combination (stale rules)
            key = (file_rules, self._admin_key)
            if self._combined_key is None or key[0] is not self._combined_key[0] or key[1] != self._combined_key[1]:
                if file_rules.is_closed:
                    self._combined = file_rules
                else:
                    self._combined = CompiledRuleSet((*file_rules.rules, *admin), source=file_rules.source)
                self._combined_key = key
            return self._combined

    def reset(self) -> None:
        """Stop the watcher and forget everything (tests, and a settings change)."""
        with self._lock:
            holder, self.holder = self.holder, None
            self.routing = None
            self.watch = None
            self._admin_key, self._admin_rules = None, ()
            self._combined_key, self._combined = None, CompiledRuleSet.empty()
        if holder is not None:
            holder.stop()
        from ugent_common.config import reset_caches
        reset_caches()


runtime = Runtime()


def fresh_read() -> DjangoRuleEngineHolder:
    """The rules file as this process finds and reads it now, for itself: nothing is recorded or watched."""
    holder = DjangoRuleEngineHolder.from_settings()
    holder.read_only = True
    holder.start()
    return holder


def recorded_ruleset() -> CompiledRuleSet:
    """The rules the daemon recorded as in force: its mirror of the file's rules, then the admin's."""
    from rules_app.models import LoadStatus
    from rules_app.selectors import admin_rules, file_rule_set
    row = file_rule_set()
    if row is not None and row.status == LoadStatus.CLOSED:
        return CompiledRuleSet.closed(row.last_error, source=row.path)
    compiled = []
    file_rules = [] if row is None else [r for r in row.rules.order_by("position", "id") if not r.dropped_reason]
    for offset, rules in ((0, file_rules), (ADMIN_INDEX_OFFSET, admin_rules())):
        for i, rule in enumerate(rules):
            try:
                engine_rule, problem = rule.compile(offset + i)
            except RuleSetError:
                continue
            if problem is None:
                compiled.append(engine_rule)
    return CompiledRuleSet(tuple(compiled), source=row.path if row is not None else None)


def status_section() -> dict:
    """The "rules" section of GET /v1/ugent/status: are rules in force, how many, the last load error."""
    from rules_app.models import RuleSource
    from rules_app.models import RuleSet as RuleSetRow
    from rules_app.selectors import daemon_heartbeat
    ruleset = runtime.ruleset()
    holder = runtime.ensure()
    rows = list(RuleSetRow.objects.order_by("id"))
    file_row = next((r for r in rows if r.source == RuleSource.FILE), None)
    admin_rows = [r for r in rows if r.source == RuleSource.ADMIN]
    table = runtime.routing_table()
    routing = runtime.routing
    beat = daemon_heartbeat(file_row)
    return {
        # "daemon": this process enforces these rules and wrote the file's record; "this_process":
        # it read the file for itself (its figures are its own), the record is another's
        "source": "daemon" if enforcing() else "this_process",
        "pid": os.getpid(),
        "in_force": bool(len(ruleset)) or ruleset.is_closed,
        "rules": len(ruleset),
        "refusing_all": ruleset.is_closed,
        "on_error": holder.on_error,
        "watching": holder.watching,
        "file": None if file_row is None else {
            "path": file_row.path or None,
            "status": file_row.status,
            "rules": file_row.rule_count,
            "dropped": file_row.dropped,
            "last_error": file_row.last_error or None,
            "warnings": file_row.warnings,
            "loaded_at": file_row.loaded_at.isoformat() if file_row.loaded_at else None,
            "pid": file_row.pid,
            "host": file_row.host or None,
            "heartbeat_at": file_row.heartbeat_at.isoformat() if file_row.heartbeat_at else None,
            "heartbeat_age": beat.age,
            "daemon_alive": beat.alive,
        },
        "admin": {"rule_sets": len(admin_rows), "rules": sum(r.rule_count for r in admin_rows),
                  "dropped": [d for r in admin_rows for d in r.dropped]},
        "routing": {"path": str(routing.path) if routing and routing.path else None, "routes": len(table),
                    "last_error": routing.last_error if routing else None},
    }
