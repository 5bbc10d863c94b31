"""Agent profiles' secrets (issue #12, item 5): encrypted at rest, never rendered back, replaceable."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from plugins_app.agent.engines import registry
from plugins_app.agent.models import AgentProfile
from ugent_common.secrets import is_secret_name

SECRET = "sk-very-secret-upstream-key"


def _stored(pk: int) -> str:
    with connection.cursor() as cur:
        cur.execute(f"SELECT config FROM {AgentProfile._meta.db_table} WHERE id = %s", [pk])
        return str(cur.fetchone()[0])


def test_names_like_a_secret_are_secrets_and_max_tokens_is_not():
    assert all(map(is_secret_name, ["api_key", "apiKey", "auth_token", "password", "client_secret",
                                    "Authorization", "access_key"]))
    assert not any(map(is_secret_name, ["max_tokens", "base_url", "model", "timeout", "temperature"]))


@pytest.mark.django_db
def test_an_api_key_is_encrypted_at_rest_however_the_row_is_written_and_the_engine_gets_it():
    p = AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": "http://127.0.0.1:9/v1", "api_key": SECRET,
                                            "extra_body": {"auth_token": "tok-123"}, "max_tokens": 5})
    assert SECRET not in _stored(p.pk) and "tok-123" not in _stored(p.pk) and "max_tokens" in _stored(p.pk)
    AgentProfile.objects.filter(pk=p.pk).update(config={"api_key": SECRET + "-2"})
    assert SECRET not in _stored(p.pk)
    p.refresh_from_db()
    engine = registry.engine_for_profile(p)
    assert engine.api_key == SECRET + "-2"


@pytest.mark.django_db
def test_the_admin_never_shows_a_secret_and_replaces_it_on_request():
    admin = User.objects.create_superuser("root", "r@example.com", "pw")
    c = Client()
    c.force_login(admin)
    p = AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": "http://127.0.0.1:9/v1", "api_key": SECRET})
    page = c.get(f"/admin/plugins_app/agentprofile/{p.pk}/change/").content.decode()
    token = json.loads(_stored(p.pk))["api_key"]["$ugent_secret"]
    assert SECRET not in page and token not in page and "Replace a stored secret" in page
    form = {"name": "up", "provider": "openai-compatible", "instance": "default",
            "config": json.dumps({"base_url": "http://127.0.0.1:9/v1"}), "memory_engine": "", "summarizer_engine": "",
            "system_prompt": "", "allowed": "on", "history_turns": "20", "replace_secret": "", "replace_secret_value": ""}
    r = c.post(f"/admin/plugins_app/agentprofile/{p.pk}/change/", form)
    assert r.status_code == 302, r.content.decode()[:2000]
    p = AgentProfile.objects.get(pk=p.pk)
    assert registry.engine_for_profile(p).api_key == SECRET  # kept: not shown, not lost
    r = c.post(f"/admin/plugins_app/agentprofile/{p.pk}/change/",
               {**form, "replace_secret": "api_key", "replace_secret_value": "sk-new"})
    assert r.status_code == 302
    p = AgentProfile.objects.get(pk=p.pk)
    assert "sk-new" not in _stored(p.pk) and registry.engine_for_profile(p).api_key == "sk-new"
