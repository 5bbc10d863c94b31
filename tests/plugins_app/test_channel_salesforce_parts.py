"""channel-salesforce in parts: event normalisation, splitting, the outbound fields, the REST client and the
CometD subscription's steps against the fake org (tests/fakes/salesforce.py), with no supervisor."""
from __future__ import annotations

import logging
import threading

import pytest

from plugins_app.channel.sdk.outbox import Outbox
from plugins_app.channel.sdk.messages import Delivery
from plugins_app.channel.workers.salesforce import (TEXT_LIMIT, event_fields, message_parts, normalise, parse_args,
                                                    salesforce_time)
from plugins_app.channel.workers.salesforce.api import (ClientRefused, RateLimited, SalesforceApi, SalesforceError,
                                                        rest_errors)
from plugins_app.channel.workers.salesforce.cometd import (REPLAY_ALL, REPLAY_NEW, ChannelMissing, ReplayStore,
                                                           Subscription)
from tests.fakes.salesforce import CONVERSATION, INBOUND, INTEGRATION_USER, OUTBOUND, USER, FakeSalesforce

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

OPTS = parse_args([], {})
CHANNEL = f"/event/{INBOUND}"


def event(payload: dict, *, uuid: str | None = "a1b2c3d4-0000-4000-8000-000000000001", replay: int | None = 4711):
    ev = {} if uuid is None else {"EventUuid": uuid}
    if replay is not None:
        ev["replayId"] = replay
    return {"channel": CHANNEL, "data": {"schema": "s", "payload": payload, "event": ev}}


@pytest.fixture
def sf():
    fake = FakeSalesforce().start()
    fake.connect_hold_secs = 0.2
    yield fake
    fake.stop()


def api_for(fake: FakeSalesforce, **kw) -> SalesforceApi:
    waits: list[float] = []
    api = SalesforceApi(fake.client_id, fake.client_secret, login_url=fake.base_url, api_version="62.0",
                        sleep=lambda s: waits.append(s) or False, **kw)
    api.waits = waits
    return api


# ---------------------------------------------------------------------- inbound normalisation

def test_an_event_becomes_a_message_of_its_conversation_keyed_by_the_publishers_id():
    msg = normalise(event({"ConversationId__c": CONVERSATION, "UserId__c": USER, "Text__c": "hello",
                           "MessageId__c": "msg-7", "CreatedDate": "2026-12-06T10:00:00.123Z",
                           "CreatedById": INTEGRATION_USER}), OPTS)
    assert (msg.channel, msg.conversation_id, msg.sender_id, msg.text, msg.message_id) == (
        "salesforce", CONVERSATION, USER, "hello", "msg-7")
    assert msg.timestamp == "2026-12-06T10:00:00.123Z"
    assert msg.metadata == {"event": CHANNEL, "replay_id": 4711, "event_uuid": "a1b2c3d4-0000-4000-8000-000000000001",
                            "created_by_id": INTEGRATION_USER}


def test_without_a_message_id_the_event_uuid_then_the_replay_id_is_the_key():
    payload = {"ConversationId__c": "c", "Text__c": "hi", "CreatedById": INTEGRATION_USER}
    assert normalise(event(payload), OPTS).message_id == "a1b2c3d4-0000-4000-8000-000000000001"
    assert normalise(event(payload, uuid=None), OPTS).message_id == "replay-4711"
    assert normalise(event(payload, uuid=None, replay=None), OPTS) is None
    # no user field: the event's creator is the sender
    assert normalise(event(payload), OPTS).sender_id == INTEGRATION_USER


def test_an_event_without_a_conversation_or_text_is_no_message():
    assert normalise(event({"Text__c": "hi"}), OPTS) is None
    assert normalise(event({"ConversationId__c": "c", "Text__c": "  "}), OPTS) is None
    assert normalise(event({"ConversationId__c": "c"}), OPTS) is None


def test_the_field_names_come_from_the_arguments():
    opts = parse_args(["--conversation-field", "Case__c", "--text-field", "Body__c", "--user-field", "Who__c",
                       "--message-id-field", ""], {})
    msg = normalise(event({"Case__c": "500x", "Body__c": "hey", "Who__c": "005y", "MessageId__c": "ignored"}), opts)
    assert (msg.conversation_id, msg.text, msg.sender_id) == ("500x", "hey", "005y")
    assert msg.message_id == "a1b2c3d4-0000-4000-8000-000000000001"


