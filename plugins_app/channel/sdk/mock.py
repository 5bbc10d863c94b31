"""``MockBridge``: a fake host for testing a worker without the daemon.

It runs the real bridge server (``plugins_app.channel.bridge``, pure Python)
with an ``InMemoryHub`` on a real Unix socket in a private temp directory, on
a background event loop. A test points a worker at it (``bridge.env()`` gives
the worker's environment), queues deliveries, and inspects what the worker
submitted and acked. ``hold()`` makes the host stop answering a method, to
freeze a worker at an exact point (e.g. between deliver and ack) and kill it.

    with MockBridge(heartbeat_secs=0.05) as bridge:
        worker = MyWorker(**bridge.worker_kwargs(state_dir=tmp))
        ...
        bridge.queue_delivery("chat-1", "hi")
        bridge.wait_for(lambda: bridge.acks)
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

from plugins_app.channel.bridge import BridgeServer, InMemoryHub, ServerThread

from .jsonrpc import DEFAULT_MAX_FRAME_BYTES
from .messages import InboundMessage, Media
from .worker import PLUGIN_ID_ENV, SOCKET_ENV, TOKEN_ENV

DROP = "drop"    # the host never sees the call and never answers (a request lost before the host)
AFTER = "after"  # the host carries the call out and never answers (a response lost on the way back)


class _HoldingHub(InMemoryHub):
    """InMemoryHub whose submit and ack can be held (see ``MockBridge.hold``)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.holds: dict[str, str] = {}
        self.held: list[tuple[str, Any]] = []
        self._held_lock = threading.Lock()

    async def _hold(self, method: str, what: Any) -> None:
        with self._held_lock:
            self.held.append((method, what))
        await asyncio.Event().wait()  # until the connection closes and the call is cancelled

    async def submit_inbound(self, plugin_id: str, message: InboundMessage) -> dict:
        mode = self.holds.get("inbound.submit")
        if mode == DROP:
            await self._hold("inbound.submit", message)
        result = await super().submit_inbound(plugin_id, message)
        if mode == AFTER:
            await self._hold("inbound.submit", message)
        return result

    async def ack_outbound(self, plugin_id: str, delivery_id: str, status: str, retryable: bool,
                           reason: str | None, channel_message_id: str | None = None,
                           claim: str | None = None) -> dict:
        mode = self.holds.get("outbound.ack")
        if mode == DROP:
            await self._hold("outbound.ack", delivery_id)
        result = await super().ack_outbound(plugin_id, delivery_id, status, retryable, reason, channel_message_id,
                                            claim=claim)
        if mode == AFTER:
            await self._hold("outbound.ack", delivery_id)
        return result


class MockBridge:
    """An in-process fake host speaking the bridge protocol over a real Unix socket."""

    def __init__(self, plugin_id: str = "mock-plugin", *, token: str | None = None, max_in_flight: int = 64,
                 max_retries: int = 5, heartbeat_secs: float = 30.0, retry_backoff_secs: float = 0.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, allowed_senders: set[str] | None = None,
                 submit_rate: float = 0.0, submit_burst: int | None = None):
        self.plugin_id = plugin_id
        self.token = token or secrets.token_urlsafe(24)
        self._dir = tempfile.mkdtemp(prefix="ugent-mock-")  # 0700, and short enough for AF_UNIX paths
        self.socket_path = os.path.join(self._dir, "bridge.sock")
        self.hub = _HoldingHub(max_in_flight=max_in_flight, max_retries=max_retries, heartbeat_secs=heartbeat_secs,
                               retry_backoff_secs=retry_backoff_secs, allowed_senders=allowed_senders)
        self.server = BridgeServer(socket_path=self.socket_path, plugin_id=plugin_id, token=self.token,
                                   hub=self.hub, max_frame_bytes=max_frame_bytes, submit_rate=submit_rate,
                                   submit_burst=submit_burst)
        self._thread = ServerThread(self.server)
        self._started = False

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> "MockBridge":
        self._thread.start()
        self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._thread.stop()
            self._started = False
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "MockBridge":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def restart(self) -> None:
        """Close the socket and every connection, then listen again (a host restart, as a worker sees it)."""
        self._thread.run(self.server.close())
        self._thread.run(self.server.start())

    def env(self, **extra: str) -> dict[str, str]:
        """The environment the supervisor would give the worker."""
        return {SOCKET_ENV: self.socket_path, PLUGIN_ID_ENV: self.plugin_id, TOKEN_ENV: self.token, **extra}

    def worker_kwargs(self, **extra: Any) -> dict[str, Any]:
        """Constructor arguments for an in-process ``ChannelWorker`` aimed at this bridge."""
        return {"socket_path": self.socket_path, "plugin_id": self.plugin_id, "token": self.token,
                "install_signal_handlers": False, **extra}

    def rotate_token(self) -> str:
        """A new per-start token, as the supervisor issues for each worker start."""
        self.token = secrets.token_urlsafe(24)
        self.server.set_token(self.token)
        return self.token

    # -- driving the worker -----------------------------------------------------------

    def queue_delivery(self, conversation_id: str = "conv-1", text: str = "hello", **kwargs: Any) -> str:
        """Queue an outbound delivery for the worker to poll; returns its delivery id."""
        return self.hub.enqueue(conversation_id, text, **kwargs)

    def store_media(self, data: bytes, content_type: str, filename: str | None = None) -> str:
        return self.hub.store_media(data, content_type, filename)

    def media(self, media_id: str) -> Media | None:
        return self.hub.stored_media(media_id)

    def hold(self, method: str, mode: str = DROP) -> None:
        """Stop answering ``inbound.submit`` or ``outbound.ack``: DROP before, AFTER carrying it out."""
        if method not in ("inbound.submit", "outbound.ack") or mode not in (DROP, AFTER):
            raise ValueError("hold inbound.submit or outbound.ack, mode drop or after")
        self.hub.holds[method] = mode

    def release(self, method: str) -> None:
        """Answer ``method`` again from now on (calls already held stay unanswered)."""
        self.hub.holds.pop(method, None)

    # -- what happened ----------------------------------------------------------------

    @property
    def submits(self) -> list[InboundMessage]:
        """Inbound messages the host accepted, once each."""
        return list(self.hub.inbound)

    @property
    def submit_log(self) -> list[InboundMessage]:
        """Every inbound.submit that reached the host, repeats included."""
        return list(self.hub.submit_log)

    @property
    def acks(self) -> list[dict]:
        """Every outbound.ack that reached the host, repeats included."""
        return list(self.hub.ack_log)

    @property
    def held(self) -> list[tuple[str, Any]]:
        return list(self.hub.held)

    @property
    def hellos(self) -> list[dict]:
        return list(self.hub.hellos)

    @property
    def heartbeats(self) -> int:
        return self.hub.heartbeats

    def delivery(self, delivery_id: str) -> dict | None:
        return self.hub.delivery(delivery_id)

    def dead_letters(self) -> list[dict]:
        return self.hub.dead_letters()

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.01) -> Any:
        """Poll ``predicate`` until it is truthy; returns its value or raises ``TimeoutError``. (30 s by default: a
        worker process started on a loaded machine took over 5 s to get this far, and a wait that succeeds
        returns as soon as it does.)"""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"condition not met within {timeout} s")
            time.sleep(interval)
