"""channel-salesforce end to end: the real supervisor runs the worker against a fake Salesforce org on loopback.

The fake (tests/fakes/salesforce.py) speaks the OAuth token endpoint, the Streaming API's CometD (Bayeux,
long polling, durable replay) and the REST sObject create a platform event is published with; the worker is
the built-in kind with no command.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin
from tests.fakes.salesforce import CONVERSATION, INBOUND, OUTBOUND, USER, FakeSalesforce
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "salesforce-main"
ENV_REFS = ["SALESFORCE_CLIENT_ID", "SALESFORCE_CLIENT_SECRET", "SALESFORCE_LOGIN_URL"]
CHANNEL = f"/event/{INBOUND}"


@pytest.fixture
def sf(monkeypatch):
    fake = FakeSalesforce().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def sf_plugin(*args: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second worker
    return make_plugin(PID, kind="channel-salesforce", command="", args=["--api-version", "62.0", *args],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def subscribed(rt, sf: FakeSalesforce, n: int = 1) -> None:
    """Wait until the worker has subscribed ``n`` times (and the fake knows the subscription)."""
    assert wait_until(lambda: len(sf.bayeux("/meta/subscribe")) >= n and sf.subscribed(), 30), rt.log(PID)


def answered(sf: FakeSalesforce, n: int = 1, timeout: float = 30) -> list[str]:
    assert wait_until(lambda: len(sf.texts()) >= n, timeout), [c.answer for c in sf.publishes()]
    return sf.texts()


def replays(sf: FakeSalesforce) -> list:
    return [m["ext"]["replay"][CHANNEL] for m in sf.bayeux("/meta/subscribe")]


def delivered(rt, n: int = 1, timeout: float = 30) -> None:
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() >= n, timeout), rt.log(PID)


def test_an_event_in_gets_the_agents_answer_published_out(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    event = sf.say("script:answer=hello from the agent")
    assert answered(sf) == ["hello from the agent"]
    delivered(rt)
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    [published] = sf.published
    uuid = event["data"]["event"]["EventUuid"]
    assert published == {"ConversationId__c": CONVERSATION, "Text__c": "hello from the agent",
                         "DeliveryId__c": delivery.delivery_id, "Part__c": 1, "Parts__c": 1, "InReplyTo__c": uuid,
                         "id": published["id"], "event": OUTBOUND, "EventUuid": published["EventUuid"]}
    [publish] = sf.publishes()
    # the worker sent the token the token endpoint gave it, as a Bearer token
    [token] = sf.calls_to("/services/oauth2/token")
    assert publish.headers["authorization"] == f"Bearer {token.answer['access_token']}"
    # the event's EventUuid is the idempotency key; the conversation field is the conversation
    assert delivery.turn.receipt.client_message_id == uuid
    assert (delivery.conversation.channel, delivery.conversation.external_id) == ("salesforce", CONVERSATION)
    # the answer's channel_message_id is the EventUuid a Salesforce-side subscriber sees on the outbound event
    assert delivery.channel_message_id == published["EventUuid"] != published["id"]
    assert Receipt.objects.select_related("actor").get().actor.key == f"salesforce:{USER}"
    assert replays(sf) == [-1]  # the first start takes new events only
    assert token.body == {"grant_type": "client_credentials", "client_id": sf.client_id,
                          "client_secret": sf.client_secret}
    assert Plugin.objects.get().state == "running"


def test_the_same_message_published_twice_runs_one_turn(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    sf.say("script:answer=only once", message_id="msg-1")
    answered(sf, 1)
    sf.say("script:answer=only once", message_id="msg-1")  # the publisher retried: a second event, same id
    sf.say("script:answer=after", message_id="msg-2")
    answered(sf, 2)
    wait_until(lambda: False, 0.5)
    assert sf.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id="msg-1").count() == 1
    assert Receipt.objects.count() == 2


def test_a_long_answer_is_split_at_the_text_fields_length_one_event_a_part(tcast, sf, start_runtime):
    sf.events[OUTBOUND]["Text__c"] = ("LongTextArea", 1000)
    sf_plugin("--text-limit", "1000")
    rt = start_runtime()
    subscribed(rt, sf)
    answer = "\n\n".join(f"paragraph {i} " + "word " * 60 for i in range(12))  # about 3,800 characters
    sf.say("script:answer=" + answer)
    delivered(rt)
    published = sf.published
    assert len(published) == 4 and all(len(p["Text__c"]) <= 1000 for p in published)
    assert " ".join(p["Text__c"] for p in published).split() == answer.split()
    delivery = OutboundDelivery.objects.get()
    assert [(p["DeliveryId__c"], p["Part__c"], p["Parts__c"]) for p in published] == [
        (delivery.delivery_id, n, 4) for n in (1, 2, 3, 4)]


def test_503_is_waited_out_and_request_limit_exceeded_goes_back_to_the_hub(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    sf.busy(times=2, status=503)
    sf.say("script:answer=patience")
    assert answered(sf) == ["patience"]
    unavailable, again, sent = sf.publishes()
    assert (unavailable.status, unavailable.answer[0]["errorCode"]) == (503, "SERVER_UNAVAILABLE")
    assert again.status == 503 and sent.status == 201
    assert again.at - unavailable.at >= 0.9 and sent.at - again.at >= 1.9  # 1 s, then 2 s
    delivered(rt)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host
    sf.busy(times=1, status=403)  # REQUEST_LIMIT_EXCEEDED: the org's API requests over 24 hours
    sf.say("script:answer=later")
    assert answered(sf, 2) == ["patience", "later"]
    delivered(rt, 2)
    limited = sf.publishes()[3]
    assert (limited.status, limited.answer[0]["errorCode"]) == (403, "REQUEST_LIMIT_EXCEEDED")
    # not waited on in place: the send failed retryable and the hub's retry published it
    later = OutboundDelivery.objects.exclude(pk=OutboundDelivery.objects.order_by("pk").first().pk).get()
    assert later.attempt == 2 and later.state == "delivered"


def test_a_field_salesforce_refuses_dead_letters_the_delivery(tcast, sf, start_runtime):
    del sf.events[OUTBOUND]["DeliveryId__c"]  # the admin left a field out of the outbound event
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    sf.say("script:answer=unsent")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    [publish] = sf.publishes()
    assert (publish.status, publish.answer[0]["errorCode"]) == (400, "INVALID_FIELD")
    assert "No such column 'DeliveryId__c'" in OutboundDelivery.objects.get().last_error
    assert not sf.texts()
    assert Plugin.objects.get().state == "running"


def test_an_expired_token_is_fetched_again_for_the_stream_and_the_publish(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    stale = set(sf.tokens)
    sf.expire_tokens()
    sf.say("script:answer=still here")
    assert answered(sf) == ["still here"]
    assert len(sf.calls_to("/services/oauth2/token")) >= 2
    refused = [a for c in sf.calls if c.path.startswith("/cometd/") for a in c.answer
               if a.get("error") == "401::Authentication invalid"]
    assert refused  # the stream was told, fetched a new token and handshook again
    [publish] = [p for p in sf.publishes() if p.status == 201]
    assert publish.headers["authorization"].removeprefix("Bearer ") not in stale
    assert Plugin.objects.get().enabled


def test_an_unknown_client_handshakes_again_and_resumes_from_the_last_replay_id(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    first = sf.say("script:answer=one")
    answered(sf, 1)
    sf.forget_clients()  # 403::Unknown client on the next connect
    subscribed(rt, sf, 2)
    sf.say("script:answer=two")
    assert answered(sf, 2) == ["one", "two"]
    assert replays(sf)[:2] == [-1, first["data"]["event"]["replayId"]]
    assert len(sf.bayeux("/meta/handshake")) >= 2
    assert Receipt.objects.count() == 2


def test_a_replay_id_salesforce_no_longer_keeps_falls_back_to_every_event_kept(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    first = sf.say("script:answer=one")
    answered(sf, 1)
    old = first["data"]["event"]["replayId"]
    sf.expire_before(old + 1)  # past the 72 hours
    sf.forget_clients()
    sf.say("script:answer=two")
    assert answered(sf, 2) == ["one", "two"]
    refused = [c for c in sf.calls if c.path.startswith("/cometd/") and isinstance(c.answer, list)
               and any("replayId" in str(a.get("error")) for a in c.answer)]
    assert refused and "{%d}" % old in refused[0].answer[0]["error"]
    assert replays(sf)[1:3] == [old, -2]
    assert "no longer kept by Salesforce" in rt.log(PID)
    assert Receipt.objects.count() == 2


def test_replay_from_all_takes_the_events_published_before_the_first_start(tcast, sf, start_runtime):
    sf.say("script:answer=while away")
    sf_plugin("--replay-from", "all")
    start_runtime()
    assert answered(sf) == ["while away"]
    assert replays(sf)[0] == -2


def test_new_only_stays_new_only_when_the_worker_restarts_before_taking_any_event(tcast, sf, start_runtime):
    import time
    sf.say("script:answer=from last week", created=time.time() - 3600)  # kept on the bus, older than the start
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)  # no event recorded yet: no replay id to resume from
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, first) and len(replays(sf)) >= 2, 30), rt.log(PID)
    sf.say("script:answer=new")
    assert answered(sf) == ["new"]
    wait_until(lambda: False, 0.5)
    assert sf.texts() == ["new"] and Receipt.objects.count() == 1
    assert replays(sf)[:2] == [-1, -2]


def test_a_client_salesforce_refuses_later_disables_the_plugin(tcast, sf, start_runtime, admin_client):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    sf.revoke_client()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == (
        "the channel refused the worker: POST /services/oauth2/token: 400 invalid_client: invalid client "
        "credentials: the connected app's consumer key or secret (SALESFORCE_CLIENT_ID, SALESFORCE_CLIENT_SECRET) "
        "or its client credentials flow (enabled, with a run-as user) is refused (fix it in Setup, App Manager)")
    calls = len(sf.calls)
    wait_until(lambda: False, 1.5)
    assert len(sf.calls) == calls  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert "invalid client credentials" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_client_refused_at_start_disables_the_plugin_before_it_subscribes(tcast, sf, start_runtime):
    sf.revoke_client()
    sf_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: POST /services/oauth2/token: 400 invalid_client")
    wait_until(lambda: False, 1.0)
    assert len(sf.calls_to("/services/oauth2/token")) == 1
    assert not sf.bayeux("/meta/handshake")


def test_a_worker_killed_after_an_event_arrived_answers_it_exactly_once(tcast, sf, start_runtime):
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    first = rt.worker_pid(PID)
    event = sf.say("script:answer=exactly once")
    assert sf.delivered.wait(30)
    os.kill(first, signal.SIGKILL)  # wherever it was: before the outbox, before the replay id, before the hub
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, first), 30), rt.log(PID)
    delivered(rt)
    sf.say("script:answer=next")
    answered(sf, 2)
    wait_until(lambda: False, 0.5)
    assert sf.texts() == ["exactly once", "next"]
    uuid = event["data"]["event"]["EventUuid"]
    assert Turn.objects.filter(receipt__client_message_id=uuid).count() == 1
    # the restarted worker resumed from the replay id recorded, or (none recorded yet) from every event kept
    # less those older than its first start: never from "new only" again, which would skip the event
    assert replays(sf)[0] == -1 and len(replays(sf)) >= 2 and -1 not in replays(sf)[1:]


def test_a_worker_killed_before_it_could_record_an_event_is_given_it_again(tcast, sf, start_runtime):
    import sqlite3
    sf_plugin()
    rt = start_runtime()
    subscribed(rt, sf)
    sf.say("script:answer=one")
    answered(sf, 1)
    outbox = rt.root / "state" / f"{PID}.outbox.sqlite3"
    replay_file = rt.root / "state" / f"{PID}.salesforce-replay.sqlite3"
    assert outbox.exists() and replay_file.exists()
    # another writer holds the outbox: the worker receives the next event but cannot write it down
    lock = sqlite3.connect(str(outbox), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    sf.delivered.clear()
    event = sf.say("script:answer=two")
    assert sf.delivered.wait(30)
    wait_until(lambda: False, 0.5)
    recorded = sqlite3.connect(str(replay_file)).execute("SELECT replay_id FROM replay").fetchone()[0]
    assert recorded < event["data"]["event"]["replayId"]  # not recorded: the event is not in the outbox
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    lock.execute("ROLLBACK")
    lock.close()
    assert answered(sf, 2, timeout=45) == ["one", "two"], rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert replays(sf)[-1] == recorded  # resumed from the last replay id recorded, which gave the event again
    wait_until(lambda: False, 0.5)
    assert sf.texts() == ["one", "two"] and Receipt.objects.count() == 2


def test_a_worker_killed_mid_publish_publishes_no_part_twice_but_the_one_in_flight(tcast, sf, start_runtime):
    sf.events[OUTBOUND]["Text__c"] = ("LongTextArea", 1000)
    sf_plugin("--text-limit", "1000")
    rt = start_runtime()
    subscribed(rt, sf)
    sf.hold_publish_secs, sf.hold_publish_number = 30, 2  # part 2 taken, its answer late: the crash window
    answer = "\n\n".join(f"paragraph {i} " + "word " * 60 for i in range(9))  # three parts
    sf.say("script:answer=" + answer)
    answered(sf, 2)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    sf.hold_publish_secs = 0
    delivered(rt)
    assert rt.worker_pid(PID) not in (None, first)
    delivery = OutboundDelivery.objects.get()
    parts = [(p["DeliveryId__c"], p["Part__c"]) for p in sf.published]
    # part 1 was journaled: never again; part 2 was in flight: once more, with the same delivery id and part;
    # then part 3
    assert parts == [(delivery.delivery_id, 1), (delivery.delivery_id, 2), (delivery.delivery_id, 2),
                     (delivery.delivery_id, 3)]
    # what a subscriber deduping on (DeliveryId__c, Part__c) reads is the answer, once
    seen = {}
    for p in sf.published:
        seen.setdefault((p["DeliveryId__c"], p["Part__c"]), p["Text__c"])
    assert " ".join(seen[k] for k in sorted(seen)).split() == answer.split()
