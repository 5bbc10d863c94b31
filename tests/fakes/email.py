"""A mail provider on loopback for the email channel: a real IMAP server with IDLE and a real SMTP server.

* IMAP: pymap's in-memory (dict) backend, served by pymap's own IMAP server on
  127.0.0.1:<ephemeral>, in a thread with its own event loop. Mail "arrives" by a
  real IMAP APPEND to INBOX (``deliver(raw)``), so the worker sees what a provider's
  IDLE sends: ``* n EXISTS``.
* SMTP: aiosmtpd's SMTP server on 127.0.0.1:<ephemeral> (AUTH PLAIN/LOGIN with the same
  user and password, no TLS on loopback), recording every accepted message.

Knobs: ``drop_connections()`` (the provider drops every IMAP socket), ``set_password()``
(the account's password changed or its app password was revoked), ``smtp_refuse(code,
text, times)`` (the next sends answered so: ``451 4.7.1`` rate limit, ``535`` auth),
``fail_fetch(uid, times, no=None)`` (the next UID FETCHes of that mail answered ``* BYE [UNAVAILABLE]``,
or ``NO [<no>]``), ``refuse_login(text, times, result="NO")`` (the next LOGINs answered ``NO <text>``:
Gmail's ``[ALERT] Too many simultaneous connections. (Failure)``, a server's ``[UNAVAILABLE] ...``; or
``BAD <text>``), ``expunge(uid)`` (the mail deleted or moved away),
``stall_quit(event)`` (the server accepted the message and then hangs before answering
QUIT: a window to kill a worker in, after the send and before its ack), ``idle_count``.

    with MailServer(user="bot@example.org", password="pw") as mail:
        mail.deliver(raw_bytes)
        mail.sent()            # [email.message.EmailMessage, ...]

``BareImap`` is the least of an IMAP server, for what pymap will not do: advertise LOGINDISABLED, or never
answer LOGOUT; it counts the connections still open.
"""
from __future__ import annotations

import asyncio
import email
import email.policy
import imaplib
import socket
import threading
from argparse import Namespace
from email.message import EmailMessage


