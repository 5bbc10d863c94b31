"""The Django hub: inbound onto the one message path, the outbound queue and its limits."""
from __future__ import annotations

import asyncio
import logging

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel import services
from plugins_app.channel.bridge import UnknownDelivery
from plugins_app.channel.hub import DjangoHub
from plugins_app.channel.models import DeliveryState, OutboundDelivery
from plugins_app.channel.sdk.messages import InboundMessage
from tests.plugins_app.conftest import make_plugin
from tests.support import scripted


def msg(message_id="m-1", text="hello", sender_id="42", conversation_id="chat-1"):
    return InboundMessage(channel="echo", conversation_id=conversation_id, message_id=message_id,
                          sender_id=sender_id, text=text, source_type="user")


def run(coro):
    return asyncio.run(coro)


def test_an_inbound_message_runs_a_turn_whose_answer_is_queued_for_the_plugin(tcast):
    plugin = make_plugin()
    result = run(DjangoHub().submit_inbound("echo-main", msg(text="script:answer=hi there")))
    assert result["accepted"] and not result["duplicate"]
    turn = Turn.objects.select_related("conversation", "actor").get(turn_id=result["turn_id"])
    assert turn.actor.key == "echo:42"
    assert (turn.conversation.channel, turn.conversation.client_id, turn.conversation.external_id) == \
        ("echo", "echo-main", "chat-1")
    assert turn.receipt.client_message_id == "m-1"
    delivery = OutboundDelivery.objects.get(plugin=plugin)
    assert (delivery.text, delivery.state, delivery.turn_id) == ("hi there", "pending", turn.pk)
    assert delivery.payload["reply_to_message_id"] == "m-1"


def test_a_repeated_channel_message_id_runs_nothing(tcast):
    make_plugin()
    hub = DjangoHub()
    calls = len(scripted.CALLS)
    first = run(hub.submit_inbound("echo-main", msg(text="script:answer=once")))
    again = run(hub.submit_inbound("echo-main", msg(text="script:answer=once")))
    assert first["duplicate"] is False and again["duplicate"] is True
    assert again["turn_id"] == first["turn_id"]
    assert Receipt.objects.count() == Turn.objects.count() == 1
    assert len(scripted.CALLS) == calls + 1
    assert OutboundDelivery.objects.count() == 1


def test_a_sender_outside_allowed_senders_is_refused_before_anything_runs_and_logged(tcast, caplog):
    make_plugin(allowed_senders=["echo:42"])
    hub = DjangoHub()
    with caplog.at_level(logging.WARNING, logger="ugent.plugins"):
        refused = run(hub.submit_inbound("echo-main", msg("m-9", sender_id="999")))
    assert refused == {"accepted": False, "duplicate": False, "reason": "sender not allowed"}
    assert Receipt.objects.count() == 0 and Turn.objects.count() == 0
    assert any("echo:999" in r.getMessage() and "allowed_senders" in r.getMessage() for r in caplog.records)
    allowed = run(hub.submit_inbound("echo-main", msg("m-1", sender_id="42")))
    assert allowed["accepted"] is True and Receipt.objects.count() == 1


def test_a_web_turn_queues_no_delivery(tcast):
    make_plugin()
    from channels_app.services import Submission as Hubmsg, actor_resolve, message_submit
    actor = actor_resolve(caller=tcast.operator, user="alice")
    message_submit(inbound=Hubmsg(actor=actor, text="hi", caller=tcast.operator, conversation_id="echo-main"))
    assert OutboundDelivery.objects.count() == 0


def _queue(plugin, n, text="out"):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id=plugin.plugin_id, external_id="chat-1",
                                   actor=actor, caller=None)
    return [services.delivery_enqueue(plugin=plugin, conversation=conv, text=f"{text}-{i}").delivery_id
            for i in range(n)]


def test_max_in_flight_is_never_exceeded_by_concurrent_polls(tcast):
    plugin = make_plugin(max_in_flight=2)
    ids = _queue(plugin, 5)
    hub = DjangoHub()

    async def polls():
        return await asyncio.gather(*(hub.poll_outbound("echo-main", 5, 0.3) for _ in range(4)))

    batches = run(polls())
    taken = [d.delivery_id for batch in batches for d in batch]
    assert len(taken) == 2 and len(set(taken)) == 2
    assert OutboundDelivery.objects.filter(state=DeliveryState.IN_FLIGHT).count() == 2
    run(hub.ack_outbound("echo-main", taken[0], "delivered", False, None, "ch-1"))
    more = run(hub.poll_outbound("echo-main", 5, 0.3))
    assert [d.delivery_id for d in more] == [ids[2]]  # one slot freed, the next in order
    assert run(hub.poll_outbound("echo-main", 5, 0.1)) == []


