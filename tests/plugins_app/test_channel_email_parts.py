"""channel-email's pure parts: normalisation, threads, what is never answered, markup, retry waits, args."""
from __future__ import annotations

import email
import email.policy

import pytest

from plugins_app.channel.workers.email import parse as mailworker, state as mailstate, worker as mailproc
from tests.fakes.email import make_mail

OWN = {"bot@example.org"}


def parsed(msg):
    return email.message_from_bytes(msg.as_bytes(), policy=email.policy.default)


def normalise(msg, known=None, uid=7):
    return mailworker.normalise(msg.as_bytes(), uidvalidity=42, uid=uid, own_addresses=OWN, known=known or {},
                                user="bot@example.org", host="imap.example.org", mailbox="INBOX")


def test_a_new_mail_is_its_own_thread_keyed_by_its_message_id():
    msg = make_mail(sender="Alice Example <Alice@Example.com>", text="hello", message_id="<a1@example.com>")
    inbound, _, reason = normalise(msg)
    assert reason is None
    assert (inbound.channel, inbound.conversation_id, inbound.message_id) == ("email", "<a1@example.com>",
                                                                              "<a1@example.com>")
    assert (inbound.sender_id, inbound.sender_name, inbound.source_type) == ("alice@example.com", "Alice Example",
                                                                             "user")
    assert inbound.text == "hello" and inbound.reply_to is None
    assert inbound.metadata == {"subject": "Hello", "uidvalidity": 42, "uid": 7}


def test_a_mail_without_message_id_is_keyed_by_uidvalidity_and_uid():
    msg = make_mail(text="x")
    del msg["Message-ID"]
    inbound, _, _ = normalise(msg, uid=9)
    assert inbound.message_id == inbound.conversation_id == "uid:42:9"


def test_a_reply_joins_the_thread_a_known_id_names_else_the_references_root():
    reply = make_mail(text="more", message_id="<r2@example.com>", in_reply_to="<ours@example.org>",
                      references="<root@example.com> <ours@example.org>")
    inbound, _, _ = normalise(reply, known={"<ours@example.org>": "<root@example.com>"})
    assert inbound.conversation_id == "<root@example.com>"
    assert inbound.reply_to.message_id == "<ours@example.org>"
    only_in_reply_to = make_mail(text="more", in_reply_to="<ours@example.org>")
    assert normalise(only_in_reply_to, known={"<ours@example.org>": "<root@example.com>"})[0].conversation_id == \
        "<root@example.com>"
    unknown = make_mail(text="more", references="<first@x> <second@x>", in_reply_to="<second@x>")
    assert normalise(unknown)[0].conversation_id == "<first@x>"


def test_other_recipients_make_it_a_group_conversation():
    msg = make_mail(text="hi all", to="bot@example.org, carol@example.com")
    assert normalise(msg)[0].source_type == "group"
    msg = make_mail(text="hi", to="Bot <BOT@example.org>")
    assert normalise(msg)[0].source_type == "user"


@pytest.mark.parametrize("headers, sender, reason", [
    ({"Auto-Submitted": "auto-replied"}, "alice@example.com", "Auto-Submitted: auto-replied"),
    ({"Auto-Submitted": "auto-generated"}, "alice@example.com", "Auto-Submitted: auto-generated"),
    ({"Precedence": "bulk"}, "alice@example.com", "Precedence: bulk"),
    ({"Precedence": "list"}, "alice@example.com", "Precedence: list"),
    ({"X-Autoreply": "yes"}, "alice@example.com", "X-Autoreply"),
    ({"Return-Path": "<>"}, "alice@example.com", "null Return-Path (a bounce)"),
    ({}, "MAILER-DAEMON@mx.example.com", "sender mailer-daemon@mx.example.com"),
    ({}, "postmaster@example.com", "sender postmaster@example.com"),
    ({}, "bot@example.org", "our own mail"),
])
def test_what_is_never_answered(headers, sender, reason):
    inbound, _, why = normalise(make_mail(text="x", sender=sender, headers=headers))
    assert inbound is None and why == reason