class MailServer:
    def __init__(self, *, user: str = "bot@example.org", password: str = "app-password"):
        self.user = user
        self.password = password
        self.smtp_password: str | None = None   # set: SMTP AUTH wants this one (the IMAP password is unchanged)
        self.imap_port = 0
        self.smtp_port = 0
        self.idle_count = 0
        self.smtp_refusals: list[str] = []      # what was refused, as "code text"
        self._sent: list[bytes] = []
        self._refuse: list[tuple[int, str]] = []
        self._fetch_failures: dict[str, tuple[int, str | None]] = {}  # UID -> (how many more fail, NO code)
        self.fetches: list[tuple[int, bool]] = []  # (UID, answered) of every single-UID UID FETCH, in order
        self._login_refusals: list[tuple[str, str]] = []  # (NO or BAD, text) of the next LOGINs, one each
        self.logins: list[str] = []             # every LOGIN: "OK" or the NO's text, in order
        self._quit_stall: threading.Event | None = None
        self._writers: set = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> "MailServer":
        self._thread = threading.Thread(target=self._main, name="fake-mail", daemon=True)
        self._thread.start()
        if not self._ready.wait(20) or self._error:
            raise RuntimeError(f"the fake mail server did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._quit_stall is not None:
            self._quit_stall.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "MailServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from aiosmtpd.smtp import SMTP, AuthResult
        from proxyprotocol.reader import ProxyProtocolReader
        from pymap.backend.dict import DictBackend
        from pymap.imap import IMAPServer
        from pymap.imap import state as imap_state

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        args = Namespace(host="127.0.0.1", port=0, debug=False, cert=None, key=None, tls=False, passlib_cfg=None,
                         proxy_protocol=None, demo_data=False, demo_user=self.user, demo_password=self.password,
                         inherited_sockets=None)
        backend, config = await DictBackend.init(args, invalid_user_sleep=0.0, reject_dnsbl=False)
        config.apply_context()
        self._backend, self._config = backend, config
        server = self

        original_fetch = imap_state.ConnectionState.do_fetch
        if not getattr(original_fetch, "_faulty", False):
            from pymap.exceptions import ResponseError
            from pymap.parsing.response import ResponseBye, ResponseNo

            from pymap.parsing.response import ResponseCode

            class Unavailable(ResponseError):
                def __init__(self, code):
                    super().__init__()
                    self.code = code

                def get_response(self, tag):
                    if self.code is not None:  # a tagged NO with that response code (RFC 5530); the connection stays
                        return ResponseNo(tag, b"FETCH failed, try again later.", ResponseCode.of(self.code.encode()))
                    # the BYE makes pymap close the connection after it
                    response = ResponseNo(tag, b"FETCH failed: the server is going down.")
                    response.add_untagged(ResponseBye(b"[UNAVAILABLE] Server busy, try again later."))
                    return response

            async def do_fetch(state_self, cmd):
                fake = getattr(state_self.config, "_fake_mail_server", None)
                uid = bytes(cmd.sequence_set).decode() if cmd.uid else None
                if fake is not None and uid is not None:
                    with fake._lock:
                        failing, code = fake._fetch_failures.get(uid, (0, None))
                        if failing:
                            fake._fetch_failures[uid] = (failing - 1, code)
                        fake.fetches.append((int(uid) if uid.isdigit() else uid, not failing))
                    if failing:
                        raise Unavailable(code)  # "* BYE ..." (the provider hangs up), or "NO [code] ..."
                return await original_fetch(state_self, cmd)
            do_fetch._faulty = True
            imap_state.ConnectionState.do_fetch = do_fetch

        original_idle = imap_state.ConnectionState.do_idle
        if not getattr(original_idle, "_counted", False):
            async def do_idle(state_self, cmd):
                counter = getattr(state_self.config, "_fake_mail_server", None)
                if counter is not None:
                    counter.idle_count += 1
                return await original_idle(state_self, cmd)
            do_idle._counted = True
            imap_state.ConnectionState.do_idle = do_idle
        original_login = imap_state.ConnectionState.do_login
        if not getattr(original_login, "_refusing", False):
            from pymap.parsing.response import ResponseBad as _Bad, ResponseNo as _No

            async def do_login(state_self, cmd):
                fake = getattr(state_self.config, "_fake_mail_server", None)
                refusal = None
                if fake is not None:
                    with fake._lock:
                        refusal = fake._login_refusals.pop(0) if fake._login_refusals else None
                        fake.logins.append(refusal[1] if refusal else "OK")
                if refusal is not None:  # "<tag> NO <text>" as the provider writes it; the connection stays
                    result, text = refusal
                    return (_Bad if result == "BAD" else _No)(cmd.tag, text.encode()), None
                return await original_login(state_self, cmd)
            do_login._refusing = True
            imap_state.ConnectionState.do_login = do_login
        config._fake_mail_server = self

        imap_server = IMAPServer(backend.login, config)

        async def tracked(reader, writer, sock_info):
            self._writers.add(writer)
            try:
                await imap_server(reader, writer, sock_info)
            finally:
                self._writers.discard(writer)

        callback = ProxyProtocolReader(config.proxy_protocol).get_callback(tracked)
        imap = await asyncio.start_server(callback, "127.0.0.1", 0)
        self.imap_port = imap.sockets[0].getsockname()[1]

        class Handler:
            async def handle_DATA(self, smtp, session, envelope):
                with server._lock:
                    refusal = server._refuse.pop(0) if server._refuse else None
                if refusal:
                    server.smtp_refusals.append(f"{refusal[0]} {refusal[1]}")
                    return f"{refusal[0]} {refusal[1]}"
                with server._lock:
                    server._sent.append(bytes(envelope.original_content or envelope.content))
                return "250 2.0.0 OK queued"

        def authenticator(smtp, session, envelope, mechanism, auth_data):
            ok = (getattr(auth_data, "login", b"") or b"").decode() == server.user and \
                 (getattr(auth_data, "password", b"") or b"").decode() == (server.smtp_password or server.password)
            return AuthResult(success=ok, handled=False)

        class StallingSMTP(SMTP):
            async def smtp_QUIT(self, arg):
                stall = server._quit_stall
                if stall is not None:
                    while not stall.is_set():
                        await asyncio.sleep(0.05)
                return await super().smtp_QUIT(arg)

        def smtp_factory():
            return StallingSMTP(Handler(), hostname="fake-mail.test", authenticator=authenticator,
                                auth_require_tls=False, auth_exclude_mechanism=["CRAM-MD5"])

        smtp = await self._loop.create_server(smtp_factory, "127.0.0.1", 0)
        self.smtp_port = smtp.sockets[0].getsockname()[1]
        self._ready.set()
        async with imap, smtp:
            await self._stop.wait()
            for writer in list(self._writers):
                writer.transport.abort()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(20)

    # -- the provider's side ----------------------------------------------------------

    def imap(self) -> imaplib.IMAP4:
        """A client of the fake's own (what a second mail client of the account would do). It logs in with
        AUTHENTICATE PLAIN, so ``refuse_login`` (which answers LOGIN, what the worker sends) never refuses it."""
        conn = imaplib.IMAP4("127.0.0.1", self.imap_port, timeout=20)
        conn.authenticate("PLAIN", lambda _: f"\0{self.user}\0{self.password}".encode())
        return conn

    def deliver(self, raw: bytes | EmailMessage, mailbox: str = "INBOX") -> int:
        """Mail arrives in the mailbox (an APPEND); returns its UID."""
        data = raw.as_bytes() if isinstance(raw, EmailMessage) else raw
        conn = self.imap()
        try:
            typ, resp = conn.append(mailbox, None, None, data)
            assert typ == "OK", resp
            text = resp[0].decode()
            return int(text.split("APPENDUID", 1)[1].split()[1].rstrip("]"))
        finally:
            conn.logout()

    def expunge(self, uid: int, mailbox: str = "INBOX") -> None:
        """The mail is deleted (or moved away) by another client of the account: ``\\Deleted`` and EXPUNGE."""
        conn = self.imap()
        try:
            conn.select(mailbox)
            typ, resp = conn.uid("STORE", str(uid), "+FLAGS", "(\\Deleted)")
            assert typ == "OK", resp
            typ, resp = conn.expunge()
            assert typ == "OK", resp
        finally:
            conn.logout()

    def flags(self, uid: int, mailbox: str = "INBOX") -> str:
        conn = self.imap()
        try:
            conn.select(mailbox, readonly=True)
            typ, data = conn.uid("FETCH", str(uid), "(FLAGS)")
            return data[0].decode() if data and data[0] else ""
        finally:
            conn.logout()

    def sent(self) -> list[EmailMessage]:
        with self._lock:
            raws = list(self._sent)
        return [email.message_from_bytes(r, policy=email.policy.default) for r in raws]

    def drop_connections(self) -> int:
        """Abort every open IMAP connection, as a provider restarting does."""
        done = threading.Event()
        box = {}

        def drop():
            writers = list(self._writers)
            for w in writers:
                w.transport.abort()
            box["n"] = len(writers)
            done.set()
        self._loop.call_soon_threadsafe(drop)
        done.wait(10)
        return box.get("n", 0)

    def connection_count(self) -> int:
        return len(self._writers)

    def set_password(self, password: str) -> None:
        """The account's password changes (an app password revoked): new logins with the old one fail."""
        from pymap.user import Passwords, UserMetadata

        async def change():
            hashed = await Passwords(self._config).hash_password(password)
            self._backend.login.users_dict[self.user] = UserMetadata(self._config, self.user, password=hashed)
        self._call(change())
        self.password = password

    def smtp_refuse(self, code: int, text: str, times: int = 1) -> None:
        """Answer the next ``times`` messages' DATA with ``code text`` instead of accepting them."""
        with self._lock:
            self._refuse.extend([(code, text)] * times)

    def fail_fetch(self, uid: int, times: int = 1, *, no: str | None = None) -> None:
        """The next ``times`` UID FETCHes of ``uid`` are answered ``* BYE [UNAVAILABLE]`` and the connection
        closed (the provider busy or restarting), not the message; with ``no`` (a response code such as
        ``UNAVAILABLE``) a tagged ``NO [<no>]`` instead, the connection kept."""
        with self._lock:
            self._fetch_failures[str(uid)] = (times, no)

    def refuse_login(self, text: str, times: int = 1, result: str = "NO") -> None:
        """Answer the next ``times`` LOGINs ``<tag> <result> <text>`` (the connection stays open, as Gmail's
        does)."""
        with self._lock:
            self._login_refusals.extend([(result, text)] * times)

    def stall_quit(self, release: threading.Event | None) -> None:
        """Hold every QUIT until ``release`` is set (None: answer QUIT at once again)."""
        self._quit_stall = release


def make_mail(*, sender: str = "alice@example.com", to: str = "bot@example.org", subject: str = "Hello",
              text: str = "hi", message_id: str | None = None, in_reply_to: str | None = None,
              references: str | None = None, headers: dict | None = None,
              attachments: list[tuple[bytes, str, str]] | None = None) -> EmailMessage:
    """A mail as a mail client writes it (attachments as (data, content type, filename))."""
    import email.utils
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = subject
    msg["Date"] = email.utils.formatdate(usegmt=True)
    msg["Message-ID"] = message_id or email.utils.make_msgid(domain=sender.rsplit("@", 1)[-1])
    if in_reply_to:
        msg["In-Reply-To"] = in_reply_to
    if references:
        msg["References"] = references
    for k, v in (headers or {}).items():
        msg[k] = v
    msg.set_content(text)
    for data, ctype, filename in attachments or []:
        maintype, subtype = ctype.split("/", 1)
        msg.add_attachment(data, maintype=maintype, subtype=subtype, filename=filename)
    return msg


class BareImap:
    """A greeting with ``capabilities``, ``<tag> <login>`` to every LOGIN, ``OK`` to anything else, and to LOGOUT
    a BYE and OK unless ``answer_logout`` is False (a server too busy to answer). ``logins`` holds each LOGIN
    line as sent; ``open`` the connections the client has not closed."""

    def __init__(self, *, capabilities: str = "IMAP4rev1", login: bytes = b"NO [UNAVAILABLE] later",
                 answer_logout: bool = True):
        self.capabilities, self.login, self.answer_logout = capabilities.encode(), login, answer_logout
        self.logins: list[bytes] = []
        self.open = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]

    def __enter__(self) -> BareImap:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.open += 1
        try:
            with conn, conn.makefile("rb") as lines:
                conn.sendall(b"* OK [CAPABILITY " + self.capabilities + b"] ready\r\n")
                for line in lines:
                    tag, _, command = line.rstrip(b"\r\n").partition(b" ")
                    verb = command.split(b" ", 1)[0].upper()
                    if verb == b"CAPABILITY":
                        conn.sendall(b"* CAPABILITY " + self.capabilities + b"\r\n" + tag + b" OK done\r\n")
                    elif verb == b"LOGIN":
                        self.logins.append(line)
                        conn.sendall(tag + b" " + self.login + b"\r\n")
                    elif verb != b"LOGOUT":
                        conn.sendall(tag + b" OK done\r\n")
                    elif self.answer_logout:
                        conn.sendall(b"* BYE bye\r\n" + tag + b" OK done\r\n")
                        return
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1
