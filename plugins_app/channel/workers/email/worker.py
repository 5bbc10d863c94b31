"""channel-email's worker: one IMAP connection in IDLE for inbound, one SMTP session per answer."""
from __future__ import annotations

import argparse
import ast
import asyncio
import email
import email.policy
import email.utils
import imaplib
import os
import re
import ssl
import sys
import threading
import time
from email.message import EmailMessage
from pathlib import Path

from plugins_app.channel.sdk import Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, MediaNotReady
from plugins_app.channel.sdk.download import MEDIA_TIMEOUT_SECS
from plugins_app.channel.sdk.outbox import default_state_dir
from ugent_common.digits import ascii_int

from . import DESCRIPTION, KIND
from .parse import (_IMAP_URL, attachment_parts, header_ids, markdown_to_html, normalise, reply_address,
                    reply_subject, retry_delay)
from .state import MailState

IDLE_LIMIT_SECS = 29 * 60
_AUTH_FAILED = 535
#: The listener's reconnect backoff (0.5 s, doubling) is capped at this for a dropped or unreachable server...
RECONNECT_MAX_SECS = 30.0
#: ...and at this while the server answers LOGIN "later" (a full account, a server down): a LIMIT can last
#: hours (the user's phone and laptop holding the account's connections), and a login every 30 s all that
#: while would only add to the load; new mail waits at most this long once the server takes logins again.
LATER_MAX_SECS = 300.0


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
    g = p.add_argument_group("Gmail push (instead of IMAP IDLE; outbound through the Gmail API)")
    g.add_argument("--gmail-push", action="store_true", help="read the mailbox through Gmail push + history")
    g.add_argument("--gmail-topic", default="", help="the Pub/Sub topic users.watch publishes to")
    g.add_argument("--push-bind", default="127.0.0.1", help="where the push endpoint listens")
    g.add_argument("--push-port", type=int, default=8025, help="its port (0: any free one, logged)")
    g.add_argument("--push-audience", default="", help="the audience of the push subscription's OIDC token")
    g.add_argument("--push-service-account", default="", help="the service account the token must name")
    g.add_argument("--gmail-poll-secs", type=float, default=300.0, help="read history this often without a push")
    args = p.parse_args(argv)
    args.idle_secs = max(1.0, min(args.idle_secs, IDLE_LIMIT_SECS - 60))
    return args


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
        self._later: tuple[float, int] | None = None  # (since, answers) while LOGIN is answered "later"
        self.gmail = None                            # GmailPush with --gmail-push

    # ------------------------------------------------------------ connect / listen

    def connect(self) -> None:
        missing = [n for n, v in (("EMAIL_IMAP_HOST", self.imap_host), ("EMAIL_IMAP_USER", self.user),
                                  ("EMAIL_IMAP_PASSWORD", self.password)) if not v]
        if self.args.gmail_push:
            missing = []  # Gmail push logs in with OAuth (gmail.py checks its own variables)
        if missing:
            raise ChannelRefused(f"email: {', '.join(missing)} not set")
        if not self.address:
            raise ChannelRefused("email: EMAIL_ADDRESS not set and EMAIL_IMAP_USER is not an address")
        base = Path(self.state_dir) if self.state_dir else default_state_dir()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.plugin_id)
        self.state = MailState(base / f"{safe}.email.sqlite3")
        if self.args.gmail_push:
            from .gmail import GmailPush
            self.gmail = GmailPush(self, self.args)
            self.gmail.check()
            return
        # Check the login once here: a bad password is a clear state at once, not a retry loop.
        asyncio.run(self._probe_login())

    async def _probe_login(self) -> None:
        try:
            client = await self._imap_open()
        except LoginLater as exc:  # not a refusal: the listener keeps trying, with its backoff
            self._later = (time.monotonic(), 1)
            self.log.warning("%s at start; not a refusal: the listener tries again", exc)
            return
        try:
            await client.logout()
        except Exception:  # noqa: BLE001 - the login is what was checked
            pass

    def listen(self, submit) -> None:
        if self.gmail is not None:
            self.gmail.run(lambda gid, raw: self.handle_raw(raw, submit, where=f"Gmail message {gid}", gmail_id=gid))
            return
        asyncio.run(self._listen(submit))

    async def _listen(self, submit) -> None:
        # Two backoffs: a run of "later" answers (capped at 5 minutes) must not slow the reconnect of a server
        # that then drops or cannot be reached (0.5 s doubling to 30 s), nor that the other way round.
        reconnect = later = 0.5
        while not self.stopping.is_set():
            if self._refusal:
                raise ChannelRefused(self._refusal)
            try:
                await self._session(submit)
                reconnect = 0.5
            except ChannelRefused:
                raise
            except LoginLater as exc:  # never a refusal: logged at each answer, so one that never ends is seen
                reconnect = 0.5  # the server answered: it is reachable
                if self._later is None:
                    later = 0.5  # a login was taken since the last "later" (or this is the first): a new run
                since, answers = self._later or (time.monotonic(), 0)
                self._later = (since, answers + 1)
                self.log.warning("%s; not a refusal: trying again in %.1f s (answer %d, the first %.0f s ago)",
                                 exc, later, answers + 1, time.monotonic() - since)
                await asyncio.to_thread(self.stopping.wait, later)
                later = min(later * 2, LATER_MAX_SECS)
            except Exception as exc:  # noqa: BLE001 - a dropped or failed connection: reconnect
                if self._session_ok:
                    reconnect = 0.5  # the connection worked before it dropped: reconnect at once
                self._session_ok = False
                self.log.warning("IMAP session ended (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc,
                                 reconnect)
                await asyncio.to_thread(self.stopping.wait, reconnect)
                reconnect = min(reconnect * 2, RECONNECT_MAX_SECS)

    async def _imap_open(self):
        import aioimaplib
        lost = asyncio.Event()
        ctx = ssl.create_default_context() if self.args.imap_security == "ssl" else None
        cls = aioimaplib.IMAP4_SSL if ctx else aioimaplib.IMAP4
        kwargs = {"ssl_context": ctx} if ctx else {}
        client = cls(host=self.imap_host, port=self.imap_port, timeout=self.args.timeout_secs,
                     conn_lost_cb=lambda exc: lost.set(), **kwargs)
        client.lost = lost
        try:
            await client.wait_hello_from_server()
            refusal = login_disabled(self.user, client.protocol.capabilities)
            if refusal:
                raise ChannelRefused(refusal)
            # (aioimaplib quotes the password, not the user: DOMAIN\\user would be a BAD)
            response = await client.login(aioimaplib.quoted(self.user), self.password)
            if response.result != "OK":
                text = " ".join(_s(l) for l in response.lines).strip()
                if not login_says_later(response.result, text):
                    raise ChannelRefused(login_refused(self.user, response.result, text))
                raise LoginLater(f"the IMAP server answered LOGIN for {self.user}: {response.result} {text}")
        except BaseException:  # a "later", a refusal or a timeout: a connection left open holds one of the
            await _close(client)  # account's few (Gmail: 15)
            raise
        if "IDLE" not in client.protocol.capabilities:
            self.log.warning("the IMAP server offers no IDLE; polling every %.0f s", self.args.idle_secs)
        return client

    async def _session(self, submit) -> None:
        client = await self._imap_open()
        self._login_taken()
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
            await _close(client)

    def _login_taken(self) -> None:
        """The server took the login: a run of "later" answers is over (the next starts again at 0.5 s)."""
        if self._later:
            since, answers = self._later
            self._later = None
            self.log.warning("the IMAP server took the login after %d answers of \"later\" over %.0f s", answers,
                             time.monotonic() - since)

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
        await asyncio.to_thread(self.handle_raw, raw, submit, where=f"UID {uid}", uidvalidity=uidvalidity, uid=uid)
        await self._mark_seen(client, uid)

    def handle_raw(self, raw: bytes, submit, *, where: str, uidvalidity: int = 0, uid: int = 0,
                   gmail_id: str | None = None) -> None:
        """One fetched mail: normalised, its thread recorded, submitted (or logged as never answered)."""
        pre = email.message_from_bytes(raw, policy=email.policy.default)
        ids = header_ids(pre.get("In-Reply-To")) + header_ids(pre.get("References"))
        inbound, msg, reason = normalise(raw, uidvalidity=uidvalidity, uid=uid, own_addresses=self.own,
                                         known=self.state.known_threads(ids), user=self.user, host=self.imap_host,
                                         mailbox=self.args.mailbox, gmail_id=gmail_id)
        if inbound is None:
            self.log.info("%s not answered: %s", where, reason)
            return
        for part, att in zip(attachment_parts(msg), inbound.attachments):
            self._media[att.url] = part.get_payload(decode=True) or b""
        refs = header_ids(msg.get("References")) or header_ids(msg.get("In-Reply-To"))
        if inbound.conversation_id.startswith("<") and inbound.conversation_id not in refs \
                and inbound.conversation_id != inbound.message_id:
            refs = [inbound.conversation_id] + refs  # a reply that carried only In-Reply-To keeps the root
        own_id = inbound.message_id if inbound.message_id.startswith("<") else None
        self.state.remember(inbound.conversation_id, own_id or inbound.message_id, address=reply_address(msg),
                            subject=inbound.metadata.get("subject", ""), refs=refs + ([own_id] if own_id else []))
        try:
            result = submit(inbound)
        finally:
            for att in inbound.attachments:
                self._media.pop(att.url, None)
        self.log.info("%s submitted as %s in %s: accepted=%s duplicate=%s queued=%s", where, inbound.message_id,
                      inbound.conversation_id, result.accepted, result.duplicate, result.queued)

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
        if url.startswith("gmail:") and self.gmail is not None:
            from .gmail import Transient
            gid, _, index = url[len("gmail:"):].partition("/")
            try:  # one short try: the SDK's hold tries again (gmail.py's retries would hold the chat and the listener)
                raw = self.gmail.fetch_raw(gid, retries=0, timeout=min(self.args.timeout_secs, MEDIA_TIMEOUT_SECS))
            except Transient as exc:  # a 429/5xx, or Gmail unreachable: not now
                raise MediaNotReady(str(exc)) from exc
            if raw is None:  # a 404: deleted meanwhile
                raise LookupError(GONE)
            return _part(raw, ascii_int(index) or 0)
        m = _IMAP_URL.search(url)
        if not m:  # (a Gmail part with --gmail-push turned off since): never None, which would pass the URL on
            raise LookupError("the mail cannot be read again this way (the worker's way of reading mail changed)")
        return self._fetch_attachment_sync(int(m.group(1)), int(m.group(2)), int(m.group(3)))

    def _fetch_attachment_sync(self, uidvalidity: int, uid: int, index: int) -> bytes:
        """The bytes are gone from memory (a restart, or the message could not go at once: the host away, an
        earlier message of its thread still waiting): read the part again from the server.

        "Not now" raises ``MediaNotReady``, so the message waits (its chat only) and the SDK fetches again: the
        server unreachable, timing out or hanging up (a network error, ``IMAP4.abort``, a ``BYE``), or a tagged
        ``NO`` with a code that says "later" (RFC 5530: ``UNAVAILABLE``, ``INUSE``, ``SERVERBUG``, ``LIMIT``), or
        a LOGIN answer the listener would try again (``login_says_later``: Gmail's full account too). A refused
        login (a BAD to LOGIN and LOGINDISABLED included) records the refusal and raises ``ChannelRefused``: the
        message stays owed and the worker stops, as the listener does. The mail no longer there (expunged, moved,
        or the mailbox renumbered: a new UIDVALIDITY), any other ``NO``, or a certificate that does not verify
        is final: the message goes on with a note saying why, never with the IMAP URL (which names the account)."""
        try:
            return self._read_part(uidvalidity, uid, index)
        except ssl.SSLCertVerificationError:
            raise
        except (OSError, imaplib.IMAP4.abort) as exc:
            raise MediaNotReady(f"the IMAP server cannot give the attachment now: {type(exc).__name__}: {exc}") \
                from exc

    def _read_part(self, uidvalidity: int, uid: int, index: int) -> bytes:
        cls = imaplib.IMAP4_SSL if self.args.imap_security == "ssl" else imaplib.IMAP4
        conn = cls(self.imap_host, self.imap_port, timeout=min(self.args.timeout_secs, MEDIA_TIMEOUT_SECS))
        try:
            from aioimaplib import quoted  # RFC 3501's quoted string, as the listener's login sends the user
            refusal = login_disabled(self.user, conn.capabilities)
            if refusal:
                self._refusal = refusal
                raise ChannelRefused(refusal)
            try:
                conn.login(quoted(self.user), self.password)  # (imaplib too quotes only the password)
            except imaplib.IMAP4.abort:
                raise
            except imaplib.IMAP4.error as exc:
                result, text = _imaplib_answer(_s(exc.args[0] if exc.args else exc))
                if login_says_later(result, text):  # the listener tries again too
                    raise MediaNotReady(f"the IMAP server answered LOGIN: {result} {text}") from exc
                self._refusal = login_refused(self.user, result, text)
                raise ChannelRefused(self._refusal) from exc
            typ, data = conn.select(self.args.mailbox, readonly=True)
            if typ != "OK":
                _raise_refused("SELECT", typ, data)
            if int((conn.untagged_responses.get("UIDVALIDITY") or [b"0"])[0]) != uidvalidity:
                raise LookupError(f"{GONE} (the mailbox was renumbered: a new UIDVALIDITY)")
            typ, data = conn.uid("FETCH", str(uid), "(BODY.PEEK[])")
            if typ != "OK":
                _raise_refused("UID FETCH", typ, data)
            raw = next((d[1] for d in data or [] if isinstance(d, tuple)), None)
            if raw is None:
                raise LookupError(GONE)  # expunged or moved away: UID FETCH answers OK and nothing
            return _part(raw, index)
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
            if self.gmail is not None:
                self.gmail.send(msg.as_bytes())
                self.state.mark_sent(delivery.delivery_id, message_id)
            else:
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
            size = ascii_int(smtp.esmtp_extensions.get("size"))
            if size and len(msg.as_bytes()) > size:
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
        if self.gmail is not None:
            self.gmail.close()
        if self.state is not None:
            self.state.close()
            self.state = None


