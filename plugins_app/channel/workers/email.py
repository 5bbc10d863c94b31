"""The email channel: IMAP IDLE in, SMTP out, built on the worker SDK.

    python -m plugins_app.channel.workers.email [--imap-security ssl|none] [--smtp-security starttls|ssl|none] ...

* **Inbound.** One IMAP connection SELECTs the mailbox and waits in IDLE, re-issued
  every ``--idle-secs`` (25 minutes by default, under the 29 minutes RFC 2177 allows).
  Every message with a UID past the worker's cursor is fetched (``BODY.PEEK[]``),
  normalised and submitted; the cursor ``(UIDVALIDITY, UID)`` is committed only once
  the SDK's outbox holds the message, so a crash or a dropped connection loses nothing
  and a reconnect reads on from where it stopped. The message's ``Message-ID`` is the
  inbound idempotency key (the same mail delivered twice, or renumbered by a new
  UIDVALIDITY, runs one turn); without one, ``uid:<UIDVALIDITY>:<UID>``.
* **Threads.** ``In-Reply-To``/``References`` pick the conversation: the conversation
  id is the thread's root Message-ID, and every id seen in a thread (ours included)
  maps back to it, so a reply that carries only ``In-Reply-To`` lands in its thread.
* **Never answered**: auto-replies and bounces (``Auto-Submitted`` other than ``no``,
  ``Precedence: bulk|junk|list``, ``X-Autoreply``, ``X-Autorespond``, a null
  ``Return-Path``, MAILER-DAEMON/postmaster senders, ``multipart/report``) and the
  worker's own mail.
* **Outbound.** A reply over SMTP (aiosmtplib) with ``In-Reply-To``, ``References``,
  ``Re:`` subject, a deterministic ``Message-ID`` from the delivery id, ``Auto-Submitted:
  auto-replied`` (RFC 3834, so other robots do not answer it), and both a text/plain part
  (the Markdown as written) and a text/html part (rendered by markdown-it, raw HTML off);
  attachments from the host's media. A transient SMTP reply (421/45x: greylisting, rate
  limits) waits and retries the same send; a refused login (535) stops the worker with
  a clear state; a refused recipient is a permanent failure.

Variables: EMAIL_IMAP_HOST, EMAIL_IMAP_PORT, EMAIL_IMAP_USER, EMAIL_IMAP_PASSWORD,
EMAIL_SMTP_HOST, EMAIL_SMTP_PORT (SMTP logs in with the IMAP user and password when the
server offers AUTH), and optionally EMAIL_ADDRESS (the From address; the IMAP user by default).
"""
from __future__ import annotations

import argparse
import asyncio
import email
import email.policy
import email.utils
import html
import imaplib
import json
import os
import re
import sqlite3
import ssl
import threading
import time
from email.message import EmailMessage, Message
from html.parser import HTMLParser
from pathlib import Path

from plugins_app.channel.sdk import Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage
from plugins_app.channel.sdk.messages import ReplyContext
from plugins_app.channel.sdk.outbox import default_state_dir

KIND = "channel-email"
DESCRIPTION = "Email: IMAP IDLE in, SMTP out; threads by In-Reply-To/References."
ENV_REFS = ("EMAIL_IMAP_HOST", "EMAIL_IMAP_PORT", "EMAIL_IMAP_USER", "EMAIL_IMAP_PASSWORD",
            "EMAIL_SMTP_HOST", "EMAIL_SMTP_PORT")

CHANNEL = "email"
IDLE_LIMIT_SECS = 29 * 60
_MSGID = re.compile(r"<[^<>\s]+>")
_RETRY_IN = re.compile(r"(?:retry|try again)\D{0,20}?(\d+(?:\.\d+)?)\s*(?:s\b|sec|second)", re.I)
_QUOTE_INTRO = re.compile(r"^\s*(On .{3,200} wrote:|-----\s*Original Message\s*-----)\s*$", re.I)
_AUTH_FAILED = 535


