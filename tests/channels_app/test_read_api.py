"""GET /v1/models, /v1/health and /v1/ugent/receipt, with the permission matrix."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from tests.support.schema import validate

pytestmark = pytest.mark.django_db(transaction=True)


def get(path, key=None, **params):
    headers = {"HTTP_X_API_KEY": key} if key else {}
    return Client().get(path, params, **headers)


def send(who, text, **extra):
    body = {"messages": [{"role": "user", "content": text}]}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(extra)
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def test_models_lists_profiles_and_qualified_names_for_copies(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="llama3", provider="openai-compatible", instance="gpu-a")
    AgentProfile.objects.create(name="llama3", provider="openai-compatible", instance="gpu-b")
    AgentProfile.objects.create(name="hidden", provider="scripted", allowed=False)
    resp = get("/v1/models", tcast.keys["app"])
    assert resp.status_code == 200
    validate(resp.json(), "ListModelsResponse")
    ids = [m["id"] for m in resp.json()["data"]]
    assert "scripted" in ids and ids.count("llama3") == 1
    assert "openai-compatible:gpu-a@llama3" in ids and "openai-compatible:gpu-b@llama3" in ids
    assert "hidden" not in ids


def test_a_model_by_its_id_is_the_object_the_list_holds(tcast):
    """GET /v1/models/{model} (OpenAI's retrieveModel): each id the list holds, qualified names too."""
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="llama3", provider="openai-compatible", instance="gpu-a")
    AgentProfile.objects.create(name="llama3", provider="openai-compatible", instance="gpu-b")
    listed = get("/v1/models", tcast.keys["app"]).json()["data"]
    assert any(m["id"] == "openai-compatible:gpu-b@llama3" for m in listed)
    for model in listed:
        resp = get(f"/v1/models/{model['id']}", tcast.keys["app"])
        assert resp.status_code == 200, model
        assert resp.json() == model
        validate(resp.json(), "Model")


def test_a_model_the_list_does_not_hold_is_openais_404(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="hidden", provider="scripted", allowed=False)
    for name in ("hidden", "gpt-4o", "org/some-model"):
        resp = get(f"/v1/models/{name}", tcast.keys["app"])
        assert resp.status_code == 404
        validate(resp.json(), "ErrorResponse")
        assert resp.json()["error"] == {
            "message": f"The model '{name}' does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}  # OpenAI's type


def test_ugent_default_is_listed_and_retrieved_as_chat_accepts_it(tcast, settings):
    """Chat takes model "ugent-default" (the stored choice, the caller's default, the global one): the list names
    it first and retrieve answers it, created as the model it runs by default; with nothing allowed, neither."""
    from plugins_app.agent.models import AgentProfile
    later = AgentProfile.objects.create(name="later", provider="scripted")
    AgentProfile.objects.filter(pk=later.pk).update(created_at=tcast.profile.created_at.replace(year=2030))
    settings.UGENT_DEFAULT_MODEL = "later"
    created = int(AgentProfile.objects.get(pk=later.pk).created_at.timestamp())  # the global default's, not the oldest
    alias = {"id": "ugent-default", "object": "model", "created": created, "owned_by": "ugent"}
    assert created != int(tcast.profile.created_at.timestamp())
    listed = get("/v1/models", tcast.keys["app"]).json()["data"]
    assert listed[0] == alias and [m["id"] for m in listed].count("ugent-default") == 1
    resp = get("/v1/models/ugent-default", tcast.keys["app"])
    assert resp.status_code == 200 and resp.json() == alias
    validate(resp.json(), "Model")
    assert send(tcast.carol, "x", model="ugent-default").status_code == 200
    AgentProfile.objects.update(allowed=False)
    assert get("/v1/models", tcast.keys["app"]).json()["data"] == []
    assert get("/v1/models/ugent-default", tcast.keys["app"]).status_code == 404


def test_a_qualified_name_picks_one_copy(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="twin", provider="scripted", instance="a", config={"prefix": "A"})
    AgentProfile.objects.create(name="twin", provider="scripted", instance="b", config={"prefix": "B"})
    resp = send(tcast.alice, "x", model="scripted:b@twin")
    assert resp.json()["choices"][0]["message"]["content"].startswith("B:")


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/scripted", "/v1/ugent/receipt"])
def test_endpoints_need_a_key(tcast, path):
    assert get(path).status_code == 401
    assert get(path, "wrong").status_code == 401


def test_health_needs_no_key_and_reveals_nothing(tcast):
    resp = get("/v1/health")
    assert resp.status_code == 200
    assert set(resp.json()) == {"status", "mode"}


def test_receipt_for_its_sender_and_the_operator_only(tcast):
    r = send(tcast.carol, "hello", conversation_id="c1", client_message_id="m1")
    turn_id = r["x-ugent-turn-id"]
    own = get("/v1/ugent/receipt", tcast.keys["app"], conversation_id="c1", client_message_id="m1",
              federation_issuer="example-crm", federation_subject="carol")
    assert own.status_code == 200
    body = own.json()
    assert body["state"] == "completed" and body["turn_id"] == turn_id and body["answer"].startswith("echo:")
    # the operator sees it
    assert get("/v1/ugent/receipt", tcast.keys["operator"], conversation_id="c1",
               client_message_id="m1").status_code == 200
    # another user of the same application, the application's anonymous user, an outsider: 404 like a missing one
    other = get("/v1/ugent/receipt", tcast.keys["app"], conversation_id="c1", client_message_id="m1",
                federation_issuer="example-crm", federation_subject="dave")
    anon = get("/v1/ugent/receipt", tcast.keys["app"], conversation_id="c1", client_message_id="m1")
    outsider = get("/v1/ugent/receipt", tcast.keys["outsider"], conversation_id="c1", client_message_id="m1")
    missing = get("/v1/ugent/receipt", tcast.keys["app"], conversation_id="c1", client_message_id="nope",
                  federation_issuer="example-crm", federation_subject="carol")
    for resp in (other, anon, outsider, missing):
        assert resp.status_code == 404
        assert resp.json() == missing.json()


def test_receipt_says_failed_with_the_reason(tcast):
    send(tcast.alice, "script:fail=no upstream", conversation_id="c1", client_message_id="m1")
    body = get("/v1/ugent/receipt", tcast.keys["operator"], conversation_id="c1", client_message_id="m1",
               user="alice").json()
    assert body["state"] == "failed" and body["reason"] == "no upstream"


def test_receipt_needs_its_parameters(tcast):
    resp = get("/v1/ugent/receipt", tcast.keys["operator"], conversation_id="c1")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "client_message_id"


def test_status_answers_operator_keys_only(tcast):
    assert get("/v1/ugent/status").status_code == 401
    assert get("/v1/ugent/status", tcast.keys["app"]).status_code == 403
    assert get("/v1/ugent/status", tcast.keys["outsider"]).status_code == 403
    resp = get("/v1/ugent/status", tcast.keys["operator"])
    assert resp.status_code == 200
    voice = resp.json()["status"]["media"]["voice"]
    assert voice["input"]["available"] is False and voice["input"]["reason"] == "no_engine"
