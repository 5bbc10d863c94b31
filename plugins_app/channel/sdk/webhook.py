"""An HTTP endpoint a chat platform calls (a webhook, a callback URL), for a worker that listens for one.

One home for what every such endpoint needs, whatever the platform: a thread of its own serving requests
(one thread each, at most ``max_connections`` at once: past that a connection waits in the listen backlog
until one ends, so a flood of connections costs no more memory than that many threads; and none lasts past
``connection_deadline``, so a client trickling bytes cannot hold a thread), a body read whole up to
``max_body_bytes`` (``read_body``: past it the body is not read, the request's handler gets ``None`` and the
connection is closed after the answer, so the unread bytes are never taken for a next request; a length
that is no number or negative, or given twice with different values, is answered 400, and a body sent with
``Transfer-Encoding`` (chunked) 411, both without reading it and closing the connection; a body that ends
before its length is answered 400 and closes the connection, the request never handed on), ``timeout`` seconds for a connection (a client that
stalls holds no thread), and answers as ``(status, body)``: a dict is sent as JSON, a str as UTF-8 text.

A worker's server subclasses it and answers in ``respond(method, target, headers, body)``: verify the
platform's signature before anything is recorded, and answer 2xx only once the message is in the outbox.
An exception out of ``respond`` is logged (with its traceback, once, on the server's ``log``) and answered
500, never a connection dropped with no answer.

``WebhookInbox`` is the rest of such a worker: the webhook's threads record and queue, and its ``listen``
hands each chat's messages to a thread of that chat's (``InboxLanes``, on ``ChatLanes``), so one chat's file
downloading for minutes holds back that chat's later messages only (the SDK's submits lock per chat, not per
worker). A listener fed by a thread of its own (Slack's socket, Discord's Gateway, Telegram's getUpdates) uses
``InboxLanes`` alone: that thread records each message before it confirms it to the platform, and queues it.
"""
from __future__ import annotations

import collections
import json
import logging
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

log = logging.getLogger("ugent.worker.webhook")

#: Recorded messages a listener's lanes hold at most, queued, waiting on a lane or in hand (``InboxQueue``).
INBOX_QUEUE_LIMIT = 1000


