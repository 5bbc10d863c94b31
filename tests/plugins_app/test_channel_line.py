"""channel-line end to end: the real supervisor runs the worker against a fake LINE on loopback.

The fake (tests/fakes/line.py) speaks the Messaging API's wire format and posts signed webhook
events to the worker as LINE does; the worker is the built-in kind with no command.
"""
from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.workers.line.api import retry_key
from tests.fakes.line import GROUP, USER, FakeLine
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "line-main"
ENV_REFS = ["LINE_CHANNEL_ACCESS_TOKEN", "LINE_CHANNEL_SECRET", "LINE_API_BASE_URL", "LINE_DATA_API_BASE_URL"]
LISTENING = re.compile(r"webhook listening on (http://\S+)")


@pytest.fixture
def line(monkeypatch):
    fake = FakeLine().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def line_plugin(*args: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second worker
    return make_plugin(PID, kind="channel-line", command="", args=["--bind", "127.0.0.1:0", *args],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def listening(rt, fake: FakeLine, *, after: str | None = None) -> None:
    """Wait until the worker's webhook is up, and point the fake at it."""
    def url():
        found = LISTENING.findall(rt.log(PID))
        return found[-1] if found and found[-1] != after else None
    fake.webhook_url = wait_until(url, 30) or pytest.fail(rt.log(PID))


def answered(fake: FakeLine, n: int = 1, timeout: float = 30) -> list[str]:
    assert wait_until(lambda: len(fake.texts()) >= n, timeout), fake.pushes()
    return fake.texts()


def test_a_message_in_gets_the_agents_answer_pushed_out(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    event = line.say("script:answer=hello from the agent")
    assert answered(line) == ["hello from the agent"]
    [push] = line.pushes()
    assert push.status == 200
    assert push.body == {"to": USER, "messages": [{"type": "text", "text": "hello from the agent"}]}
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 15), rt.log(PID)
    delivery = OutboundDelivery.objects.select_related("turn__receipt", "conversation").get()
    assert push.headers["x-line-retry-key"] == retry_key(delivery.delivery_id, 0, push.body["messages"])
    # the webhook event id is the idempotency key; the user is the conversation
    assert delivery.turn.receipt.client_message_id == event["webhookEventId"]
    assert (delivery.conversation.channel, delivery.conversation.external_id) == ("line", USER)
    assert delivery.channel_message_id == line.pushed[0]["id"]
    receipt = Receipt.objects.select_related("actor").get()
    assert receipt.actor.key == f"line:{USER}"
    assert Plugin.objects.get().state == "running"


def test_a_group_message_is_answered_in_the_group(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.say("script:answer=to the group", source=line.group())
    answered(line)
    assert line.pushed[0]["to"] == GROUP
    assert wait_until(lambda: Receipt.objects.exists(), 10)
    receipt = Receipt.objects.select_related("conversation", "actor").get()
    assert receipt.conversation.external_id == GROUP and receipt.actor.key == f"line:{USER}"


def test_a_long_answer_is_split_at_5000_characters_five_messages_to_a_push(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    paragraphs = [f"paragraph {i} " + "word " * 200 for i in range(28)]  # about 28,000 characters
    answer = "\n\n".join(paragraphs)
    line.say("script:answer=" + answer)
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 30), rt.log(PID)
    pushes = line.pushes()
    assert [len(p.body["messages"]) for p in pushes] == [5, 2]
    texts = line.texts()
    assert all(len(t) <= 5000 for t in texts)
    assert " ".join(texts).split() == answer.split()
    delivery = OutboundDelivery.objects.get()
    assert [p.headers["x-line-retry-key"] for p in pushes] == [
        retry_key(delivery.delivery_id, n, p.body["messages"]) for n, p in enumerate(pushes)]


def test_the_same_event_redelivered_runs_one_turn(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    event = line.say("script:answer=only once")
    answered(line, 1)
    again = line.redeliver(event)  # LINE's redelivery: same webhookEventId, isRedelivery true
    assert again.status_code == 200
    line.say("script:answer=after")  # handled after the redelivery (one queue, in order)
    answered(line, 2)
    wait_until(lambda: False, 0.5)
    assert line.texts() == ["only once", "after"]
    assert Turn.objects.filter(receipt__client_message_id=event["webhookEventId"]).count() == 1
    assert Receipt.objects.count() == 2


def test_a_429_makes_the_push_wait_and_then_succeed(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.rate_limit(times=2)
    line.say("script:answer=patience")
    assert answered(line) == ["patience"]
    limited1, limited2, sent = line.pushes()
    assert (limited1.status, limited1.answer) == (429, {"message": "The API rate limit has been exceeded. "
                                                                  "Try again later."})
    assert limited2.status == 429 and sent.status == 200
    # a bounded backoff: 1 s, then 2 s (LINE sends no Retry-After)
    assert limited2.at - limited1.at >= 0.9 and sent.at - limited2.at >= 1.9
    assert len({c.headers["x-line-retry-key"] for c in (limited1, limited2, sent)}) == 1
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 15), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send, not a failed one retried by the host


def test_a_worker_killed_after_the_push_left_answers_exactly_once_after_the_restart(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.hold_push_secs = 30  # LINE delivered the message, the worker has no answer yet: the crash window
    line.say("script:answer=exactly once")
    answered(line, 1)
    first = rt.worker_pid(PID)
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    line.hold_push_secs = 0
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 30), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    assert line.texts() == ["exactly once"]
    first_push, again = line.pushes()
    # the restarted worker pushed again with the same retry key; LINE refused it as already accepted
    assert first_push.headers["x-line-retry-key"] == again.headers["x-line-retry-key"]
    assert (again.status, again.answer["message"]) == (409, "The retry key is already accepted")
    assert OutboundDelivery.objects.get().channel_message_id == line.pushed[0]["id"]


def test_a_revoked_token_is_the_plugins_state_and_it_stops_retrying(tcast, line, start_runtime, admin_client):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.revoke()
    line.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == (
        "the channel refused the worker: POST /v2/bot/message/push: 401 Unauthorized: the channel access token "
        "(LINE_CHANNEL_ACCESS_TOKEN) is wrong, expired or revoked (issue a new one in the LINE Developers "
        "console, Messaging API tab)")
    calls = len(line.calls)
    wait_until(lambda: False, 1.5)
    assert len(line.calls) == calls  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert len(line.pushes()) == 1 and not line.texts()
    # the answer is not lost: it waits, retryable, for the operator's new token
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)
    assert "LINE_CHANNEL_ACCESS_TOKEN) is wrong, expired or revoked" in \
        admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_token_line_refuses_at_start_disables_the_plugin_before_it_listens(tcast, line, start_runtime):
    line.revoke()
    line_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: GET /v2/bot/info: 401 Unauthorized")
    wait_until(lambda: False, 1.0)
    assert len(line.calls_to("/v2/bot/info")) == 1
    assert "webhook listening" not in rt.log(PID)


def test_a_bad_or_missing_signature_is_refused_and_records_nothing(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    event = line.event(line.text_message("script:answer=no"))
    forged = line.post(line.payload([event]), secret="another-secret")
    missing = line.post(line.payload([event]), signature="")
    assert (forged.status_code, forged.json()) == (401, {"message": "Invalid signature"})
    assert missing.status_code == 401
    # LINE's "Verify" button: an empty, signed event list is answered 200
    assert line.post(line.payload([])).status_code == 200
    wait_until(lambda: False, 1.0)
    assert not Receipt.objects.exists() and not line.pushes()


def test_an_image_in_is_downloaded_from_the_data_api_and_stored_on_the_host(tcast, line, start_runtime):
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    photo = b"\xff\xd8\xff\xe0" + os.urandom(64)
    message = line.media_message(photo)
    assert line.post(line.payload([line.event(message)])).status_code == 200
    assert wait_until(lambda: PluginMedia.objects.exists(), 20), rt.log(PID)
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type) == (photo, "image/jpeg")
    [fetch] = line.calls_to(f"/v2/bot/message/{message['id']}/content")
    assert fetch.headers["authorization"] == f"Bearer {line.token}"


def test_an_event_sent_while_the_worker_is_down_is_taken_when_line_redelivers_it(tcast, line, start_runtime):
    import httpx
    line_plugin()
    rt = start_runtime()
    listening(rt, line)
    line.say("script:answer=before")
    answered(line, 1)
    before, pid = line.webhook_url, rt.worker_pid(PID)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: rt.worker_pid(PID) != pid, 15)
    event = line.event(line.text_message("script:answer=after"))
    try:  # the old port is gone (or, briefly, not yet): LINE counts it as a failed delivery
        status = line.post(line.payload([event])).status_code
    except httpx.HTTPError:
        status = 0
    assert status != 200
    listening(rt, line, after=before)  # the restarted worker listens on a new port (--bind :0)
    assert line.redeliver(event).status_code == 200
    assert answered(line, 2, timeout=45) == ["before", "after"]
    assert Receipt.objects.filter(client_message_id=event["webhookEventId"]).count() == 1
