"""StartWorkflow against the real cron room (rules_app.workflows → cron_app.services, imported directly:
an interface that moves fails here loudly instead of skipping)."""
from __future__ import annotations

from cron_app.messages import WORKFLOW_STARTED_WEB
from cron_app.services import rule_trigger_reason, workflow_start  # noqa: F401 - the interface rules call
from tests.rules_app.conftest import answer
from tests.support.http import chat

RULES = '''
[[rules]]
name = "digest"
priority = 50
match = { field = "text", starts_with = "digest" }

[rules.decision.StartWorkflow]
workflow = "digest"
inject_context = true
'''


def job(**kw):
    from cron_app.models import CronJob, CronTask
    j = CronJob.objects.create(name="digest", **kw)
    CronTask.objects.create(job=j, task_id="summarise", prompt="script:answer=summary done")
    return j


def test_a_rule_starts_a_rule_triggered_cron_job(site, tcast):
    from cron_app.models import CronRun
    job(rule_trigger=True)
    site.rules(RULES)
    assert answer(chat(tcast.alice, "digest my week")) == WORKFLOW_STARTED_WEB.format(workflow="digest") == \
        "Started workflow 'digest'. Its result goes to the workflow's destinations."
    run = CronRun.objects.get()
    assert run.job_name == "digest" and run.acts_for.key == "web:alice"


def test_a_job_that_does_not_opt_in_is_dropped_as_the_rules_load(site, tcast, rules_log):
    job(rule_trigger=False)
    site.rules(RULES)
    assert answer(chat(tcast.alice, "digest")) == "echo: digest (history=0)"
    assert ("rule dropped (rule=digest, reason=workflow 'digest' is not a cron job with rule_trigger = true)"
            in rules_log.messages)


def test_a_job_that_opts_out_after_the_load_is_refused_as_the_rule_fires(site, tcast):
    from cron_app.models import CronJob, CronRun
    job(rule_trigger=True)
    site.rules(RULES)
    assert answer(chat(tcast.alice, "digest")).startswith("Started workflow 'digest'")
    CronJob.objects.update(enabled=False)
    assert answer(chat(tcast.bob, "digest")) == "Workflow 'digest' could not start: cron job 'digest' is disabled."
    assert CronRun.objects.count() == 1


def test_a_cron_jobs_own_prompts_are_not_subject_to_rules(site, tcast):
    from cron_app.models import CronRun
    job(rule_trigger=True)
    site.rules(RULES + '\n[[rules]]\nname = "web-only"\ndecision = "Ignore"\npriority = 10\n'
               'match = { not = { field = "channel", equals = "web" } }\n')
    assert answer(chat(tcast.alice, "digest")).startswith("Started workflow 'digest'")
    run = CronRun.objects.get()
    from channels_app.models import Receipt
    cron_receipts = Receipt.objects.filter(conversation__channel="cron")
    assert cron_receipts.exists()
    assert not cron_receipts.filter(answer="rule engine: message ignored").exists()
    assert run.state != "failed" or "ignored" not in (run.error or "")