def test_salesforce_times_with_a_numeric_offset_are_rfc3339():
    assert salesforce_time("2026-12-06T10:00:00.000+0000") == "2026-12-06T10:00:00.000Z"
    assert salesforce_time("2026-12-06T12:00:00.000+0200") == "2026-12-06T10:00:00.000Z"
    assert salesforce_time("yesterday") is None and salesforce_time("2026-12-06T10:00:00") is None


def test_the_api_version_and_event_names_come_from_the_environment_unless_an_argument_says_otherwise():
    env = {"SALESFORCE_API_VERSION": "60.0", "SALESFORCE_INBOUND_EVENT": "In__e", "SALESFORCE_OUTBOUND_EVENT": "Out__e"}
    opts = parse_args([], env)
    assert (opts.api_version, opts.inbound_event, opts.outbound_event) == ("60.0", "In__e", "Out__e")
    opts = parse_args(["--api-version", "61.0", "--outbound-event", "Other__e"], env)
    assert (opts.api_version, opts.inbound_event, opts.outbound_event) == ("61.0", "In__e", "Other__e")
    assert (OPTS.api_version, OPTS.inbound_event, OPTS.outbound_event, OPTS.text_limit) == (
        "62.0", INBOUND, OUTBOUND, TEXT_LIMIT)


# ---------------------------------------------------------------------- outbound

