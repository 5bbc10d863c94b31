"""The scheduled_jobs toolbox: a turn lists and starts opted-in cron jobs for its user, and a turn whose
tools are narrowed is not offered them (seed 000: "not offered scheduled jobs, which would run without them")."""
from __future__ import annotations

import json

import pytest

from channels_app import tools as hub_tools
from channels_app.models import ToolCall
from cron_app.messages import WORKFLOW_COULD_NOT_START, WORKFLOW_STARTED_WEB
from cron_app.models import CronRun
from tests.cron_app.conftest import import_cron
from tests.support import http, scripted
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = '''
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
schedule = "0 3 * * *"

[[jobs.tasks]]
id = "report"
prompt = "Write the nightly report."
'''


def chat(who: dict, text: str, **extra):
    resp = http.chat(who, text, **extra)
    assert resp.status_code == 200, resp.content
    return resp.json()["choices"][0]["message"]["content"]


@pytest.fixture
def jobs(tcast, tools_toml):
    tools_toml('[tools]\nenabled = ["scheduled_jobs", "testing"]\n')
    import_cron(JOBS)
    scripted.CALLS.clear()
    return tcast


def test_an_unrestricted_turn_lists_only_the_jobs_a_message_may_start(jobs):
    text = chat(jobs.alice, "script:call=list_scheduled_jobs{}|result", conversation_id="s1")
    assert json.loads(text) == {"jobs": [{"name": "digest", "schedule": None}]}
    assert {"list_scheduled_jobs", "start_scheduled_job"} <= set(scripted.CALLS[0]["tools"])


def test_a_turn_starts_an_opted_in_job_for_its_user_with_its_limits(jobs):
    text = chat(jobs.alice, 'script:call=start_scheduled_job{"job": "digest", "input": "my unread mail"}|result',
                conversation_id="s2", ugent_disable_memory_write=True)
    assert json.loads(text) == {"result": WORKFLOW_STARTED_WEB.format(workflow="digest")}
    run = CronRun.objects.get()
    assert (run.job_name, run.trigger, run.acts_for.key) == ("digest", "tool", "web:alice")
    assert run.message == "my unread mail"
    assert run.limits["disable_memory_write"] is True
    assert ToolCall.objects.get(name="start_scheduled_job").state == "done"


def test_a_job_that_does_not_opt_in_is_refused_and_starts_nothing(jobs):
    text = chat(jobs.alice, 'script:call=start_scheduled_job{"job": "nightly"}|result', conversation_id="s3")
    assert json.loads(text) == {"result": WORKFLOW_COULD_NOT_START.format(
        workflow="nightly", reason="cron job 'nightly' does not set rule_trigger = true")}
    assert not CronRun.objects.exists()


@pytest.mark.parametrize("limits", [{"ugent_allowed_tools": ["echo", "start_scheduled_job"]},
                                    {"ugent_denied_tools": ["noop"]}])
def test_a_narrowed_turn_is_not_offered_scheduled_jobs_even_when_it_names_them(jobs, limits):
    text = chat(jobs.alice, 'script:call=start_scheduled_job{"job": "digest"}|result', conversation_id="s4",
                **limits)
    offered = scripted.CALLS[0]["tools"]
    assert "start_scheduled_job" not in offered and "list_scheduled_jobs" not in offered
    assert offered  # the turn still has tools: only scheduling is withheld
    assert "no tool named 'start_scheduled_job' is offered to this turn" in text
    assert not CronRun.objects.exists()


def test_the_scheduling_tools_are_the_ones_narrowing_removes():
    assert {"list_scheduled_jobs", "start_scheduled_job"} <= hub_tools.SCHEDULING_TOOLS
    names = ["echo", "start_scheduled_job", "list_scheduled_jobs"]
    assert hub_tools.tools_narrow(names, allowed=None, denied=[]) == names
    assert hub_tools.tools_narrow(names, allowed=None, denied=["x"]) == ["echo"]