def test_a_long_poll_wakes_when_a_delivery_is_queued(tcast):
    plugin = make_plugin()
    hub = DjangoHub()

    async def scenario():
        poll = asyncio.ensure_future(hub.poll_outbound("echo-main", 5, 5.0))
        await asyncio.sleep(0.2)
        assert not poll.done()
        await asyncio.to_thread(_queue, plugin, 1)
        return await asyncio.wait_for(poll, 2.0)

    assert [d.text for d in run(scenario())] == ["out-0"]


def test_max_retries_then_dead_letter_with_the_reason(tcast):
    make_plugin(max_retries=2)
    plugin = make_plugin("other", max_retries=2)
    [delivery_id] = _queue(plugin, 1)
    hub = DjangoHub()
    states = []
    for attempt in (1, 2, 3):
        [d] = run(hub.poll_outbound("other", 5, 1.0))
        assert d.attempt == attempt
        states.append(run(hub.ack_outbound("other", delivery_id, "failed", True, "rate limited"))["state"])
    assert states == ["pending", "pending", "dead_letter"]
    row = OutboundDelivery.objects.get(delivery_id=delivery_id)
    assert row.state == "dead_letter" and row.last_error == "max_retries (2) exceeded: rate limited"
    assert run(hub.poll_outbound("other", 5, 0.1)) == []
    assert run(hub.ack_outbound("other", delivery_id, "delivered", False, None))["duplicate"] is True


def test_a_permanent_failure_is_dead_lettered_at_once(tcast):
    plugin = make_plugin()
    [delivery_id] = _queue(plugin, 1)
    hub = DjangoHub()
    run(hub.poll_outbound("echo-main", 5, 1.0))
    out = run(hub.ack_outbound("echo-main", delivery_id, "failed", False, "chat is gone"))
    assert out["state"] == "dead_letter"
    assert OutboundDelivery.objects.get().last_error == "permanent failure: chat is gone"


def test_an_ack_for_another_plugins_delivery_is_unknown(tcast):
    make_plugin()
    other = make_plugin("other")
    [delivery_id] = _queue(other, 1)
    with pytest.raises(UnknownDelivery):
        run(DjangoHub().ack_outbound("echo-main", delivery_id, "delivered", False, None))
    assert OutboundDelivery.objects.get().state == "pending"


def test_a_new_hello_returns_what_was_in_flight_and_a_cancelled_poll_takes_nothing(tcast):
    plugin = make_plugin()
    _queue(plugin, 2)
    hub = DjangoHub()
    assert len(run(hub.poll_outbound("echo-main", 5, 1.0))) == 2
    limits = run(hub.hello_ok("echo-main", {"kind": "channel-echo"}))
    assert limits == {"heartbeat_secs": 0.2, "max_in_flight": 8, "max_retries": 2}
    assert OutboundDelivery.objects.filter(state="pending").count() == 2

    async def cancelled():
        poll = asyncio.ensure_future(hub.poll_outbound("echo-main", 5, 5.0))
        await asyncio.sleep(0)  # the take is under way in its thread
        poll.cancel()
        with pytest.raises(asyncio.CancelledError):
            await poll

    run(cancelled())
    assert OutboundDelivery.objects.filter(state="pending").count() == 2


def test_media_put_then_get_through_the_hub(tcast):
    make_plugin()
    from plugins_app.channel.sdk.messages import Media
    hub = DjangoHub()
    media_id = run(hub.media_put("echo-main", Media(b"\x89PNG", "image/png", "a.png")))
    got = run(hub.media_get("echo-main", media_id))
    assert (got.data, got.content_type, got.filename) == (b"\x89PNG", "image/png", "a.png")


def test_a_late_failure_ack_from_a_replaced_session_spends_no_attempt(tcast):
    plugin = make_plugin()
    [delivery_id] = _queue(plugin, 1)
    hub = DjangoHub()
    run(hub.poll_outbound("echo-main", 5, 1.0))
    run(hub.hello_ok("echo-main", {"kind": "channel-echo"}))  # a new session: the delivery is pending again
    out = run(hub.ack_outbound("echo-main", delivery_id, "failed", True, "old session timed out"))
    assert out["duplicate"] is True
    row = OutboundDelivery.objects.get(delivery_id=delivery_id)
    assert row.state == "pending" and row.attempt == 1 and row.failures == []
    # the truth still counts whenever it comes: a delivered ack settles it
    assert run(hub.ack_outbound("echo-main", delivery_id, "delivered", False, None))["state"] == "delivered"


