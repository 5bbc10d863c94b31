"""Cron jobs from the command line.

    python manage.py cron import [FILE]      # cron.toml -> rows (FILE defaults to UGENT_CRON_FILE)
    python manage.py cron export [-o FILE]   # rows -> cron.toml (stdout by default)
    python manage.py cron run JOB            # run a job now, here, and print its result
    python manage.py cron status             # the switch, the jobs, their last runs
"""
from __future__ import annotations

import json
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from cron_app import conf


class Command(BaseCommand):
    help = "Import, export, run and inspect cron jobs (cron.toml)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        imp = sub.add_parser("import", help="Load cron.toml into the database.")
        imp.add_argument("file", nargs="?", default=None)
        exp = sub.add_parser("export", help="Write the jobs out as cron.toml.")
        exp.add_argument("-o", "--output", default=None)
        run = sub.add_parser("run", help="Run a job now and wait for its result.")
        run.add_argument("job")
        run.add_argument("--no-wait", action="store_true", help="Queue the run and return.")
        st = sub.add_parser("status", help="Show cron's switch, jobs and last runs.")
        st.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        return getattr(self, f"do_{opts['action']}")(opts)

    def do_import(self, opts):
        from cron_app.services import cron_config_import
        from cron_app.tomlio import CronConfigError, parse_cron_toml
        path = opts["file"] or conf.CRON_FILE
        if not path:
            raise CommandError("Name the cron.toml to import (or set UGENT_CRON_FILE).")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}")
        try:
            config = parse_cron_toml(text)
        except CronConfigError as exc:
            raise CommandError(f"{path}: {exc}; nothing was changed")
        counts = cron_config_import(config=config)
        self.stdout.write(f"Imported {counts['jobs']} cron job(s) from {path}"
                          + (f"; removed {counts['removed']}" if counts["removed"] else "") + ".")

    def do_export(self, opts):
        from cron_app.services import cron_config_export
        from cron_app.tomlio import render_cron_toml
        text = render_cron_toml(cron_config_export())
        if opts["output"]:
            with open(opts["output"], "w", encoding="utf-8") as fh:
                fh.write(text)
            self.stdout.write(f"Wrote {opts['output']}.")
        else:
            self.stdout.write(text, ending="")

    def do_run(self, opts):
        from cron_app.models import FINAL_RUN_STATES
        from cron_app.services import CronError, cron_run_manual
        from celery import current_app as app  # the project's app (ugent_site wires it)
        # embedded mode: no worker in this process shares the daemon's in-process broker, so run here
        eager = settings.UGENT_MODE == "embedded" and not opts["no_wait"]
        before = app.conf.task_always_eager
        app.conf.task_always_eager = before or eager
        try:
            run = cron_run_manual(job_name=opts["job"])
        except CronError as exc:
            raise CommandError(str(exc))
        finally:
            app.conf.task_always_eager = before
        if opts["no_wait"]:
            self.stdout.write(f"Run #{run.pk} of '{run.job_name}' is {run.state}.")
            return
        while True:
            run.refresh_from_db()
            if run.state in FINAL_RUN_STATES:
                break
            time.sleep(0.2)
        self.stdout.write(f"Run #{run.pk} of '{run.job_name}': {run.state}")
        if run.error:
            self.stdout.write(f"reason: {run.error}")
        if run.result:
            self.stdout.write(run.result)
        if run.state != "completed":
            raise CommandError(f"the run ended {run.state}")

    def do_status(self, opts):
        from cron_app.selectors import cron_active_runs_count, cron_jobs_overview
        from cron_app.services import cron_running
        data = {"running": cron_running(), "active_runs": cron_active_runs_count(), "jobs": cron_jobs_overview()}
        if opts["json"]:
            self.stdout.write(json.dumps(data, indent=2))
            return
        self.stdout.write(f"cron: {'running' if data['running'] else 'not running'}; "
                          f"{data['active_runs']} active run(s)")
        for job in data["jobs"]:
            how = job["schedule"] + (f" ({job['timezone']})" if job["timezone"] else "") if job["schedule"] \
                else "no schedule"
            last = job["last_run"]
            last_text = f"last run #{last['id']} {last['trigger']} {last['state']}" if last else "never run"
            self.stdout.write(f"  {job['id']}: {'enabled' if job['enabled'] else 'disabled'}, {how}, "
                              f"rule_trigger={'true' if job['rule_trigger'] else 'false'}, "
                              f"overlap={job['overlap']}, active={job['active_runs']}, {last_text}")
