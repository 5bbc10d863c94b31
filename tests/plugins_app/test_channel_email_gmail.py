"""channel-email with --gmail-push under the real supervisor, against Gmail, Google OAuth and Pub/Sub push
faked on loopback (tests/fakes/gmail.py)."""
from __future__ import annotations

import re
import sys

import pytest

from channels_app.models import Receipt
from plugins_app.channel.models import OutboundDelivery, Plugin
from tests.fakes.email import make_mail
from tests.fakes.gmail import AUDIENCE, SERVICE_ACCOUNT, FakeGmail
from tests.plugins_app.conftest import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

BOT = "bot@example.org"
TOPIC = "projects/example-project/topics/ugent-mail"
ENV = ["GMAIL_CLIENT_ID", "GMAIL_CLIENT_SECRET", "GMAIL_REFRESH_TOKEN", "GMAIL_API_BASE_URL", "GMAIL_TOKEN_URL",
       "GMAIL_PUSH_JWKS_URL", "EMAIL_ADDRESS"]


@pytest.fixture
def gmail(monkeypatch):
    fake = FakeGmail(address=BOT).start()
    for name, value in (("GMAIL_CLIENT_ID", "client-1.apps.googleusercontent.com"), ("GMAIL_CLIENT_SECRET", "s"),
                        ("GMAIL_REFRESH_TOKEN", "1//refresh"), ("GMAIL_API_BASE_URL", fake.api_url),
                        ("GMAIL_TOKEN_URL", fake.token_url), ("GMAIL_PUSH_JWKS_URL", fake.jwks_url),
                        ("EMAIL_ADDRESS", BOT)):
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def gmail_plugin(*extra):
    return Plugin.objects.create(
        plugin_id="gmail", kind="channel-email", command="", env_refs=ENV, max_in_flight=4, max_retries=2,
        heartbeat_secs=0.5, args=["--gmail-push", "--gmail-topic", TOPIC, "--push-port", "0",
                                  "--push-audience", AUDIENCE, "--push-service-account", SERVICE_ACCOUNT,
                                  "--timeout-secs", "10", *extra])


def endpoint(rt) -> str:
    found = wait_until(lambda: re.search(r"Gmail push endpoint listening on (http://\S+)", rt.log("gmail")), 30)
    assert found, rt.log("gmail")
    return found.group(1)


def delivered(n):
    return lambda: OutboundDelivery.objects.filter(state="delivered").count() >= n


def plain(msg) -> str:
    return msg.get_body(("plain",)).get_content().replace("\r\n", "\n").strip()


def test_a_push_reads_the_new_mail_and_the_answer_goes_out_through_messages_send(tcast, gmail, start_runtime):
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    assert gmail.watches == [{"topicName": TOPIC, "labelIds": ["INBOX"], "labelFilterBehavior": "INCLUDE"}]
    first = make_mail(subject="Hi", text="script:answer=hello *there*")
    gmail.add_mail(first)
    assert gmail.push(url) == 204
    assert wait_until(delivered(1), 30), rt.log("gmail")
    assert Receipt.objects.get().client_message_id == first["Message-ID"]
    [answer] = gmail.sent()
    assert (answer["To"], answer["Subject"], answer["In-Reply-To"]) == ("alice@example.com", "Re: Hi",
                                                                        first["Message-ID"])
    assert plain(answer) == "hello *there*"
    assert "<em>there</em>" in answer.get_body(("html",)).get_content()


def test_a_push_without_googles_signature_or_for_another_audience_is_refused_and_reads_nothing(
        tcast, gmail, start_runtime):
    from cryptography.hazmat.primitives.asymmetric import rsa
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    gmail.add_mail(make_mail(text="script:answer=only after a real push"))
    reads = sum(1 for r in gmail.requests if r[1].endswith("/history"))
    forged = gmail.oidc_token(key=rsa.generate_private_key(public_exponent=65537, key_size=2048))
    assert gmail.push(url, token=forged) == 403
    assert gmail.push(url, token=gmail.oidc_token(audience="https://elsewhere.example/push")) == 403
    assert gmail.push(url, token=gmail.oidc_token(email_claim="someone@evil.example")) == 403
    assert gmail.push(url, token="not-a-jwt") == 403
    wait_until(lambda: False, 1.0)
    assert sum(1 for r in gmail.requests if r[1].endswith("/history")) == reads
    assert not Receipt.objects.exists()
    assert gmail.push(url) == 204
    assert wait_until(delivered(1), 30), rt.log("gmail")


def test_a_redelivered_push_and_a_mail_seen_twice_run_one_turn(tcast, gmail, start_runtime):
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    msg = make_mail(text="script:answer=once")
    gmail.add_mail(msg)
    gmail.add_mail(msg)  # the same mail again (a second copy, a new Gmail id)
    assert gmail.push(url, message_id="pubsub-1") == 204
    assert gmail.push(url, message_id="pubsub-1") == 204  # Pub/Sub redelivers the same push
    assert wait_until(delivered(1), 30), rt.log("gmail")
    wait_until(lambda: False, 1.0)
    assert Receipt.objects.count() == 1 and len(gmail.sent()) == 1


