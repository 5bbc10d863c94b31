"""channel-slack's parts on their own: markup both ways, normalisation, splitting, rate limits, signatures."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from slack_sdk.signature import SignatureVerifier

from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.slack import (TEXT_LIMIT, SlackWorker, conversation_of, message_parts,
                                               source_type, split_conversation)
from plugins_app.channel.workers.slack.api import Bucket, RateGate
from plugins_app.channel.workers.slack.mrkdwn import to_mrkdwn, to_plain
from plugins_app.channel.workers.slack.webhook import EventsServer

DATA = Path(__file__).resolve().parents[1] / "data"


def worker(*argv: str) -> SlackWorker:
    w = SlackWorker(argv=list(argv), environ={}, socket_path="/nowhere", plugin_id="slack-test", token="t",
                    install_signal_handlers=False)
    w.bot_user_id = "U0BOT"
    return w


def payload(event: dict, event_id: str = "Ev1") -> dict:
    return {"type": "event_callback", "team_id": "T1", "event_id": event_id, "event_time": 1700000000,
            "event": event}


def message(**over) -> dict:
    event = {"type": "message", "user": "U1", "text": "hi", "ts": "1700000000.000100", "channel": "C1",
             "channel_type": "channel"}
    event.update(over)
    return event


# -- markup -----------------------------------------------------------------------------------

@pytest.mark.parametrize("markdown, mrkdwn", [
    ("**bold** and __bold__", "*bold* and *bold*"),
    ("*italic* and _italic_", "_italic_ and _italic_"),
    ("~~gone~~", "~gone~"),
    ("[docs](https://x.org/a?b=1&c=2)", "<https://x.org/a?b=1&amp;c=2|docs>"),
    ("<https://x.org>", "<https://x.org>"),
    ("![a cat](https://x.org/cat.png)", "<https://x.org/cat.png|a cat>"),
    ("# Title", "*Title*"),
    ("- one\n  * two\n+ three", "• one\n  • two\n• three"),
    ("> quoted <b> & so", "> quoted &lt;b&gt; &amp; so"),
    ("a < b > c & d", "a &lt; b &gt; c &amp; d"),
    ("`a **b** < c`", "`a **b** &lt; c`"),
    ("```python\nx = **y** < 2\n```", "```\nx = **y** &lt; 2\n```"),
    ("ping <!channel> and <@U123>", "ping &lt;!channel&gt; and &lt;@U123&gt;"),  # never a real mention
    ("2 * 3 * 4", "2 * 3 * 4"),
])
def test_markdown_becomes_slack_mrkdwn(markdown, mrkdwn):
    assert to_mrkdwn(markdown) == mrkdwn


def test_slack_text_reads_as_plain_text_without_the_bots_own_leading_mention():
    text = "<@U0BOT> /ask <@U2|bob> in <#C1|general>: <https://x.org|site> &lt;b&gt; &amp; <!here>"
    assert to_plain(text, bot_user_id="U0BOT") == "/ask @bob in #general: site (https://x.org) <b> & @here"
    assert to_plain("<@U0BOT> hi", bot_user_id="U9") == "@U0BOT hi"


def test_a_long_answer_is_split_within_the_limit_with_code_fences_closed_in_each_part():
    answer = "intro\n\n```\n" + "\n".join(f"line {i} < {i + 1}" for i in range(900)) + "\n```\n\nend"
    parts = message_parts(answer)
    assert len(parts) > 1 and all(len(p) <= TEXT_LIMIT for p in parts)
    assert all(p.count("```") % 2 == 0 for p in parts)
    assert message_parts("") == [] and message_parts("  ") == []


# -- normalisation -----------------------------------------------------------------------------

@pytest.mark.parametrize("channel_type, channel, expected", [
    ("im", "D1", "user"), ("mpim", "G1", "group"), ("channel", "C1", "room"), ("group", "G2", "room"),
    (None, "D9", "user"), (None, "C9", "room"),
])
def test_slacks_channel_type_is_the_rule_engines_source_type(channel_type, channel, expected):
    assert source_type(channel_type, channel) == expected


def test_threads_are_conversations_when_the_operator_chooses():
    assert conversation_of("C1", "1.1", None, "channel", threads=True) == "C1/1.1"   # starts a thread
    assert conversation_of("C1", "2.2", "1.1", "channel", threads=True) == "C1/1.1"  # a reply in it
    assert conversation_of("D1", "1.1", None, "im", threads=True) == "D1"            # a DM's top level
    assert conversation_of("D1", "2.2", "1.1", "im", threads=True) == "D1/1.1"
    assert conversation_of("C1", "2.2", "1.1", "channel", threads=False) == "C1"
    assert split_conversation("C1/1.1") == ("C1", "1.1") and split_conversation("C1") == ("C1", None)


def test_a_message_event_is_normalised_with_its_channel_and_ts_as_its_idempotency_key():
    w = worker()
    msg = w.normalise(payload(message(text="<@U0BOT> hello", thread_ts="1699999999.000001",
                                      user_profile={"display_name": "Ann"}), "Ev42"))
    assert (msg.channel, msg.conversation_id, msg.message_id, msg.sender_id, msg.sender_name, msg.source_type,
            msg.text) == ("slack", "C1/1699999999.000001", "C1:1700000000.000100", "U1", "Ann", "room", "hello")
    assert msg.reply_to.message_id == "C1:1699999999.000001"  # (the thread's first message's message_id)
    assert msg.timestamp == "2023-11-14T22:13:20.000Z"
    assert msg.metadata["ts"] == "1700000000.000100"


def test_files_become_attachments_fetched_with_the_token_only_from_slack_hosts():
    w = worker()
    w.base_url = "http://127.0.0.1:9/api/"
    msg = w.normalise(payload(message(subtype="file_share", text="", files=[
        {"id": "F1", "name": "a.png", "mimetype": "image/png", "size": 3,
         "url_private_download": "https://files.slack.com/files-pri/T1-F1/download/a.png"}])))
    [att] = msg.attachments
    assert (att.kind, att.content_type, att.filename, att.size, att.channel_ref) == ("image", "image/png", "a.png",
                                                                                    3, "F1")
    assert w._slack_host(att.url) and w._slack_host("http://127.0.0.1:9/files-pri/x")
    assert not w._slack_host("https://files.slack.com.evil.example/x") and not w._slack_host("https://evil.example")


@pytest.mark.parametrize("event", [
    message(user="U0BOT"),                                       # the bot itself
    message(bot_id="B1"),                                        # another bot
    message(subtype="message_changed"), message(subtype="channel_join"), message(subtype="message_deleted"),
    message(text=""),                                            # nothing to say
    {"type": "reaction_added", "user": "U1", "item": {}},
])
def test_what_is_not_a_persons_message_is_not_submitted(event):
    assert worker().normalise(payload(event)) is None


def test_one_message_seen_as_message_and_app_mention_is_submitted_once():
    w = worker()
    assert w.normalise(payload(message(), "Ev1")) is not None
    assert w.normalise(payload(dict(message(), type="app_mention"), "Ev2")) is None
    assert w.normalise(payload(message(), "Ev1")) is not None  # a retry of the first is still itself


def test_one_message_seen_as_app_mention_then_after_a_restart_as_message_is_recorded_once(tmp_path):
    """Its two events' ids differ: matched in memory only, a restart between them (and Slack retrying the one
    it could not deliver meanwhile) recorded it under a second key, and it was answered twice."""
    from plugins_app.channel.sdk.outbox import PENDING

    def started() -> SlackWorker:
        w = SlackWorker(argv=[], environ={}, socket_path="/nowhere", plugin_id="slack-test", token="t",
                        install_signal_handlers=False, outbox_path=str(tmp_path / "o.sqlite3"))
        w.bot_user_id = "U0BOT"
        w._outbox()  # (opened as connect() does)
        return w

    first = started()
    first.accept(payload(dict(message(text="<@U0BOT> hi"), type="app_mention"), "EvMention"))
    assert first._inbox.qsize() == 1
    [row] = first.outbox.inbound_pending()
    first.outbox.inbound_acked(row.key, {"accepted": True})  # the hub took it
    first.outbox.close()
    again = started()  # the worker restarted; Slack retries the 'message' event it could not deliver meanwhile
    again.accept(payload(message(text="<@U0BOT> hi"), "EvMessage"))
    assert again._inbox.qsize() == 0 and again.outbox.inbound_pending() == []
    assert again.outbox.inbound_get(row.key).state != PENDING
    again.outbox.close()


def test_an_unknown_mode_is_refused_by_the_argument_parser():
    with pytest.raises(SystemExit):
        worker("--mode", "polling")


# -- rate limits ---------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_retry_after_blocks_that_channel_only_and_other_methods_per_workspace():
    clock = Clock()
    gate = RateGate(clock=clock)
    gate.block("chat.postMessage", "C1", 3)
    assert gate.delay("chat.postMessage", "C1") == 3
    assert gate.delay("chat.postMessage", "C2") == 0
    gate.block("conversations.history", "", 2)
    assert gate.delay("conversations.history", "C9") == 2
    clock.now += 3
    assert gate.delay("chat.postMessage", "C1") == 0


def test_posting_to_one_channel_is_paced_after_the_burst():
    clock = Clock()
    bucket = Bucket(rate=1.0, burst=3, clock=clock)
    assert [bucket.delay() for _ in range(3)] == [0, 0, 0]
    assert bucket.delay() == pytest.approx(1.0)
    clock.now += 5
    assert bucket.delay() == 0


# -- signatures -----------------------------------------------------------------------------------

class FixedClock:
    def __init__(self, now):
        self._now = now

    def now(self):
        return self._now


def slack_vector() -> dict:
    vectors = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
    return next(v for v in vectors if v["id"] == "slack-v0-docs")


def server_at(clock, secret, records) -> EventsServer:
    server = EventsServer("127.0.0.1:0", "/slack/events", secret, records.append,
                          verifier=SignatureVerifier(secret, clock=clock))
    server.httpd.server_close()
    return server


def test_the_v0_signature_vector_verifies_within_the_window_and_not_tampered_or_stale():
    v = slack_vector()
    inputs, expected = v["inputs"], v["expected"]
    records: list = []
    fresh = server_at(FixedClock(expected["valid_when_clock_is"]), inputs["signing_secret"], records)
    status, _ = fresh.handle("/slack/events", inputs["headers"], inputs["body"].encode())
    assert status == 400  # the signature holds; the body (a slash command's form) is simply not an event
    tampered = expected["negative_cases"][0]["body"].encode()
    assert fresh.handle("/slack/events", inputs["headers"], tampered) == (401, {"ok": False,
                                                                              "error": "invalid signature"})
    stale = server_at(FixedClock(expected["valid_when_clock_is"] + 301), inputs["signing_secret"], records)
    assert stale.handle("/slack/events", inputs["headers"], inputs["body"].encode())[0] == 401
    assert records == []


def test_a_signed_event_is_recorded_and_a_challenge_answered():
    from tests.fakes.slack import sign
    records: list = []
    server = server_at(FixedClock(1700000000), "s3cret", records)
    body = json.dumps(payload(message())).encode()
    headers = {"X-Slack-Request-Timestamp": "1700000000", "X-Slack-Signature": sign("s3cret", "1700000000", body)}
    assert server.handle("/slack/events", headers, body) == (200, "")
    assert records == [payload(message())]
    body = json.dumps({"type": "url_verification", "challenge": "abc"}).encode()
    headers["X-Slack-Signature"] = sign("s3cret", "1700000000", body)
    assert server.handle("/slack/events", headers, body) == (200, {"challenge": "abc"})
    assert server.handle("/other", headers, body)[0] == 404


# -- registration -----------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_slack_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-slack"]
    assert kind.module == "plugins_app.channel.workers.slack"
    assert kind.env_refs == ("SLACK_BOT_TOKEN", "SLACK_APP_TOKEN")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "slack-main"\nkind = "channel-slack"\n'
                               'args = ["--mode", "socket"]\nenv_refs = ["SLACK_BOT_TOKEN", "SLACK_APP_TOKEN"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.slack", "--mode", "socket"])


@pytest.mark.parametrize("headers", [
    {},  # neither header
    {"X-Slack-Signature": "v0=00"},  # no timestamp
    {"X-Slack-Request-Timestamp": "abc", "X-Slack-Signature": "v0=00"},
    {"X-Slack-Request-Timestamp": "1e3", "X-Slack-Signature": "v0=00"},
    {"X-Slack-Request-Timestamp": "1700000000"},  # no signature
    {"X-Slack-Request-Timestamp": "9" * 5000, "X-Slack-Signature": "v0=00"},  # past int()'s digit limit
    {"X-Slack-Request-Timestamp": str(int(time.time())), "X-Slack-Signature": "v0=\u00e9\u00e9"},  # not ASCII
    {"X-Slack-Request-Timestamp": str(int(time.time())), "X-Slack-Signature": "v0=00", "body": b"\xff\xfe{"},
], ids=["none", "no-timestamp", "timestamp-abc", "timestamp-1e3", "no-signature", "timestamp-5000-digits",
        "signature-not-ascii", "body-not-utf8"])
def test_a_request_without_both_headers_or_with_a_timestamp_that_is_no_integer_is_answered_401(headers):
    """(slack_sdk's verifier raised on int(timestamp), on a body that is not UTF-8 and on a signature that is not
    ASCII: the connection closed with no answer, later a 500 with a traceback.)"""
    import httpx
    records: list = []
    headers = dict(headers)
    body = headers.pop("body", json.dumps(payload(message())).encode())
    server = EventsServer("127.0.0.1:0", "/slack/events", "s3cret", records.append)
    server.start()
    try:
        answer = httpx.post(server.url, content=body,
                            headers={"Content-Type": "application/json",
                                     **{k: v.encode("utf-8") for k, v in headers.items()}})
        assert (answer.status_code, answer.json()) == (401, {"ok": False, "error": "invalid signature"})
    finally:
        server.stop()
    assert records == []
