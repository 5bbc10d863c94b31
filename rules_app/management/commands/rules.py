"""The rule engine from the command line.

    python manage.py rules test "TEXT" [--rules FILE] [--channel C] [--source-type S]
                                [--user-id U] [--conversation-id X] [--input-mode M] [--explain]
    python manage.py rules status
    python manage.py rules import FILE [--set NAME]
    python manage.py rules export [--set NAME]

`rules test` prints `[dry-run] matched rule "NAME"` or `[dry-run] no rule matched for: "TEXT"`.
Without --rules it tests the rules this deployment runs with: the running daemon's (its record of
the file's rules, and the admin's) when a daemon's heartbeat is fresh, else a fresh read of the file
found by discovery; with --rules it tests that file alone, with the same load-time checks.
`rules status` reports the running daemon's record, or says it read the file itself.
Either says which (on stderr for `test`, first line for `status`); neither writes the daemon's record.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from channels_app.models import INPUT_MODES
from rules_app import engine


class Command(BaseCommand):
    help = "Test, inspect, import and export rules."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        test = sub.add_parser("test", help="Which rule would decide this message?")
        test.add_argument("text")
        test.add_argument("--rules", help="Test this rules file instead of the rules in force.")
        test.add_argument("--channel", default=engine.DRY_RUN_CHANNEL)
        test.add_argument("--source-type", default=engine.DRY_RUN_SOURCE_TYPE)
        test.add_argument("--user-id")
        test.add_argument("--conversation-id")
        test.add_argument("--input-mode", choices=INPUT_MODES)
        test.add_argument("--explain", action="store_true", help="Also say which conditions held.")
        sub.add_parser("status", help="Are rules in force, how many, and the last load error.")
        imp = sub.add_parser("import", help="Replace an admin-owned rule set with a rules.toml's rules.")
        imp.add_argument("file")
        imp.add_argument("--set", default="admin", dest="set_name")
        exp = sub.add_parser("export", help="Print a rule set as rules.toml.")
        exp.add_argument("--set", default="admin", dest="set_name")

    def handle(self, *args, **opts):
        from rules_app.runtime import runtime
        from ugent_common.dbconn import tables_required
        runtime.watch = False  # a command reads the rules once; it does not keep watching them
        if not (opts["action"] == "test" and opts["rules"]):  # a file's dry run needs rows for StartWorkflow alone
            tables_required("rules_app")
        getattr(self, f"do_{opts['action']}")(opts)

    @staticmethod
    def daemon_words(beat) -> str:
        where = f"pid {beat.pid}" + (f" on {beat.host}" if beat.host else "")
        return f"the running daemon's rules ({where}, heartbeat {beat.age:g} s ago)"

    @staticmethod
    def fresh_words(path, beat) -> str:
        why = ("no daemon has recorded the rules" if beat.age is None
               else f"no daemon is running (last heartbeat {beat.age:g} s ago, pid {beat.pid})")
        return (f"a fresh read of {path or 'no rules file'} by this command (pid {os.getpid()}): {why}, "
                "so these are not rules anything enforces now")

    def do_test(self, opts):
        from rules_app.workflows import workflow_check
        from rules_app.runtime import fresh_read, recorded_ruleset
        from rules_app.selectors import daemon_heartbeat
        from ugent_common.dbconn import tables_required
        if opts["rules"]:
            def workflow_check_here(workflow):
                # the one check of a file's dry run that reads rows (the cron jobs): before `migrate`, one line
                tables_required("cron_app")
                return workflow_check(workflow)
            try:
                ruleset = engine.load_rules_file(opts["rules"], workflow_check=workflow_check_here).ruleset
            except engine.RuleSetError as exc:
                raise CommandError(f"{engine.LOG_FAILED_LOAD}: {exc}")
            self.stderr.write(f"testing a fresh read of {opts['rules']} (--rules), not the daemon's rules")
        elif (beat := daemon_heartbeat()).alive:
            ruleset = recorded_ruleset()
            self.stderr.write(f"testing {self.daemon_words(beat)}")
        else:
            holder = fresh_read()
            ruleset = holder.ruleset
            if not ruleset.is_closed:  # the file's rules as read now, then the admin's
                ruleset = engine.CompiledRuleSet((*ruleset.rules, *_admin_compiled()), source=ruleset.source)
            self.stderr.write(f"testing {self.fresh_words(holder.path, beat)}")
            if holder.last_error:
                self.stderr.write(f"rule set failed to load: {holder.last_error}")
        message = engine.MessageFacts(text=opts["text"], channel=opts["channel"] or None,
                                 source_type=opts["source_type"] or None, user_id=opts["user_id"] or None,
                                 conversation_id=opts["conversation_id"] or None,
                                 input_mode=opts["input_mode"] or None)
        explanation = ruleset.explain(message)
        match = explanation.match
        if match.rule is not None:
            self.stdout.write(engine.DRY_RUN_MATCHED.format(name=match.rule.name))
        else:
            self.stdout.write(engine.DRY_RUN_NO_MATCH.format(text=opts["text"]))
        if opts["explain"]:
            for line in explanation.lines():
                self.stdout.write(line)

    def do_status(self, opts):
        from rules_app.models import RuleSet, RuleSource
        from rules_app.runtime import fresh_read, runtime
        from rules_app.selectors import daemon_heartbeat, file_rule_set
        admin_rows = list(RuleSet.objects.filter(source=RuleSource.ADMIN))
        admin_count = sum(r.rule_count for r in admin_rows)
        row, beat = file_rule_set(), daemon_heartbeat()
        if beat.alive:
            self.stdout.write(f"reporting {self.daemon_words(beat)}")
            f = {"path": row.path, "status": row.status, "rules": row.rule_count, "dropped": row.dropped,
                 "warnings": row.warnings, "last_error": row.last_error}
            on_error, closed = row.on_error, row.status == "closed"
        else:
            holder = fresh_read()
            record = holder.load_record()
            self.stdout.write(f"reporting {self.fresh_words(record.path, beat)}")
            f = {"path": record.path, "status": record.status, "rules": record.rule_count,
                 "dropped": record.dropped, "warnings": record.warnings, "last_error": record.last_error}
            on_error, closed = holder.on_error, holder.ruleset.is_closed
        in_force = 0 if closed else f["rules"] + admin_count
        self.stdout.write(f"rules in force: {in_force}" + (" (refusing every message: on_error = closed)"
                                                           if closed else ""))
        self.stdout.write(f"rules file: {f['path'] or '-'} ({f['status']}, {f['rules']} rules, "
                          f"on_error = {on_error})")
        for d in f["dropped"] or []:
            self.stdout.write(f"rule dropped (rule={d['rule']}, reason={d['reason']})")
        for w in f["warnings"] or []:
            self.stdout.write(f"warning: {w}")
        self.stdout.write(f"last load error: {f['last_error'] or '-'}")
        self.stdout.write(f"admin rules: {admin_count} in {len(admin_rows)} set(s)")
        table = runtime.routing_table()  # routing keeps no record: always this command's own read
        routing = runtime.routing
        self.stdout.write(f"routing (a fresh read): {routing.path or '-'} ({len(table)} routes)"
                          + (f", last error: {routing.last_error}" if routing.last_error else ""))

    def do_import(self, opts):
        from rules_app import services
        path = Path(opts["file"])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}")
        try:
            result = services.rules_import(text=text, source=str(path), set_name=opts["set_name"])
        except services.RulesError as exc:
            raise CommandError(str(exc))
        for s in result.skipped:
            self.stderr.write(f"rule skipped (rule={s['rule']}, reason={s['reason']})")
        self.stdout.write(f"imported {result.imported} rules into rule set '{result.ruleset.name}'")

    def do_export(self, opts):
        from rules_app import selectors, services
        from rules_app.models import RuleSet
        ruleset = selectors.rule_set_by_name(opts["set_name"])
        if ruleset is None:
            names = ", ".join(json.dumps(n) for n in RuleSet.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"no rule set '{opts['set_name']}' (rule sets: {names})")
        self.stdout.write(services.rules_export(ruleset=ruleset))


def _admin_compiled():
    from rules_app.runtime import runtime
    from rules_app.selectors import rule_set_versions
    return runtime._admin_ruleset_rules(rule_set_versions())
