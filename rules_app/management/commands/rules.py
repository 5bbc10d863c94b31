"""The rule engine from the command line.

    python manage.py rules test "TEXT" [--rules FILE] [--channel C] [--source-type S]
                                [--user-id U] [--conversation-id X] [--input-mode M] [--explain]
    python manage.py rules status
    python manage.py rules import FILE [--set NAME]
    python manage.py rules export [--set NAME]

`rules test` prints `[dry-run] matched rule "NAME"` or `[dry-run] no rule matched for: "TEXT"`.
Without --rules it tests the rules this deployment runs with (the rules file found by discovery and
the admin's rules); with --rules it tests that file alone, with the same load-time checks.
"""
from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

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
        test.add_argument("--input-mode", choices=["voice", "live"])
        test.add_argument("--explain", action="store_true", help="Also say which conditions held.")
        sub.add_parser("status", help="Are rules in force, how many, and the last load error.")
        imp = sub.add_parser("import", help="Replace an admin-owned rule set with a rules.toml's rules.")
        imp.add_argument("file")
        imp.add_argument("--set", default="admin", dest="set_name")
        exp = sub.add_parser("export", help="Print a rule set as rules.toml.")
        exp.add_argument("--set", default="admin", dest="set_name")

    def handle(self, *args, **opts):
        from rules_app.runtime import runtime
        runtime.watch = False  # a command reads the rules once; it does not keep watching them
        getattr(self, f"do_{opts['action']}")(opts)

    def do_test(self, opts):
        from rules_app.workflows import workflow_check
        from rules_app.runtime import runtime
        if opts["rules"]:
            try:
                ruleset = engine.load_rules_file(opts["rules"], workflow_check=workflow_check).ruleset
            except engine.RuleSetError as exc:
                raise CommandError(f"{engine.LOG_FAILED_LOAD}: {exc}")
        else:
            ruleset = runtime.ruleset()
            if runtime.holder is not None and runtime.holder.last_error:
                self.stderr.write(f"rule set failed to load: {runtime.holder.last_error}")
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
        from rules_app.runtime import status_section
        s = status_section()
        f = s["file"] or {}
        self.stdout.write(f"rules in force: {s['rules']}" + (" (refusing every message: on_error = closed)"
                                                              if s["refusing_all"] else ""))
        self.stdout.write(f"rules file: {f.get('path') or '-'} ({f.get('status', 'missing')}, "
                          f"{f.get('rules', 0)} rules, on_error = {s['on_error']})")
        for d in f.get("dropped") or []:
            self.stdout.write(f"rule dropped (rule={d['rule']}, reason={d['reason']})")
        for w in f.get("warnings") or []:
            self.stdout.write(f"warning: {w}")
        self.stdout.write(f"last load error: {f.get('last_error') or '-'}")
        self.stdout.write(f"admin rules: {s['admin']['rules']} in {s['admin']['rule_sets']} set(s)")
        r = s["routing"]
        self.stdout.write(f"routing: {r['path'] or '-'} ({r['routes']} routes)"
                          + (f", last error: {r['last_error']}" if r["last_error"] else ""))

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
