"""Every management command that reads the database, run before the first `migrate`: one line saying to
migrate and a non-zero exit, never a "no such table" traceback (only `firewall` said so; ugent_common.dbconn).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs each command as manage.py would (ManagementUtility: a CommandError is one line and exit 1, anything
# else propagates, which the interpreter prints as a traceback), in one process so Django starts once.
DRIVER = r"""
import contextlib, io, json, signal, sys, traceback
import django
django.setup()
from django.core.management import ManagementUtility

class Hung(Exception):
    pass

ALARM = int(sys.argv[2]) if len(sys.argv) > 2 else 20

def hung(*_):
    raise Hung(f"still running after {ALARM} s")

signal.signal(signal.SIGALRM, hung)
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    code = 0
    signal.alarm(ALARM)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            ManagementUtility(["manage.py", *argv]).execute()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        err.write(traceback.format_exc())
        code = 1
    finally:
        signal.alarm(0)
    results.append({"argv": argv, "code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""


def test_every_command_that_reads_the_database_says_to_migrate_in_one_line(tmp_path):
    var, ws = tmp_path / "var", tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "cron.toml").write_text("enabled = true\n")
    (tmp_path / "rules.toml").write_text('rules = []\n')
    (tmp_path / "ugent.toml").write_text("[web.auth]\n")
    (tmp_path / "plugins.toml").write_text("schema_version = 1\n")
    (tmp_path / "workflow.toml").write_text('[[rules]]\nname = "digest"\nmatch = { always = true }\n'
                                            '[rules.decision.StartWorkflow]\nworkflow = "digest"\n')
    # a file's dry run reads no rows unless a StartWorkflow rule is checked against the cron jobs
    free = [["rules", "test", "hello", "--rules", str(tmp_path / "rules.toml")]]
    commands = [
        ["cron", "import", str(tmp_path / "cron.toml")], ["cron", "export"], ["cron", "status"],
        ["cron", "run", "nightly", "--no-wait"],
        ["rules", "status"], ["rules", "test", "hello"], ["rules", "import", str(tmp_path / "rules.toml")],
        ["rules", "export"], ["rules", "test", "hello", "--rules", str(tmp_path / "workflow.toml")],
        ["identity", "import", str(tmp_path / "ugent.toml")], ["identity", "export"],
        ["plugins", "import", str(tmp_path / "plugins.toml")], ["plugins", "export"], ["plugins", "status"],
        ["plugins", "migrate", "--global-file", str(tmp_path / "plugins.toml")],
        ["plugins", "setup", "--no-input", "--global-file", str(tmp_path / "plugins.toml")],
        ["firewall", "workspace", "status"],
        ["runsupervisor"],
        ["rundaemon", "--no-migrate", "--port", "0"],  # last: it pins this process's threads
    ]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_VAR_DIR=str(var), UGENT_WORKSPACE=str(ws), UGENT_CPU_AFFINITY="off",
               DJANGO_SETTINGS_MODULE="ugent_site.settings")
    out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(free + commands)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["argv"] for r in results] == free + commands
    assert [(r["code"], r["stderr"].strip().splitlines()) for r in results[:len(free)]] == [
        (0, [f"testing a fresh read of {tmp_path / 'rules.toml'} (--rules), not the daemon's rules"])]
    results = results[len(free):]
    assert not var.joinpath("web_api_key").exists()  # rundaemon --no-migrate checks the tables before it writes
    wrong = []
    for r in results:
        lines = r["stderr"].strip().splitlines()
        if (r["code"] != 1 or len(lines) != 1 or not lines[0].startswith("CommandError: the database has no ")
                or not lines[0].endswith(" table yet: run `python manage.py migrate` first")):
            wrong.append((" ".join(r["argv"]), r["code"], lines[-3:]))
    assert not wrong, "\n".join(map(str, wrong))


@pytest.mark.django_db
def test_a_migrated_database_has_every_table_the_commands_ask_for():
    """The check itself must not refuse a migrated database (rundaemon --no-migrate asks for every model's)."""
    from django.apps import apps
    from ugent_common.dbconn import tables_required
    tables_required(*apps.get_models())
    tables_required("cron_app", "rules_app", "plugins_app", "channels_app")


def test_a_database_that_cannot_be_reached_is_one_line_and_the_supervisor_waits_for_it(tmp_path):
    """PostgreSQL not up (nothing listens on its port): a command says so in one line; runsupervisor, started at boot
    beside the database, goes on and waits for it (its loop keeps the current workers) rather than exiting."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_VAR_DIR=str(tmp_path / "var"), UGENT_CPU_AFFINITY="off", DJANGO_SETTINGS_MODULE="ugent_site.settings",
               DATABASE_URL="postgres://root@127.0.0.1:1/nowhere")
    commands = [["cron", "status"], ["runsupervisor"]]
    out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands), "5"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cron, supervisor = json.loads(out.stdout.strip().splitlines()[-1])
    lines = cron["stderr"].strip().splitlines()
    assert cron["code"] == 1 and len(lines) == 1, lines[-5:]
    assert lines[0].startswith("CommandError: cannot reach the database: ") and "127.0.0.1" in lines[0], lines
    assert supervisor["code"] == 1 and "Hung: still running after 5 s" in supervisor["stderr"], supervisor["stderr"][-2000:]