GONE = "the mail is no longer on the server"
#: RFC 5530 response codes of a tagged NO that say "try again later", not "never": UNAVAILABLE ("temporary
#: failure because a subsystem is down"; Dovecot's "NO [UNAVAILABLE] Temporary authentication failure."),
#: INUSE, SERVERBUG, LIMIT (Yahoo's "NO [LIMIT] Too many simultaneous connections").
LATER_CODES = ("UNAVAILABLE", "INUSE", "SERVERBUG", "LIMIT")
#: RFC 5530 codes of a refused login, which only the account's owner or an operator can change: a wrong or
#: revoked password (Gmail: "NO [AUTHENTICATIONFAILED] Invalid credentials (Failure)"), no right to the
#: mailbox, an expired password, a login that needs TLS, "contact your administrator".
REFUSED_CODES = ("AUTHENTICATIONFAILED", "AUTHORIZATIONFAILED", "EXPIRED", "PRIVACYREQUIRED", "CONTACTADMIN")
#: Gmail answers a LOGIN beyond the account's 15 IMAP connections (support.google.com/mail/answer/97150)
#: "NO [ALERT] Too many simultaneous connections. (Failure)" (github.com/zone-eu/wildduck/issues/35,
#: github.com/jstedfast/MailKit/issues/377): the user's phone and laptop hold them, and free them in a while.
#: Gmail's bandwidth limit, "NO [ALERT] Account exceeded command or bandwidth limits. (Failure)" (also seen as
#: "[OVERQUOTA] Account exceeded ..."), lifts within a day (github.com/chatwoot/chatwoot/issues/6082);
#: Fastmail's "NO login not available on this server. 451 Already reached per-10 minute limit for logins ...
#: try again later" (github.com/LogicLabs-OU/OpenArchiver/issues/37) within ten minutes.
#: Gmail's other [ALERT]s at LOGIN are refusals: "Application-specific password required:
#: https://support.google.com/accounts/answer/185833 (Failure)" (2-Step Verification on, no app password)
#: and "Please log in via your web browser: https://support.google.com/mail/accounts/answer/78754 (Failure)".
_LATER_WORDS = re.compile(r"too many simultaneous connections|exceeded command or bandwidth limits"
                          r"|per-10 minute limit|try again later", re.IGNORECASE)


