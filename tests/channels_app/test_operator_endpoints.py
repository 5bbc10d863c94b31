"""The operator's host endpoints: GET /v1/ugent/sandbox, PUT /v1/ugent/directory, POST /v1/ugent/conversations/repair."""
from __future__ import annotations

import json
import os

import pytest
from django.test import Client

from channels_app import repair, sandbox
from channels_app.models import Conversation, Event, Message, Receipt, Turn
from tests.conftest import APP_KEY, OPERATOR_KEY

pytestmark = pytest.mark.django_db(transaction=True)
OPERATOR_ONLY = "This endpoint answers operator keys only."


def chat(text="hi", conversation_id="ca", **extra):
    body = {"messages": [{"role": "user", "content": text}], "user": "alice", "conversation_id": conversation_id,
            **extra}
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 200, resp.content
    return Turn.objects.get(turn_id=resp["x-ugent-turn-id"])


def put_directory(directory, key=OPERATOR_KEY, conversation_id="ca"):
    return Client().put("/v1/ugent/directory", data=json.dumps({"conversation_id": conversation_id,
                                                                "directory": directory}),
                        content_type="application/json", HTTP_X_API_KEY=key)


def post_repair(key=OPERATOR_KEY, conversation_id="ca"):
    return Client().post("/v1/ugent/conversations/repair", data=json.dumps({"conversation_id": conversation_id}),
                         content_type="application/json", HTTP_X_API_KEY=key)


@pytest.fixture
def workspace(tcast, settings, tmp_path):
    root = tmp_path / "ws"
    (root / "proj" / "src").mkdir(parents=True)
    (root / "notes.txt").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link-out")
    os.symlink(root / "proj", root / "link-in")
    settings.UGENT_WORKSPACE = str(root)
    chat()
    return root


def test_the_directory_is_set_inside_the_workspace(workspace):
    body = put_directory("proj/src").json()
    assert body["directory"] == "proj/src" and body["path"] == str(workspace.resolve() / "proj" / "src")
    assert Conversation.objects.get(external_id="ca").working_directory == "proj/src"
    assert put_directory(str(workspace / "proj")).json()["directory"] == "proj"  # absolute inside: stored relative
    assert put_directory("link-in").json()["directory"] == "proj"  # a link that stays inside
    assert put_directory("").json()["directory"] == "."
    assert Conversation.objects.get(external_id="ca").working_directory == ""


@pytest.mark.parametrize("directory,message", [
    ("../outside", sandbox.DOTDOT), ("proj/../..", sandbox.DOTDOT),
    ("/etc", None), ("link-out", sandbox.SYMLINK_OUT),
    ("nope", sandbox.MISSING.format(path="nope")), ("notes.txt", sandbox.NOT_A_DIRECTORY.format(path="notes.txt")),
])
def test_a_directory_outside_missing_or_not_one_is_a_400_and_changes_nothing(workspace, directory, message):
    put_directory("proj")
    resp = put_directory(directory)
    assert resp.status_code == 400, resp.content
    expected = message or sandbox.OUTSIDE.format(root=workspace.resolve())
    assert resp.json()["error"]["message"] == expected
    assert Conversation.objects.get(external_id="ca").working_directory == "proj"


def test_operator_keys_only_and_an_unknown_conversation_is_a_404(workspace):
    for resp in (put_directory("proj", key=APP_KEY), post_repair(key=APP_KEY),
                 Client().get("/v1/ugent/sandbox", HTTP_X_API_KEY=APP_KEY)):
        assert resp.status_code == 403 and resp.json()["error"]["message"] == OPERATOR_ONLY
    assert Conversation.objects.get(external_id="ca").working_directory == ""
    assert put_directory("proj", conversation_id="nope").status_code == 404
    assert post_repair(conversation_id="nope").status_code == 404
    assert Client().get("/v1/ugent/sandbox", {"conversation_id": "nope"}, HTTP_X_API_KEY=OPERATOR_KEY).status_code == 404


def test_the_sandbox_says_what_it_allows_and_every_working_directory(workspace, settings):
    settings.UGENT_SANDBOX_WRITABLE = ["proj"]
    settings.UGENT_SANDBOX_NETWORK = True
    put_directory("proj/src")
    body = Client().get("/v1/ugent/sandbox", HTTP_X_API_KEY=OPERATOR_KEY).json()
    assert body["workspace_root"] == str(workspace.resolve()) and body["workspace_exists"] is True
    assert body["writable_paths"] == [str(workspace.resolve() / "proj")] and body["network"] is True
    assert [(d["conversation_id"], d["directory"]) for d in body["working_directories"]] == [("ca", "proj/src")]


def test_repair_re_derives_turns_and_receipts_once_and_never_answers_twice(workspace):
    done = chat("one")  # completed
    Receipt.objects.filter(pk=done.receipt_id).update(state="running")  # a receipt behind its turn
    logged = chat("two")  # its terminal event is in the log, but the row says running
    Turn.objects.filter(pk=logged.pk).update(state="running", finished_at=None)
    Receipt.objects.filter(pk=logged.receipt_id).update(state="running")
    lapsed = chat("three")  # running, its lease long gone, no terminal event
    Event.objects.filter(turn=lapsed, type="turn.completed").delete()
    Message.objects.filter(turn=lapsed, role="assistant").delete()
    from django.utils import timezone
    Turn.objects.filter(pk=lapsed.pk).update(state="running", finished_at=None,
                                             lease_expires_at=timezone.now() - timezone.timedelta(minutes=5))
    Receipt.objects.filter(pk=lapsed.receipt_id).update(state="running")
    conv = Conversation.objects.get(external_id="ca")
    orphan = Receipt.objects.create(conversation=conv, client_message_id="orphan", content_hash="x",
                                    actor=conv.owner, state="accepted")
    events_before = Event.objects.filter(type__in=["turn.completed", "turn.failed"]).count()
    answers_before = Message.objects.filter(role="assistant").count()

    body = post_repair().json()
    kinds = sorted((f["kind"], f["to"]) for f in body["fixed"])
    assert kinds == [("lease_lapsed", "interrupted"), ("receipt_behind_turn", "completed"),
                     ("receipt_without_turn", "abandoned"), ("turn_ended_in_log", "completed")]
    assert body["fixed_count"] == 4
    assert Receipt.objects.get(pk=done.receipt_id).state == "completed"
    assert Turn.objects.get(pk=logged.pk).state == "completed" and Receipt.objects.get(pk=logged.receipt_id).state == "completed"
    assert Turn.objects.get(pk=lapsed.pk).state == "interrupted"
    assert Receipt.objects.get(pk=orphan.pk).state == "abandoned" and Receipt.objects.get(pk=orphan.pk).reason == repair.TURN_MISSING
    # one terminal event more (the lapsed turn's), none for the turn whose end was already logged
    assert Event.objects.filter(type__in=["turn.completed", "turn.failed"]).count() == events_before + 1
    assert Event.objects.filter(turn=logged, type="turn.completed").count() == 1
    # the interrupted turn keeps what it streamed; the turn whose end was logged keeps its one answer
    assert Message.objects.filter(role="assistant").count() == answers_before + 1
    assert Message.objects.filter(turn=logged, role="assistant").count() == 1
    again = post_repair().json()
    assert again["fixed"] == [] and again["fixed_count"] == 0
    assert Event.objects.filter(type__in=["turn.completed", "turn.failed"]).count() == events_before + 1
