"""A rule-started workflow is held to the sender's limits when the operator's caller defaults set them
(seed 002: "whether their request asked or the operator's caller defaults did")."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app.models import CallerDefaults, Turn
from cron_app.models import CronRun
from tests.conftest import APP_KEY

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_workflow_a_federated_sender_starts_carries_the_issuers_defaults(seed_job, start_rule):
    CallerDefaults.objects.create(issuer="example-crm", disable_memory_write=True, disable_code_context=True)
    start_rule.add("digest", "digest")
    body = {"messages": [{"role": "user", "content": "digest my mail"}], "conversation_id": "w1",
            "federation_issuer": "example-crm", "federation_subject": "carol"}
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=APP_KEY)
    assert resp.status_code == 200
    run = CronRun.objects.get()
    assert run.acts_for.key == "fed:example-crm:carol"
    assert run.limits["disable_memory_write"] is True and run.limits["disable_code_context"] is True
    assert run.limits["disable_memory_recall"] is False
    turns = list(Turn.objects.filter(conversation_id=run.conversation_id))
    assert turns and all(t.disable_memory_write and t.disable_code_context and not t.disable_memory_recall
                         for t in turns)


def test_a_workflow_started_without_defaults_is_not_narrowed(seed_job, start_rule):
    start_rule.add("digest", "digest")
    body = {"messages": [{"role": "user", "content": "digest my mail"}], "conversation_id": "w2",
            "federation_issuer": "example-crm", "federation_subject": "carol"}
    Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                  HTTP_X_API_KEY=APP_KEY)
    run = CronRun.objects.get()
    assert not run.limits["disable_memory_write"] and not run.limits["disable_code_context"]
