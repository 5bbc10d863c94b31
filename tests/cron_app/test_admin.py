"""Cron in the admin: jobs, runs and the switch list and search; a job saved there keeps its beat
schedule in step; "Run now" starts a run."""
from __future__ import annotations

import pytest
from django_celery_beat.models import PeriodicTask

from cron_app import services
from cron_app.models import CronJob, CronRun, CronSettings
from tests.cron_app.conftest import SEED_CRON_TOML

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = {
    "cron_app/cronjob": {"q": "digest", "rule_trigger__exact": "1"},
    "cron_app/cronrun": {"q": "digest", "state__exact": "completed"},
    "cron_app/cronsettings": {},
}


@pytest.mark.parametrize("page,params", PAGES.items())
def test_each_model_lists_searches_and_filters(tcast, cron_toml, admin_client, page, params):
    cron_toml(SEED_CRON_TOML)
    services.cron_run_manual(job_name="digest")
    assert admin_client.get(f"/admin/{page}/").status_code == 200
    if params:
        assert admin_client.get(f"/admin/{page}/", {"q": params["q"]}).status_code == 200
        filtered = admin_client.get(f"/admin/{page}/", {k: v for k, v in params.items() if k != "q"})
        assert filtered.status_code == 200 and b"0 results" not in filtered.content
    run = CronRun.objects.get()
    assert admin_client.get(f"/admin/cron_app/cronrun/{run.pk}/change/").status_code == 200


def _job_form(**over):
    data = {"name": "nightly", "enabled": "on", "schedule": "0 3 * * *", "timezone": "", "overlap": "skip",
            "max_concurrent_runs": "1", "catch_up": "once", "position": "0",
            "tasks-TOTAL_FORMS": "1", "tasks-INITIAL_FORMS": "0", "tasks-0-task_id": "report",
            "tasks-0-prompt": "Write the report.", "tasks-0-model": "", "tasks-0-position": "0",
            "destinations-TOTAL_FORMS": "0", "destinations-INITIAL_FORMS": "0"}
    data.update(over)
    return data


def test_a_job_saved_in_the_admin_keeps_its_periodic_task_in_step(tcast, admin_client):
    resp = admin_client.post("/admin/cron_app/cronjob/add/", _job_form())
    assert resp.status_code == 302, resp.content[:2000]
    job = CronJob.objects.get(name="nightly")
    pt = PeriodicTask.objects.get(pk=job.periodic_task_id)
    assert pt.enabled and pt.crontab.hour == "3"
    task_id = job.tasks.get().pk
    resp = admin_client.post(f"/admin/cron_app/cronjob/{job.pk}/change/", _job_form(**{
        "schedule": "30 4 * * *", "tasks-INITIAL_FORMS": "1", "tasks-0-id": str(task_id), "tasks-0-job": str(job.pk)}))
    assert resp.status_code == 302
    pt2 = PeriodicTask.objects.get(name="cron job nightly")
    assert pt2.pk == pt.pk and (pt2.crontab.minute, pt2.crontab.hour) == ("30", "4")


def test_a_bad_schedule_is_refused_in_the_admin_and_changes_nothing(tcast, admin_client):
    resp = admin_client.post("/admin/cron_app/cronjob/add/", _job_form(schedule="every day"))
    assert resp.status_code == 200 and b"five-field crontab" in resp.content
    assert not CronJob.objects.exists() and not PeriodicTask.objects.exists()


def test_deleting_a_job_in_the_admin_deletes_its_periodic_task(tcast, admin_client):
    admin_client.post("/admin/cron_app/cronjob/add/", _job_form())
    job = CronJob.objects.get()
    resp = admin_client.post(f"/admin/cron_app/cronjob/{job.pk}/delete/", {"post": "yes"})
    assert resp.status_code == 302
    assert not CronJob.objects.exists() and not PeriodicTask.objects.exists()


def test_run_now_starts_a_manual_run(tcast, cron_toml, admin_client):
    cron_toml(SEED_CRON_TOML)
    job = CronJob.objects.get()
    resp = admin_client.post("/admin/cron_app/cronjob/", {"action": "run_now", "_selected_action": [job.pk]},
                             follow=True)
    assert resp.status_code == 200
    run = CronRun.objects.get()
    assert (run.trigger, run.state) == ("manual", "completed")
    assert f"run #{run.pk}".encode() in resp.content


def test_switching_cron_off_in_the_admin_disables_every_schedule(tcast, admin_client):
    admin_client.post("/admin/cron_app/cronjob/add/", _job_form())
    settings_row = CronSettings.current()
    resp = admin_client.post(f"/admin/cron_app/cronsettings/{settings_row.pk}/change/", {})  # unchecked: off
    assert resp.status_code == 302
    assert CronSettings.objects.get().enabled is False
    assert not PeriodicTask.objects.get().enabled