def test_a_long_text_is_split_within_the_limit_counted_in_utf16_units():
    text = ("😀" * 30 + "\n\n") * 10  # each emoji is two UTF-16 units
    parts = message_parts(text, 100)
    assert all(len(p.encode("utf-16-le")) // 2 <= 100 for p in parts) and len(parts) >= 7
    assert "".join(parts).replace("\n", "") == text.replace("\n", "")
    assert message_parts("short", 100) == ["short"] and message_parts("  \n ", 100) == []
    assert message_parts("x" * TEXT_LIMIT) == ["x" * TEXT_LIMIT]
    assert len(message_parts("x" * (TEXT_LIMIT + 1))) == 2


def test_each_part_carries_the_delivery_id_its_number_and_the_message_answered():
    delivery = Delivery(delivery_id="d-1", conversation_id="500x", text="a b", reply_to_message_id="msg-7")
    assert event_fields(OPTS, delivery, 1, ["a", "b"]) == {
        "ConversationId__c": "500x", "Text__c": "b", "DeliveryId__c": "d-1", "Part__c": 2, "Parts__c": 2,
        "InReplyTo__c": "msg-7"}
    opts = parse_args(["--parts-field", "", "--in-reply-to-field", ""], {})
    assert event_fields(opts, delivery, 0, ["a b"]) == {"ConversationId__c": "500x", "Text__c": "a b",
                                                       "DeliveryId__c": "d-1", "Part__c": 1}


def test_salesforce_error_lists_read_as_a_code_and_the_messages():
    import httpx
    response = httpx.Response(400, json=[{"message": "Text: data value too large", "errorCode": "STRING_TOO_LONG",
                                          "fields": ["Text__c"]}, {"message": "and more", "errorCode": "X"}])
    assert rest_errors(response) == ("STRING_TOO_LONG", "Text: data value too large (Text__c); and more")
    assert rest_errors(httpx.Response(502, text="Bad gateway")) == ("", "Bad gateway")


def test_a_publish_returns_the_events_id(sf):
    api = api_for(sf)
    event_id = api.publish(OUTBOUND, {"ConversationId__c": "c", "Text__c": "hi"})
    assert event_id == sf.published[0]["EventUuid"] == sf.bus[f"/event/{OUTBOUND}"][0]["data"]["event"]["EventUuid"]
    # an answer without OPERATION_ENQUEUED (an older API version): the record id
    from plugins_app.channel.workers.salesforce.api import published_id
    assert published_id({"id": "e00x", "success": True, "errors": []}) == "e00x"
    [token] = sf.calls_to("/services/oauth2/token")
    assert token.body["grant_type"] == "client_credentials"


def test_a_stale_token_is_fetched_again_once_and_the_publish_made_again(sf):
    api = api_for(sf)
    api.publish(OUTBOUND, {"Text__c": "one"})
    sf.expire_tokens()
    api.publish(OUTBOUND, {"Text__c": "two"})
    assert sf.texts() == ["one", "two"]
    assert [c.status for c in sf.publishes()] == [201, 401, 201]
    assert len(sf.calls_to("/services/oauth2/token")) == 2


def test_busy_answers_are_waited_out_doubling_and_then_given_up(sf):
    api = api_for(sf, max_wait_secs=5)
    sf.busy(times=2, status=503)
    api.publish(OUTBOUND, {"Text__c": "late"})
    assert api.waits == [1.0, 2.0] and sf.texts() == ["late"]
    sf.busy(times=10, status=503)
    with pytest.raises(RateLimited) as err:
        api.publish(OUTBOUND, {"Text__c": "never"})
    assert err.value.code == "SERVER_UNAVAILABLE" and api.waits[2:] == [1.0, 2.0]


def test_success_false_in_a_2xx_answer_is_read_by_its_error_codes(sf, tmp_path):
    from plugins_app.channel.sdk import DeliveryFailed
    unavailable = [{"statusCode": "PLATFORM_EVENT_PUBLISHING_UNAVAILABLE", "fields": [],
                    "message": "Failed to publish platform event. Try again later."}]
    api = api_for(sf, max_wait_secs=5)
    sf.busy(times=2, status=201, errors=unavailable)
    api.publish(OUTBOUND, {"Text__c": "late"})
    assert api.waits == [1.0, 2.0] and sf.texts() == ["late"]  # waited out in place, as a 503 is
    worker = worker_for(sf, tmp_path)
    sf.busy(times=1, status=201, errors=unavailable)
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-6", conversation_id="500x", text="hi"))
    assert not err.value.permanent and "PLATFORM_EVENT_PUBLISHING_UNAVAILABLE" in err.value.reason
    sf.busy(times=1, status=201, errors=[{"statusCode": "LIMIT_EXCEEDED", "message": "Hourly limit", "fields": []}])
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-7", conversation_id="500x", text="hi"))
    assert not err.value.permanent and "LIMIT_EXCEEDED" in err.value.reason
    sf.busy(times=1, status=201, errors=[{"statusCode": "INVALID_FIELD", "message": "No such column", "fields": []}])
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-8", conversation_id="500x", text="hi"))
    assert err.value.permanent and "INVALID_FIELD" in err.value.reason


def test_a_field_error_is_a_400_with_salesforces_code(sf):
    api = api_for(sf)
    with pytest.raises(SalesforceError) as err:
        api.publish(OUTBOUND, {"Text__c": "x" * 131073})
    assert (err.value.status, err.value.code) == (400, "STRING_TOO_LONG")
    with pytest.raises(SalesforceError) as err:
        api.publish(OUTBOUND, {"Nope__c": "x"})
    assert (err.value.status, err.value.code) == (400, "INVALID_FIELD")
    assert not isinstance(err.value, (RateLimited, ClientRefused))


def test_a_client_the_token_endpoint_refuses_is_client_refused(sf):
    api = SalesforceApi(sf.client_id, "wrong", login_url=sf.base_url)
    with pytest.raises(ClientRefused) as err:
        api.token()
    assert (err.value.status, err.value.code, err.value.message) == (400, "invalid_client",
                                                                      "invalid client credentials")


# ---------------------------------------------------------------------- the subscription

class Recorder:
    """What the worker does with an event: recorded in a real outbox (keyed by conversation and message id)."""

    def __init__(self, path, fail: bool = False):
        self.outbox = Outbox(path)
        self.fail = fail
        self.seen: list[int] = []

    def __call__(self, message: dict) -> None:
        if self.fail:
            raise OSError("disk full")
        self.seen.append(message["data"]["event"]["replayId"])
        self.outbox.inbound_record(normalise(message, OPTS))


def subscription(sf, store, on_event, **kw) -> Subscription:
    sub = Subscription(api_for(sf), CHANNEL, store, on_event, **kw)
    sub.handshake()
    sub.subscribe()
    return sub


def test_an_events_replay_id_is_recorded_only_after_the_event_is(sf, tmp_path):
    store = ReplayStore(str(tmp_path / "replay.sqlite3"))
    failing = Recorder(tmp_path / "a.sqlite3", fail=True)
    sub = subscription(sf, store, failing)
    first = sf.say("one")
    with pytest.raises(OSError):
        sub.connect_once()
    assert store.get(CHANNEL) is None  # not recorded: the replay id stays where it was
    # a restarted worker resumes from the moment of its first subscription and is given the event again
    recorder = Recorder(tmp_path / "b.sqlite3")
    sub = subscription(sf, store, recorder)
    assert sub.subscribed_from == REPLAY_ALL
    sub.connect_once()
    assert recorder.seen == [first["data"]["event"]["replayId"]]
    assert store.get(CHANNEL) == first["data"]["event"]["replayId"]
    second = sf.say("two")
    subscription(sf, store, recorder).connect_once()
    assert store.get(CHANNEL) == second["data"]["event"]["replayId"]
    assert sf.bayeux("/meta/subscribe")[-1]["ext"] == {"replay": {CHANNEL: first["data"]["event"]["replayId"]}}
    assert recorder.seen == [first["data"]["event"]["replayId"], second["data"]["event"]["replayId"]]


def test_an_event_given_again_is_one_row_of_the_outbox(sf, tmp_path):
    store = ReplayStore(str(tmp_path / "replay.sqlite3"))
    recorder = Recorder(tmp_path / "outbox.sqlite3")
    sub = subscription(sf, store, recorder)
    sf.say("once")
    sub.connect_once()
    store.put(CHANNEL, store.get(CHANNEL) - 3)  # a crash after the outbox, before the replay id
    subscription(sf, store, recorder).connect_once()
    assert len(recorder.seen) == 2 and recorder.seen[0] == recorder.seen[1]
    assert recorder.outbox.counts().get("inbound.pending") == 1


def test_the_first_start_takes_new_events_only_or_every_event_kept(sf, tmp_path):
    old = sf.say("before the start")
    recorder = Recorder(tmp_path / "o.sqlite3")
    sub = subscription(sf, ReplayStore(str(tmp_path / "r1.sqlite3")), recorder)
    assert sub.subscribed_from == REPLAY_NEW
    sub.connect_once()
    assert recorder.seen == []
    sub = subscription(sf, ReplayStore(str(tmp_path / "r2.sqlite3")), recorder, first_replay=REPLAY_ALL)
    sub.connect_once()
    assert recorder.seen == [old["data"]["event"]["replayId"]]


def test_events_in_the_subscribes_answer_are_taken_and_their_replay_id_recorded(sf, tmp_path):
    backlog = [sf.say("while away 1"), sf.say("while away 2")]
    sf.flush_on_subscribe = True
    store = ReplayStore(str(tmp_path / "replay.sqlite3"))
    recorder = Recorder(tmp_path / "o.sqlite3")
    sub = subscription(sf, store, recorder, first_replay=REPLAY_ALL)
    ids = [e["data"]["event"]["replayId"] for e in backlog]
    [answer] = [c.answer for c in sf.calls
                if c.path.startswith("/cometd/") and c.body[0]["channel"] == "/meta/subscribe"]
    assert [m["channel"] for m in answer] == [CHANNEL, CHANNEL, "/meta/subscribe"]  # the fake flushed there
    assert recorder.seen == ids and store.get(CHANNEL) == ids[-1]
    later = sf.say("later")
    sub.connect_once()
    assert recorder.seen == ids + [later["data"]["event"]["replayId"]]


def test_new_only_keeps_passing_over_old_events_once_a_catch_up_recorded_a_replay_id(sf, tmp_path):
    import time
    old = [sf.say("old 1", created=time.time() - 3600), sf.say("old 2", created=time.time() - 3590)]
    store = ReplayStore(str(tmp_path / "replay.sqlite3"))
    recorder = Recorder(tmp_path / "o.sqlite3")
    subscription(sf, store, recorder)  # the first start, "new only"; killed before any event
    sub = subscription(sf, store, recorder)
    assert sub.subscribed_from == REPLAY_ALL and sub.skip_before is not None
    # the catch-up went as far as the first old event (passed over, its replay id recorded), then a crash
    store.put(CHANNEL, old[0]["data"]["event"]["replayId"])
    sub = subscription(sf, store, recorder)
    assert sub.subscribed_from == old[0]["data"]["event"]["replayId"]
    new = sf.say("new")
    sub.connect_once()
    assert recorder.seen == [new["data"]["event"]["replayId"]]  # not "old 2", from before the first start
    assert store.get(CHANNEL) == new["data"]["event"]["replayId"]


def test_a_replay_id_no_longer_kept_falls_back_to_minus_two_with_an_error(sf, tmp_path, caplog):
    store = ReplayStore(str(tmp_path / "replay.sqlite3"))
    gone = sf.say("taken, then purged")["data"]["event"]["replayId"]
    store.put(CHANNEL, gone)
    kept = sf.say("published while the worker was away")["data"]["event"]["replayId"]
    sf.expire_before(gone + 1)
    recorder = Recorder(tmp_path / "o.sqlite3")
    with caplog.at_level(logging.ERROR, "ugent.worker.salesforce.cometd"):
        sub = subscription(sf, store, recorder)
    assert sub.subscribed_from == REPLAY_ALL
    assert [m["ext"]["replay"][CHANNEL] for m in sf.bayeux("/meta/subscribe")] == [gone, -2]
    assert f"the replay id {gone} recorded is no longer kept by Salesforce" in caplog.text
    sub.connect_once()
    assert recorder.seen == [kept]


def test_a_handshake_denied_for_a_stale_token_fetches_a_new_one_and_handshakes_again(sf, tmp_path):
    api = api_for(sf)
    sub = Subscription(api, CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None)
    sub.token = api.token()
    sf.expire_tokens()
    sub.handshake()
    assert sub.client_id
    denied, accepted = [c.answer[0] for c in sf.calls if c.path.startswith("/cometd/")]
    assert (denied["error"], denied["ext"]["sfdc"]["failureReason"]) == ("403::Handshake denied",
                                                                         "401::Authentication invalid")
    assert accepted["successful"] and len(sf.calls_to("/services/oauth2/token")) == 2


@pytest.mark.parametrize("wording", ["does not exist", "doesn\u2019t exist"])
def test_a_channel_that_does_not_exist_is_channel_missing(sf, tmp_path, wording):
    sf.missing_channel_error = f"400::The channel you requested to subscribe to {wording} {{%s}}"
    sub = Subscription(api_for(sf), "/event/Nowhere__e", ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None)
    sub.handshake()
    with pytest.raises(ChannelMissing) as err:
        sub.subscribe()
    assert wording in str(err.value)


@pytest.mark.parametrize("reason, refused", [
    ("403::API is not enabled for this Organization or Partner", True),
    ("403::Organization total events daily limit exceeded", False),   # a limit: waited out
    ("401::Authentication invalid", False),                           # the token: fetched again
])
def test_a_handshake_denied_for_a_permission_is_refused_for_good(sf, tmp_path, reason, refused):
    from plugins_app.channel.workers.salesforce.cometd import CometdError, StreamRefused
    sf.deny_handshakes = reason
    sub = Subscription(api_for(sf), CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None)
    with pytest.raises(CometdError) as err:
        sub.handshake()
    assert isinstance(err.value, StreamRefused) == refused and reason in str(err.value)


def test_an_api_version_the_streaming_api_does_not_serve_is_refused_for_good(sf, tmp_path):
    from plugins_app.channel.workers.salesforce.cometd import StreamRefused
    api = SalesforceApi(sf.client_id, sf.client_secret, login_url=sf.base_url, api_version="22.0")
    sub = Subscription(api, CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None)
    with pytest.raises(StreamRefused) as err:
        sub.run()  # raises instead of backing off and trying again forever
    assert "Unsupported API version" in str(err.value)


def test_an_unknown_client_is_told_to_handshake_and_run_starts_over(sf, tmp_path):
    stopping = threading.Event()
    recorder = Recorder(tmp_path / "o.sqlite3")

    def on_event(message):
        recorder(message)
        if len(recorder.seen) == 2:
            stopping.set()

    sub = Subscription(api_for(sf), CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), on_event, stopping=stopping)
    runner = threading.Thread(target=sub.run, daemon=True)
    runner.start()
    assert _wait(sf.subscribed)
    sf.say("one")
    assert _wait(lambda: len(recorder.seen) == 1)
    sf.forget_clients()
    assert _wait(lambda: len(sf.bayeux("/meta/handshake")) == 2 and sf.subscribed())
    sf.say("two")
    runner.join(10)
    assert not runner.is_alive() and len(recorder.seen) == 2
    connects = [c for c in sf.calls if c.path.startswith("/cometd/") and c.body[0]["channel"] == "/meta/connect"]
    assert any(a.get("error") == "403::Unknown client" for c in connects for a in c.answer)