# ---------------------------------------------------------------------------- pure parts (unit-tested)

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-email", description=DESCRIPTION)
    p.add_argument("--mailbox", default="INBOX", help="the mailbox to watch")
    p.add_argument("--imap-security", choices=("ssl", "none"), default="ssl")
    p.add_argument("--smtp-security", choices=("starttls", "ssl", "none"), default="starttls")
    p.add_argument("--idle-secs", type=float, default=25 * 60,
                   help="re-issue IDLE after this long (at most 29 minutes, RFC 2177)")
    p.add_argument("--start-at", choices=("new", "unseen"), default="new",
                   help="on the first start: only mail that arrives from now on, or also the unread backlog")
    p.add_argument("--mark-seen", action=argparse.BooleanOptionalAction, default=True,
                   help="flag a message \\Seen once the hub holds it")
    p.add_argument("--smtp-retry-secs", type=float, default=30.0,
                   help="first wait after a transient SMTP reply that names no delay (doubles each time)")
    p.add_argument("--smtp-retry-max-secs", type=float, default=300.0)
    p.add_argument("--smtp-retries", type=int, default=4, help="transient replies waited out within one send")
    p.add_argument("--max-per-minute", type=float, default=0.0, help="global send limit (0: none)")
    p.add_argument("--per-recipient-interval-secs", type=float, default=0.0,
                   help="least time between two mails to one address (0: none)")
    p.add_argument("--timeout-secs", type=float, default=30.0, help="network timeout of one IMAP/SMTP step")
    args = p.parse_args(argv)
    args.idle_secs = max(1.0, min(args.idle_secs, IDLE_LIMIT_SECS - 60))
    return args


def header_ids(value: str | None) -> list[str]:
    """The message ids (``<...>``) in a Message-ID/In-Reply-To/References header, in order."""
    return _MSGID.findall(str(value or ""))


def skip_reason(msg: Message, own_addresses: set[str]) -> str | None:
    """Why a message must not be answered (an auto-reply, a bounce, a list, our own), else None."""
    auto = str(msg.get("Auto-Submitted", "")).strip().lower()
    if auto and auto != "no":
        return f"Auto-Submitted: {auto}"
    precedence = str(msg.get("Precedence", "")).strip().lower()
    if precedence in ("bulk", "junk", "list", "auto_reply"):
        return f"Precedence: {precedence}"
    for name in ("X-Autoreply", "X-Autorespond"):
        if msg.get(name) is not None:
            return name
    return_path = msg.get("Return-Path")
    if return_path is not None and str(return_path).strip() in ("<>", ""):
        return "null Return-Path (a bounce)"
    sender = sender_address(msg)
    local = sender.split("@", 1)[0]
    if local in ("mailer-daemon", "postmaster", "mail-daemon"):
        return f"sender {sender}"
    if msg.get_content_type() == "multipart/report":
        return "multipart/report (a delivery report)"
    if sender and sender in own_addresses:
        return "our own mail"
    return None


def sender_address(msg: Message) -> str:
    """Who wrote it (From); Reply-To is only where an answer goes."""
    _, addr = email.utils.parseaddr(str(msg.get("From", "")))
    return addr.strip().lower()


def reply_address(msg: Message) -> str:
    _, addr = email.utils.parseaddr(str(msg.get("Reply-To") or msg.get("From") or ""))
    return addr.strip()


def recipients(msg: Message) -> set[str]:
    pairs = email.utils.getaddresses([str(v) for h in ("To", "Cc") for v in (msg.get_all(h) or [])])
    return {a.strip().lower() for _, a in pairs if a.strip()}


def thread_root(msg: Message, known: dict[str, str]) -> str:
    """The conversation of a message: the thread a known id in its headers names, else its root."""
    in_reply_to = header_ids(msg.get("In-Reply-To"))
    references = header_ids(msg.get("References"))
    for ref in list(reversed(in_reply_to)) + list(reversed(references)):
        if ref in known:
            return known[ref]
    if references:
        return references[0]
    if in_reply_to:
        return in_reply_to[0]
    own = header_ids(msg.get("Message-ID"))
    return own[0] if own else ""


def strip_quoted(text: str) -> str:
    """The new part of a reply: the trailing quote (``On ... wrote:`` and ``>`` lines) removed."""
    lines = text.replace("\r\n", "\n").split("\n")
    end = len(lines)
    while end and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith(">")):
        end -= 1
    if end < len(lines) and end and _QUOTE_INTRO.match(lines[end - 1]):
        end -= 1
    elif end == len(lines):
        for i, line in enumerate(lines):
            if _QUOTE_INTRO.match(line) and all(not l.strip() or l.lstrip().startswith(">") for l in lines[i + 1:]):
                end = i
                break
    kept = "\n".join(lines[:end]).strip()
    return kept or text.strip()


class _TextOfHtml(HTMLParser):
    _BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre"}

    def __init__(self):
        super().__init__()
        self.out: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self._skip += 1
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self._skip = max(0, self._skip - 1)
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if not self._skip:
            self.out.append(data)


def html_to_text(markup: str) -> str:
    parser = _TextOfHtml()
    parser.feed(markup)
    parser.close()
    return re.sub(r"\n{3,}", "\n\n", "".join(parser.out)).strip()


def markdown_to_html(text: str) -> str:
    """The answer's Markdown as the HTML part (CommonMark and tables; raw HTML in the answer is escaped)."""
    from markdown_it import MarkdownIt
    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table").enable("strikethrough")
    return f"<!DOCTYPE html>\n<html><body>\n{md.render(text)}</body></html>\n"


