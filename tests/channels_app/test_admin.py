"""The admin shows every hub model with working search and filters, and never shows a key."""
from __future__ import annotations

import json
import re

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = {
    "channels_app/caller": {"q": "crm", "role__exact": "application"},
    "channels_app/apikey": {"q": "crm", "active__exact": "1"},
    "channels_app/actor": {"q": "alice", "channel": "web"},
    "channels_app/conversation": {"q": "c1", "channel": "web"},
    "channels_app/turn": {"q": "turn", "state__exact": "completed"},
    "channels_app/receipt": {"q": "m1", "state__exact": "completed"},
    "channels_app/message": {"q": "hello", "role__exact": "user"},
    "channels_app/event": {"q": "turn.completed", "type": "turn.completed"},
    "plugins_app/agentprofile": {"q": "scripted", "provider": "scripted"},
}


def _chat(key, **extra):
    body = {"messages": [{"role": "user", "content": "hello"}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


@pytest.mark.parametrize("page,params", PAGES.items())
def test_each_model_lists_searches_and_filters(tcast, admin_client, page, params):
    _chat(tcast.keys["operator"], user="alice", conversation_id="c1", client_message_id="m1")
    assert admin_client.get(f"/admin/{page}/").status_code == 200
    searched = admin_client.get(f"/admin/{page}/", {"q": params["q"]})
    assert searched.status_code == 200
    filtered = admin_client.get(f"/admin/{page}/", {k: v for k, v in params.items() if k != "q"})
    assert filtered.status_code == 200
    # the filter is real: a result is listed (no "?e=1" error redirect, a row count shown)
    assert b"0 results" not in filtered.content or page == "channels_app/apikey"


def test_a_search_narrows_the_list(tcast, admin_client):
    _chat(tcast.keys["operator"], user="alice", conversation_id="c-alice")
    _chat(tcast.keys["operator"], user="bob", conversation_id="c-bob")
    page = admin_client.get("/admin/channels_app/conversation/", {"q": "c-alice"}).content.decode()
    assert "c-alice" in page and "c-bob" not in page


def test_key_values_are_never_shown_only_hashes(tcast, admin_client):
    from channels_app.models import ApiKey
    key = ApiKey.objects.select_related("caller").get(caller__name="crm")
    page = admin_client.get(f"/admin/channels_app/apikey/{key.pk}/change/").content.decode()
    assert tcast.keys["app"] not in page
    assert key.key_hash in page


def test_issue_a_key_action_shows_it_once_and_it_works(tcast, admin_client):
    from channels_app.models import ApiKey, Caller
    caller = Caller.objects.get(name="crm")
    resp = admin_client.post("/admin/channels_app/caller/", {"action": "issue_key", "_selected_action": [caller.pk]},
                             follow=True)
    text = resp.content.decode()
    raw = text.split("it is not shown again): ")[1].split("<")[0].strip()
    assert raw.startswith("ugk_")
    assert ApiKey.objects.filter(caller=caller).count() == 2
    assert _chat(raw).status_code == 200
    later = admin_client.get("/admin/channels_app/caller/").content.decode()
    assert raw not in later


def test_the_admin_needs_a_staff_login(tcast):
    resp = Client().get("/admin/channels_app/turn/")
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]


def test_a_conversations_identity_is_read_only_and_its_model_choice_editable(tcast, admin_client):
    from channels_app.models import Conversation
    _chat(tcast.keys["operator"], user="alice", conversation_id="c-owned")
    conv = Conversation.objects.get(external_id="c-owned")
    url = f"/admin/channels_app/conversation/{conv.pk}/change/"
    page = admin_client.get(url)
    assert page.status_code == 200
    form = page.context["adminform"].form
    assert set(form.fields) == {"model_choice"}
    # a POST naming the identity fields changes none of them (they are not in the form), the choice it does
    bob = conv.owner.__class__.objects.create(key="web:bob", channel="web", user_id="bob")
    resp = admin_client.post(url, {"model_choice": "scripted", "channel": "telegram", "owner": bob.pk,
                                   "external_id": "stolen", "client_id": "x", "working_directory": "../..",
                                   "messages-TOTAL_FORMS": "0", "messages-INITIAL_FORMS": "0"})
    assert resp.status_code == 302, resp.content[:2000]
    conv.refresh_from_db()
    assert (conv.channel, conv.owner.key, conv.external_id, conv.client_id, conv.working_directory,
            conv.model_choice) == ("web", "web:alice", "c-owned", "", "", "scripted")
    assert admin_client.get("/admin/channels_app/conversation/add/").status_code == 403


def test_a_conversation_that_holds_records_is_not_deleted_in_the_admin(tcast, admin_client):
    # its turns, receipts and events are records, never deleted here, so neither is what holds them
    from channels_app.models import Conversation, Receipt
    _chat(tcast.keys["operator"], user="alice", conversation_id="c-del", client_message_id="m1")
    conv = Conversation.objects.get(external_id="c-del")
    assert admin_client.post(f"/admin/channels_app/conversation/{conv.pk}/delete/", {"post": "yes"}).status_code == 403
    admin_client.post("/admin/channels_app/conversation/", {"action": "delete_selected", "_selected_action": [conv.pk],
                                                            "post": "yes"})
    assert Conversation.objects.filter(pk=conv.pk).exists() and Receipt.objects.filter(client_message_id="m1").exists()


def _conversation_with(tcast, name: str, n: int):
    """A conversation of one chat turn and `n` more messages (bulk), the last one with markup in it."""
    from channels_app.models import Conversation, Message
    _chat(tcast.keys["operator"], user="alice", conversation_id=name)
    conv = Conversation.objects.get(external_id=name)
    turn = conv.turns.get()
    Message.objects.bulk_create([Message(conversation=conv, turn=turn, role=("user", "assistant")[i % 2],
                                         content=f"message number {i}") for i in range(n - 1)]
                                + [Message(conversation=conv, turn=turn, role="user", content="<b>last</b> words")])
    return conv


def test_a_conversations_page_shows_its_newest_messages_and_links_to_all_of_them(tcast, admin_client):
    from channels_app.admin import RECENT_MESSAGES
    from channels_app.models import Message
    conv = _conversation_with(tcast, "c-long", 80)
    page = admin_client.get(f"/admin/channels_app/conversation/{conv.pk}/change/").content.decode()
    newest = list(Message.objects.filter(conversation=conv).order_by("-id").values_list("pk", flat=True))
    shown = [int(pk) for pk in re.findall(r'href="/admin/channels_app/message/(\d+)/change/"', page)]
    assert shown == newest[:RECENT_MESSAGES][::-1]  # the newest, oldest of them first
    assert "&lt;b&gt;last&lt;/b&gt; words" in page and "<b>last</b>" not in page  # text, never markup
    assert f"the newest {RECENT_MESSAGES}, oldest first" in page
    every = f"/admin/channels_app/message/?conversation__id__exact={conv.pk}"
    assert every.replace("&", "&amp;") in page or every in page
    listed = admin_client.get(every)
    assert listed.status_code == 200 and b"message number 3" in listed.content
    other = _conversation_with(tcast, "c-other", 3)
    assert b"message number 1" not in admin_client.get(
        f"/admin/channels_app/message/?conversation__id__exact={other.pk}&q=number+7").content
    short = admin_client.get(f"/admin/channels_app/conversation/{other.pk}/change/").content.decode()
    assert "all of them, oldest first" in short


def test_a_conversations_page_costs_the_same_at_any_length(tcast, admin_client):
    from django.db import connection

    from tests.support.plans import vm_steps
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count")
    short, long = _conversation_with(tcast, "c-s", 60), _conversation_with(tcast, "c-l", 3000)
    steps = {c.external_id: vm_steps(lambda c=c: admin_client.get(
        f"/admin/channels_app/conversation/{c.pk}/change/"), every=10) for c in (short, long)}
    # an inline of every message read and rendered each of them: about 50x the short one's
    assert steps["c-l"] <= steps["c-s"] * 1.05, steps


def test_a_conversations_model_choice_saves_while_messages_arrive(tcast, admin_client):
    from channels_app.models import Conversation
    conv = _conversation_with(tcast, "c-busy", 60)
    url = f"/admin/channels_app/conversation/{conv.pk}/change/"
    assert admin_client.get(url).status_code == 200
    _chat(tcast.keys["operator"], user="alice", conversation_id="c-busy")  # a turn between the page and the save
    resp = admin_client.post(url, {"model_choice": "scripted"})
    assert resp.status_code == 302, resp.content[:2000]
    assert Conversation.objects.get(pk=conv.pk).model_choice == "scripted"


def test_a_save_of_a_conversation_keeps_what_compaction_counted_meanwhile(tcast, admin_client):
    """The form changes the model choice only; a compaction that counts hidden messages between the save's read
    of the conversation and its write keeps its count (a full save wrote back the count it had read)."""
    from unittest import mock

    from django.db.models import F

    from channels_app.admin import ConversationAdmin
    from channels_app.models import Conversation
    conv = _conversation_with(tcast, "c-compacted", 3)
    url = f"/admin/channels_app/conversation/{conv.pk}/change/"
    real_get_object = ConversationAdmin.get_object

    def read_then_compacted(self, request, object_id, from_field=None):
        obj = real_get_object(self, request, object_id, from_field)
        if request.method == "POST":  # as a compaction commits meanwhile
            Conversation.objects.filter(pk=conv.pk).update(hidden_messages=F("hidden_messages") + 30)
        return obj
    with mock.patch.object(ConversationAdmin, "get_object", read_then_compacted):
        assert admin_client.post(url, {"model_choice": "scripted"}).status_code == 302
    conv.refresh_from_db()
    assert (conv.model_choice, conv.hidden_messages) == ("scripted", 30)