def test_auto_submitted_no_is_an_ordinary_mail():
    assert normalise(make_mail(text="x", headers={"Auto-Submitted": "no"}))[0] is not None


def test_a_delivery_report_is_never_answered():
    report = email.message_from_string(
        "From: alice@example.com\nTo: bot@example.org\nSubject: Delivery Status Notification\n"
        "Message-ID: <dsn@x>\nMIME-Version: 1.0\n"
        "Content-Type: multipart/report; report-type=delivery-status; boundary=b\n\n"
        "--b\nContent-Type: text/plain\n\nfailed\n--b--\n", policy=email.policy.default)
    inbound, _, why = normalise(report)
    assert inbound is None and why == "multipart/report (a delivery report)"


def test_the_quoted_history_of_a_reply_is_dropped():
    assert mailworker.strip_quoted("Thanks!\n\nOn Mon, 1 Dec 2026, Bot <bot@example.org> wrote:\n> the answer\n> more\n") \
        == "Thanks!"
    assert mailworker.strip_quoted("new text\n> quoted\n") == "new text"
    assert mailworker.strip_quoted("> only a quote") == "> only a quote"  # nothing new: keep it all
    assert mailworker.strip_quoted("a\n> inline\nb") == "a\n> inline\nb"  # an interleaved answer stays whole


def test_an_html_only_mail_is_read_as_text():
    msg = make_mail(text="ignored")
    msg.set_content("<html><head><style>p{}</style></head><body><p>Hello <b>there</b></p><p>second</p></body></html>",
                    subtype="html")
    inbound, _, _ = normalise(msg)
    assert inbound.text == "Hello there\n\nsecond"


def test_attachments_are_named_by_an_imap_url_the_worker_can_read_again():
    msg = make_mail(text="see", attachments=[(b"\x89PNGdata", "image/png", "a.png"),
                                             (b"%PDF", "application/pdf", "b.pdf")])
    inbound, _, _ = normalise(msg)
    assert [(a.kind, a.content_type, a.filename) for a in inbound.attachments] == [
        ("image", "image/png", "a.png"), ("document", "application/pdf", "b.pdf")]
    assert inbound.attachments[1].url == \
        "imap://bot%40example.org@imap.example.org/INBOX;UIDVALIDITY=42/;UID=7/;SECTION=ATTACHMENT.2"
    assert mailworker._IMAP_URL.search(inbound.attachments[1].url).groups() == ("42", "7", "2")


def test_a_very_long_message_id_becomes_a_digest_that_fits_the_hub():
    long_id = "<" + "x" * 300 + "@example.com>"
    inbound, _, _ = normalise(make_mail(text="x", message_id=long_id))
    assert inbound.message_id.startswith("sha256:") and len(inbound.message_id) == 71
    assert inbound.conversation_id == inbound.message_id


def test_markdown_becomes_html_and_raw_html_in_an_answer_is_escaped():
    page = mailworker.markdown_to_html("# Title\n\n**bold** and `code`\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<script>x</script>")
    assert "<h1>Title</h1>" in page and "<strong>bold</strong>" in page and "<code>code</code>" in page
    assert "<table>" in page
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_reply_subjects_gain_one_re():
    assert mailworker.reply_subject("Numbers") == "Re: Numbers"
    assert mailworker.reply_subject("Re: Numbers") == "Re: Numbers"
    assert mailworker.reply_subject("AW: Zahlen") == "AW: Zahlen"


@pytest.mark.parametrize("text, attempt, expected", [
    ("4.7.1 Rate limited, retry after 7 seconds", 0, 7.0),
    ("4.7.0 Try again in 12s", 3, 12.0),
    ("4.7.0 Try again later", 0, 30.0),
    ("4.7.0 Try again later", 2, 120.0),
    ("4.7.0 Try again later", 9, 300.0),
    ("4.7.1 retry after 9999 seconds", 0, 300.0),
])
def test_a_transient_reply_is_waited_out_as_long_as_it_asks_within_the_cap(text, attempt, expected):
    assert mailworker.retry_delay(text, attempt, 30.0, 300.0) == expected