class BodyRefused(Exception):
    """A request body left unread: the ``status`` to answer (400, 411, 413) and ``reason``, for the answer and
    the log."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def body_length(headers, max_bytes: int) -> int:
    """The length of the body a request's ``headers`` announce, checked before a byte of it is read:
    ``BodyRefused`` for a body sent with ``Transfer-Encoding`` (411: the stdlib's server reads no chunks, and
    would take the chunk-size line for a next request), Content-Length headers with different values (400: a
    proxy in front may have taken the other, and the bytes past the one taken would be read as a next request:
    request smuggling), a Content-Length that is no number or negative (400), or one past ``max_bytes`` (413)."""
    if headers.get("Transfer-Encoding"):
        raise BodyRefused(411, f"a body sent with Transfer-Encoding: {headers.get('Transfer-Encoding')} is not "
                               "read; send it with a Content-Length")
    given = {v.strip() for v in (headers.get_all("Content-Length") or [])}
    if len(given) > 1:  # RFC 7230 §3.3.3: which one a proxy took is unknown, the rest would be read as a request
        raise BodyRefused(400, f"Content-Length given {len(given)} different values: "
                               f"{', '.join(sorted(v[:20] for v in given))[:80]}")
    raw = given.pop() if given else "0"
    if not (raw.isascii() and raw.isdigit()):
        raise BodyRefused(400, f"Content-Length {raw[:40]!r} is not a length")
    length = int(raw)
    if length > max_bytes:
        raise BodyRefused(413, f"a body of {length} bytes is more than the {max_bytes} taken")
    return length


def read_body(handler: BaseHTTPRequestHandler, max_bytes: int) -> bytes:
    """The request's body, read whole (``body_length`` checks it first). When it is refused (``BodyRefused``)
    it is not read, and the connection is closed after the answer: its bytes must not be taken for a next
    request. A body that ends before its Content-Length (the client half-closed, a proxy gave up, the
    connection's deadline cut it) is refused too (400), never handed on short: part of a message is not the
    message, and a platform whose signature does not cover the body would tie it to the part."""
    try:
        length = body_length(handler.headers, max_bytes)
    except BodyRefused:
        handler.close_connection = True
        raise
    if not length:
        return b""
    try:
        body = handler.rfile.read(length)
    except OSError:  # (the connection cut, or silent past the handler's timeout)
        body = b""
    if len(body) < length:
        handler.close_connection = True
        raise BodyRefused(400, f"body ended after {len(body)} of {length} bytes")
    return body


def json_loads_bounded(data: bytes | str) -> Any:
    """``json.loads``, with JSON nested past the interpreter's depth a ``ValueError`` like any other body that
    is not JSON (``json`` raises ``RecursionError`` for it): a webhook answers it 400, never 500."""
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most ``max_connections`` connection threads at once, none lasting past
    ``connection_deadline``: for a worker that serves HTTP with its own handler (Telegram's webhook, Gmail's push)."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting for a thread wait here (the kernel's listen backlog)

    def __init__(self, address, handler, max_connections: int = 64, connection_deadline: float = 30.0):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.connection_deadline = connection_deadline
        self.closing = threading.Event()

    def process_request(self, request, client_address):
        while not self._slots.acquire(timeout=0.2):  # every thread busy: this connection waits its turn
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        # the handler's timeout bounds each read, not the connection: a client dripping a byte now and then
        # would hold its thread for ever. Past connection_deadline the socket is shut and the thread freed.
        cut = threading.Timer(self.connection_deadline, self._cut, (request,))
        cut.daemon = True
        try:
            cut.start()
        except RuntimeError as exc:
            # No thread to be had (a worker at its memory cap: each thread's stack counts against it). The
            # connection is let go unanswered, the platform sends it again, and its slot is freed: held, it
            # would be gone for good, and a webhook that lost them all would answer nobody while the worker
            # still heartbeats.
            log.warning("a connection from %s to port %s let go unanswered, no thread for its deadline: %s",
                        client_address[0] if client_address else "?", self.server_address[1], exc)
            self.shutdown_request(request)
            self._slots.release()
            return
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self._slots.release()

    @staticmethod
    def _cut(request) -> None:
        try:
            request.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class WebhookServer:
    #: The thread's name, and how the server is named in the worker's log.
    name = "webhook"
    #: The largest body read; a larger one is answered by ``respond`` with ``body=None``.
    max_body_bytes = 1 << 20
    #: Seconds a connection may keep the server waiting.
    timeout = 10.0
    #: Connections served at once (a thread each); the next ones wait until one ends.
    max_connections = 64
    #: Seconds a connection may last in all (keep-alive included), however it trickles.
    connection_deadline = 30.0
    #: Where a refused body and a failed ``respond`` are logged (a worker's server names its own logger).
    log = log

    def __init__(self, bind: str, path: str):
        host, _, port = bind.rpartition(":")
        self.path = path
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = server.timeout

            def log_message(self, fmt, *args):  # noqa: N802 - the stdlib's name
                log.debug("%s %s " + fmt, server.name, self.address_string(), *args)

            def do_GET(self):  # noqa: N802
                if (self.headers.get("Content-Length", "0").strip() not in ("", "0")
                        or self.headers.get("Transfer-Encoding")):
                    self.close_connection = True  # a GET's body is never read: it must not be taken for a request
                self._respond("GET", b"")

            def do_POST(self):  # noqa: N802
                try:
                    body = read_body(self, server.max_body_bytes)
                except BodyRefused as exc:
                    server.log.warning("%s: refused a POST %s from %s (%d): %s", server.name, self.path.split("?")[0],
                                       self.address_string(), exc.status, exc.reason)
                    if exc.status != 413:
                        return self._answer(exc.status, exc.reason)
                    body = None  # (the receiver answers a body too large in its platform's form)
                self._respond("POST", body)

            def _respond(self, method: str, body: bytes | None) -> None:
                try:
                    status, answer = server.respond(method, self.path, self.headers, body)
                except Exception:  # noqa: BLE001 - any receiver's failure is an answer, not a dropped connection
                    server.log.exception("%s: answering %s %s failed", server.name, method, self.path.split("?")[0])
                    status, answer = 500, "internal error"
                self._answer(status, answer)

            def _answer(self, status: int, body: Any):
                if isinstance(body, dict):
                    data, kind = json.dumps(body).encode(), "application/json"
                else:
                    data, kind = str(body or "").encode(), "text/plain; charset=utf-8"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = BoundedHTTPServer((host or "127.0.0.1", int(port or 0)), Handler, self.max_connections,
                                    self.connection_deadline)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}{self.path}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, Any]:
        """One request (``target``: its path and query): ``(status, body)``."""
        raise NotImplementedError


class ChatLanes:
    """Calls ``handle(item)`` for each item ``put``, in a thread per chat that has items: a chat's one after
    another in the order put, different chats' side by side, at most ``max_lanes`` chats at once (then ``put``
    waits for one to finish). A chat's thread ends with its last item, so the threads are as many as the chats
    with a message under way, never as the chats seen. After ``close()`` a lane takes no new item: it ends
    with the one in hand, and the items still waiting on it are dropped."""

    def __init__(self, handle, *, max_lanes: int = 16, name: str = "chat"):
        self._handle = handle
        self._max = max(1, max_lanes)
        self._name = name
        self._cond = threading.Condition()
        self._lanes: dict[str, collections.deque] = {}
        self.closed = False

    def put(self, chat: str, item, *, give_up: Callable[[], bool] | None = None) -> bool:
        """Queue ``item`` on ``chat``'s lane. While every lane is busy, wait for one, asking ``give_up()`` every
        0.2 s: False (nothing queued) once it says so, or once the lanes are closed."""
        with self._cond:
            while not self.closed and chat not in self._lanes and len(self._lanes) >= self._max:
                if give_up is not None and give_up():
                    return False
                self._cond.wait(0.2)
            if self.closed:
                return False
            lane = self._lanes.get(chat)
            if lane is not None:
                lane.append(item)
                return True
            self._lanes[chat] = collections.deque([item])
        try:
            threading.Thread(target=self._run, args=(chat,), name=f"{self._name}-lane", daemon=True).start()
        except BaseException:
            # No thread (a worker at its memory cap): a lane left behind would take the chat's next items and
            # handle none, and hold join() to its timeout. Its items are dropped with it (InboxLanes' messages
            # stay owed in the outbox, for the replay); the caller gets the error.
            with self._cond:
                self._lanes.pop(chat, None)
                self._cond.notify_all()
            raise
        return True

    def close(self) -> None:
        """No lane takes a new item from now on (each ends with the one in hand); ``put`` queues nothing."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every lane is done; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._lanes, timeout)

    def __len__(self) -> int:
        with self._cond:
            return len(self._lanes)

    def _run(self, chat: str) -> None:
        while True:
            with self._cond:
                lane = self._lanes[chat]
                if not lane or self.closed:
                    del self._lanes[chat]
                    self._cond.notify_all()
                    return
                item = lane.popleft()
            try:
                self._handle(item)
            except Exception:  # noqa: BLE001 - one item's failure must not end its chat's lane
                log.exception("%s: handling an item of chat %s failed", self._name, chat)


