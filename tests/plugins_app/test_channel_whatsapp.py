"""channel-whatsapp end to end: the real supervisor starts the worker against a fake Cloud API on loopback.

The fake (tests/fakes/whatsapp.py) speaks Meta's wire formats: it POSTs signed notifications to the
worker's webhook as Meta does (and again while not answered 200), answers the Graph API's calls, and
sends a ``sent`` status notification after each message the bot sends.
"""
from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from plugins_app.channel.workers.whatsapp import message_parts
from tests.fakes.whatsapp import USER, FakeWhatsApp
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "whatsapp-main"
ENV_REFS = ["WHATSAPP_ACCESS_TOKEN", "WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN", "WHATSAPP_PHONE_NUMBER_ID",
            "WHATSAPP_API_BASE_URL"]
LISTENING = re.compile(r"webhook listening on (http://\S+)")


@pytest.fixture
def fake(monkeypatch):
    fake = FakeWhatsApp().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def whatsapp_plugin(*extra: str) -> Plugin:
    # a heartbeat a loaded machine keeps up with: a watchdog restart would be a second listener
    return make_plugin(PID, kind="channel-whatsapp", command="", args=["--bind", "127.0.0.1:0", *extra],
                       env_refs=ENV_REFS, heartbeat_secs=1.0)


def listening(rt, fake: FakeWhatsApp, *, after: str | None = None) -> str:
    """Wait until the worker's webhook listens, and point the fake's notifications at it."""
    def url():
        found = LISTENING.findall(rt.log(PID))
        return found[-1] if found and found[-1] != after else None
    fake.webhook_url = wait_until(url, 30) or pytest.fail(rt.log(PID))
    return fake.webhook_url


def delivered(n: int = 1, timeout: float = 20) -> bool:
    return wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() >= n, timeout)


