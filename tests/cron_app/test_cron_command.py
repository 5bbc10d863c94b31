"""`manage.py cron import|export|run|status`, and each schedule's PeriodicTask kept in step with its row."""
from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django_celery_beat.models import PeriodicTask, PeriodicTasks

from cron_app.models import CronDestination, CronJob, CronRun, CronSettings, CronTask
from cron_app.tomlio import CronConfigError, parse_cron_toml
from tests.cron_app.conftest import SEED_CRON_TOML

pytestmark = pytest.mark.django_db(transaction=True)

FULL = '''
enabled = true

[[jobs]]
id = "digest"
enabled = true
rule_trigger = true

[[jobs.tasks]]
id = "summarise"
prompt = "Summarise what the sender asked for, in one line."

[[jobs]]
id = "nightly"
enabled = true
rule_trigger = false
schedule = "30 2 * * 1-5"
timezone = "Europe/Paris"
overlap = "queue"
max_concurrent_runs = 2
catch_up = "none"

[[jobs.tasks]]
id = "collect"
prompt = """Collect yesterday's tickets.
Group them by "team"."""
model = "scripted"

[[jobs.tasks]]
id = "write"
prompt = "Write the report."

[[jobs.destinations]]
channel = "slack"
conversation = "C0123"

[[jobs.destinations]]
channel = "web"
conversation = "ops-reports"
'''


def run_cmd(*args) -> str:
    out = io.StringIO()
    call_command("cron", *args, stdout=out)
    return out.getvalue()


