"""POST /v1/ugent/commands: /model and its order, /models, /recall, /sandbox, allow_remote_control, and what
is no command or an unsupported one (docs/commands.md)."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app import commands
from channels_app.models import Actor, Caller, CallerDefaults, Conversation, Event, Message, Receipt, Turn
from plugins_app.agent.models import AgentProfile
from tests.conftest import APP_KEY, OPERATOR_KEY
from tests.support.http import chat

pytestmark = pytest.mark.django_db(transaction=True)

ALICE = {"key": OPERATOR_KEY, "user": "alice"}
CAROL = {"key": APP_KEY, "federation_issuer": "example-crm", "federation_subject": "carol"}


def command(who: dict, text, **extra):
    body = {k: v for k, v in who.items() if k != "key"}
    body.update(extra)
    if text is not None:
        body["command"] = text
    return Client().post("/v1/ugent/commands", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def counts() -> dict:
    return {m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Message, Event)}


@pytest.fixture
def models(tcast):
    return {"other": AgentProfile.objects.create(name="other", provider="scripted", config={"prefix": "other"}),
            "callers": AgentProfile.objects.create(name="callers", provider="scripted", config={"prefix": "callers"})}


# --- /model ------------------------------------------------------------------------------------

def test_model_alone_shows_the_choice_and_where_it_comes_from(tcast, models):
    body = command(ALICE, "/model").json()
    assert body["ok"] and not body["changed"] and body["data"] == {"model": "scripted", "source": "default_profile",
                                                                   "stored": None}
    tcast.operator.default_model = "callers"
    tcast.operator.save()
    body = command(ALICE, "/model").json()
    assert body["data"]["source"] == "caller" and body["text"] == "Model: callers (from the caller's default model)."


def test_a_stored_choice_runs_every_turn_that_names_no_model_and_a_request_model_only_its_own(tcast, models):
    tcast.operator.default_model = "callers"
    tcast.operator.save()
    body = command(ALICE, "/model other").json()
    assert body["changed"] and body["data"] == {"model": "other", "source": "user", "stored": "other"}
    assert Actor.objects.get(key="web:alice").model_choice == "other"
    assert command(ALICE, "/model").json()["data"]["source"] == "user"
    assert chat(ALICE, "x", conversation_id="c1").json()["model"] == "other"
    assert chat(ALICE, "y", conversation_id="c1", model="ugent-default").json()["model"] == "other"
    # a request's model runs that turn only and stores nothing
    assert chat(ALICE, "z", conversation_id="c1", model="scripted").json()["model"] == "scripted"
    assert Actor.objects.get(key="web:alice").model_choice == "other"
    # it is the user's choice, not the caller's: bob is not affected
    assert chat({"key": OPERATOR_KEY, "user": "bob"}, "b").json()["model"] == "callers"
    # the same choice again changes nothing
    assert command(ALICE, "/model other").json()["changed"] is False


def test_model_default_clears_the_stored_choice(tcast, models):
    command(ALICE, "/model other")
    body = command(ALICE, "/model default").json()
    assert body["changed"] and body["data"] == {"model": "scripted", "source": "default_profile", "stored": None}
    assert Actor.objects.get(key="web:alice").model_choice == ""
    assert command(ALICE, "/model ugent-default").json()["changed"] is False
    assert chat(ALICE, "x").json()["model"] == "scripted"


def test_the_users_choice_comes_before_the_per_caller_defaults_which_come_before_the_global_one(tcast, models,
                                                                                                 settings):
    settings.UGENT_DEFAULT_MODEL = "other"
    assert command(CAROL, "/model").json()["data"]["source"] == "global"
    CallerDefaults.objects.create(issuer="example-crm", model="callers")
    assert command(CAROL, "/model").json()["data"] == {"model": "callers", "source": "caller_defaults",
                                                       "stored": None}
    assert chat(CAROL, "x").json()["model"] == "callers"
    Caller.objects.filter(pk=tcast.app.pk).update(allow_remote_control=True)
    assert command(CAROL, "/model scripted").status_code == 200
    assert chat(CAROL, "y").json()["model"] == "scripted"
    assert chat(CAROL, "z", model="other").json()["model"] == "other"  # the request's model still wins its turn
    command(CAROL, "/model default")
    assert chat(CAROL, "w").json()["model"] == "callers"


def test_a_stored_choice_the_operator_no_longer_allows_is_passed_over(tcast, models):
    command(ALICE, "/model other")
    AgentProfile.objects.filter(name="other").update(allowed=False)
    assert command(ALICE, "/model").json()["data"] == {"model": "scripted", "source": "default_profile",
                                                       "stored": "other"}
    assert chat(ALICE, "x").json()["model"] == "scripted"


def test_a_model_the_operator_does_not_allow_is_refused_with_the_chat_endpoints_400(tcast, models):
    AgentProfile.objects.create(name="forbidden", provider="scripted", allowed=False)
    for name in ("forbidden", "no-such-model"):
        chat_error = chat(ALICE, "x", model=name).json()["error"]
        resp = command(ALICE, f"/model {name}")
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == chat_error["message"] == f"The model '{name}' is not available here."
        assert resp.json()["error"]["code"] == "model_not_found"
    assert not Actor.objects.filter(model_choice__gt="").exists()


def test_models_lists_what_get_models_lists(tcast, models):
    listed = Client().get("/v1/models", HTTP_X_API_KEY=APP_KEY).json()["data"]
    body = command(CAROL, "/models").json()
    assert body["data"]["models"] == listed and {m["id"] for m in listed} == {"ugent-default", "scripted", "other", "callers"}
    assert all(f"- {m['id']}" in body["text"] for m in listed)


# --- allow_remote_control ----------------------------------------------------------------------

def test_changes_need_allow_remote_control_and_read_only_commands_are_always_allowed(tcast, models):
    anonymous = {"key": APP_KEY}
    assert chat(anonymous, "mine", conversation_id="app-conv").status_code == 200
    before = counts()
    for text in ("/model other", "/model default", "/harness goal ship it", "/harness verify",
                 "/steering go faster"):
        resp = command(anonymous, text, conversation_id="app-conv")
        assert resp.status_code == 403, (text, resp.content)
        name = text.split(" ")[0]
        assert resp.json()["error"] == {
            "message": commands.REMOTE_CONTROL_REFUSED.format(name=name, read_only=commands.READ_ONLY),
            "type": "permission_error", "code": "remote_control_not_allowed", "param": "command"}
    assert counts() == before and Actor.objects.get(key="web-user@crm").model_choice == ""
    for text in ("/model", "/models", "/sandbox", "/harness", "/recall hello"):
        assert command(anonymous, text, conversation_id="app-conv").status_code == 200, text
    Caller.objects.filter(pk=tcast.app.pk).update(allow_remote_control=True)
    assert command(anonymous, "/model other").json()["changed"] is True
    # an operator front end may by default, and not when the operator switched it off
    assert command(ALICE, "/model other").status_code == 200
    Caller.objects.filter(pk=tcast.operator.pk).update(allow_remote_control=False)
    assert command(ALICE, "/model callers").status_code == 403
    assert Actor.objects.get(key="web:alice").model_choice == "other"


def test_remote_control_by_role_when_unset():
    assert Caller(role="operator").remote_control_allowed is True
    assert Caller(role="application").remote_control_allowed is False
    assert Caller(role="operator", allow_remote_control=False).remote_control_allowed is False
    assert Caller(role="application", allow_remote_control=True).remote_control_allowed is True


# --- /recall -----------------------------------------------------------------------------------

def test_recall_says_plainly_that_there_is_no_memory_backend(tcast):
    body = command(ALICE, "/recall what do I like?").json()
    assert body["ok"] and body["text"] == commands.NO_MEMORY
    assert body["data"] == {"backend": None, "facts": [], "tokens_est": 0, "query": "what do I like?"}


def test_recall_reads_through_recall_preview_for_the_users_last_message(tcast, monkeypatch):
    chat(ALICE, "I like green tea", conversation_id="c1")
    seen = []

    def preview(*, actor_key, text):
        seen.append((actor_key, text))
        return {"backend": "sqlite_fts", "facts": [{"text": "likes green tea", "tier": "fact", "score": 1.0}],
                "tokens_est": 4}
    monkeypatch.setattr("plugins_app.agent.memory.recall_preview", preview)
    body = command(ALICE, "/recall", conversation_id="c1").json()
    assert seen == [("web:alice", "I like green tea")]
    assert body["data"]["backend"] == "sqlite_fts" and "- likes green tea" in body["text"]
    assert "would inject 1 fact(s), about 4 tokens" in body["text"]


def test_recall_with_nothing_to_recall_for_is_a_400(tcast):
    resp = command(ALICE, "/recall")
    assert resp.status_code == 400 and resp.json()["error"]["message"] == commands.NEEDS_TEXT.format(
        what="to recall for", usage="/recall TEXT, or name a conversation with a message of yours in it")


# --- what is no command, or not one of ours ----------------------------------------------------

def test_an_unsupported_command_is_answered_with_the_supported_ones_and_changes_nothing(tcast):
    chat(ALICE, "hello", conversation_id="c1")
    before = counts()
    for text in ("/plugin setup", "/FOO", "/deploy now please"):
        resp = command(ALICE, text, conversation_id="c1")
        assert resp.status_code == 200
        body = resp.json()
        assert body["unsupported"] is True and body["ok"] is False and body["changed"] is False
        name = text.split(" ")[0].lower()
        assert body["text"] == f"{name} is not a command here. The supported commands are: /model, /models, " \
                               "/recall, /steering, /btw, /harness, /refine, /sandbox, /compress."
        assert body["data"]["supported"] == list(commands.SUPPORTED)
    assert counts() == before


def test_a_command_name_is_read_case_insensitively(tcast):
    assert command(ALICE, "/MODELS").json()["command"] == "/models"


@pytest.mark.parametrize("text", ["hello", "/", "/ model", "", "   "])
def test_text_that_is_no_command_is_a_400(tcast, text):
    resp = command(ALICE, text)
    assert resp.status_code == 400
    if text.strip():
        assert resp.json()["error"]["message"] == commands.NOT_A_COMMAND


@pytest.mark.parametrize("body", [{}, {"command": 5}, {"command": "/models\x00"}, {"command": ["/models"]}, {"command": "/models", "turn_id": {"a": 1}}])
def test_bad_bodies_are_400s(tcast, body):
    resp = Client().post("/v1/ugent/commands", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 400, resp.content
    resp = Client().post("/v1/ugent/commands", data="{not json", content_type="application/json",
                         HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_a_command_never_creates_a_conversation(tcast):
    for text in ("/harness", "/models"):
        resp = command(ALICE, text, conversation_id="never-seen")
        assert resp.status_code == 404 and resp.json()["error"]["message"] == "No such conversation."
    assert Conversation.objects.count() == 0


def test_a_command_that_needs_a_conversation_says_so(tcast):
    for name in ("/harness", "/refine"):
        resp = command(ALICE, name)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == commands.NEEDS_CONVERSATION.format(name=name)


def test_a_command_on_another_users_conversation_is_refused_as_a_message_is(tcast):
    chat(ALICE, "alice's", conversation_id="ca")
    before = counts()
    for who in ({"key": OPERATOR_KEY, "user": "bob"}, CAROL, {"key": OPERATOR_KEY}):
        resp = command(who, "/harness", conversation_id="ca")
        assert resp.status_code == 403
        assert resp.json()["error"]["message"] == "This conversation belongs to another user."
    assert counts() == before
    # the application naming a user it may not name: the chat endpoint's refusal
    resp = command({"key": APP_KEY, "user": "alice"}, "/models")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "actor_not_allowed"
    assert command({"key": "ugk_nope"}, "/models").status_code == 401


def test_sandbox_command_shows_the_workspace_and_the_conversations_directory(tcast, settings, tmp_path):
    (tmp_path / "proj").mkdir()
    settings.UGENT_WORKSPACE = str(tmp_path)
    chat(ALICE, "x", conversation_id="c1")
    Conversation.objects.filter(external_id="c1").update(working_directory="proj")
    body = command(ALICE, "/sandbox", conversation_id="c1").json()
    assert body["data"]["workspace_root"] == str(tmp_path.resolve())
    assert body["data"]["working_directory"]["directory"] == "proj"
    assert body["data"]["network"] is False and body["data"]["writable_paths"] == []
    assert "working_directories" not in body["data"]  # other conversations are the operator's business
    assert f"Workspace: {tmp_path.resolve()}" in body["text"] and "Network: none" in body["text"]
    assert f"({tmp_path.resolve() / 'proj'})" in body["text"]


def test_sandbox_command_shows_host_paths_to_an_operator_key_only(tcast, settings, tmp_path):
    """An application key gets the same report with no path on the host in it: the paths relative to the
    workspace root; an operator key, whomever it names, gets the host's paths (as GET /v1/ugent/sandbox)."""
    workspace, elsewhere = tmp_path / "workspace", tmp_path / "scratch"
    (workspace / "proj").mkdir(parents=True)
    elsewhere.mkdir()
    settings.UGENT_WORKSPACE = str(workspace)
    settings.UGENT_SANDBOX_WRITABLE = ["out", str(elsewhere)]
    for who, conv in ((CAROL, "carol-conv"), (ALICE, "alice-conv")):
        assert chat(who, "x", conversation_id=conv).status_code == 200
    Conversation.objects.update(working_directory="proj")
    body = command(CAROL, "/sandbox", conversation_id="carol-conv").json()
    assert str(tmp_path) not in json.dumps(body), body
    assert body["data"]["workspace_root"] is None and body["data"]["workspace_exists"] is True
    assert body["data"]["writable_paths"] == ["out", "(outside the workspace)"]
    assert body["data"]["working_directory"]["directory"] == body["data"]["working_directory"]["path"] == "proj"
    assert body["text"].splitlines() == [
        "Workspace: its path on the host is shown to operator keys only; the paths below are relative to it",
        "Writable: out, (outside the workspace)", "Network: none", "This conversation's working directory: proj"]
    assert str(tmp_path) not in json.dumps(command({"key": APP_KEY}, "/sandbox").json())
    for who, conv in ((ALICE, "alice-conv"), ({"key": OPERATOR_KEY}, None)):
        body = command(who, "/sandbox", **({"conversation_id": conv} if conv else {})).json()
        root = workspace.resolve()
        assert body["data"]["workspace_root"] == str(root)
        assert body["data"]["writable_paths"] == [str(root / "out"), str(elsewhere.resolve())]
        assert f"Workspace: {root}" in body["text"]
        if conv:
            assert body["data"]["working_directory"]["path"] == str(root / "proj")
