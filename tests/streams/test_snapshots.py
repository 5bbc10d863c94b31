"""GET /v1/ugent/conversation/snapshot, /v1/ugent/snapshot and /v1/ugent/history, with the permission matrix."""
from __future__ import annotations

import pytest
from django.db.models import F

from channels_app import streams
from channels_app.models import Conversation, Message, Receipt
from tests.streams.conftest import get, stream
from tests.support.http import chat

pytestmark = pytest.mark.django_db(transaction=True)

PATHS = ["/v1/ugent/conversation/snapshot", "/v1/ugent/snapshot", "/v1/ugent/history"]


def test_the_conversation_snapshot_holds_the_50_newest_receipts_answers_and_the_cursor_it_was_read_at(tcast):
    for i in range(52):
        chat(tcast.alice, f"script:answer=answer {i}|cite=doc-{i}", conversation_id="ca",
             client_message_id=f"m{i}")
    Receipt.objects.filter(client_message_id="m51").update(files=[{"id": "file-1", "name": "a.txt"}])
    resp = get("/v1/ugent/conversation/snapshot", tcast.alice, conversation_id="ca")
    assert resp.status_code == 200
    body = resp.json()
    receipts = body["receipts"]
    assert [r["client_message_id"] for r in receipts] == [f"m{i}" for i in range(2, 52)]
    last = receipts[-1]
    assert last["state"] == "completed" and last["answer"] == "answer 51" and last["citations"] == ["doc-51"]
    assert last["files"] == [{"id": "file-1", "name": "a.txt"}]
    assert body["cursor"] == streams.log_head() and body["as_of"].endswith("Z")
    assert body["question"] is None and body["verifications"] == []
    # subscribing from the snapshot's cursor misses nothing and repeats nothing
    chat(tcast.alice, "after the snapshot", conversation_id="ca")
    frames = stream("/v1/ugent/events", tcast.alice, cursor=str(body["cursor"]))
    assert frames[0]["event"] == "ugent.user_message" and frames[0]["data"]["data"]["content"] == "after the snapshot"


def test_each_receipt_in_the_snapshot_is_its_senders_and_the_operator_sees_all(tcast):
    chat(tcast.alice, "hi", conversation_id="ca", client_message_id="m1")
    conv = Conversation.objects.get()
    other = Receipt.objects.get()
    # a receipt of another sender in the same conversation (as a channel relay could leave)
    from channels_app.services import actor_resolve
    bob = actor_resolve(caller=tcast.operator, user="bob")
    Receipt.objects.create(conversation=conv, client_message_id="m-bob", content_hash="x", actor=bob)
    alice = get("/v1/ugent/conversation/snapshot", tcast.alice, conversation_id="ca").json()
    operator = get("/v1/ugent/conversation/snapshot", {"key": tcast.keys["operator"]}, conversation_id="ca").json()
    assert [r["client_message_id"] for r in alice["receipts"]] == [other.client_message_id]
    assert [r["client_message_id"] for r in operator["receipts"]] == ["m1", "m-bob"]


def _hide(conv, n):
    ids = list(Message.objects.filter(conversation=conv).order_by("id").values_list("id", flat=True)[:n])
    Message.objects.filter(id__in=ids).update(hidden=True)
    # and the count compaction keeps with what it hides (channels_app.compaction)
    Conversation.objects.filter(pk=conv.pk).update(hidden_messages=F("hidden_messages") + len(ids))
    return ids


def test_the_session_snapshot_is_the_tail_of_visible_messages(tcast):
    for i in range(4):
        chat(tcast.alice, f"message {i}", conversation_id="ca")
    conv = Conversation.objects.get()
    hidden = _hide(conv, 2)
    body = get("/v1/ugent/snapshot", tcast.alice, conversation_id="ca", limit=3).json()
    visible = list(Message.objects.filter(conversation=conv, hidden=False).order_by("id"))
    assert [m["id"] for m in body["messages"]] == [m.id for m in visible[-3:]]
    assert body["has_older"] is True and body["hidden_count"] == len(hidden)
    assert body["messages"][-1]["role"] == "assistant" and body["messages"][-1]["turn_id"]
    assert not set(hidden) & {m["id"] for m in body["messages"]}


def test_history_pages_back_through_what_compaction_hid(tcast):
    for i in range(5):
        chat(tcast.alice, f"message {i}", conversation_id="ca")
    conv = Conversation.objects.get()
    hidden = _hide(conv, 7)
    page1 = get("/v1/ugent/history", tcast.alice, conversation_id="ca", limit=4).json()
    assert [m["id"] for m in page1["data"]] == hidden[-4:] and page1["has_more"] is True
    page2 = get("/v1/ugent/history", tcast.alice, conversation_id="ca", limit=4,
                before=page1["next_before"]).json()
    assert [m["id"] for m in page2["data"]] == hidden[:3] and page2["has_more"] is False
    assert page2["next_before"] is None
    assert page1["data"][1]["content"] == "message 2"


@pytest.mark.parametrize("path", PATHS)
def test_permission_matrix(tcast, path):
    chat(tcast.alice, "hi", conversation_id="ca")
    chat(tcast.carol, "hi", conversation_id="cc")
    ok = {"owner": tcast.alice, "operator": {"key": tcast.keys["operator"]}, "app user": tcast.carol}
    for who, caller in ok.items():
        conv = "cc" if who == "app user" else "ca"
        assert get(path, caller, conversation_id=conv).status_code == 200, who
    refused = {"other user": tcast.bob, "application": {"key": tcast.keys["app"]}, "app user": tcast.carol,
               "outsider": {"key": tcast.keys["outsider"]}}
    for who, caller in refused.items():
        resp = get(path, caller, conversation_id="ca")
        assert resp.status_code == 404 and resp.json()["error"]["message"] == "No such conversation.", who
    assert get(path, {"key": tcast.keys["app"]}, conversation_id="cc").status_code == 404  # carol's, not the app's
    assert get(path, {"key": "ugk_nope"}, conversation_id="ca").status_code == 401
    assert get(path, tcast.alice).status_code == 400
    assert get(path, {"key": tcast.keys["app"]}, conversation_id="cc", user="carol").status_code == 403


@pytest.mark.parametrize("path,params", [("/v1/ugent/snapshot", {"limit": 0}), ("/v1/ugent/snapshot", {"limit": 999}),
                                         ("/v1/ugent/history", {"before": "x"}), ("/v1/ugent/history", {"limit": -1})])
def test_bad_paging_is_a_400_naming_the_field(tcast, path, params):
    chat(tcast.alice, "hi", conversation_id="ca")
    resp = get(path, tcast.alice, conversation_id="ca", **params)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == next(iter(params))
