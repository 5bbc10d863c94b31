"""ugent.toml [web.auth]: the role of UGENT_WEB_API_KEY and the keys read from the environment."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from ugent_common import config

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def toml_config(tmp_path, settings, monkeypatch):
    def write(text: str):
        path = tmp_path / "ugent.toml"
        path.write_text(text)
        settings.UGENT_CONFIG = str(path)
        config.reset_caches()
        return path
    yield write
    config.reset_caches()


def chat(key, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


def test_web_api_key_is_an_operator_key_by_default(tcast, settings, toml_config):
    toml_config("[web.auth]\n")
    settings.UGENT_WEB_API_KEY = "env-operator-key"
    resp = chat("env-operator-key", user="zoe", conversation_id="z1")
    assert resp.status_code == 200


def test_api_key_role_makes_the_env_key_an_application(tcast, settings, toml_config):
    toml_config('[web.auth]\napi_key_role = "application"\n')
    settings.UGENT_WEB_API_KEY = "env-app-key"
    assert chat("env-app-key", user="zoe").status_code == 403
    assert chat("env-app-key").status_code == 200


def test_keys_are_read_from_the_environment_variable_they_name(tcast, toml_config, monkeypatch):
    toml_config('[[web.auth.keys]]\nname = "partner"\nkey_env = "UGENT_WEB_API_KEY_PARTNER"\n'
                'role = "application"\nissuers = ["partner-idp"]\n')
    assert chat("partner-secret").status_code == 401  # the variable is not set yet
    monkeypatch.setenv("UGENT_WEB_API_KEY_PARTNER", "partner-secret")
    ok = chat("partner-secret", federation_issuer="partner-idp", federation_subject="u1")
    assert ok.status_code == 200
    assert chat("partner-secret", federation_issuer="example-crm", federation_subject="u1").status_code == 403
    from channels_app.models import Caller
    partner = Caller.objects.get(name="partner")
    assert partner.role == "application" and partner.issuers == ["partner-idp"] and partner.from_config


def remote_command(key, text, **extra):
    return Client().post("/v1/ugent/commands", data=json.dumps({"command": text, **extra}),
                         content_type="application/json", HTTP_X_API_KEY=key)


def test_allow_remote_control_is_set_for_a_key_in_ugent_toml_and_follows_the_file(tcast, toml_config, monkeypatch):
    from channels_app.models import Actor, Caller
    monkeypatch.setenv("UGENT_WEB_API_KEY_PANEL", "panel-secret")
    entry = '[[web.auth.keys]]\nname = "panel"\nkey_env = "UGENT_WEB_API_KEY_PANEL"\nrole = "application"\n'
    path = toml_config(entry)
    # unset: an application may not change things; read-only commands still answer
    refused = remote_command("panel-secret", "/model default")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "remote_control_not_allowed"
    assert remote_command("panel-secret", "/models").status_code == 200
    assert Caller.objects.get(name="panel").allow_remote_control is None
    path.write_text(entry + "allow_remote_control = true\n")
    config.reset_caches()
    assert remote_command("panel-secret", "/model default").status_code == 200
    assert Caller.objects.get(name="panel").allow_remote_control is True
    assert not Actor.objects.filter(key="web-user@panel").exists()  # clearing a choice never stored keeps no row
    assert remote_command("panel-secret", "/model scripted").json()["changed"] is True
    assert Actor.objects.get(key="web-user@panel").model_choice == "scripted"
    # the file wins: taking the line out again puts the caller back to its role's default
    path.write_text(entry)
    config.reset_caches()
    assert remote_command("panel-secret", "/model default").status_code == 403
    assert Caller.objects.get(name="panel").allow_remote_control is None


def test_api_key_allow_remote_control_switches_the_env_operator_key_off(tcast, settings, toml_config):
    settings.UGENT_WEB_API_KEY = "env-operator-key"
    toml_config("[web.auth]\napi_key_allow_remote_control = false\n")
    resp = remote_command("env-operator-key", "/model default", user="zoe")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "remote_control_not_allowed"
    assert remote_command("env-operator-key", "/model", user="zoe").status_code == 200


def test_allow_remote_control_that_is_no_boolean_is_refused_naming_the_key(toml_config):
    toml_config('[[web.auth.keys]]\nname = "panel"\nkey_env = "X"\nallow_remote_control = "yes"\n')
    with pytest.raises(config.ConfigError) as info:
        config.web_auth_check()
    assert "allow_remote_control" in str(info.value)