class LoginLater(ConnectionError):
    """The IMAP server answered LOGIN "not now" (``login_says_later``): the listener reconnects, never disables."""


def _codes(text: str) -> set[str]:
    """The response codes (``[CODE ...]``, RFC 3501 resp-text-code) in a response's text, upper case."""
    return {c.upper() for c in re.findall(r"\[([A-Za-z][A-Za-z0-9.-]*)[\] ]", text)}


def login_says_later(result: str, text: str) -> bool:
    """Whether the server's answer to LOGIN other than OK (``result`` NO or BAD, ``text`` what it said) means
    "later" rather than "refused" (the one rule of the listener's login and an attachment re-read's).

    A BAD is never later: RFC 3501 7.1.3 makes it an error in the client's command, and the same command sent
    again gets the same answer. A refusal code (``REFUSED_CODES``) is a refusal whatever else the answer says.
    A NO is later only with a code that says so (``LATER_CODES``) or a provider's known "later" wording
    (``_LATER_WORDS``); any other NO (a wrong password on a server without RFC 5530 codes, Gmail's [ALERT]s
    asking for an app password or a browser login) is a refusal, as it always was."""
    if result != "NO":
        return False
    codes = _codes(text)
    if codes & set(REFUSED_CODES):
        return False
    return bool(codes & set(LATER_CODES)) or bool(_LATER_WORDS.search(text))