def test_a_late_failure_ack_under_an_old_claim_leaves_the_new_holders_delivery_alone(tcast):
    """Session A took it, A was replaced, session B took it again: A's late failure must not requeue it
    (B is sending it; a requeue would send it twice) nor spend an attempt."""
    plugin = make_plugin()
    [delivery_id] = _queue(plugin, 1)
    hub = DjangoHub()
    [first] = run(hub.poll_outbound("echo-main", 5, 1.0))
    services.deliveries_requeue(plugin_id="echo-main")  # session A is gone
    [second] = run(hub.poll_outbound("echo-main", 5, 1.0))  # session B holds it now
    assert first.claim and second.claim and first.claim != second.claim
    assert second.to_dict()["claim"] == second.claim  # the claim goes to the worker, which acks with it
    out = run(hub.ack_outbound("echo-main", delivery_id, "failed", True, "A timed out", claim=first.claim))
    assert out["duplicate"] is True
    row = OutboundDelivery.objects.get(delivery_id=delivery_id)
    assert (row.state, row.attempt, row.failures) == ("in_flight", 1, [])
    # B's own failure under its claim is a real one
    out = run(hub.ack_outbound("echo-main", delivery_id, "failed", True, "B failed", claim=second.claim))
    assert (out["duplicate"], out["state"], out["attempt"]) == (False, "pending", 2)


@pytest.mark.parametrize("error, away", [
    ("OperationalError", True),   # down, restarting, SQLite locked past its timeout
    ("InterfaceError", True),     # the connection is gone
    ("DataError", False),         # a value of this call's the database refuses
    ("IntegrityError", False),    # a constraint this call's data breaks
])
def test_only_a_database_that_is_away_makes_the_host_unavailable(error, away):
    """-32006 makes a worker wait, however long, counting no attempt; an error about one call's own data must
    reach it as -32603 instead, which it counts toward giving that message up (HOLD_ATTEMPTS)."""
    import django.db
    from asgiref.sync import async_to_sync

    from plugins_app.channel.bridge import HostUnavailable
    from plugins_app.channel.hub import _db
    exc_type = getattr(django.db, error)

    def fails():
        raise exc_type("what the database said")
    call = async_to_sync(_db(fails))
    with pytest.raises(HostUnavailable if away else exc_type):
        call()


def test_one_plugins_burst_of_blocked_calls_leaves_another_plugins_call_a_thread(monkeypatch):
    """Every plugin's bridge shares one loop and its thread pool: a plugin's share of it is bounded.

    Plugin A has as many heartbeats in flight as a connection allows (a batch of 64), each stuck in
    the database; plugin B's heartbeat is still answered while they are held.
    """
    import threading
    gate = threading.Event()

    def record(*, plugin_id):
        if plugin_id == "plugin-a":
            gate.wait(30)

    monkeypatch.setattr(services, "plugin_heartbeat_record", record)
    hub = DjangoHub()

    async def scenario():
        held = [asyncio.ensure_future(hub.heartbeat("plugin-a", {})) for _ in range(64)]
        try:
            # wait_for only keeps a broken build from hanging: B's call returns while A's are held.
            await asyncio.wait_for(hub.heartbeat("plugin-b", {}), 20)
            assert not gate.is_set() and not any(t.done() for t in held)
        finally:
            gate.set()
            await asyncio.gather(*held)
        return hub.last_heartbeat("plugin-b")

    assert run(scenario()) is not None


def test_a_plugins_heartbeat_is_answered_while_its_own_work_hangs(monkeypatch):
    """The SDK's host probe asks a heartbeat when a submit hangs: it must not queue behind the plugin's own
    hung calls (they fill its share), or every hung submit reads as "the host is away" and counts no try."""
    import threading
    gate = threading.Event()

    def hanging(**kw):
        gate.wait(30)

    monkeypatch.setattr(services, "plugin_heartbeat_record", lambda *, plugin_id: None)
    hub = DjangoHub()

    async def scenario():
        stuck = [asyncio.ensure_future(hub._db("plugin-a", hanging)()) for _ in range(hub.EXECUTOR_SHARE + 1)]
        try:
            await asyncio.sleep(0)
            await asyncio.wait_for(hub.heartbeat("plugin-a", {}), 20)  # only keeps a broken build from hanging
            assert not gate.is_set() and not any(t.done() for t in stuck)
        finally:
            gate.set()
            await asyncio.gather(*stuck)
        return True

    assert run(scenario())


def test_a_text_over_the_request_limit_is_invalid_params_and_runs_nothing(tcast, settings):
    make_plugin()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100  # UGENT_MAX_REQUEST_BYTES
    from plugins_app.channel.sdk.jsonrpc import InvalidParams
    with pytest.raises(InvalidParams) as refused:
        run(DjangoHub().submit_inbound("echo-main", msg(text="é" * 51)))  # 102 bytes in UTF-8
    assert refused.value.field == "message.text"
    assert str(refused.value.message) == ("Invalid params: message.text: is longer than the host takes: "
                                          "at most 100 bytes (UGENT_MAX_REQUEST_BYTES)")
    assert Receipt.objects.count() == Turn.objects.count() == 0
    assert run(DjangoHub().submit_inbound("echo-main", msg(text="é" * 50)))["accepted"] is True