def test_idle_is_always_reissued_before_29_minutes():
    assert mailproc.parse_args([]).idle_secs == 1500
    assert mailproc.parse_args(["--idle-secs", "3600"]).idle_secs == 28 * 60
    assert mailproc.parse_args(["--idle-secs", "0"]).idle_secs == 1.0


def test_the_worker_imports_no_django():
    import subprocess
    import sys
    code = ("import sys, plugins_app.channel.workers.email.worker; "
            "print(any(m == 'django' or m.startswith('django.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_state_maps_ids_to_threads_and_remembers_what_was_sent(tmp_path):
    state = mailstate.MailState(tmp_path / "s.sqlite3")
    state.remember("<root@x>", "<root@x>", address="alice@example.com", subject="Hi", refs=["<root@x>"])
    state.remember("<root@x>", "<ours@y>", address=None, subject=None, refs=[])
    assert state.known_threads(["<ours@y>", "<other@z>"]) == {"<ours@y>": "<root@x>"}
    assert state.conversation("<root@x>") == {"address": "alice@example.com", "subject": "Hi",
                                              "last_message_id": "<root@x>", "refs": ["<root@x>"]}
    assert not state.was_sent("d1")
    state.mark_sent("d1", "<ours@y>")
    state.close()
    again = mailstate.MailState(tmp_path / "s.sqlite3")  # it survives a restart
    assert again.was_sent("d1")
    assert again.cursor("INBOX") == (None, None)
    again.set_cursor("INBOX", 42, 7)
    assert again.cursor("INBOX") == (42, 7)


ENTRY = '''schema_version = 1
[[plugins]]
id       = "support-mail"
kind     = "channel-email"
env_refs = ["EMAIL_IMAP_HOST", "EMAIL_IMAP_PORT", "EMAIL_IMAP_USER", "EMAIL_IMAP_PASSWORD",
            "EMAIL_SMTP_HOST", "EMAIL_SMTP_PORT"]
args     = ["--mailbox", "Support"]
'''


@pytest.mark.django_db
def test_the_docs_plugins_toml_entry_is_complete_without_a_command():
    import sys
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.workers import installed_kinds
    tomlio.plugins_import(text=ENTRY)
    plugin = Plugin.objects.get(plugin_id="support-mail")
    assert plugin.command == "" and plugin.channel == "email"
    assert selectors.plugin_argv(plugin) == (sys.executable, ["-m", "plugins_app.channel.workers.email",
                                                              "--mailbox", "Support"])
    kind = installed_kinds()["channel-email"]
    assert kind.env_refs == tuple(plugin.env_refs)
    assert kind.description.startswith("Email: IMAP IDLE in, SMTP out")


@pytest.mark.parametrize("result, text, later", [
    ("NO", "[ALERT] Too many simultaneous connections. (Failure)", True),     # Gmail: the account's connections full
    ("NO", "[UNAVAILABLE] Temporary authentication failure. [mx1:2026-12-06 20:00:00]", True),
    ("NO", "[INUSE] Mailbox in use", True),
    ("NO", "[SERVERBUG] Internal error", True),
    ("NO", "[LIMIT] Too many simultaneous connections", True),
    ("NO", "[ALERT] Account exceeded command or bandwidth limits. (Failure)", True),  # Gmail, lifts within a day
    ("NO", "[OVERQUOTA] Account exceeded command or bandwidth limits. (Failure)", True),
    ("NO", "login not available on this server. 451 Already reached per-10 minute limit for logins, "
           "try again later", True),                                                    # Fastmail
    ("BAD", "[CLIENTBUG] try that again", False),   # RFC 3501 7.1.3: the command itself is wrong, again and again
    ("BAD", "LOGIN: Invalid arguments.", False),    # a user name with a space or a backslash, sent unquoted
    ("BAD", "[UNAVAILABLE] Too many simultaneous connections", False),
    ("NO", "[AUTHENTICATIONFAILED] Invalid credentials (Failure)", False),
    ("NO", "[AUTHORIZATIONFAILED] No such authorization-ID", False),
    ("NO", "[EXPIRED] That password is no longer valid", False),
    ("NO", "[PRIVACYREQUIRED] Connection is not private", False),
    ("NO", "[CONTACTADMIN] You must contact the sys admin", False),
    ("NO", "[AUTHENTICATIONFAILED] Too many simultaneous connections", False),  # a refusal code wins
    ("NO", "[ALERT] Application-specific password required: https://support.google.com/accounts/answer/185833 "
           "(Failure)", False),
    ("NO", "[WEBALERT https://accounts.google.com/signin/continue?sarp=1] Web login required. [ALERT] Please log "
           "in via your web browser: https://support.google.com/mail/accounts/answer/78754 (Failure)", False),
    ("NO", "LOGIN failed.", False),  # a server without RFC 5530 codes: a refusal, as before
])
def test_a_login_answer_says_later_or_refused(result, text, later):
    assert mailproc.login_says_later(result, text) is later


@pytest.mark.parametrize("raised, result, text", [
    ("[AUTHENTICATIONFAILED] Invalid credentials (Failure)", "NO", "[AUTHENTICATIONFAILED] Invalid credentials "
                                                                  "(Failure)"),
    ("LOGIN command error: BAD [b'[CLIENTBUG] try that again']", "BAD", "[CLIENTBUG] try that again"),
])
def test_imaplibs_login_error_is_read_back_as_the_servers_answer(raised, result, text):
    assert mailproc._imaplib_answer(raised) == (result, text)


# -- the listener's login, against the fake IMAP server (and a bare one for what pymap will not do) ----------

BOT = "bot@example.org"
LATER = "[ALERT] Too many simultaneous connections. (Failure)"


def imap_worker(monkeypatch, tmp_path, port, user=BOT):
    for name, value in (("EMAIL_IMAP_HOST", "127.0.0.1"), ("EMAIL_IMAP_PORT", str(port)), ("EMAIL_IMAP_USER", user),
                        ("EMAIL_IMAP_PASSWORD", "pw"), ("EMAIL_ADDRESS", BOT), ("EMAIL_SMTP_HOST", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    return mailproc.EmailWorker(argv=["--imap-security", "none", "--smtp-security", "none", "--timeout-secs", "5"],
                                socket_path="/nowhere", plugin_id="email-test", token="t",
                                install_signal_handlers=False, state_dir=str(tmp_path))


def logins_answered(worker, times: int) -> list[str]:
    """Log in ``times`` times as the listener does; what each raised."""
    import asyncio

    async def run():
        out = []
        for _ in range(times):
            try:
                client = await worker._imap_open()
            except Exception as exc:  # noqa: BLE001
                out.append(type(exc).__name__)
            else:
                await mailproc._close(client)
                out.append("OK")
        return out
    return asyncio.run(run())


def wait_for(predicate, secs=5.0) -> bool:
    import time
    deadline = time.monotonic() + secs
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_each_login_answered_later_closes_its_connection(monkeypatch, tmp_path):
    from tests.fakes.email import MailServer
    with MailServer(user=BOT, password="pw") as server:
        worker = imap_worker(monkeypatch, tmp_path, server.imap_port)
        server.refuse_login(LATER, times=5)
        assert logins_answered(worker, 5) == ["LoginLater"] * 5
        assert wait_for(lambda: len(server._writers) == 0), len(server._writers)
        assert server.logins == [LATER] * 5


def test_a_server_that_never_answers_logout_is_closed_all_the_same(monkeypatch, tmp_path):
    from tests.fakes.email import BareImap
    with BareImap(login=b"NO " + LATER.encode(), answer_logout=False) as server:
        worker = imap_worker(monkeypatch, tmp_path, server.port)
        assert logins_answered(worker, 3) == ["LoginLater"] * 3
        assert wait_for(lambda: server.open == 0), server.open
        assert len(server.logins) == 3


def test_a_bad_to_the_listeners_login_disables_with_the_servers_words(monkeypatch, tmp_path):
    from plugins_app.channel.sdk import ChannelRefused
    from tests.fakes.email import MailServer
    with MailServer(user=BOT, password="pw") as server:
        worker = imap_worker(monkeypatch, tmp_path, server.imap_port)
        worker.connect()
        server.refuse_login("LOGIN: Invalid arguments.", result="BAD", times=100)
        import threading
        stop = threading.Timer(15, worker.stopping.set)  # (a BAD taken for "later" would go on for ever)
        stop.start()
        try:
            with pytest.raises(ChannelRefused) as info:
                worker.listen(lambda m: None)
        finally:
            stop.cancel()
        assert str(info.value) == (f"IMAP login refused for {BOT}: the server rejected the LOGIN command itself "
                                   "(BAD): LOGIN: Invalid arguments.")
        assert wait_for(lambda: len(server._writers) == 0), len(server._writers)


def test_a_server_with_logindisabled_is_refused_without_sending_the_password(monkeypatch, tmp_path):
    from plugins_app.channel.sdk import ChannelRefused
    from tests.fakes.email import BareImap
    with BareImap(capabilities="IMAP4rev1 STARTTLS LOGINDISABLED", login=b"OK welcome") as server:
        worker = imap_worker(monkeypatch, tmp_path, server.port)
        with pytest.raises(ChannelRefused, match=r"refuses plaintext LOGIN on this connection \(it advertises "
                                                 r"LOGINDISABLED\): use --imap-security ssl"):
            worker.connect()
        assert server.logins == []
        assert wait_for(lambda: server.open == 0), server.open


@pytest.mark.parametrize("user", ["bot@example.org\\shared@example.org", "DOMAIN\\bot", "the bot"])
def test_a_user_name_with_a_backslash_or_a_space_is_sent_quoted_and_logs_in(monkeypatch, tmp_path, user):
    from tests.fakes.email import MailServer
    with MailServer(user=user, password="pw") as server:
        worker = imap_worker(monkeypatch, tmp_path, server.imap_port, user=user)
        worker.connect()  # sent bare, the server answers BAD
        assert server.logins == ["OK"]


def scripted_listener(monkeypatch, tmp_path, script):
    """The listener's loop with each session one step of ``script`` (an exception to raise, or "taken": the
    login taken, the mailbox selected, then the connection dropped) and its waits recorded, not waited."""
    worker = imap_worker(monkeypatch, tmp_path, 1)
    waits: list[float] = []

    async def session(submit):
        if not script:
            worker.stopping.set()
            return
        step = script.pop(0)
        if step == "taken":
            worker._login_taken()
            worker._session_ok = True
            raise ConnectionError("the IMAP connection dropped")
        raise step

    monkeypatch.setattr(worker, "_session", session)
    monkeypatch.setattr(worker.stopping, "wait", lambda secs: waits.append(secs))
    import asyncio
    asyncio.run(worker._listen(None))
    return waits


def test_a_run_of_later_answers_does_not_slow_the_reconnect_of_a_server_that_then_drops(monkeypatch, tmp_path):
    later = mailproc.LoginLater("the IMAP server answered LOGIN: NO [LIMIT] later")
    waits = scripted_listener(monkeypatch, tmp_path, [later] * 12 + [ConnectionError("refused")] * 8)
    assert waits[:12] == [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert waits[12:] == [0.5, 1, 2, 4, 8, 16, 30, 30]  # as if the "later"s had not been


def test_a_login_taken_starts_the_next_run_of_later_answers_from_half_a_second(monkeypatch, tmp_path):
    later = mailproc.LoginLater("the IMAP server answered LOGIN: NO [LIMIT] later")
    waits = scripted_listener(monkeypatch, tmp_path, [later] * 6 + ["taken"] + [later] * 3)
    assert waits == [0.5, 1, 2, 4, 8, 16, 0.5, 0.5, 1, 2]