def login_refused(user: str, result: str, text: str) -> str:
    """The reason a refused LOGIN disables the plugin with: the server's words, and for a BAD that the server
    rejected the LOGIN command itself (sent again it would be rejected again)."""
    if result == "BAD":
        return f"IMAP login refused for {user}: the server rejected the LOGIN command itself (BAD): {text}"
    return f"IMAP login refused for {user}: {text}"


def login_disabled(user: str, capabilities) -> str | None:
    """The refusal when the server advertises LOGINDISABLED (RFC 3501 6.2.3: no plaintext LOGIN on this
    connection), else None: LOGIN sent anyway would only be answered NO or BAD."""
    if "LOGINDISABLED" not in {str(c).upper() for c in capabilities}:
        return None
    return (f"IMAP login refused for {user}: the server refuses plaintext LOGIN on this connection "
            "(it advertises LOGINDISABLED): use --imap-security ssl (implicit TLS, port 993)")


def _imaplib_answer(text: str) -> tuple[str, str]:
    """(result, the server's text) of an ``imaplib.IMAP4.error`` raised by ``login``: a NO raises the server's
    text; a BAD, ``LOGIN command error: BAD [b'<text>']``."""
    m = re.fullmatch(r"\w+ command error: (BAD|NO) \[(.*)\]", text, re.S)
    if not m:
        return "NO", text
    try:
        lines = ast.literal_eval(f"[{m.group(2)}]")
    except (ValueError, SyntaxError):
        return m.group(1), m.group(2)
    return m.group(1), " ".join(_s(line) for line in lines if line is not None).strip()


