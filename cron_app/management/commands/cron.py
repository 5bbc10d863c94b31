"""Cron jobs from the command line.

    python manage.py cron import [FILE]      # cron.toml -> rows (FILE defaults to UGENT_CRON_FILE)
    python manage.py cron export [-o FILE]   # rows -> cron.toml (stdout by default)
    python manage.py cron run JOB            # run a job now, here, and print its result
    python manage.py cron status             # the switch, the jobs, their last runs
"""
from __future__ import annotations

import json
import os
import socket
import threading
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
        from ugent_common.dbconn import tables_required
        tables_required("cron_app")
        return getattr(self, f"do_{opts['action']}")(opts)

    def do_import(self, opts):
        from cron_app.services import cron_config_import, cron_file_digest
        from cron_app.tomlio import CronConfigError, parse_cron_toml
        from ugent_common.config import EmptyFileError
        path = opts["file"] or conf.CRON_FILE
        if not path:
            raise CommandError("Name the cron.toml to import (or set UGENT_CRON_FILE).")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}")
        try:
            config = parse_cron_toml(text, source=path)
        except EmptyFileError as exc:
            raise CommandError(str(exc))
        except CronConfigError as exc:
            raise CommandError(f"{path}: {exc}; nothing was changed")
        counts = cron_config_import(config=config, digest=cron_file_digest(text))
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
        from cron_app.services import CronError, cron_run_cancel, cron_run_manual
        from celery import current_app as app  # the project's app (ugent_site wires it)
        # embedded mode: no worker in this process shares the daemon's in-process broker, so run here,
        # holding the run by a lease this process renews: killed mid-way, it leaves no run behind
        eager = settings.UGENT_MODE == "embedded" and not opts["no_wait"]
        runner = f"cron run pid {os.getpid()} on {socket.gethostname()}" if eager else ""
        progress = None if opts["no_wait"] else RunProgress(self.stdout, job=opts["job"], runner=runner)
        before = app.conf.task_always_eager
        app.conf.task_always_eager = before or eager
        run = None
        try:
            if progress:
                progress.start()
            run = cron_run_manual(job_name=opts["job"], runner=runner)
            if progress and progress.run_pk is None:
                progress.run_pk = run.pk
            if opts["no_wait"]:
                self.stdout.write(f"Run #{run.pk} of '{run.job_name}' is {run.state}.")
                return
            while True:
                run.refresh_from_db()
                if run.state in FINAL_RUN_STATES:
                    break
                time.sleep(0.2)
        except CronError as exc:
            raise CommandError(str(exc))
        except KeyboardInterrupt:
            pk = run.pk if run is not None else (progress.run_pk if progress else None)
            if pk is not None and cron_run_cancel(run_pk=pk, by=runner or "cron run (interrupted)"):
                raise CommandError(f"interrupted: run #{pk} was cancelled")
            raise CommandError("interrupted")
        finally:
            app.conf.task_always_eager = before
            if progress:
                progress.stop()
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


class RunProgress(threading.Thread):
    """While `cron run` waits: prints each change of the run and its tasks as it happens, and renews
    the lease on the run this process holds (embedded mode, where the run executes here)."""

    POLL_SECONDS = 0.3

    def __init__(self, out, *, job: str, runner: str):
        super().__init__(name="cron-run-progress", daemon=True)
        self.out, self.job, self.runner = out, job, runner
        self.run_pk = None
        self.halt = threading.Event()
        self.seen: dict = {}

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)
        self.step()  # the last changes, before the command prints the result

    def run(self) -> None:
        from django.db import close_old_connections
        from cron_app import conf
        from cron_app.services import cron_runner_renew
        renewed = 0.0
        try:
            while not self.halt.wait(self.POLL_SECONDS):
                if self.runner and time.monotonic() - renewed >= conf.RUNNER_RENEW_SECS:
                    cron_runner_renew(runner=self.runner)
                    renewed = time.monotonic()
                self.step()
        finally:
            close_old_connections()

    def step(self) -> None:
        """Print what changed since the last look."""
        from channels_app.models import Turn
        from cron_app.models import FINAL_RUN_STATES, CronRun
        if self.runner:  # the run is claimed inside this process's call: found by the lease it holds
            rows = CronRun.objects.filter(runner=self.runner)
        elif self.run_pk is not None:
            rows = CronRun.objects.filter(pk=self.run_pk)
        else:
            return
        row = rows.order_by("-id").values("pk", "state", "outputs").first()
        if row is None:
            return
        self.run_pk = row["pk"]
        if self.seen.get("run") != row["state"] and row["state"] not in FINAL_RUN_STATES:
            self.seen["run"] = row["state"]
            self.out.write(f"Run #{row['pk']} of '{self.job}': {row['state']}")
        outputs = row["outputs"] or []
        live = {e["turn_id"] for e in outputs if e.get("turn_id") and e.get("state") in ("", "accepted", "running")}
        turns = dict(Turn.objects.filter(turn_id__in=live).values_list("turn_id", "state")) if live else {}
        for entry in outputs:
            # the turn's own state while it is live (the run's record of it moves only at its next step)
            state = turns.get(entry.get("turn_id")) or entry.get("state") or "submitted"
            key = ("task", entry.get("task"))
            if self.seen.get(key) != state:
                self.seen[key] = state
                turn = f" (turn {entry['turn_id']})" if entry.get("turn_id") else ""
                self.out.write(f"  task '{entry.get('task')}': {state}{turn}")
        self.out.flush()