class InboxQueue(queue.Queue):
    """The recorded messages a listener's lanes hold, at most ``limit`` of them: queued, waiting on a chat's lane,
    or in hand.

    Each message in it is already in the outbox, owed to the host: holding it only spares it the wait for the
    replay. While the host is away (or slow) the lanes stop finishing, and a busy channel would hold every
    message in memory; past ``limit`` a new message is not taken (``offer`` returns False) and waits in the
    outbox alone, for the replay, which submits each chat's in order (a chat's later message, submitted on its
    lane, sends the earlier owed ones first). While some are left the replay is woken (``wake``) each time the
    lanes are done with a message: the replay passes over a chat whose submit is under way, and takes the
    others, a chat that never had a lane included. Once a replay that began after the last message was left
    has passed over no chat (``replay_caught_up``), or the lanes hold nothing, none is left: the wakes stop.
    The first message left and the end of the episode are logged, once each time."""

    def __init__(self, limit: int, *, wake: Callable[[], None] = lambda: None, log=log):
        super().__init__()
        self.limit = max(1, int(limit))
        self.left = 0  # messages left to the outbox in this episode (0: none is waiting for the replay)
        self._left_ever = 0  # every message left, for replay_caught_up
        self._held = 0  # offered and not yet released
        self._count = threading.Lock()
        self._wake, self._log = wake, log

    @classmethod
    def of(cls, worker, limit: int = INBOX_QUEUE_LIMIT) -> "InboxQueue":
        """A worker's inbox: the replay it wakes is the worker's background one, its log the worker's."""
        return cls(limit, wake=worker._replay_due.set, log=worker.log)

    @property
    def held(self) -> int:
        with self._count:
            return self._held

    def offer(self, message) -> bool:
        with self._count:
            taken = self._held < self.limit
            if taken:
                self._held += 1
            else:
                self.left += 1
                self._left_ever += 1
                first = self.left == 1
        if taken:
            self.put(message)
            return True
        if first:
            self._log.warning("inbox full (%d messages held for the host): new messages wait in the outbox "
                              "for the replay", self.limit)
        return False

    def release(self) -> None:
        """A message taken is done with: submitted, failed (owed, for the replay) or dropped."""
        with self._count:
            self._held = max(0, self._held - 1)
            left = self.left
            if left and not self._held:
                self.left = 0  # the lanes hold nothing: the replay this wakes passes over no chat
        if left:
            if not self._held:
                self._episode_over(left)
            self._wake()  # (wakes coalesce: the replay thread runs one at a time)

    def replay_begins(self) -> int:
        """A replay is about to read the outbox: what it will find left so far (for ``replay_caught_up``)."""
        with self._count:
            return self._left_ever

    def replay_caught_up(self, begun: int) -> None:
        """The replay begun at ``begun`` passed over no chat: it submitted every message left before it began,
        and if none was left since, none is waiting for it."""
        with self._count:
            left = self.left if self._left_ever == begun else 0
            if left:
                self.left = 0
        if left:
            self._episode_over(left)

    def _episode_over(self, left: int) -> None:
        self._log.info("inbox no longer full: %d messages were left in the outbox for the replay", left)


