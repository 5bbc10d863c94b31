"""One delivery contract, run over both hubs: ``InMemoryHub`` (the SDK's test host) and the Django hub.

Both keep ``plugins_app.channel.bridge.policy``; these tests pin what that means at each hub's interface:
claim, ack delivered, ack failed (retryable and not), backoff, dead letter after max retries,
the in-flight limit, requeue on a new session, and acks matched to the claim that holds the delivery.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import os

import pytest

from plugins_app.channel.bridge import BridgeServer, InMemoryHub, ServerThread
from plugins_app.channel.bridge.policy import DeliveryPolicy

from .conftest import make_plugin
from .test_jsonrpc import PLUGIN_ID, TOKEN, LineConn, hello_params, short_socket_dir

# the Django hub's threads read committed rows
pytestmark = pytest.mark.django_db(transaction=True)

MAX_IN_FLIGHT = 2
MAX_RETRIES = 2


LOOP = None


def run(coro):
    """One event loop for a test's calls, as the bridge's own loop would be (the in-memory hub binds to it)."""
    return LOOP.run_until_complete(coro)


class MemoryHost:
    """The in-memory hub with a clock the test moves."""

    name = "memory"

    def __init__(self, backoff_secs):
        self.now = 1000.0
        self.hub = InMemoryHub(max_in_flight=MAX_IN_FLIGHT, max_retries=MAX_RETRIES,
                               retry_backoff_secs=backoff_secs, clock=lambda: self.now)
        self.plugin_id = PLUGIN_ID

    def enqueue(self, n):
        return [self.hub.enqueue("chat-1", f"out-{i}") for i in range(n)]

    def state(self, delivery_id):
        d = self.hub.delivery(delivery_id)
        return {"state": d["state"], "attempt": d["attempt"], "failures": d["failures"],
                "reason": d["reason"], "handed_out": d["handed_out"]}

    def end_backoffs(self):
        self.now += 10_000


class DjangoHost:
    """The Django hub over real rows (SQLite or PostgreSQL, as the run mode says)."""

    name = "django"

    def __init__(self, backoff_secs, monkeypatch):
        from plugins_app.channel import conf
        from plugins_app.channel.hub import DjangoHub
        monkeypatch.setattr(conf, "RETRY_BACKOFF_SECS", backoff_secs)
        self.plugin = make_plugin(PLUGIN_ID, max_in_flight=MAX_IN_FLIGHT, max_retries=MAX_RETRIES)
        self.plugin_id = PLUGIN_ID
        self.hub = DjangoHub()

    def enqueue(self, n):
        from channels_app.services import channel_actor_resolve, conversation_resolve
        from plugins_app.channel import services
        actor = channel_actor_resolve(channel="echo", user_id="42")
        conv, _ = conversation_resolve(channel="echo", client_id=self.plugin_id, external_id="chat-1",
                                       actor=actor, caller=None)
        return [services.delivery_enqueue(plugin=self.plugin, conversation=conv, text=f"out-{i}").delivery_id
                for i in range(n)]

    def state(self, delivery_id):
        from plugins_app.channel.models import OutboundDelivery
        d = OutboundDelivery.objects.get(delivery_id=delivery_id)
        return {"state": d.state, "attempt": d.attempt, "failures": list(d.failures),
                "reason": d.last_error if d.state == "dead_letter" else None, "handed_out": d.handed_out}

    def end_backoffs(self):
        from django.utils import timezone

        from plugins_app.channel.models import OutboundDelivery
        # the clock cannot be moved for the database: move the retries' due time into the past instead
        OutboundDelivery.objects.filter(not_before__isnull=False).update(
            not_before=timezone.now() - dt.timedelta(seconds=1))


@pytest.fixture(autouse=True)
def _loop():
    global LOOP
    LOOP = asyncio.new_event_loop()
    yield
    LOOP.close()


@pytest.fixture(params=["memory", "django"])
def make_host(request, monkeypatch):
    def make(backoff_secs=0.0):
        if request.param == "memory":
            return MemoryHost(backoff_secs)
        return DjangoHost(backoff_secs, monkeypatch)
    return make


def poll(host, max_items=10, timeout=0.0):
    return run(host.hub.poll_outbound(host.plugin_id, max_items, timeout))


def ack(host, delivery_id, status="delivered", retryable=False, reason=None, claim=None):
    return run(host.hub.ack_outbound(host.plugin_id, delivery_id, status, retryable, reason, None, claim=claim))


# --- the contract --------------------------------------------------------------------------

def test_a_poll_claims_in_queue_order_and_marks_each_hand_out_with_a_claim(make_host):
    host = make_host()
    ids = host.enqueue(2)
    taken = poll(host)
    assert [d.delivery_id for d in taken] == ids
    assert all(d.claim for d in taken) and all(d.to_dict()["claim"] == d.claim for d in taken)
    assert [host.state(i)["state"] for i in ids] == ["in_flight", "in_flight"]


def test_a_delivered_ack_is_final_and_a_repeat_is_a_duplicate(make_host):
    host = make_host()
    [d] = host.enqueue(1)
    [w] = poll(host)
    assert ack(host, d, claim=w.claim) == {"state": "delivered", "attempt": 1, "duplicate": False}
    assert ack(host, d, claim=w.claim)["duplicate"] is True
    assert ack(host, d, "failed", True, "late", claim=w.claim)["duplicate"] is True
    assert host.state(d)["state"] == "delivered" and poll(host) == []


def test_a_retryable_failure_comes_back_with_the_next_attempt_only_after_its_backoff(make_host):
    host = make_host(backoff_secs=30.0)
    [d] = host.enqueue(1)
    [w] = poll(host)
    assert ack(host, d, "failed", True, "429", claim=w.claim) == {"state": "pending", "attempt": 2,
                                                                   "duplicate": False}
    assert poll(host) == []  # still backing off
    host.end_backoffs()
    [again] = poll(host)
    assert (again.delivery_id, again.attempt) == (d, 2) and again.claim != w.claim


def test_a_permanent_failure_is_dead_lettered_at_once_with_its_reason(make_host):
    host = make_host()
    [d] = host.enqueue(1)
    [w] = poll(host)
    assert ack(host, d, "failed", False, "chat is gone", claim=w.claim)["state"] == "dead_letter"
    s = host.state(d)
    assert (s["state"], s["reason"], s["failures"], s["handed_out"]) == \
        ("dead_letter", "permanent failure: chat is gone", ["chat is gone"], 1)
    assert poll(host) == []


def test_the_attempt_that_uses_the_last_retry_is_dead_lettered_when_it_fails(make_host):
    host = make_host()
    [d] = host.enqueue(1)
    states = []
    for attempt in range(1, MAX_RETRIES + 2):
        [w] = poll(host)
        assert w.attempt == attempt
        states.append(ack(host, d, "failed", True, "rate limited", claim=w.claim)["state"])
    assert states == ["pending"] * MAX_RETRIES + ["dead_letter"]
    s = host.state(d)
    assert s["reason"] == f"max_retries ({MAX_RETRIES}) exceeded: rate limited"
    assert s["failures"] == ["rate limited"] * (MAX_RETRIES + 1) and poll(host) == []


def test_a_plugin_never_holds_more_than_max_in_flight_and_an_ack_frees_a_slot(make_host):
    host = make_host()
    ids = host.enqueue(MAX_IN_FLIGHT + 2)
    first = poll(host)
    assert [d.delivery_id for d in first] == ids[:MAX_IN_FLIGHT]
    assert poll(host) == []
    ack(host, first[0].delivery_id, claim=first[0].claim)
    [nxt] = poll(host)
    assert nxt.delivery_id == ids[MAX_IN_FLIGHT]


def test_a_new_session_requeues_what_was_in_flight_with_the_same_attempt(make_host):
    host = make_host()
    ids = host.enqueue(2)
    old = poll(host)
    run(host.hub.hello_ok(host.plugin_id, {"kind": "channel-echo"}))
    assert [host.state(i)["state"] for i in ids] == ["pending", "pending"]
    again = poll(host)
    assert [(d.delivery_id, d.attempt) for d in again] == [(i, 1) for i in ids]
    assert {d.claim for d in again}.isdisjoint({d.claim for d in old})


def test_a_replaced_holders_late_failure_changes_nothing_and_the_message_goes_out_once(make_host):
    host = make_host()
    [d] = host.enqueue(1)
    [a] = poll(host)                                        # session A holds it
    run(host.hub.hello_ok(host.plugin_id, {"kind": "channel-echo"}))  # session B replaces A
    [b] = poll(host)                                        # B holds it now, under another claim
    late = ack(host, d, "failed", True, "A timed out", claim=a.claim)
    assert late["duplicate"] is True
    s = host.state(d)
    assert (s["state"], s["attempt"], s["failures"]) == ("in_flight", 1, [])
    assert poll(host) == []                                 # not requeued behind B's back
    assert ack(host, d, "delivered", claim=a.claim)["state"] == "delivered"  # the truth, whoever says it
    assert host.state(d)["handed_out"] == 2 and poll(host) == []


def test_a_failure_from_a_session_that_holds_no_claim_on_it_changes_nothing(make_host):
    host = make_host()
    [d] = host.enqueue(1)
    poll(host)
    assert ack(host, d, "failed", True, "not mine", claim="")["duplicate"] is True
    assert host.state(d)["state"] == "in_flight"
    run(host.hub.requeue_outbound(host.plugin_id, [d]))
    assert ack(host, d, "failed", True, "nobody holds it")["duplicate"] is True  # pending: nothing spent
    assert (host.state(d)["state"], host.state(d)["attempt"]) == ("pending", 1)


# --- through the bridge: the claim on the wire -------------------------------------------------

def test_over_the_wire_a_late_ack_is_matched_by_its_own_claim_and_the_delivery_goes_out_once(make_host):
    host = make_host()
    path = os.path.join(short_socket_dir(), "bridge.sock")
    server = BridgeServer(socket_path=path, plugin_id=PLUGIN_ID, token=TOKEN, hub=host.hub)
    with ServerThread(server):
        a, b = LineConn(path), LineConn(path)
        try:
            assert "result" in a.call("hello", hello_params())
            [d] = host.enqueue(1)
            [held_by_a] = a.call("outbound.poll", {"timeout_secs": 5}, id=2)["result"]["deliveries"]
            assert "result" in b.call("hello", hello_params())       # A is replaced
            [held_by_b] = b.call("outbound.poll", {"timeout_secs": 5}, id=2)["result"]["deliveries"]
            assert held_by_a["delivery_id"] == held_by_b["delivery_id"] == d
            assert held_by_a["claim"] != held_by_b["claim"]
            # A's failure reaches the host late, naming the claim it answers
            late = b.call("outbound.ack", {"delivery_id": d, "status": "failed", "retryable": True,
                                           "reason": "A timed out", "claim": held_by_a["claim"]}, id=3)["result"]
            assert late["duplicate"] is True and late["state"] == "in_flight"
            assert b.call("outbound.poll", {"timeout_secs": 0}, id=4)["result"]["deliveries"] == []
            done = b.call("outbound.ack", {"delivery_id": d, "status": "delivered"}, id=5)["result"]
            assert (done["state"], done["duplicate"]) == ("delivered", False)
        finally:
            a.close()
            b.close()
    assert host.state(d)["handed_out"] == 2  # A's copy and B's: no third hand-out, one send


# --- the policy itself -------------------------------------------------------------------------

def test_backoff_doubles_with_each_attempt_and_stops_at_its_cap():
    policy = DeliveryPolicy(backoff_secs=2.0, backoff_max_secs=10.0)
    assert [policy.backoff(a) for a in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert policy.room(in_flight=63, max_items=10) == 1 and policy.room(in_flight=70, max_items=1) == 0
