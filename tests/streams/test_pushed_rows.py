"""A turn's event appends carry their rows to readers; a reader takes them only when they follow its cursor.

The pushed rows save the chat stream a database read. They must never let it skip an event: a batch that
does not start where the reader stands, a plain wake-up, or too many held batches send it to the database.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from channels_app import notify
from channels_app.api import _take_pushed, turn_events
from channels_app.events import events_append, turn_topic
from channels_app.models import Conversation, Event, Receipt, Turn
from channels_app.notify import TurnBatch


def _batch(prev, *ids):
    return TurnBatch(prev=prev, rows=tuple((i, "turn.delta", {"text": str(i)}) for i in ids))


def test_contiguous_batches_are_taken_in_order():
    rows = _take_pushed([_batch(4, 5, 6), _batch(6, 9)], cursor=4)
    assert [r[0] for r in rows] == [5, 6, 9]


def test_a_batch_that_does_not_start_at_the_cursor_sends_the_reader_to_the_database():
    assert _take_pushed([_batch(5, 7)], cursor=4) is None
    # out of commit order: the later batch arrived first
    assert _take_pushed([_batch(6, 7), _batch(4, 5, 6)], cursor=4) is None


def test_batches_already_read_are_skipped_and_nothing_pushed_means_read():
    assert _take_pushed([_batch(2, 3, 4), _batch(4, 5)], cursor=4) == [(5, "turn.delta", {"text": "5"})]
    assert _take_pushed([], cursor=4) is None
    assert _take_pushed(None, cursor=4) is None


def test_a_plain_wake_up_or_too_many_held_batches_make_take_say_read():
    async def scenario():
        w = await notify.subscribe("t:test")
        try:
            w._wake(_batch(0, 1))
            assert w.take() == [_batch(0, 1)]
            w._wake(_batch(1, 2))
            w._wake(None)
            assert w.take() is None
            for i in range(notify.MAX_HELD_BATCHES + 1):
                w._wake(_batch(i, i + 1))
            assert w.take() is None
            assert w.take() == []  # and it starts over
        finally:
            w.close()
    asyncio.run(scenario())


def _turn(tcast, n):
    from channels_app.services import actor_resolve
    actor = actor_resolve(caller=tcast.operator, user="alice")
    conv = Conversation.objects.create(external_id=f"c-push-{n}", owner=actor)
    receipt = Receipt.objects.create(conversation=conv, actor=actor, client_message_id=f"m{n}", content_hash="x")
    return Turn.objects.create(turn_id=f"turn-push-{n}", conversation=conv, actor=actor, receipt=receipt)


@pytest.mark.django_db(transaction=True)
def test_an_append_names_the_turns_previous_event_even_with_other_turns_between(tcast, monkeypatch):
    a, b = _turn(tcast, 1), _turn(tcast, 2)
    published = []
    monkeypatch.setattr(notify, "publish", lambda *topics, batch=None, **kw: published.append(batch))
    first = events_append(conversation_id=a.conversation_id, turn_pk=a.pk, items=[("turn.delta", {"n": 1}, [])])
    events_append(conversation_id=b.conversation_id, turn_pk=b.pk, items=[("turn.delta", {"n": 2}, [])])
    third = events_append(conversation_id=a.conversation_id, turn_pk=a.pk,
                          items=[("turn.delta", {"n": 3}, []), ("turn.completed", {"n": 4}, [])])
    topic, batch = published[-1]
    assert topic == turn_topic(a.pk)
    assert batch.prev == first[0]
    assert [r[0] for r in batch.rows] == third
    assert [r[1] for r in batch.rows] == ["turn.delta", "turn.completed"]
    assert published[0][1].prev == 0  # the turn's first event


@pytest.mark.django_db(transaction=True)
def test_the_chat_stream_reader_gets_every_event_once_in_order_from_pushes_and_reads(tcast):
    """Events appended from another thread while the reader waits: pushed, read, or both, never lost or doubled."""
    turn = _turn(tcast, 3)
    appended = []

    def writer(ready: threading.Event):
        ready.wait(5)
        for i in range(30):
            appended.extend(events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                                          items=[("turn.delta", {"segment": "answer", "text": str(i)}, [])]))
        appended.extend(events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                                      items=[("turn.completed", {"answer": ""}, [])]))
        connection.close()

    async def reader():
        ready = threading.Event()
        thread = threading.Thread(target=writer, args=(ready,))
        thread.start()
        seen = []
        async for row in turn_events(turn.pk):
            if row is None:
                continue
            seen.append(row[0])
            ready.set()
        await sync_to_async(thread.join)()
        return seen

    # the reader's first read finds the user message written before it subscribed
    first = events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                          items=[("ugent.user_message", {"content": "hi"}, [])])
    seen = asyncio.run(reader())
    assert seen == first + appended


@pytest.mark.skipif("not __import__('os').environ.get('REDIS_URL')", reason="servers mode: Redis pub/sub")
def test_a_batch_published_by_another_deployment_on_the_same_redis_is_never_heard():
    """Deployments sharing a Redis (pub/sub ignores the database number) each hear only their own channels."""
    import json as _json

    import redis
    from django.conf import settings

    async def scenario():
        w = await notify.subscribe("turn:424242")
        try:
            client = redis.Redis.from_url(settings.REDIS_URL)
            payload = _json.dumps([0, [[1, "turn.delta", {"text": "another deployment's answer"}]]])
            for _ in range(50):  # until the listener has subscribed: our own wake-up arrives
                client.publish(notify.channel_prefix() + "turn:0", b"1")
                client.publish("ugent:n:another-deployment:turn:424242", payload)
                client.publish("ugent:n:turn:424242", payload)  # the old, unprefixed channel
                await asyncio.sleep(0.05)
            assert w.take() == [] and not w.event.is_set()
            client.publish(notify.channel_prefix() + "turn:424242", payload)
            await w.wait(5)
            assert [b.rows[0][2]["text"] for b in w.take()] == ["another deployment's answer"]
        finally:
            w.close()
    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_a_new_turns_reader_subscribed_before_commit_hears_every_event_without_reading_back(tcast, monkeypatch):
    """The chat API subscribes a new turn's reader inside the submitting transaction: the user message and
    everything the runner appends arrive with their wake-ups, in order, and the database is never read."""
    from channels_app import api
    from django.http.request import HttpHeaders
    reads = []
    real_read = api._events_after
    monkeypatch.setattr(api, "_events_after", lambda *a: reads.append(a) or real_read(*a))
    published = []
    real_publish = notify.publish
    monkeypatch.setattr(notify, "publish", lambda *t, batch=None, **kw: published.append(batch) or real_publish(*t, batch=batch, **kw))
    # the turn's task is not run here: this test appends the runner's events itself
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    headers = HttpHeaders({"HTTP_X_API_KEY": tcast.keys["operator"]})

    async def main():
        loop = asyncio.get_running_loop()
        data, result, refused, waiter = await sync_to_async(api._accept, thread_sensitive=False)(
            headers, {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}, loop)
        assert refused is None and waiter is not None
        turn = result.turn
        assert waiter in notify._waiters[turn_topic(turn.pk)]
        # subscribed before the commit: the user message's batch was already delivered to it
        assert published and published[0][1].prev == 0
        appended = []

        def runner():
            for i in range(5):
                appended.extend(events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                                              items=[("turn.delta", {"segment": "answer", "text": str(i)}, [])]))
            appended.extend(events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk,
                                          items=[("turn.completed", {"answer": ""}, [])]))
            connection.close()

        thread = threading.Thread(target=runner)
        thread.start()
        seen = [row async for row in turn_events(turn.pk, waiter) if row is not None]
        await sync_to_async(thread.join)()
        assert turn_topic(turn.pk) not in notify._waiters  # the reader let go at the end
        return turn, seen, appended

    turn, seen, appended = asyncio.run(main())
    user_message = list(Event.objects.filter(turn=turn, type="ugent.user_message").values_list("id", flat=True))
    assert [row[0] for row in seen] == user_message + appended
    assert [row[1] for row in seen][0] == "ugent.user_message" and seen[-1][1] == "turn.completed"
    assert reads == []


@pytest.mark.django_db(transaction=True)
def test_a_message_refused_after_its_turn_was_made_leaves_no_subscription_behind(tcast, monkeypatch):
    """A refusal raised after the turn's reader subscribed (the transaction then rolls back): no waiter stays."""
    from channels_app import api, services
    from channels_app.errors import ApplicationError
    from django.http.request import HttpHeaders
    subscribed = []
    real_register = notify.register
    monkeypatch.setattr(notify, "register", lambda *a: subscribed.append(real_register(*a)) or subscribed[-1])
    real_locked = services._submit_locked

    def refuse_after_the_turn(*args, **kwargs):
        real_locked(*args, **kwargs)
        raise ApplicationError("refused late", status=409, code="late_refusal")

    monkeypatch.setattr(services, "_submit_locked", refuse_after_the_turn)
    headers = HttpHeaders({"HTTP_X_API_KEY": tcast.keys["operator"]})

    async def main():
        return await sync_to_async(api._accept, thread_sensitive=False)(
            headers, {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            asyncio.get_running_loop())

    data, result, refused, waiter = asyncio.run(main())
    assert result is None and waiter is None and refused.code == "late_refusal"
    assert len(subscribed) == 1  # the turn was made and its reader subscribed before the refusal
    assert subscribed[0].topic not in notify._waiters
    assert not Turn.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_request_cancelled_while_its_message_is_accepted_lets_go_of_the_turns_waiter(tcast, monkeypatch):
    """The client leaves mid-accept: the accept finishes on its thread, and the waiter it made is closed."""
    from django.test import RequestFactory
    from channels_app import api
    release = threading.Event()
    made = []
    real_accept = api._accept

    def slow_accept(headers, payload, loop=None):
        out = real_accept(headers, payload, loop)
        made.append(out[3])
        release.wait(10)
        return out

    monkeypatch.setattr(api, "_accept", slow_accept)
    monkeypatch.setattr("channels_app.tasks.run_turn.delay", lambda pk: None)
    request = RequestFactory().post("/v1/chat/completions", data=b'{"model": "scripted", "messages": '
                                    b'[{"role": "user", "content": "hi"}]}', content_type="application/json",
                                    HTTP_X_API_KEY=tcast.keys["operator"])

    async def main():
        view = asyncio.ensure_future(api.ChatCompletionApi().post(request))
        while not made:
            await asyncio.sleep(0.01)
        view.cancel()
        release.set()  # (the cancelled view waits for the accept to end: api._accept_settled)
        with pytest.raises(asyncio.CancelledError):
            await view
        for _ in range(200):
            if made[0].topic not in notify._waiters:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main()) is True
