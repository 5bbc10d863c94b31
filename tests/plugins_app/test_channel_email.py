"""channel-email under the real supervisor, against a real IMAP server (pymap, IDLE) and a real SMTP server
(aiosmtpd) on loopback (tests/fakes/email.py)."""
from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from channels_app.models import Conversation, Receipt
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginMedia
from tests.fakes.email import MailServer, make_mail
from tests.plugins_app.conftest import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

BOT = "bot@example.org"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
ARGS = ["--imap-security", "none", "--smtp-security", "none", "--start-at", "unseen", "--timeout-secs", "10",
        "--smtp-retry-secs", "0.2"]
ENV_REFS = ["EMAIL_IMAP_HOST", "EMAIL_IMAP_PORT", "EMAIL_IMAP_USER", "EMAIL_IMAP_PASSWORD", "EMAIL_SMTP_HOST",
            "EMAIL_SMTP_PORT"]


@pytest.fixture
def mail(monkeypatch):
    server = MailServer(user=BOT, password="app-password").start()
    monkeypatch.setenv("EMAIL_IMAP_HOST", "127.0.0.1")
    monkeypatch.setenv("EMAIL_IMAP_PORT", str(server.imap_port))
    monkeypatch.setenv("EMAIL_IMAP_USER", BOT)
    monkeypatch.setenv("EMAIL_IMAP_PASSWORD", "app-password")
    monkeypatch.setenv("EMAIL_SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("EMAIL_SMTP_PORT", str(server.smtp_port))
    yield server
    server.stop()


def email_plugin(*extra_args, **over):
    """A plugins.toml entry as an operator writes it: the kind, its env_refs, its args; no command."""
    fields = dict(plugin_id="mail", kind="channel-email", command="", args=ARGS + list(extra_args),
                  env_refs=ENV_REFS, max_in_flight=4, max_retries=2, heartbeat_secs=0.5)
    fields.update(over)
    return Plugin.objects.create(**fields)


def answers_to(mail, address="alice@example.com"):
    return [m for m in mail.sent() if address in str(m["To"])]


def plain(msg) -> str:
    return msg.get_body(("plain",)).get_content().replace("\r\n", "\n").strip()


def delivered(n):
    return lambda: OutboundDelivery.objects.filter(state="delivered").count() >= n


def test_a_mail_in_is_answered_by_mail_in_its_thread_with_text_and_html_parts(tcast, mail, start_runtime):
    plugin = email_plugin()
    rt = start_runtime()
    first = make_mail(subject="Quarterly numbers", text="script:answer=**Revenue** is up\n\n- north\n- south")
    first_uid = mail.deliver(first)
    assert wait_until(delivered(1), 30), rt.log("mail")
    receipt = Receipt.objects.select_related("conversation").get()
    assert receipt.client_message_id == first["Message-ID"]
    assert receipt.conversation.external_id == first["Message-ID"]
    assert receipt.conversation.channel == "email" and receipt.conversation.client_id == plugin.plugin_id
    [answer] = answers_to(mail)
    assert answer["From"] == BOT
    assert answer["Subject"] == "Re: Quarterly numbers"
    assert answer["In-Reply-To"] == first["Message-ID"]
    assert answer["References"] == first["Message-ID"]
    assert answer["Auto-Submitted"] == "auto-replied"
    assert plain(answer) == "**Revenue** is up\n\n- north\n- south"
    page = answer.get_body(("html",)).get_content()
    assert "<strong>Revenue</strong>" in page and "<li>north</li>" in page
    delivery = OutboundDelivery.objects.get()
    assert delivery.channel_message_id == answer["Message-ID"]

    # Alice answers the answer, her client naming only In-Reply-To: the same conversation, threaded on.
    second = make_mail(subject="Re: Quarterly numbers", text="script:answer=noted\n\nOn Monday, the bot wrote:\n> old",
                       in_reply_to=answer["Message-ID"])
    mail.deliver(second)
    assert wait_until(delivered(2), 30), rt.log("mail")
    assert Conversation.objects.count() == 1
    assert Receipt.objects.count() == 2
    reply = answers_to(mail)[-1]
    assert reply["In-Reply-To"] == second["Message-ID"]
    assert reply["References"].split() == [first["Message-ID"], answer["Message-ID"], second["Message-ID"]]
    assert reply["Subject"] == "Re: Quarterly numbers"
    # the quoted history is not part of what the agent read
    from channels_app.models import Message
    assert Message.objects.filter(role="user", content__contains="> old").count() == 0
    # the hub holds it, so the mail is flagged read
    assert wait_until(lambda: "\\Seen" in mail.flags(first_uid), 10)


def test_the_same_mail_delivered_twice_runs_one_turn(tcast, mail, start_runtime):
    email_plugin()
    rt = start_runtime()
    msg = make_mail(text="script:answer=once")
    mail.deliver(msg)
    mail.deliver(msg)  # a second copy, a new UID: the provider redelivered it
    assert wait_until(delivered(1), 30), rt.log("mail")
    assert wait_until(lambda: "submitted as" in rt.log("mail") and rt.log("mail").count("submitted as") >= 2, 20)
    assert Receipt.objects.count() == 1
    wait_until(lambda: False, 1.0)
    assert len(answers_to(mail)) == 1


def test_auto_replies_bounces_and_bulk_mail_are_never_answered(tcast, mail, start_runtime):
    email_plugin()
    rt = start_runtime()
    mail.deliver(make_mail(text="script:answer=no", subject="Out of office",
                           headers={"Auto-Submitted": "auto-replied"}))
    mail.deliver(make_mail(text="script:answer=no", headers={"Precedence": "bulk"}))
    mail.deliver(make_mail(text="script:answer=no", sender="MAILER-DAEMON@example.com",
                           subject="Undelivered Mail Returned to Sender"))
    mail.deliver(make_mail(text="script:answer=no", headers={"Return-Path": "<>"}))
    mail.deliver(make_mail(text="script:answer=yes"))
    assert wait_until(delivered(1), 30), rt.log("mail")
    assert Receipt.objects.count() == 1
    log = rt.log("mail")
    for reason in ("Auto-Submitted: auto-replied", "Precedence: bulk", "sender mailer-daemon@example.com",
                   "null Return-Path"):
        assert reason in log
    assert [plain(a) for a in answers_to(mail)] == ["yes"]


def test_attachments_travel_both_ways_through_the_hubs_media(tcast, mail, start_runtime):
    plugin = email_plugin()
    rt = start_runtime()
    mail.deliver(make_mail(text="script:answer=got it", attachments=[(PNG, "image/png", "chart.png")]))
    assert wait_until(delivered(1), 30), rt.log("mail")
    media = PluginMedia.objects.get()
    assert (bytes(media.data), media.content_type, media.filename) == (PNG, "image/png", "chart.png")

    from plugins_app.channel import services
    report = b"%PDF-1.4 a small report"
    media_id = services.media_store(plugin_id=plugin.plugin_id, data=report, content_type="application/pdf",
                                    filename="report.pdf")
    services.delivery_enqueue(plugin=plugin, conversation=Conversation.objects.get(), text="Here is the report.",
                              attachments=[{"kind": "document", "content_type": "application/pdf",
                                            "media_id": media_id, "filename": "report.pdf"}])
    assert wait_until(delivered(2), 30), rt.log("mail")
    sent = answers_to(mail)[-1]
    [att] = list(sent.iter_attachments())
    assert (att.get_filename(), att.get_content_type(), att.get_content()) == \
        ("report.pdf", "application/pdf", report)


def test_a_worker_killed_after_the_send_and_before_the_ack_answers_exactly_once(tcast, mail, start_runtime):
    email_plugin()
    rt = start_runtime()
    release = threading.Event()
    mail.stall_quit(release)  # the server takes the message, then hangs on QUIT: the worker has not acked
    mail.deliver(make_mail(text="script:answer=only once"))
    assert wait_until(lambda: answers_to(mail), 30), rt.log("mail")
    first = rt.worker_pid("mail")
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    mail.stall_quit(None)
    release.set()
    assert wait_until(delivered(1), 30), rt.log("mail")
    assert rt.worker_pid("mail") not in (None, first)
    assert len(answers_to(mail)) == 1
    # and the restarted worker still reads and answers
    mail.deliver(make_mail(text="script:answer=after the restart"))
    assert wait_until(delivered(2), 30), rt.log("mail")
    assert [plain(a) for a in answers_to(mail)] == \
        ["only once", "after the restart"]


def test_a_rate_limited_send_waits_and_succeeds(tcast, mail, start_runtime):
    email_plugin()
    rt = start_runtime()
    mail.smtp_refuse(451, "4.7.1 Rate limited, retry after 1 second")
    mail.deliver(make_mail(text="script:answer=patience"))
    assert wait_until(delivered(1), 30), rt.log("mail")
    assert mail.smtp_refusals == ["451 4.7.1 Rate limited, retry after 1 second"]
    assert [plain(a) for a in answers_to(mail)] == ["patience"]
    assert OutboundDelivery.objects.get().attempt == 1  # waited out inside the one send, not a host retry
    assert "SMTP said try later (4.7.1 Rate limited, retry after 1 second); waiting 1.0 s" in rt.log("mail")


def test_a_dropped_connection_loses_no_mail_and_idle_is_reissued(tcast, mail, start_runtime):
    email_plugin("--idle-secs", "1")
    rt = start_runtime()
    mail.deliver(make_mail(text="script:answer=one"))
    assert wait_until(delivered(1), 30), rt.log("mail")
    before = mail.idle_count
    assert wait_until(lambda: mail.idle_count >= before + 2, 20)  # IDLE ended and issued again on a timer
    assert wait_until(lambda: mail.drop_connections() >= 1, 10)
    mail.deliver(make_mail(text="script:answer=two"))   # arrives while the worker reconnects
    mail.drop_connections()
    mail.deliver(make_mail(text="script:answer=three"))
    assert wait_until(delivered(3), 30), rt.log("mail")
    assert sorted(plain(a) for a in answers_to(mail)) == ["one", "three", "two"]
    assert "the IMAP connection dropped" in rt.log("mail")


def test_a_revoked_password_disables_the_plugin_with_the_reason_and_it_is_not_retried(
        tcast, mail, start_runtime, admin_client):
    email_plugin()
    rt = start_runtime()
    mail.deliver(make_mail(text="script:answer=fine"))
    assert wait_until(delivered(1), 30), rt.log("mail")
    mail.set_password("rotated")
    mail.drop_connections()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("mail")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == ("the channel refused the worker: IMAP login refused for bot@example.org: "
                                      "[AUTHENTICATIONFAILED] Invalid authentication credentials.")
    wait_until(lambda: False, 1.0)
    assert rt.log("mail").count("the channel refused this worker") == 1
    assert "IMAP login refused" in admin_client.get("/admin/plugins_app/plugin/").content.decode()


def test_a_wrong_password_at_start_is_refused_at_once(tcast, mail, start_runtime, monkeypatch):
    monkeypatch.setenv("EMAIL_IMAP_PASSWORD", "wrong")
    email_plugin()
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("mail")
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: IMAP login refused for bot@example.org")
    assert rt.log("mail").count("the channel refused this worker") == 1


@pytest.mark.parametrize("answer", [
    "[ALERT] Too many simultaneous connections. (Failure)",    # Gmail: the account's 15 connections in use
    "[UNAVAILABLE] Temporary authentication failure.",         # Dovecot: its auth service down (RFC 5530)
])
def test_a_login_the_server_answers_later_is_tried_again_and_the_mail_meanwhile_is_answered_once(
        tcast, mail, start_runtime, answer):
    mail.refuse_login(answer, times=3)  # the start's login check and the listener's first two
    mail.deliver(make_mail(text="script:answer=waited"))
    email_plugin()
    rt = start_runtime()
    assert wait_until(delivered(1), 60), rt.log("mail")
    assert mail.logins[:4] == [answer] * 3 + ["OK"]
    # a dropped connection later is met by the same answers, and the mail that came meanwhile is read too
    mail.refuse_login(answer, times=2)
    assert wait_until(lambda: mail.drop_connections() >= 1, 10)
    mail.deliver(make_mail(text="script:answer=again"))
    assert wait_until(delivered(2), 60), rt.log("mail")
    assert sorted(plain(a) for a in answers_to(mail)) == ["again", "waited"]
    plugin = Plugin.objects.get()
    assert plugin.enabled and not plugin.disabled_reason
    log = rt.log("mail")
    assert "the channel refused this worker" not in log
    assert f"the IMAP server answered LOGIN for {BOT}: NO {answer}; not a refusal: trying again in 0.5 s " \
           "(answer 2" in log
    assert "the IMAP server took the login after 3 answers" in log


def test_an_smtp_login_the_server_refuses_stops_the_worker_with_the_reason(tcast, mail, start_runtime):
    email_plugin()
    rt = start_runtime()
    mail.smtp_password = "only-smtp-rotated"
    mail.deliver(make_mail(text="script:answer=cannot send"))
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("mail")
    assert Plugin.objects.get().disabled_reason.startswith(
        "the channel refused the worker: SMTP login refused for bot@example.org: 535")
    assert not answers_to(mail)
    # the answer is not lost: one attempt spent, it waits for the operator's fix
    delivery = OutboundDelivery.objects.get()
    assert (delivery.state, delivery.attempt) == ("pending", 2)
    assert rt.log("mail").count("the channel refused this worker") == 1


def test_by_default_a_first_start_answers_only_mail_that_arrives_after_it(tcast, mail, start_runtime):
    old = mail.deliver(make_mail(text="script:answer=too late"))
    email_plugin(args=[a for a in ARGS if a not in ("--start-at", "unseen")])
    rt = start_runtime()
    assert wait_until(lambda: "watching INBOX" in rt.log("mail") and f"after UID {old}" in rt.log("mail"), 30), \
        rt.log("mail")
    mail.deliver(make_mail(text="script:answer=just in time"))
    assert wait_until(delivered(1), 30), rt.log("mail")
    wait_until(lambda: False, 1.0)
    assert [plain(a) for a in answers_to(mail)] == ["just in time"]
    assert Receipt.objects.count() == 1


def test_a_conversation_named_by_an_address_starts_a_new_thread_to_it(tcast, mail, start_runtime):
    plugin = email_plugin()
    start_runtime()
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    actor = channel_actor_resolve(channel="email", user_id="carol@example.com")
    conv, _ = conversation_resolve(channel="email", client_id=plugin.plugin_id, external_id="carol@example.com",
                                   actor=actor, caller=None)
    services.delivery_enqueue(plugin=plugin, conversation=conv, text="Your weekly digest",
                              metadata={"subject": "Weekly digest"})
    assert wait_until(delivered(1), 30)
    [sent] = answers_to(mail, "carol@example.com")
    assert (sent["Subject"], sent["In-Reply-To"], plain(sent)) == ("Weekly digest", None, "Your weekly digest")