def body_text(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    try:
        content = part.get_content()
    except (LookupError, UnicodeError):
        content = part.get_payload(decode=True).decode("utf-8", "replace")
    if part.get_content_type() == "text/html":
        content = html_to_text(content)
    return strip_quoted(content)


def attachment_kind(content_type: str) -> str:
    major = content_type.split("/", 1)[0].lower()
    return major if major in ("image", "audio", "video") else "document"


def attachment_parts(msg: EmailMessage) -> list[EmailMessage]:
    return [p for p in msg.iter_attachments() if not p.is_multipart()]


def imap_url(user: str, host: str, mailbox: str, uidvalidity: int, uid: int, index: int) -> str:
    """RFC 5092 IMAP URL of one attachment (``index`` counts the message's attachments from 1)."""
    from urllib.parse import quote
    return (f"imap://{quote(user, safe='')}@{host}/{quote(mailbox)};UIDVALIDITY={uidvalidity}"
            f"/;UID={uid}/;SECTION=ATTACHMENT.{index}")


_IMAP_URL = re.compile(r";UIDVALIDITY=(\d+)/;UID=(\d+)/;SECTION=ATTACHMENT\.(\d+)$")


def normalise(raw: bytes, *, uidvalidity: int, uid: int, own_addresses: set[str], known: dict[str, str],
              user: str, host: str, mailbox: str) -> tuple[InboundMessage | None, EmailMessage, str | None]:
    """One fetched mail as an InboundMessage, or None with the reason it is not answered."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    reason = skip_reason(msg, own_addresses)
    if reason:
        return None, msg, reason
    sender = sender_address(msg)
    if not sender:
        return None, msg, "no sender address"
    own_id = (header_ids(msg.get("Message-ID")) or [None])[0]
    message_id = short_id(own_id) if own_id else f"uid:{uidvalidity}:{uid}"
    conversation = short_id(thread_root(msg, known)) or message_id
    others = recipients(msg) - own_addresses - {sender}
    name, _ = email.utils.parseaddr(str(msg.get("From", "")))
    atts = []
    for i, part in enumerate(attachment_parts(msg), 1):
        ctype = part.get_content_type()
        atts.append(Attachment(kind=attachment_kind(ctype), content_type=ctype, filename=part.get_filename(),
                               url=imap_url(user, host, mailbox, uidvalidity, uid, i)))
    in_reply_to = header_ids(msg.get("In-Reply-To"))
    subject = str(msg.get("Subject", "") or "")
    text = body_text(msg) or subject.strip()  # the subject rides in metadata; it is the text only of an empty mail
    inbound = InboundMessage(
        channel=CHANNEL, conversation_id=conversation, message_id=message_id, sender_id=sender,
        sender_name=name or None, source_type="group" if others else "user", text=text, attachments=atts,
        reply_to=ReplyContext(in_reply_to[-1]) if in_reply_to else None,
        metadata={"subject": subject, "uidvalidity": uidvalidity, "uid": uid},
    )
    return inbound, msg, None


def short_id(value: str) -> str:
    """A Message-ID as an id the hub stores (255 characters at most): a longer one by its digest."""
    if len(value) <= 250:
        return value
    import hashlib
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def reply_subject(subject: str) -> str:
    subject = (subject or "").strip()
    return subject if re.match(r"^(re|aw|sv)\s*:", subject, re.I) else f"Re: {subject}".strip()


def retry_delay(message: str, attempt: int, first: float, cap: float) -> float:
    """The wait a transient SMTP reply asks for, else ``first`` doubled per attempt."""
    m = _RETRY_IN.search(message or "")
    if m:
        return min(float(m.group(1)), cap)
    return min(first * (2 ** attempt), cap)


# ---------------------------------------------------------------------------- the worker's state

class MailState:
    """The worker's own small record beside its outbox: the IMAP cursor, threads, and what it sent."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS cursor (mailbox TEXT PRIMARY KEY, uidvalidity INTEGER, last_uid INTEGER);
            CREATE TABLE IF NOT EXISTS thread (message_id TEXT PRIMARY KEY, conversation_id TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS conversation (
                conversation_id TEXT PRIMARY KEY, address TEXT NOT NULL, subject TEXT NOT NULL,
                last_message_id TEXT, refs TEXT NOT NULL DEFAULT '[]');
            CREATE TABLE IF NOT EXISTS sent (delivery_id TEXT PRIMARY KEY, message_id TEXT, at REAL);
        """)

    def close(self):
        with self._lock:
            self._db.close()

    def cursor(self, mailbox: str) -> tuple[int | None, int | None]:
        with self._lock:
            row = self._db.execute("SELECT uidvalidity, last_uid FROM cursor WHERE mailbox = ?", (mailbox,)).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def set_cursor(self, mailbox: str, uidvalidity: int, last_uid: int) -> None:
        with self._lock:
            self._db.execute("INSERT INTO cursor VALUES (?, ?, ?) ON CONFLICT(mailbox) DO UPDATE SET "
                             "uidvalidity = excluded.uidvalidity, last_uid = excluded.last_uid",
                             (mailbox, uidvalidity, last_uid))

    def known_threads(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(f"SELECT message_id, conversation_id FROM thread WHERE message_id IN "
                                    f"({','.join('?' * len(ids))})", ids).fetchall()
        return dict(rows)

    def remember(self, conversation_id: str, message_id: str, *, address: str | None, subject: str | None,
                 refs: list[str]) -> None:
        """Map ``message_id`` to its thread; an inbound one also becomes the message an answer replies to."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO thread VALUES (?, ?)", (message_id, conversation_id))
                if address is not None:
                    self._db.execute(
                        "INSERT INTO conversation VALUES (?, ?, ?, ?, ?) ON CONFLICT(conversation_id) DO UPDATE SET "
                        "address = excluded.address, last_message_id = excluded.last_message_id, "
                        "refs = excluded.refs, subject = CASE WHEN conversation.subject = '' "
                        "THEN excluded.subject ELSE conversation.subject END",
                        (conversation_id, address, subject or "", message_id, json.dumps(refs)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def conversation(self, conversation_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT address, subject, last_message_id, refs FROM conversation "
                                   "WHERE conversation_id = ?", (conversation_id,)).fetchone()
        if row is None:
            return None
        return {"address": row[0], "subject": row[1], "last_message_id": row[2], "refs": json.loads(row[3])}

    def references_of(self, message_id: str) -> list[str] | None:
        """The References an answer to ``message_id`` carries, when that message was the thread's latest."""
        with self._lock:
            row = self._db.execute("SELECT refs FROM conversation WHERE last_message_id = ?", (message_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def mark_sent(self, delivery_id: str, message_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO sent VALUES (?, ?, ?)", (delivery_id, message_id, time.time()))

    def was_sent(self, delivery_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM sent WHERE delivery_id = ?", (delivery_id,)).fetchone() is not None


# ---------------------------------------------------------------------------- the worker

class EmailWorker(ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("attachments", "threads")

    def __init__(self, *, argv: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.args = parse_args(argv)
        env = os.environ
        self.imap_host = env.get("EMAIL_IMAP_HOST", "")
        self.imap_port = int(env.get("EMAIL_IMAP_PORT") or (993 if self.args.imap_security == "ssl" else 143))
        self.user = env.get("EMAIL_IMAP_USER", "")
        self.password = env.get("EMAIL_IMAP_PASSWORD", "")
        self.smtp_host = env.get("EMAIL_SMTP_HOST") or self.imap_host
        default_smtp = {"ssl": 465, "starttls": 587, "none": 25}[self.args.smtp_security]
        self.smtp_port = int(env.get("EMAIL_SMTP_PORT") or default_smtp)
        self.address = (env.get("EMAIL_ADDRESS") or (self.user if "@" in self.user else "")).strip()
        self.own = {a for a in (self.address.lower(), self.user.lower()) if "@" in a}
        self.domain = self.address.rsplit("@", 1)[-1] if "@" in self.address else "ugent.invalid"
        self.state: MailState | None = None
        self._media: dict[str, bytes] = {}           # attachment url -> bytes, for the submit just made
        self._outgoing: dict[str, list] = {}          # delivery id -> [(Media, Attachment)]
        self._send_times: list[float] = []
        self._last_to: dict[str, float] = {}
        self._refusal: str | None = None             # set by a send the server refused to log in
        self.connected_once = threading.Event()
        self._session_ok = False

    # ------------------------------------------------------------ connect / listen

    def connect(self) -> None:
        missing = [n for n, v in (("EMAIL_IMAP_HOST", self.imap_host), ("EMAIL_IMAP_USER", self.user),
                                  ("EMAIL_IMAP_PASSWORD", self.password)) if not v]
        if missing:
            raise ChannelRefused(f"email: {', '.join(missing)} not set")
        if not self.address:
            raise ChannelRefused("email: EMAIL_ADDRESS not set and EMAIL_IMAP_USER is not an address")
        base = Path(self.state_dir) if self.state_dir else default_state_dir()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.plugin_id)
        self.state = MailState(base / f"{safe}.email.sqlite3")
        # Check the login once here: a bad password is a clear state at once, not a retry loop.
        asyncio.run(self._probe_login())

    async def _probe_login(self) -> None:
        client = await self._imap_open()
        try:
            await client.logout()
        except Exception:  # noqa: BLE001 - the login is what was checked
            pass

    def listen(self, submit) -> None:
        asyncio.run(self._listen(submit))

    async def _listen(self, submit) -> None:
        backoff = 0.5
        while not self.stopping.is_set():
            if self._refusal:
                raise ChannelRefused(self._refusal)
            try:
                await self._session(submit)
                backoff = 0.5
            except ChannelRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - a dropped or failed connection: reconnect
                if self._session_ok:
                    backoff = 0.5  # the connection worked before it dropped: reconnect at once
                self._session_ok = False
                self.log.warning("IMAP session ended (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc,
                                 backoff)
                await asyncio.to_thread(self.stopping.wait, backoff)
                backoff = min(backoff * 2, 30.0)

    async def _imap_open(self):
        import aioimaplib
        lost = asyncio.Event()
        ctx = ssl.create_default_context() if self.args.imap_security == "ssl" else None
        cls = aioimaplib.IMAP4_SSL if ctx else aioimaplib.IMAP4
        kwargs = {"ssl_context": ctx} if ctx else {}
        client = cls(host=self.imap_host, port=self.imap_port, timeout=self.args.timeout_secs,
                     conn_lost_cb=lambda exc: lost.set(), **kwargs)
        client.lost = lost
        await client.wait_hello_from_server()
        response = await client.login(self.user, self.password)
        if response.result != "OK":
            text = " ".join(_s(l) for l in response.lines).strip()
            if "AUTHENTICATIONFAILED" in text.upper() or "AUTHORIZATIONFAILED" in text.upper() \
                    or response.result == "NO":
                raise ChannelRefused(f"IMAP login refused for {self.user}: {text}")
            raise ConnectionError(f"IMAP login failed: {response.result} {text}")
        if "IDLE" not in client.protocol.capabilities:
            self.log.warning("the IMAP server offers no IDLE; polling every %.0f s", self.args.idle_secs)
        return client

    async def _session(self, submit) -> None:
        client = await self._imap_open()
        try:
            uidvalidity = await self._select(client)
            self._session_ok = True
            self.connected_once.set()
            while not self.stopping.is_set() and not client.lost.is_set():
                await self._catch_up(client, uidvalidity, submit)
                if self._refusal:
                    raise ChannelRefused(self._refusal)
                await self._idle(client)
            if client.lost.is_set() and not self.stopping.is_set():
                raise ConnectionError("the IMAP connection dropped")
        finally:
            try:
                if not client.lost.is_set():
                    await asyncio.wait_for(client.logout(), 2)
            except Exception:  # noqa: BLE001
                pass

    async def _select(self, client) -> int:
        response = await client.select(self.args.mailbox)
        if response.result != "OK":
            raise ChannelRefused(f"IMAP mailbox {self.args.mailbox!r} cannot be selected: "
                                 f"{' '.join(_s(l) for l in response.lines)}")
        uidvalidity = uidnext = None
        for line in response.lines:
            text = _s(line)
            m = re.search(r"UIDVALIDITY (\d+)", text)
            if m:
                uidvalidity = int(m.group(1))
            m = re.search(r"UIDNEXT (\d+)", text)
            if m:
                uidnext = int(m.group(1))
        if uidvalidity is None:
            raise ConnectionError("SELECT named no UIDVALIDITY")
        stored_validity, last_uid = self.state.cursor(self.args.mailbox)
        if stored_validity != uidvalidity:
            if stored_validity is not None:
                # The mailbox was rebuilt: every UID is new. Read it all again; Message-IDs keep it to one turn each.
                self.log.warning("UIDVALIDITY changed (%s -> %s): reading the mailbox again", stored_validity,
                                 uidvalidity)
                last_uid = 0
            elif self.args.start_at == "unseen":
                last_uid = 0
            else:
                last_uid = (uidnext - 1) if uidnext else await self._highest_uid(client)
            self.state.set_cursor(self.args.mailbox, uidvalidity, last_uid)
        self.log.info("watching %s (UIDVALIDITY %s) after UID %s", self.args.mailbox, uidvalidity,
                      self.state.cursor(self.args.mailbox)[1])
        return uidvalidity

    async def _highest_uid(self, client) -> int:
        response = await client.uid_search("ALL")
        return max(_uids(response), default=0)

    async def _catch_up(self, client, uidvalidity: int, submit) -> None:
        """Read every mail past the cursor, again until a search finds none (mail that came meanwhile)."""
        while not self.stopping.is_set() and await self._catch_up_once(client, uidvalidity, submit):
            pass

    async def _catch_up_once(self, client, uidvalidity: int, submit) -> int:
        _, last_uid = self.state.cursor(self.args.mailbox)
        criteria = [f"UID {last_uid + 1}:*"]
        if self.args.start_at == "unseen" and last_uid == 0:
            criteria = ["UNSEEN"]
        response = await client.uid_search(*criteria)
        if response.result != "OK":
            raise ConnectionError(f"UID SEARCH failed: {response.result}")
        uids = sorted(u for u in _uids(response) if u > last_uid)
        for uid in uids:
            if self.stopping.is_set():
                break
            raw = await self._fetch(client, uid)
            if raw is not None:
                await self._handle(client, uidvalidity, uid, raw, submit)
            self.state.set_cursor(self.args.mailbox, uidvalidity, uid)
        return len(uids)

    async def _fetch(self, client, uid: int) -> bytes | None:
        response = await client.uid("fetch", str(uid), "(UID BODY.PEEK[])")
        if response.result != "OK":
            raise ConnectionError(f"UID FETCH {uid} failed: {response.result}")
        for line in response.lines:
            if isinstance(line, (bytearray,)) or (isinstance(line, bytes) and len(line) > 200):
                return bytes(line)
        return None  # expunged meanwhile

    async def _handle(self, client, uidvalidity: int, uid: int, raw: bytes, submit) -> None:
        pre = email.message_from_bytes(raw, policy=email.policy.default)
        ids = header_ids(pre.get("In-Reply-To")) + header_ids(pre.get("References"))
        inbound, msg, reason = normalise(raw, uidvalidity=uidvalidity, uid=uid, own_addresses=self.own,
                                         known=self.state.known_threads(ids), user=self.user, host=self.imap_host,
                                         mailbox=self.args.mailbox)
        if inbound is None:
            self.log.info("UID %s not answered: %s", uid, reason)
            await self._mark_seen(client, uid)
            return
        for part, att in zip(attachment_parts(msg), inbound.attachments):
            self._media[att.url] = part.get_payload(decode=True) or b""
        refs = header_ids(msg.get("References")) or header_ids(msg.get("In-Reply-To"))
        if inbound.conversation_id.startswith("<") and inbound.conversation_id not in refs \
                and inbound.conversation_id != inbound.message_id:
            refs = [inbound.conversation_id] + refs  # a reply that carried only In-Reply-To keeps the root
        own_id = inbound.message_id if inbound.message_id.startswith("<") else None
        if own_id:
            self.state.remember(inbound.conversation_id, own_id, address=reply_address(msg),
                                subject=inbound.metadata.get("subject", ""), refs=refs + [own_id])
        else:
            self.state.remember(inbound.conversation_id, inbound.message_id, address=reply_address(msg),
                                subject=inbound.metadata.get("subject", ""), refs=refs)
        try:
            result = await asyncio.to_thread(submit, inbound)
        finally:
            for att in inbound.attachments:
                self._media.pop(att.url, None)
        self.log.info("UID %s submitted as %s in %s: accepted=%s duplicate=%s queued=%s", uid, inbound.message_id,
                      inbound.conversation_id, result.accepted, result.duplicate, result.queued)
        await self._mark_seen(client, uid)

    async def _mark_seen(self, client, uid: int) -> None:
        if self.args.mark_seen:
            try:
                await client.uid("store", str(uid), "+FLAGS.SILENT", "(\\Seen)")
            except Exception as exc:  # noqa: BLE001 - a flag is a courtesy; the cursor is what counts
                self.log.warning("could not flag UID %s \\Seen: %s", uid, exc)

    async def _idle(self, client) -> None:
        """Wait in IDLE until the server announces mail, the re-issue time comes, or the worker stops."""
        if "IDLE" not in client.protocol.capabilities:
            await self._sleep_or_stop(client, self.args.idle_secs)
            return
        idle = await client.idle_start(timeout=self.args.idle_secs)
        deadline = time.monotonic() + self.args.idle_secs
        try:
            while not self.stopping.is_set() and not client.lost.is_set() and not self._refusal:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    push = await client.wait_server_push(timeout=min(remaining, 0.5))
                except asyncio.TimeoutError:
                    continue
                if push == aioimaplib_stop():
                    break
                lines = push if isinstance(push, list) else [push]
                if any(re.search(rb"\bEXISTS\b", bytes(l) if not isinstance(l, str) else l.encode())
                       for l in lines):
                    break
        finally:
            if not client.lost.is_set():
                client.idle_done()
                try:
                    await asyncio.wait_for(idle, self.args.timeout_secs)
                except Exception as exc:  # noqa: BLE001 - a dead connection shows on the next command
                    self.log.debug("IDLE did not end cleanly: %s", exc)

    async def _sleep_or_stop(self, client, secs: float) -> None:
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline and not self.stopping.is_set() and not client.lost.is_set() \
                and not self._refusal:
            await asyncio.sleep(0.2)
        if not client.lost.is_set():
            await client.noop()

    # ------------------------------------------------------------ media

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        url = attachment.url or ""
        if url in self._media:
            return self._media[url]
        m = _IMAP_URL.search(url)
        if not m:
            return None
        return self._fetch_attachment_sync(int(m.group(1)), int(m.group(2)), int(m.group(3)))

    def _fetch_attachment_sync(self, uidvalidity: int, uid: int, index: int) -> bytes | None:
        """After a restart the bytes are gone from memory: read the part again from the server."""
        cls = imaplib.IMAP4_SSL if self.args.imap_security == "ssl" else imaplib.IMAP4
        conn = cls(self.imap_host, self.imap_port, timeout=self.args.timeout_secs)
        try:
            conn.login(self.user, self.password)
            typ, data = conn.select(self.args.mailbox, readonly=True)
            if typ != "OK" or int((conn.untagged_responses.get("UIDVALIDITY") or [b"0"])[0]) != uidvalidity:
                return None
            typ, data = conn.uid("FETCH", str(uid), "(BODY.PEEK[])")
            raw = next((d[1] for d in data or [] if isinstance(d, tuple)), None)
            if typ != "OK" or raw is None:
                return None
            parts = attachment_parts(email.message_from_bytes(raw, policy=email.policy.default))
            return parts[index - 1].get_payload(decode=True) if 0 < index <= len(parts) else None
        finally:
            try:
                conn.logout()
            except Exception:  # noqa: BLE001
                pass

    def put_media(self, media, attachment, delivery) -> str | None:
        self._outgoing.setdefault(delivery.delivery_id, []).append((media, attachment))
        return f"cid:{len(self._outgoing[delivery.delivery_id])}"

    # ------------------------------------------------------------ outbound

    def already_delivered(self, delivery) -> bool:
        return self.state is not None and self.state.was_sent(delivery.delivery_id)

    def build_reply(self, delivery) -> tuple[EmailMessage, str]:
        conv = self.state.conversation(delivery.conversation_id)
        if conv is None:
            if "@" in delivery.conversation_id and not delivery.conversation_id.startswith("<"):
                conv = {"address": delivery.conversation_id, "subject": delivery.metadata.get("subject", ""),
                        "last_message_id": None, "refs": []}
            else:
                raise DeliveryFailed(f"email: no address known for conversation {delivery.conversation_id}",
                                     permanent=True)
        target = delivery.reply_to_message_id if (delivery.reply_to_message_id or "").startswith("<") else None
        refs = (self.state.references_of(target) if target else None) or conv["refs"]
        target = target or conv["last_message_id"]
        message_id = f"<ugent.{re.sub(r'[^A-Za-z0-9._-]', '_', delivery.delivery_id)}@{self.domain}>"
        msg = EmailMessage()
        msg["From"] = self.address
        msg["To"] = conv["address"]
        subject = conv["subject"] or delivery.metadata.get("subject") or ""
        msg["Subject"] = reply_subject(subject) if target else (subject or "A message")
        msg["Date"] = email.utils.formatdate(localtime=False, usegmt=True)
        msg["Message-ID"] = message_id
        if target:
            msg["In-Reply-To"] = target
            refs = [r for r in refs if r != target] + [target]
            msg["References"] = " ".join(refs[-20:])  # RFC 5322 allows trimming the middle of a long chain
        msg["Auto-Submitted"] = "auto-replied"
        msg["X-UGENT-Delivery-Id"] = delivery.delivery_id
        text = delivery.text or ""
        msg.set_content(text if text.endswith("\n") else text + "\n")
        msg.add_alternative(markdown_to_html(text), subtype="html")
        for media, att in self._outgoing.get(delivery.delivery_id, []):
            maintype, _, subtype = media.content_type.partition(";")[0].strip().partition("/")
            msg.add_attachment(media.data, maintype=maintype or "application", subtype=subtype or "octet-stream",
                               filename=media.filename or att.filename or "attachment")
        return msg, message_id

    def deliver(self, delivery) -> str | None:
        if self._refusal:
            self.stopping.wait(60)
            raise DeliveryFailed(self._refusal)
        try:
            msg, message_id = self.build_reply(delivery)
            self._throttle(str(msg["To"]).lower())
            self._send_with_retries(msg, delivery)
            self.state.remember(delivery.conversation_id, message_id, address=None, subject=None, refs=[])
            return message_id
        finally:
            self._outgoing.pop(delivery.delivery_id, None)

    def _throttle(self, to: str) -> None:
        now = time.monotonic()
        waits = []
        if self.args.max_per_minute > 0:
            self._send_times = [t for t in self._send_times if now - t < 60]
            if len(self._send_times) >= self.args.max_per_minute:
                waits.append(60 - (now - self._send_times[0]))
        if self.args.per_recipient_interval_secs > 0 and to in self._last_to:
            waits.append(self.args.per_recipient_interval_secs - (now - self._last_to[to]))
        wait = max(waits, default=0)
        if wait > 0:
            self.stopping.wait(wait)
        stamp = time.monotonic()
        self._send_times.append(stamp)
        self._last_to[to] = stamp

    def _send_with_retries(self, msg: EmailMessage, delivery) -> None:
        import aiosmtplib
        attempt = 0
        while True:
            try:
                asyncio.run(self._smtp_send(msg, delivery.delivery_id, str(msg["Message-ID"])))
                return
            except aiosmtplib.SMTPAuthenticationError as exc:
                self._refuse_login(f"SMTP login refused for {self.user}: {exc.code} {exc.message}")
            except aiosmtplib.SMTPRecipientsRefused as exc:
                codes = [e.code for e in exc.recipients]
                if all(400 <= c < 500 for c in codes) and attempt < self.args.smtp_retries:
                    self._wait_transient(attempt, "; ".join(e.message for e in exc.recipients))
                    attempt += 1
                    continue
                raise DeliveryFailed(f"email: recipient refused: {exc.recipients[0].code} "
                                     f"{exc.recipients[0].message}", permanent=all(c >= 500 for c in codes)) from exc
            except aiosmtplib.SMTPResponseException as exc:
                if 400 <= exc.code < 500:
                    if attempt < self.args.smtp_retries and not self.stopping.is_set():
                        self._wait_transient(attempt, exc.message)
                        attempt += 1
                        continue
                    raise DeliveryFailed(f"email: SMTP {exc.code} {exc.message}") from exc
                if exc.code == _AUTH_FAILED:
                    self._refuse_login(f"SMTP login refused for {self.user}: {exc.code} {exc.message}")
                raise DeliveryFailed(f"email: SMTP {exc.code} {exc.message}", permanent=True) from exc
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as exc:
                raise DeliveryFailed(f"email: SMTP unreachable: {type(exc).__name__}: {exc}") from exc

    def _refuse_login(self, reason: str) -> None:
        """The server refused the login: the listener stops the worker with the reason (the admin's state).

        This delivery waits for that stop, so it is handed back once (one attempt) rather than
        tried against the refusing server again and again until it is dead-lettered.
        """
        self._refusal = reason
        self.log.error("%s", reason)
        self.stopping.wait(60)
        raise DeliveryFailed(reason)

    def _wait_transient(self, attempt: int, message: str) -> None:
        delay = retry_delay(message, attempt, self.args.smtp_retry_secs, self.args.smtp_retry_max_secs)
        self.log.warning("SMTP said try later (%s); waiting %.1f s and sending again", message.strip(), delay)
        self.stopping.wait(delay)

    async def _smtp_send(self, msg: EmailMessage, delivery_id: str, message_id: str) -> None:
        import aiosmtplib
        security = self.args.smtp_security
        smtp = aiosmtplib.SMTP(hostname=self.smtp_host, port=self.smtp_port, timeout=self.args.timeout_secs,
                               use_tls=security == "ssl", start_tls=True if security == "starttls" else False)
        await smtp.connect()
        try:
            if smtp.is_ehlo_or_helo_needed:
                await smtp.ehlo()
            if smtp.supports_extension("auth") and self.password:
                await smtp.login(self.user, self.password)
            size = smtp.esmtp_extensions.get("size")
            if size and size.isdigit() and int(size) and len(msg.as_bytes()) > int(size):
                raise DeliveryFailed(f"email: the message ({len(msg.as_bytes())} bytes) exceeds the server's "
                                     f"limit of {size} bytes", permanent=True)
            await smtp.send_message(msg)
            # Accepted by the server: recorded before anything else can fail, so a crash from here on
            # is answered by already_delivered() and never sends the mail twice.
            self.state.mark_sent(delivery_id, message_id)
        finally:
            try:
                await smtp.quit()
            except Exception:  # noqa: BLE001 - the message is accepted; a lost QUIT changes nothing
                smtp.close()

    def disconnect(self) -> None:
        if self.state is not None:
            self.state.close()
            self.state = None


def _s(line) -> str:
    return bytes(line).decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else str(line)


def _uids(response) -> list[int]:
    out = []
    for line in response.lines:
        text = _s(line)
        if text.upper().startswith("SEARCH"):
            text = text[6:]
        elif not re.fullmatch(r"[\d\s]*", text):
            continue
        out.extend(int(t) for t in text.split() if t.isdigit())
    return out


def aioimaplib_stop():
    import aioimaplib
    return getattr(aioimaplib, "STOP_WAIT_SERVER_PUSH", None)


def main() -> None:
    import sys
    EmailWorker.main(argv=sys.argv[1:])


if __name__ == "__main__":
    main()