def test_mail_that_came_while_the_worker_was_down_is_read_at_its_restart(tcast, gmail, start_runtime):
    import os
    import signal
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    gmail.add_mail(make_mail(text="script:answer=before"))
    assert gmail.push(url) == 204
    assert wait_until(delivered(1), 30), rt.log("gmail")
    first = rt.worker_pid("gmail")
    os.kill(first, signal.SIGKILL)
    gmail.add_mail(make_mail(text="script:answer=while down"))
    assert wait_until(lambda: gmail.push(url) == 0, 10)  # nobody listens: the worker must not depend on the push
    assert wait_until(delivered(2), 30), rt.log("gmail")
    assert rt.worker_pid("gmail") not in (None, first)
    assert [plain(m) for m in gmail.sent()] == ["before", "while down"]


def test_a_push_that_never_comes_is_covered_by_the_fallback_read(tcast, gmail, start_runtime):
    gmail_plugin("--gmail-poll-secs", "0.5")
    rt = start_runtime()
    endpoint(rt)
    gmail.add_mail(make_mail(text="script:answer=found anyway"))
    assert wait_until(delivered(1), 30), rt.log("gmail")
    assert [plain(m) for m in gmail.sent()] == ["found anyway"]


def test_a_429_on_send_waits_for_retry_after_and_succeeds(tcast, gmail, start_runtime):
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    gmail.throttle_send(1)
    gmail.add_mail(make_mail(text="script:answer=patience"))
    assert gmail.push(url) == 204
    assert wait_until(delivered(1), 30), rt.log("gmail")
    assert gmail.throttled == 1
    assert [plain(m) for m in gmail.sent()] == ["patience"]
    assert OutboundDelivery.objects.get().attempt == 1
    assert "Gmail answered 429; waiting 1.0 s and trying again" in rt.log("gmail")


def test_a_revoked_grant_disables_the_plugin_with_the_reason_and_it_is_not_retried(tcast, gmail, start_runtime):
    gmail_plugin()
    rt = start_runtime()
    url = endpoint(rt)
    gmail.revoke()
    gmail.add_mail(make_mail(text="script:answer=never"))
    assert gmail.push(url) == 204
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log("gmail")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == ("the channel refused the worker: Gmail refused the refresh token: "
                                      "invalid_grant: Token has been expired or revoked.")
    wait_until(lambda: False, 1.0)
    assert rt.log("gmail").count("the channel refused this worker") == 1


@pytest.fixture
def push_endpoint(gmail):
    """The worker's real push endpoint on loopback (GmailPush.start_push_server), verifying tokens against the
    fake's JWKS; no supervisor, no mailbox reads."""
    import threading
    import types
    from plugins_app.channel.workers.email.gmail import GmailPush
    args = types.SimpleNamespace(timeout_secs=10, push_bind="127.0.0.1", push_port=0, push_audience=AUDIENCE,
                                 push_service_account=SERVICE_ACCOUNT)
    push = GmailPush(types.SimpleNamespace(stopping=threading.Event()), args)
    push.start_push_server()
    yield push
    push.close()


def raw_post(push, head: str, body: bytes = b"") -> bytes:
    """What the endpoint answers before it closes the connection, for a POST of ``head`` (and ``body``)."""
    import socket
    with socket.create_connection(push.server.server_address[:2], timeout=20) as conn:
        conn.sendall(f"POST / HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        answer = b""
        try:
            while chunk := conn.recv(4096):
                answer += chunk
        except ConnectionResetError:  # (closed with our unread bytes still in its buffer)
            pass
        return answer


def test_a_push_is_refused_before_its_body_is_read_unauthenticated_oversized_or_with_a_bad_length(
        gmail, push_endpoint):
    """(The body was read whole before the token was checked: one unauthenticated 300 MB POST held 300 MB;
    a Content-Length "abc" was a traceback with no answer, a negative one read until the client closed.)
    Each of these announces a body it never sends in full: the endpoint answers without waiting for it."""
    big = f"Content-Length: {300 << 20}\r\n"
    assert raw_post(push_endpoint, big, b"x" * 1024).startswith(b"HTTP/1.0 413")
    within = f"Content-Length: {60 << 10}\r\n"  # under the cap: the token is what refuses it, still unread
    assert raw_post(push_endpoint, within, b"x" * 1024).startswith(b"HTTP/1.0 401")
    forged = "Authorization: Bearer not-a-jwt\r\n"
    assert raw_post(push_endpoint, forged + within, b"x" * 1024).startswith(b"HTTP/1.0 403")
    token = f"Authorization: Bearer {gmail.oidc_token()}\r\n"
    assert raw_post(push_endpoint, token + big, b"x" * 1024).startswith(b"HTTP/1.0 413")
    assert raw_post(push_endpoint, token + "Content-Length: abc\r\n", b"{}").startswith(b"HTTP/1.0 400")
    assert raw_post(push_endpoint, token + "Content-Length: -1\r\n", b"{}").startswith(b"HTTP/1.0 400")
    assert raw_post(push_endpoint, token + "Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n").startswith(
        b"HTTP/1.0 411")
    assert not push_endpoint.wake.is_set()
    assert gmail.push("http://%s:%s/" % push_endpoint.server.server_address[:2]) == 204
    assert push_endpoint.wake.is_set()  # a real push, within the cap, still wakes the reader