class RecordingStop(threading.Event):
    """A ``stopping`` event that records each wait instead of waiting, and stops after ``n`` of them."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.waits = n, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) >= self.n:
            self.set()
        return self.is_set()


def test_a_successful_connect_advising_a_handshake_backs_off_before_handshaking_again(sf, tmp_path):
    sf.connect_hold_secs = 0
    sf.connect_advice = {"reconnect": "handshake", "interval": 0}
    stopping = RecordingStop(4)
    sub = Subscription(api_for(sf), CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None,
                       stopping=stopping)
    runner = threading.Thread(target=sub.run, daemon=True)
    runner.start()
    runner.join(10)
    stopping.set()
    runner.join(5)
    assert stopping.waits[:4] == [1.0, 2.0, 4.0, 8.0]  # doubling, not reset by each successful connect
    assert len(sf.bayeux("/meta/handshake")) == 4
    sf.connect_advice = {"reconnect": "handshake", "interval": 5000}
    stopping = RecordingStop(1)
    sub = Subscription(api_for(sf), CHANNEL, ReplayStore(str(tmp_path / "r.sqlite3")), lambda m: None,
                       stopping=stopping)
    sub.run()
    assert stopping.waits == [5.0]  # the advised interval, when longer


def _wait(predicate, timeout: float = 10.0) -> bool:
    from tests.plugins_app.conftest import wait_until
    return bool(wait_until(predicate, timeout))


# ---------------------------------------------------------------------- the worker's outbound part

def worker_for(sf, tmp_path, *argv: str):
    from plugins_app.channel.sdk.journal import SentJournal
    from plugins_app.channel.workers.salesforce import SalesforceWorker
    worker = SalesforceWorker(socket_path=str(tmp_path / "bridge.sock"), plugin_id="sf-parts", token="t",
                              state_dir=str(tmp_path), argv=list(argv), environ=sf.env(),
                              install_signal_handlers=False)
    worker.api.max_wait_secs = 0  # a busy answer goes straight back to the hub here
    worker._journal = SentJournal(str(tmp_path / "sent.sqlite3"))
    return worker


def test_a_delivery_resumed_publishes_only_the_parts_the_journal_does_not_name(sf, tmp_path):
    from plugins_app.channel.sdk import DeliveryFailed
    worker = worker_for(sf, tmp_path, "--text-limit", "20")
    delivery = Delivery(delivery_id="d-1", conversation_id="500x", text="a" * 15 + " " + "b" * 15)
    publish, calls = worker.api.publish, []

    def second_part_refused_once(event, fields):
        calls.append(fields["Part__c"])
        if len(calls) == 2:
            raise RateLimited(503, "SERVER_UNAVAILABLE", "still busy")
        return publish(event, fields)

    worker.api.publish = second_part_refused_once
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(delivery)  # part 1 out, part 2 refused: retryable, part 1 journaled
    assert not err.value.permanent and not worker.already_delivered(delivery)
    first_id = worker.deliver(delivery)
    assert calls == [1, 2, 2]  # part 1 was not published again
    assert [(p["Part__c"], p["Parts__c"]) for p in sf.published] == [(1, 2), (2, 2)]
    assert first_id == sf.published[0]["EventUuid"] and worker.already_delivered(delivery)
    assert worker.deliver(delivery) == first_id and calls == [1, 2, 2]  # nothing left to publish


def test_request_limit_exceeded_goes_back_to_the_hub_at_once(sf, tmp_path):
    from plugins_app.channel.sdk import DeliveryFailed
    api = api_for(sf, max_wait_secs=120)
    sf.busy(times=1, status=403)  # REQUEST_LIMIT_EXCEEDED: the org's API requests over 24 hours
    with pytest.raises(SalesforceError) as err:
        api.publish(OUTBOUND, {"Text__c": "later"})
    assert (err.value.status, err.value.code) == (403, "REQUEST_LIMIT_EXCEEDED") and api.waits == []
    worker = worker_for(sf, tmp_path)
    worker.api.max_wait_secs = 120
    sf.busy(times=1, status=403)
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-9", conversation_id="500x", text="hi"))
    assert not err.value.permanent and "REQUEST_LIMIT_EXCEEDED" in err.value.reason
    assert len(sf.publishes()) == 2 and not sf.texts()  # one call each, no wait in place


def test_the_hourly_allocation_is_retryable_and_a_field_error_permanent(sf, tmp_path):
    from plugins_app.channel.sdk import DeliveryFailed
    worker = worker_for(sf, tmp_path)
    sf.busy(times=1, status=400, errors=[{"message": "Hourly publish limit exceeded", "errorCode": "LIMIT_EXCEEDED"}])
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-2", conversation_id="500x", text="hi"))
    assert not err.value.permanent and "LIMIT_EXCEEDED" in err.value.reason
    sf.events[OUTBOUND]["Text__c"] = ("LongTextArea", 3)
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-3", conversation_id="500x", text="too long"))
    assert err.value.permanent and "STRING_TOO_LONG" in err.value.reason
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-4", conversation_id="500x", text="   "))
    assert err.value.permanent


@pytest.mark.parametrize("status, error, description", [
    (400, "unknown_error", "retry your request"),
    (400, "rate_limit_exceeded", "Login Rate Exceeded"),
    (503, "", "Service Unavailable"),
])
def test_a_token_endpoint_failing_after_a_401_is_retryable_and_names_the_token_call(sf, tmp_path, status, error,
                                                                                      description):
    from plugins_app.channel.sdk import DeliveryFailed
    worker = worker_for(sf, tmp_path)
    worker.api.token()
    sf.expire_tokens()  # the publish is answered 401: a new token is asked for
    sf.token_fails(status=status, error=error, description=description)
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(Delivery(delivery_id="d-5", conversation_id="500x", text="hi"))
    assert not err.value.permanent
    assert err.value.reason.startswith(f"POST /services/oauth2/token: {status} {error}")
    assert not worker._refusal and not sf.texts()
    assert worker.deliver(Delivery(delivery_id="d-5", conversation_id="500x", text="hi"))  # the hub's retry
    assert sf.texts() == ["hi"]


@pytest.mark.parametrize("argv, reason", [
    (["--outbound-event", INBOUND], "the inbound and outbound events are both UGENT_Inbound__e"),
    (["--inbound-event", "Inbound"], "'Inbound' is not a platform event's API name"),
    (["--api-version", "v62"], "--api-version 'v62' is not an API version"),
])
def test_settings_that_cannot_work_are_refused_before_any_call(sf, tmp_path, argv, reason):
    from plugins_app.channel.sdk import ChannelRefused
    worker = worker_for(sf, tmp_path, *argv)
    with pytest.raises(ChannelRefused) as err:
        worker.connect()
    assert str(err.value).startswith(reason)
    assert not sf.calls


@pytest.mark.parametrize("login_url, reason", [
    (None, "SALESFORCE_LOGIN_URL not set: the client credentials flow needs the org's My Domain URL"),
    ("https://login.salesforce.com", "SALESFORCE_LOGIN_URL is login.salesforce.com: the client credentials flow"),
])
def test_a_login_url_that_is_no_my_domain_is_refused_before_any_call(sf, tmp_path, login_url, reason):
    from plugins_app.channel.sdk import ChannelRefused
    from plugins_app.channel.workers.salesforce import SalesforceWorker
    env = {k: v for k, v in sf.env().items() if k != "SALESFORCE_LOGIN_URL"}
    if login_url:
        env["SALESFORCE_LOGIN_URL"] = login_url
    worker = SalesforceWorker(socket_path=str(tmp_path / "bridge.sock"), plugin_id="sf-parts", token="t",
                              state_dir=str(tmp_path), argv=[], environ=env, install_signal_handlers=False)
    with pytest.raises(ChannelRefused) as err:
        worker.connect()
    assert str(err.value).startswith(reason)
    assert not sf.calls