def test_a_message_in_gets_the_agents_answer_out_as_a_reply_in_whatsapp_formatting(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    payload = fake.say("script:answer=**Done**: see [the docs](https://example.org/a) ~~or not~~")
    wamid = payload["entry"][0]["changes"][0]["value"]["messages"][0]["id"]
    [sent] = fake.wait_sent(1) or pytest.fail(rt.log(PID))
    assert sent["to"] == USER and sent["messaging_product"] == "whatsapp" and sent["recipient_type"] == "individual"
    assert sent["text"] == {"body": "*Done*: see the docs (https://example.org/a) ~or not~", "preview_url": False}
    assert sent["context"] == {"message_id": wamid}
    assert delivered(), rt.log(PID)
    receipt = Receipt.objects.select_related("conversation", "actor").get()
    assert receipt.client_message_id == wamid
    assert (receipt.conversation.channel, receipt.conversation.client_id, receipt.conversation.external_id) == \
        ("whatsapp", PID, USER)
    assert receipt.actor.key == f"whatsapp:{USER}" and receipt.actor.display_name == "Ada"
    assert OutboundDelivery.objects.get().channel_message_id == sent["id"]
    # the "sent" status Meta posts after the answer is taken (200) and records nothing
    assert wait_until(fake.settled, 10) and ("status", 200) in fake.posts
    wait_until(lambda: False, 0.5)
    assert Receipt.objects.count() == 1 and Turn.objects.count() == 1
    assert Plugin.objects.get().state == "running"


def test_the_same_notification_delivered_twice_runs_one_turn(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    payload = fake.say("script:answer=once")
    assert fake.wait_sent(1), rt.log(PID)
    fake.redeliver(payload)  # Meta's retry: the same wamid
    assert wait_until(fake.settled, 20)
    fake.say("script:answer=after")  # read after the redelivery (one queue, in order)
    assert len(fake.wait_sent(2)) == 2, rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert fake.texts() == ["once", "after"]
    assert Turn.objects.count() == 2 and Receipt.objects.count() == 2


def test_a_429_makes_the_send_wait_as_meta_asks_and_then_succeed(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.rate_limit(retry_after=1)
    fake.say("script:answer=patience")
    assert fake.wait_sent(1), rt.log(PID)
    limited, ok = fake.sends()
    assert (limited.status, limited.answer["error"]["code"]) == (429, 130429)
    assert ok.status == 200
    assert fake.texts() == ["patience"]
    assert delivered(), rt.log(PID)
    assert OutboundDelivery.objects.get().attempt == 1  # the same send waited, not a failure retried by the host
    assert "waiting 1.0 s before sending again" in rt.log(PID)


def test_a_worker_killed_mid_delivery_sends_each_part_exactly_once_after_the_restart(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    first_pid = rt.worker_pid(PID)
    long_answer = ("word " * 1000).strip() + "\n\n" + ("more " * 300).strip()  # two messages of 4,096
    parts = message_parts(long_answer)
    assert len(parts) == 2
    fake.hold_next(after=1)  # part one reaches Meta; part two is in the air when the worker is killed
    fake.say(f"script:answer={long_answer}")
    assert wait_until(fake.held.is_set, 30), rt.log(PID)
    assert fake.texts() == parts[:1]
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first_pid, signal.SIGKILL)
    assert delivered(timeout=40), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first_pid)
    assert fake.texts() == parts  # part one not again, part two once
    assert Turn.objects.count() == 1


def test_notifications_posted_while_the_worker_is_down_arrive_after_its_restart(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    before = listening(rt, fake)
    pid = rt.worker_pid(PID)
    os.kill(pid, signal.SIGKILL)
    fake.say("script:answer=queued at Meta")  # posts fail until the listener is back; Meta retries
    assert wait_until(lambda: rt.worker_pid(PID) not in (None, pid), 20), rt.log(PID)
    listening(rt, fake, after=before)
    assert fake.wait_sent(1, timeout=40), rt.log(PID)
    assert fake.texts() == ["queued at Meta"]


def test_a_revoked_token_found_at_a_send_disables_the_plugin_with_the_reason_and_it_stops_retrying(
        tcast, fake, start_runtime, admin_client):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.revoke()
    fake.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith(
        "the channel refused the worker: the access token (WHATSAPP_ACCESS_TOKEN) was refused: HTTP 401, code 190/460")
    calls = len(fake.calls)
    wait_until(lambda: False, 1.5)
    assert len(fake.calls) == calls  # no retry loop against a platform that said no
    assert rt.worker_pid(PID) is None
    assert not fake.sent()
    # the answer is not lost: it waits, retryable, for the operator's new token
    delivery = OutboundDelivery.objects.get()
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)
    assert "WHATSAPP_ACCESS_TOKEN) was refused" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_locked_account_found_at_a_send_disables_the_plugin_with_the_reason(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.fail_next(400, 131031, "Account has been locked", times=100)
    fake.say("script:answer=unsent")
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert "Meta refused to send for this WhatsApp account or number: HTTP 400, code 131031" in \
        plugin.disabled_reason, plugin.disabled_reason
    assert "the business account is locked" in plugin.disabled_reason
    delivery = OutboundDelivery.objects.get()  # waits for the operator, not dead-lettered
    assert delivery.state in ("pending", "in_flight") and delivery.attempt <= 2, (delivery.state, delivery.attempt)


def test_a_token_refused_at_start_disables_the_plugin_before_the_webhook_listens(
        tcast, fake, start_runtime, monkeypatch):
    monkeypatch.setenv("WHATSAPP_ACCESS_TOKEN", "EAAGnot-the-token")
    whatsapp_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert "code 190" in Plugin.objects.get().disabled_reason
    wait_until(lambda: False, 1.0)
    assert len(fake.calls) == 1  # one GET of the phone number: not restarted in a loop
    assert not LISTENING.search(rt.log(PID))


def test_a_closed_24_hour_window_fails_the_delivery_with_that_reason_and_no_retry(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.window_closed()
    fake.say("script:answer=too late")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="dead_letter").exists(), 30), rt.log(PID)
    reason = OutboundDelivery.objects.get().last_error
    assert reason.startswith("permanent failure: 131047: the 24-hour customer service window has closed "
                             "(only a template message can be sent)"), reason
    wait_until(lambda: False, 1.0)
    assert len(fake.sends()) == 1  # permanent: not tried again
    assert "the 24-hour customer service window has closed" in rt.log(PID)
    fake.say("script:answer=others still get answers", wa_id="16315550000")
    assert fake.wait_sent(1), rt.log(PID)
    assert Plugin.objects.get().state == "running"


def test_a_closed_window_reported_after_a_200_is_logged_as_an_error_naming_the_delivery(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.fail_after_send(131047)  # Meta takes the send, then posts a "failed" status
    fake.say("script:answer=too late")
    [sent] = fake.wait_sent(1) or pytest.fail(rt.log(PID))
    assert delivered(), rt.log(PID)  # acked at the 200: nothing at the send said otherwise
    delivery_id = OutboundDelivery.objects.get().delivery_id
    line = wait_until(lambda: next((l for l in rt.log(PID).splitlines()
                                    if f"reports message {sent['id']} to {USER} failed" in l), None), 20)
    assert line, rt.log(PID)
    assert f"(delivery {delivery_id}, part 1): 131047: Re-engagement message" in line
    assert "ERROR" in line and "24-hour customer service window had closed" in line
    assert "the user did not get it" in line
    assert wait_until(fake.settled, 10) and ("status", 200) in fake.posts  # answered 200: Meta does not resend
    assert len(fake.sends()) == 1


def test_the_handshake_and_signatures_on_the_live_webhook(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    url = listening(rt, fake)
    fake.webhook_url = None  # this test posts by hand
    ok = fake.verify(challenge="1158201444", url=url)
    assert (ok.status_code, ok.text, ok.headers["content-type"].split(";")[0]) == (200, "1158201444", "text/plain")
    assert fake.verify(token="guess", url=url).status_code == 403
    assert fake.verify(mode="unsubscribe", url=url).status_code == 403
    forged = fake.message(text="script:answer=forged")
    assert fake.post_webhook(forged, None, url=url) == 401
    assert fake.post_webhook(forged, "sha256=" + "0" * 64, url=url) == 401
    assert fake.post_webhook(forged, "sha256=" + "0" * 64, url=url) == 401
    wait_until(lambda: False, 1.0)
    assert not Receipt.objects.exists() and not fake.sent()
    assert fake.post_webhook(fake.message(text="script:answer=genuine"), url=url) == 200
    assert fake.wait_sent(1), rt.log(PID)
    assert fake.texts() == ["genuine"] and Receipt.objects.count() == 1


def test_a_photo_in_is_fetched_with_the_token_and_stored_on_the_host(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    photo = b"\xff\xd8\xff\xe0 fake jpeg bytes"
    image = dict(fake.add_media(photo, "image/jpeg"), caption="script:answer=nice picture")
    fake.push(fake.message(text=None, kind="image", media=image))
    assert fake.wait_sent(1), rt.log(PID)
    assert fake.texts() == ["nice picture"]
    stored = PluginMedia.objects.get()
    assert (bytes(stored.data), stored.content_type) == (photo, "image/jpeg")
    assert [c.path for c in fake.calls if c.method == "GET" and c.path == image["id"]] == [image["id"]]


def test_another_phone_numbers_notifications_and_statuses_run_nothing(tcast, fake, start_runtime):
    whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    fake.push(fake.message(text="script:answer=not for us", phone_number_id="999999999999999"))
    fake.push(fake.status("wamid.HBgLfailed==", "failed",
                          errors=[{"code": 131026, "title": "Message undeliverable"}]))
    assert wait_until(fake.settled, 15)  # each answered 200: Meta must not retry them
    fake.say("script:answer=ours")
    assert fake.wait_sent(1), rt.log(PID)
    wait_until(lambda: False, 0.5)
    assert fake.texts() == ["ours"] and Receipt.objects.count() == 1
    assert "reports message wamid.HBgLfailed== to 16315551181 failed: 131026: Message undeliverable" in rt.log(PID)


def test_a_file_out_is_uploaded_to_meta_and_sent_as_a_document_after_the_text(tcast, fake, start_runtime):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    plugin = whatsapp_plugin()
    rt = start_runtime()
    listening(rt, fake)
    report = services.media_store(plugin_id=PID, data=b"%PDF-1.4 report", content_type="application/pdf",
                                  filename="report.pdf")
    actor = channel_actor_resolve(channel="whatsapp", user_id=USER)
    conv, _ = conversation_resolve(channel="whatsapp", client_id=PID, external_id=USER, actor=actor, caller=None)
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="your **report**", attachments=[
        {"kind": "document", "content_type": "application/pdf", "media_id": report, "filename": "report.pdf"}])
    text, doc = fake.wait_sent(2) or pytest.fail(rt.log(PID))
    assert text["text"]["body"] == "your *report*"
    [(media_id, upload)] = fake.uploads.items()
    assert upload == {"data": b"%PDF-1.4 report", "mime_type": "application/pdf", "filename": "report.pdf"}
    assert (doc["type"], doc["document"], doc["to"]) == ("document", {"id": media_id, "filename": "report.pdf"}, USER)
    assert delivered(), rt.log(PID)
