"""Per-caller defaults: the operator's opt-outs and model for every turn that asserts one federation
issuer. A request adds to them, never switches them back on; the turn keeps the effective ones."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app.models import CallerDefaults, Turn
from tests.conftest import APP_KEY, OPERATOR_KEY
from ugent_common import config

pytestmark = pytest.mark.django_db(transaction=True)
CAROL = {"federation_issuer": "example-crm", "federation_subject": "carol"}


def chat(key, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)
    assert resp.status_code == 200, resp.content
    return Turn.objects.get(turn_id=resp["x-ugent-turn-id"])


def opt_outs(turn):
    return (turn.disable_memory_recall, turn.disable_memory_write, turn.disable_code_context)


@pytest.fixture
def second_model(tcast):
    from plugins_app.agent.models import AgentProfile
    return AgentProfile.objects.create(name="scripted-b", provider="scripted")


@pytest.fixture
def defaults(tcast, second_model):
    return CallerDefaults.objects.create(issuer="example-crm", model="scripted-b", disable_memory_recall=True)


def test_every_turn_that_asserts_the_issuer_gets_its_opt_outs_and_model(defaults):
    turn = chat(APP_KEY, conversation_id="d1", **CAROL)
    assert opt_outs(turn) == (True, False, False)
    assert turn.model == "scripted-b" and turn.context["caller_defaults"] == "example-crm"


def test_a_request_can_add_opt_outs_but_not_switch_the_defaults_back_on(defaults):
    turn = chat(APP_KEY, conversation_id="d2", ugent_disable_memory_recall=False, ugent_disable_code_context=True,
                **CAROL)
    assert opt_outs(turn) == (True, False, True)


def test_a_request_that_names_a_model_runs_that_one_turn_on_it(defaults):
    assert chat(APP_KEY, conversation_id="d3", model="scripted", **CAROL).model == "scripted"
    assert chat(APP_KEY, conversation_id="d4", model="ugent-default", **CAROL).model == "scripted-b"


def test_a_turn_that_asserts_no_issuer_or_another_is_left_alone(defaults, tcast):
    assert opt_outs(chat(OPERATOR_KEY, user="alice", conversation_id="d5")) == (False, False, False)
    assert opt_outs(chat(APP_KEY, conversation_id="d6")) == (False, False, False)  # web-user@crm
    assert chat(OPERATOR_KEY, user="alice", conversation_id="d7").model == "scripted"


def test_the_operator_naming_a_federated_user_gets_that_issuers_defaults_too(defaults):
    assert opt_outs(chat(OPERATOR_KEY, conversation_id="d8", **CAROL))[0] is True


def test_defaults_from_ugent_toml_apply(tcast, second_model, tmp_path, settings):
    path = tmp_path / "ugent.toml"
    path.write_text('[[web.auth.caller_defaults]]\nissuer = "example-crm"\ndisable_memory_write = true\n'
                    'disable_code_context = true\n')
    settings.UGENT_CONFIG = str(path)
    config.reset_caches()
    try:
        assert opt_outs(chat(APP_KEY, conversation_id="t1", **CAROL)) == (False, True, True)
    finally:
        config.reset_caches()


def test_defaults_follow_a_verified_tokens_issuer(defaults, settings):
    from channels_app import federation
    from channels_app.models import Issuer
    from tests.support import idp
    key = idp.SigningKey("ec")
    server = idp.JwksServer(key)
    federation.jwks_reset()
    try:
        Issuer.objects.create(issuer=idp.ISSUER, jwks_url=server.url, audience=idp.AUDIENCE,
                              actor_prefix=idp.PREFIX)
        body = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "v1"}
        resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                             HTTP_X_API_KEY=APP_KEY, HTTP_X_UGENT_IDENTITY=idp.sign(key, idp.claims("zed")))
        turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
        assert turn.actor.key == "crm:zed" and opt_outs(turn) == (True, False, False) and turn.model == "scripted-b"
    finally:
        server.close()
        federation.jwks_reset()