def write(tmp_path, text, name="cron.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_import_then_export_round_trips(tcast, tmp_path):
    assert "Imported 2 cron job(s)" in run_cmd("import", write(tmp_path, FULL))
    exported = run_cmd("export")
    assert parse_cron_toml(exported) == parse_cron_toml(FULL)
    nightly = CronJob.objects.get(name="nightly")
    assert (nightly.overlap, nightly.max_concurrent_runs, nightly.catch_up, nightly.timezone) == (
        "queue", 2, "none", "Europe/Paris")
    assert list(nightly.tasks.values_list("task_id", flat=True)) == ["collect", "write"]
    assert list(nightly.destinations.values_list("channel", "conversation")) == [
        ("slack", "C0123"), ("web", "ops-reports")]
    # importing the export changes nothing: same rows, same PeriodicTask
    ids = (set(CronJob.objects.values_list("pk", flat=True)), set(CronTask.objects.values_list("pk", flat=True)),
           PeriodicTask.objects.get(name="cron job nightly").pk)
    run_cmd("import", write(tmp_path, exported, "again.toml"))
    assert ids == (set(CronJob.objects.values_list("pk", flat=True)),
                   set(CronTask.objects.values_list("pk", flat=True)),
                   PeriodicTask.objects.get(name="cron job nightly").pk)
    assert run_cmd("export") == exported


def test_the_seed_file_gets_its_defaults(tcast, tmp_path):
    run_cmd("import", write(tmp_path, SEED_CRON_TOML))
    job = CronJob.objects.get()
    assert (job.name, job.enabled, job.rule_trigger, job.schedule, job.overlap, job.max_concurrent_runs,
            job.catch_up) == ("digest", True, True, "", "skip", 1, "once")
    assert job.periodic_task is None  # no schedule: only a rule (or an operator) starts it


def test_a_scheduled_job_becomes_a_periodic_task_updated_in_place(tcast, tmp_path):
    run_cmd("import", write(tmp_path, FULL))
    pt = PeriodicTask.objects.get(name="cron job nightly")
    assert pt.task == "cron_app.tasks.cron_fire" and pt.kwargs == '{"job": "nightly"}' and pt.enabled
    assert (pt.crontab.minute, pt.crontab.hour, pt.crontab.day_of_week, str(pt.crontab.timezone)) == (
        "30", "2", "1-5", "Europe/Paris")
    assert CronJob.objects.get(name="nightly").periodic_task_id == pt.pk
    before = PeriodicTasks.last_change()
    run_cmd("import", write(tmp_path, FULL.replace('"30 2 * * 1-5"', '"15 4 * * *"'), "b.toml"))
    moved = PeriodicTask.objects.get(name="cron job nightly")
    assert moved.pk == pt.pk and (moved.crontab.minute, moved.crontab.hour) == ("15", "4")
    assert PeriodicTasks.last_change() > before  # beat is told to reload
    # without a schedule it is disabled, not deleted; cron switched off disables every schedule
    run_cmd("import", write(tmp_path, FULL.replace('schedule = "30 2 * * 1-5"\n', ""), "c.toml"))
    assert not PeriodicTask.objects.get(pk=pt.pk).enabled
    run_cmd("import", write(tmp_path, FULL.replace("enabled = true\n\n[[jobs]]", "enabled = false\n\n[[jobs]]", 1),
                            "d.toml"))
    assert CronSettings.objects.get().enabled is False and not PeriodicTask.objects.get(pk=pt.pk).enabled


def test_a_job_the_file_no_longer_names_is_removed_with_its_periodic_task(tcast, tmp_path):
    run_cmd("import", write(tmp_path, FULL))
    out = run_cmd("import", write(tmp_path, SEED_CRON_TOML, "seed.toml"))
    assert "removed 1" in out
    assert list(CronJob.objects.values_list("name", flat=True)) == ["digest"]
    assert not PeriodicTask.objects.filter(name="cron job nightly").exists()


@pytest.mark.parametrize("text, message", [
    ("[[jobs]]\nid = 'a'\nschedule = '* * *'\n", "jobs[0] (a).schedule: '* * *' is not a five-field crontab"),
    ("[[jobs]]\nid = 'a'\nschedule = '61 * * * *'\n", "jobs[0] (a).schedule: '61 * * * *' is not a valid crontab"),
    ("[[jobs]]\nid = 'a'\ntimezone = 'Mars/Base'\n", "jobs[0] (a).timezone: 'Mars/Base' is not a known IANA"),
    ("[[jobs]]\nid = 'a'\noverlap = 'sometimes'\n", "jobs[0] (a).overlap: 'sometimes' is not one of skip, queue, allow"),
    ("[[jobs]]\nid = 'a'\ncatch_up = 'all'\n", "jobs[0] (a).catch_up: 'all' is not one of once, none"),
    ("[[jobs]]\nid = 'a'\nmax_concurrent_runs = 0\n", "jobs[0] (a).max_concurrent_runs: must be at least 1"),
    ("[[jobs]]\nid = 'a'\n[[jobs.tasks]]\nid = 't'\n", "jobs[0] (a).tasks[0] (t): missing field `prompt`"),
    ("[[jobs]]\nid = 'a'\n[[jobs]]\nid = 'a'\n", "jobs[1] (a).id: 'a' is used twice"),
    ("[[jobs]]\nid = 'a'\nschedul = '* * * * *'\n", "jobs[0] (a).schedul: unknown field"),
    ("[[jobs]]\nid = 'a'\n[[jobs.destinations]]\nchannel = 'slack'\n",
     "jobs[0] (a).destinations[0]: missing field `conversation`"),
    ("enabled = 'yes'\n", "enabled: expected a boolean"),
    ("[[jobs]\n", "cron.toml does not parse"),
])
def test_a_bad_file_is_refused_with_a_clear_error_and_changes_nothing(tcast, tmp_path, text, message):
    run_cmd("import", write(tmp_path, SEED_CRON_TOML, "seed.toml"))
    with pytest.raises(CommandError) as err:
        run_cmd("import", write(tmp_path, text))
    assert message in str(err.value) and "nothing was changed" in str(err.value)
    assert list(CronJob.objects.values_list("name", flat=True)) == ["digest"]


@pytest.mark.parametrize("empty", ["", "  \n", "# the cron jobs\n"], ids=["nothing", "blank", "comments-alone"])
def test_an_empty_file_is_refused_and_changes_nothing(tcast, tmp_path, empty):
    """docs/cron.md: "A refused file changes nothing, and neither does an empty one": an import of a file
    caught half-way through a write must not delete every job."""
    run_cmd("import", write(tmp_path, FULL))
    with pytest.raises(CommandError) as err:
        run_cmd("import", write(tmp_path, empty, "empty.toml"))
    assert "the file is empty; nothing was changed" in str(err.value) and "`enabled = true` alone" in str(err.value)
    assert sorted(CronJob.objects.values_list("name", flat=True)) == ["digest", "nightly"]
    assert PeriodicTask.objects.filter(name="cron job nightly").exists()


def test_a_file_that_says_enabled_alone_removes_every_job(tcast, tmp_path):
    run_cmd("import", write(tmp_path, FULL))
    assert "removed 2" in run_cmd("import", write(tmp_path, "enabled = true\n", "none.toml"))
    assert not CronJob.objects.exists()


def test_cron_run_runs_the_job_here_and_prints_its_result(tcast, tmp_path):
    run_cmd("import", write(tmp_path, '[[jobs]]\nid = "hello"\n[[jobs.tasks]]\nid = "t"\nprompt = "script:answer=hi there"\n'))
    out = run_cmd("run", "hello")
    assert "completed" in out and "hi there" in out
    assert CronRun.objects.get().trigger == "manual"
    with pytest.raises(CommandError, match="there is no cron job 'nope'"):
        run_cmd("run", "nope")


def test_cron_status_lists_the_jobs(tcast, tmp_path):
    run_cmd("import", write(tmp_path, FULL))
    out = run_cmd("status")
    assert out.startswith("cron: running; 0 active run(s)")
    assert "nightly: enabled, 30 2 * * 1-5 (Europe/Paris)" in out and "digest: enabled, no schedule" in out


def test_the_status_page_has_a_cron_section(tcast, tmp_path):
    from django.test import Client
    run_cmd("import", write(tmp_path, SEED_CRON_TOML))
    resp = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"])
    assert resp.status_code == 200
    cron = resp.json()["status"]["cron"]
    assert cron["running"] is True and cron["jobs"][0]["id"] == "digest"


def test_parse_refuses_a_non_table_job():
    with pytest.raises(CronConfigError, match="jobs: expected an array, found integer"):
        parse_cron_toml("jobs = 3\n")


def test_destinations_keep_their_order(tcast, tmp_path):
    run_cmd("import", write(tmp_path, FULL))
    assert list(CronDestination.objects.filter(job__name="nightly").values_list("position", flat=True)) == [0, 1]
