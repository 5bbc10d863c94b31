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
            "system_prompt": "", "allowed": "on", "history_turns": "20", "context_tokens": "8192", "replace_secret": "", "replace_secret_value": ""}
    r = c.post(f"/admin/plugins_app/agentprofile/{p.pk}/change/", form)
    assert r.status_code == 302, r.content.decode()[:2000]
    p = AgentProfile.objects.get(pk=p.pk)
    assert registry.engine_for_profile(p).api_key == SECRET  # kept: not shown, not lost
    r = c.post(f"/admin/plugins_app/agentprofile/{p.pk}/change/",
               {**form, "replace_secret": "api_key", "replace_secret_value": "sk-new"})
    assert r.status_code == 302
    p = AgentProfile.objects.get(pk=p.pk)
    assert "sk-new" not in _stored(p.pk) and registry.engine_for_profile(p).api_key == "sk-new"


@pytest.fixture
def upstream():
    """The fake OpenAI-compatible upstream on loopback (tests/fakes/upstream.py), its own process."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(root / "tests" / "fakes" / "upstream.py"), "--port", "0",
                             "--no-record"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.startswith("READY "), line
    yield line.split(" ", 1)[1]
    proc.terminate()
    proc.wait(10)


@pytest.mark.django_db
def test_test_connection_shows_the_engines_answer_or_why_not_and_never_the_key(upstream):
    admin = User.objects.create_superuser("root", "r@example.com", "pw")
    c = Client()
    c.force_login(admin)
    good = AgentProfile.objects.create(name="up", provider="openai-compatible",
                                       config={"base_url": upstream, "api_key": SECRET, "model": "stub-model"})
    page = c.get(f"/admin/plugins_app/agentprofile/{good.pk}/change/").content.decode()
    assert "Test connection" in page
    r = c.post(f"/admin/plugins_app/agentprofile/{good.pk}/test-connection/", follow=True)
    text = " ".join(str(m) for m in r.context["messages"])
    assert text.startswith("Connection works: openai-compatible:default@up answered in") and SECRET not in text
    bad = AgentProfile.objects.create(name="down", provider="openai-compatible",
                                      config={"base_url": f"http://127.0.0.1:9/{SECRET}/v1", "api_key": SECRET})
    r = c.post(f"/admin/plugins_app/agentprofile/{bad.pk}/test-connection/", follow=True)
    text = " ".join(str(m) for m in r.context["messages"])
    assert text.startswith("Connection failed: ") and "cannot reach upstream" in text
    assert SECRET not in text and "[secret]" in text  # the key, even where the upstream's error repeats it


@pytest.mark.django_db
def test_test_connection_needs_the_right_to_change_the_profile():
    p = AgentProfile.objects.create(name="up", provider="ugent-notes")
    url = f"/admin/plugins_app/agentprofile/{p.pk}/test-connection/"
    assert Client().post(url).status_code == 302  # anonymous: to the login page
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    c = Client()
    c.force_login(viewer)
    assert c.post(url).status_code == 403  # staff without change permission
    root = User.objects.create_superuser("root", "r@example.com", "pw")
    c.force_login(root)
    assert c.get(url).status_code == 405  # a call to the engine is a POST, never a link
    assert c.post(url).status_code == 302