class InboxLanes:
    """The loop of a listener whose messages arrive on other threads (a webhook's requests, a socket's reader)
    and wait in a queue, each already recorded in the outbox: ``run`` takes them from the queue and submits
    each chat's on a lane of that chat's (``ChatLanes``), logging what became of each.

    It ends, and the listener with it, when the worker stops, when a refusal was found on any thread
    (``worker._refusal``, raised as ``ChannelRefused``: the plugin is disabled), when the thread feeding the
    queue failed (``failed()``, raised as ``RuntimeError``: the worker is restarted), or when
    ``failures_to_end`` submits in a row failed with an unexpected exception (a submit's failure leaves its
    message owed, for the replay, and the lane goes on; but submits that keep failing mean the worker is
    broken, and before the lanes an exception out of a submit ended the listener: so does this, raised as
    ``RuntimeError``, and the supervisor restarts the worker). Then the lanes take no new message, and the
    ones in hand get until the worker's drain deadline to finish, before the worker flushes and closes its
    outbox; a lane still downloading after that finds the outbox closed and leaves its message owed. Every
    message not submitted stays owed in the outbox (recorded before it was queued), for the replay."""

    #: Submits failing in a row (whatever their chats) that end the listener.
    failures_to_end = 10

    def __init__(self, worker, submit, *, max_lanes: int = 16, name: str = "inbox"):
        self.worker = worker
        self._submit = submit
        self.lanes = ChatLanes(self._lane, max_lanes=max_lanes, name=name)
        self._inbox = None  # the queue run() takes from; an InboxQueue is told what becomes of each message
        self._guard = threading.Lock()
        self._failures = 0
        self.error: Exception | None = None  # set once ``failures_to_end`` submits in a row failed

    def run(self, inbox: queue.Queue, failed: Callable[[], Exception | None] = lambda: None, *,
            what: str = "") -> None:
        """Submit what ``inbox`` holds until the listener must end (above); ``what`` begins the message of the
        ``RuntimeError`` raised for ``failed()``'s error."""
        from .worker import ChannelRefused
        worker = self.worker

        def ending() -> bool:
            return (worker.stopping.is_set() or bool(worker._refusal) or failed() is not None
                    or self.error is not None)

        self._inbox = inbox if isinstance(inbox, InboxQueue) else None
        try:
            while not ending():
                try:
                    message = inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if not self.lanes.put(message.conversation_id, message, give_up=ending):
                    self._release()  # (not put: it stays owed)
        finally:
            self.close()
        if worker._refusal:
            raise ChannelRefused(worker._refusal)
        error = failed()
        if error is not None:
            raise RuntimeError(f"{what}{type(error).__name__}: {error}") from error
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """The lanes take no new message; the ones in hand get until the worker's drain deadline (its
        ``drain_timeout_secs`` from now if it is not stopping yet) to finish."""
        self.lanes.close()
        worker = self.worker
        deadline = worker._drain_deadline or time.monotonic() + worker.drain_timeout_secs
        if not self.lanes.join(max(0.0, deadline - time.monotonic())):
            worker.log.warning("%d chats' submits still under way at the end of the drain time: their messages "
                               "stay owed, for the replay", len(self.lanes))

    def _lane(self, message) -> None:
        try:
            self._submit_logged(message)
        finally:
            self._release()

    def _release(self) -> None:
        if self._inbox is not None:
            self._inbox.release()


    def _submit_logged(self, message) -> None:
        from .client import ConnectionLost
        from .messages import MessageValidationError
        from .worker import ChannelRefused
        worker = self.worker
        if self.lanes.closed:
            return  # (the listener is ending: it stays owed)
        try:
            result = self._submit(message)
        except ChannelRefused as exc:  # a file's download refused: the listener raises it
            worker._refusal = worker._refusal or exc.reason
            return
        except MessageValidationError as exc:  # this message only: another start would not help
            worker.log.error("message %s (%s) breaks the protocol: %s", message.message_id,
                             message.conversation_id, exc)
            return
        except ConnectionLost as exc:
            if worker.stopping.is_set():  # the worker closed its outbox while this lane still ran
                worker.log.info("submit of %s (%s) cut short by the stop: it stays owed", message.message_id,
                                message.conversation_id)
                return
            self._failed(message, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the lane goes on with its chat's next message
            self._failed(message, exc)
            return
        with self._guard:
            self._failures = 0
        worker.log.info("submitted %s (%s): accepted=%s duplicate=%s queued=%s reason=%s", message.message_id,
                        message.conversation_id, result.accepted, result.duplicate, result.queued, result.reason)

    def _failed(self, message, exc: Exception) -> None:
        with self._guard:
            self._failures += 1
            failures = self._failures
        self.worker.log.warning("submit of %s (%s) failed, left to the replay: %s: %s", message.message_id,
                                message.conversation_id, type(exc).__name__, exc)
        if failures >= self.failures_to_end and self.error is None:
            error = RuntimeError(f"{failures} submits in a row failed, the last with {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self.error = error


class WebhookInbox:
    """For a ``ChannelWorker`` whose platform calls it: the webhook's threads record each message durably (the
    outbox) and queue it (``inbox_record``), and ``listen`` submits the queue, each chat's in order. A refusal
    a worker finds on any thread (a token refused at a download or a send) is set in ``self._refusal``; the
    listener then raises ``ChannelRefused`` with it, which stops the worker and disables the plugin with the reason. Any
    other failure of a thread that feeds the inbox (a platform link's reader) is set in ``self._inbox_error``:
    the listener raises it, and the supervisor restarts the worker.

    Each chat's messages are submitted in a thread of that chat's (``InboxLanes``), in the order recorded; other
    chats go beside it, so a file one chat's message downloads for minutes does not hold them back. Submits
    that fail ``InboxLanes.failures_to_end`` times in a row also end the listener (the worker is restarted).

    Mix it in before ``ChannelWorker`` and call ``inbox_init()`` in ``__init__``."""

    #: How long a send refused for the worker's credentials is held before it fails (``refused_failure``).
    refusal_hold_secs = 30.0
    #: Chats submitted at once, a thread each; a message of one more chat waits until one of them is done.
    inbox_lanes = 16
    #: Recorded messages the lanes hold at most (``InboxQueue``); past it they wait in the outbox for the
    #: replay, so a worker's memory does not grow with a backlog while the host is away.
    inbox_queue_limit = INBOX_QUEUE_LIMIT

    def inbox_init(self) -> None:
        self._inbox = self.inbox_queue()
        self._refusal: str | None = None
        self._inbox_error: Exception | None = None

    def inbox_queue(self) -> InboxQueue:
        """The queue a listener's own thread (a webhook's requests, a platform link's reader) fills with the
        messages it recorded; ``offer`` each."""
        return InboxQueue.of(self, self.inbox_queue_limit)

    def refused_failure(self, fallback: str):
        """The failure of a send the platform refused for the worker's credentials (``_refusal`` set): held until
        the listener has stopped the worker, so the host does not spend the delivery's retries against dead
        credentials meanwhile; it stays retryable and goes out once the operator fixed them."""
        from .worker import DeliveryFailed
        self.stopping.wait(self.refusal_hold_secs)
        return DeliveryFailed(self._refusal or fallback)

    def inbox_record(self, message) -> bool:
        """Record ``message`` in the outbox and queue it for the hub; False when it was taken before (the
        platform sent it again). Returns once it is written: the webhook may answer 2xx then."""
        from .outbox import PENDING
        row = self._outbox().inbound_record(message)
        if row.state != PENDING:
            return False
        if not self._inbox.offer(message):
            self.inbox_left(message)
        return True

    def inbox_left(self, message) -> None:
        """``message`` was recorded but not queued (the queue full): the replay submits it."""

    def listen(self, submit) -> None:
        InboxLanes(self, submit, max_lanes=self.inbox_lanes, name=f"{self.kind}-inbox").run(
            self._inbox, lambda: self._inbox_error)

    def listen_beside(self, submit, link, *, name: str, refusal: Callable[[Exception], str] = str) -> None:
        """``listen`` while ``link`` (an ``sdk.wslink.WebSocketLink`` whose ``handle`` records what it reads with
        ``inbox_record``) runs on a thread of its own, named ``name``: the link's ``LinkRefused`` is the worker's
        refusal (``refusal(exc)`` its reason: the plugin is disabled), any other failure ends the listener (the
        supervisor restarts the worker)."""
        from .wslink import start_link

        def refused(exc) -> None:
            self._refusal = refusal(exc)

        def failed(exc: Exception) -> None:
            self._inbox_error = exc
        reader = start_link(link, name=name, refused=refused, failed=failed)
        try:
            WebhookInbox.listen(self, submit)
        finally:
            reader.join(5)