async def _close(client) -> None:
    """Log out (at most 2 s), then close the socket whatever the server did: one it keeps open holds one of the
    account's few connections."""
    try:
        if not client.lost.is_set() and client.protocol is not None:
            await asyncio.wait_for(client.logout(), 2)
    except Exception:  # noqa: BLE001 - a server that never answers LOGOUT is closed below
        pass
    finally:
        transport = getattr(client.protocol, "transport", None)
        if transport is not None:
            transport.close()


def _raise_if_later(command: str, text: str) -> None:
    if _codes(text) & set(LATER_CODES):
        raise MediaNotReady(f"the IMAP server answered {command}: NO {text}")


def _raise_refused(command: str, typ: str, data) -> None:
    """A tagged NO (or BAD) to ``command``: MediaNotReady if its code says "later", else final."""
    text = " ".join(_s(d) for d in data or [] if d is not None)
    if typ == "NO":
        _raise_if_later(command, text)
    raise RuntimeError(f"the IMAP server answered {command}: {typ} {text}")


def _part(raw: bytes, index: int) -> bytes:
    parts = attachment_parts(email.message_from_bytes(raw, policy=email.policy.default))
    if not 0 < index <= len(parts):
        raise LookupError("the mail on the server no longer has that attachment")
    return parts[index - 1].get_payload(decode=True)


def _s(line) -> str:
    return bytes(line).decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else str(line)


def _uids(response) -> list[int]:
    out = []
    for line in response.lines:
        text = _s(line)
        if text.upper().startswith("SEARCH"):
            text = text[6:]
        elif not re.fullmatch(r"[0-9\s]*", text):
            continue
        out.extend(n for n in map(ascii_int, text.split()) if n is not None)
    return out


def aioimaplib_stop():
    import aioimaplib
    return getattr(aioimaplib, "STOP_WAIT_SERVER_PUSH", None)


def main() -> None:
    EmailWorker.main(argv=sys.argv[1:])
