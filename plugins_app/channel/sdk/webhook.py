"""An HTTP endpoint a chat platform calls (a webhook, a callback URL), for a worker that listens for one.

One home for what every such endpoint needs, whatever the platform: a thread of its own serving requests
(one thread each, at most ``max_connections`` at once: past that a connection waits in the listen backlog
until one ends, so a flood of connections costs no more memory than that many threads; and none lasts past
``connection_deadline``, so a client trickling bytes cannot hold a thread), a body read whole up to ``max_body_bytes`` (past it, or with a length that is no number,
the body is not read, the request's handler gets ``None`` and the connection is closed after the answer, so
the unread bytes are never taken for a next request), ``timeout`` seconds for a connection (a client that
stalls holds no thread), and answers as ``(status, body)``: a dict is sent as JSON, a str as UTF-8 text.

A worker's server subclasses it and answers in ``respond(method, target, headers, body)``: verify the
platform's signature before anything is recorded, and answer 2xx only once the message is in the outbox.

``WebhookInbox`` is the rest of such a worker: the webhook's threads record and queue, and its ``listen``
hands each chat's messages to a thread of that chat's (``ChatLanes``), so one chat's file downloading for
minutes holds back that chat's later messages only (the SDK's submits lock per chat, not per worker).
"""
from __future__ import annotations

import collections
import json
import logging
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("ugent.worker.webhook")


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
        cut.start()
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
                if self.headers.get("Content-Length", "0").strip() not in ("", "0"):
                    self.close_connection = True  # a GET's body is never read: it must not be taken for a request
                self._answer(*server.respond("GET", self.path, self.headers, b""))

            def do_POST(self):  # noqa: N802
                self._answer(*server.respond("POST", self.path, self.headers, self._body()))

            def _body(self) -> bytes | None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0 or length > server.max_body_bytes:
                    self.close_connection = True  # its body is never read: it must not be taken for the next request
                    return None
                return self.rfile.read(length)

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
    with a message under way, never as the chats seen."""

    def __init__(self, handle, *, max_lanes: int = 16, name: str = "chat"):
        self._handle = handle
        self._max = max(1, max_lanes)
        self._name = name
        self._cond = threading.Condition()
        self._lanes: dict[str, collections.deque] = {}

    def put(self, chat: str, item, *, stop: threading.Event | None = None) -> bool:
        """Queue ``item`` on ``chat``'s lane; False if ``stop`` was set while every lane was busy."""
        with self._cond:
            while chat not in self._lanes and len(self._lanes) >= self._max:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(0.2)
            lane = self._lanes.get(chat)
            if lane is not None:
                lane.append(item)
                return True
            self._lanes[chat] = collections.deque([item])
        threading.Thread(target=self._run, args=(chat,), name=f"{self._name}-lane", daemon=True).start()
        return True

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
                if not lane:
                    del self._lanes[chat]
                    self._cond.notify_all()
                    return
                item = lane.popleft()
            try:
                self._handle(item)
            except Exception:  # noqa: BLE001 - one item's failure must not end its chat's lane
                log.exception("%s: handling an item of chat %s failed", self._name, chat)


def submit_logged(worker, submit, message) -> None:
    """Submit one message a listener took from its inbox, on the message's chat's lane, and log what became
    of it. A ``ChannelRefused`` (a file's download refused) is kept in ``worker._refusal`` for the listener
    to raise; any other failure leaves the message owed in the outbox, for the replay."""
    from .worker import ChannelRefused
    try:
        result = submit(message)
    except ChannelRefused as exc:
        worker._refusal = worker._refusal or exc.reason
        return
    except Exception as exc:  # noqa: BLE001 - the lane goes on with its chat's next message
        worker.log.warning("submit of %s (%s) failed, left to the replay: %s: %s", message.message_id,
                           message.conversation_id, type(exc).__name__, exc)
        return
    worker.log.info("submitted %s (%s): accepted=%s duplicate=%s queued=%s reason=%s", message.message_id,
                    message.conversation_id, result.accepted, result.duplicate, result.queued, result.reason)


class WebhookInbox:
    """For a ``ChannelWorker`` whose platform calls it: the webhook's threads record each message durably (the
    outbox) and queue it (``inbox_record``), and ``listen`` submits the queue, each chat's in order. A refusal
    a worker finds on any thread (a token refused at a download or a send) is set in ``self._refusal``; the
    listener then raises ``ChannelRefused`` with it, which stops the worker and disables the plugin with the reason. Any
    other failure of a thread that feeds the inbox (a platform link's reader) is set in ``self._inbox_error``:
    the listener raises it, and the supervisor restarts the worker.

    Each chat's messages are submitted in a thread of that chat's (``ChatLanes``), in the order recorded; other
    chats go beside it, so a file one chat's message downloads for minutes does not hold them back.

    Mix it in before ``ChannelWorker`` and call ``inbox_init()`` in ``__init__``."""

    #: How long a send refused for the worker's credentials is held before it fails (``refused_failure``).
    refusal_hold_secs = 30.0
    #: Chats submitted at once, a thread each; a message of one more chat waits until one of them is done.
    inbox_lanes = 16

    def inbox_init(self) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self._refusal: str | None = None
        self._inbox_error: Exception | None = None

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
        self._inbox.put(message)
        return True

    def listen(self, submit) -> None:
        from .worker import ChannelRefused
        lanes = ChatLanes(lambda message: submit_logged(self, submit, message), max_lanes=self.inbox_lanes,
                          name=f"{self.kind}-inbox")
        while not self.stopping.is_set():
            if self._refusal:
                raise ChannelRefused(self._refusal)
            if self._inbox_error is not None:
                raise RuntimeError(f"{type(self._inbox_error).__name__}: {self._inbox_error}") from self._inbox_error
            try:
                message = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            # (not put while stopping: it stays owed in the outbox, and the flush at the stop sends it)
            lanes.put(message.conversation_id, message, stop=self.stopping)
        lanes.join()  # the submits in hand finish before the worker flushes and stops
        if self._refusal:  # (found by one of them meanwhile)
            raise ChannelRefused(self._refusal)
