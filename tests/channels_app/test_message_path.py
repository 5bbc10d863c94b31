"""The one message path as a service: channels other than web, and concurrent copies of a message."""
from __future__ import annotations

import threading

import pytest

from channels_app import services
from channels_app.errors import ApplicationError
from channels_app.models import Receipt, Turn

pytestmark = pytest.mark.django_db(transaction=True)


def submit(actor, text, **kw):
    return services.message_submit(inbound=services.Submission(actor=actor, text=text, **kw))


def test_a_group_chat_on_a_plugin_channel_takes_every_senders_messages(tcast):
    ann = services.channel_actor_resolve(channel="telegram", user_id="1")
    ben = services.channel_actor_resolve(channel="telegram", user_id="2")
    a = submit(ann, "hi", channel="telegram", client_id="tg-main", conversation_id="group-9",
               source_type="group", client_message_id="101")
    b = submit(ben, "hello", channel="telegram", client_id="tg-main", conversation_id="group-9",
               source_type="group", client_message_id="102")
    assert a.conversation.pk == b.conversation.pk
    assert Receipt.objects.get(client_message_id="102").state == "completed"


def test_on_the_web_channel_a_conversation_stays_its_first_senders(tcast):
    alice = services.actor_resolve(caller=tcast.operator, user="alice")
    bob = services.actor_resolve(caller=tcast.operator, user="bob")
    submit(alice, "mine", conversation_id="w1", caller=tcast.operator)
    with pytest.raises(ApplicationError) as info:
        submit(bob, "let me in", conversation_id="w1", caller=tcast.operator)
    assert info.value.status == 403


def test_concurrent_copies_through_the_service_run_one_turn(tcast):
    actor = services.channel_actor_resolve(channel="slack", user_id="U1")
    results, barrier = [], threading.Barrier(8)

    def go():
        from django.db import connection
        barrier.wait()
        try:
            submit(actor, "same", channel="slack", client_id="sl", conversation_id="C1", client_message_id="m-1")
            results.append("ok")
        except ApplicationError as exc:
            results.append(exc.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 1, results
    assert set(results) - {"ok"} <= {"DuplicateInFlight", "DuplicateProcessed"}
    assert Turn.objects.count() == 1
