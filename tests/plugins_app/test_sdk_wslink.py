"""The worker SDK's outbound WebSocket link (plugins_app/channel/sdk/wslink.py), which Slack's Socket Mode and
DingTalk's Stream mode both run on: a gateway on loopback (``websockets``' own server) plays the platform."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
from websockets.sync.server import ServerConnection, serve

from plugins_app.channel.sdk.wslink import LinkRefused, WebSocketLink, start_link
from tests.plugins_app.conftest import wait_until

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


class Link(WebSocketLink):
    """A link to the loopback gateway: each frame kept; "disconnect" asks to move, "boom" raises."""

    name = "test link"

    def __init__(self, url: str, stopping: threading.Event):
        super().__init__(stopping)
        self.url = url
        self.frames: list = []

    def open_url(self) -> str:
        return self.url

    def handle(self, conn, raw) -> bool:
        self.frames.append(raw)
        if raw == "boom":
            raise ValueError("a frame the worker could not take")
        if raw == "refused":
            raise LinkRefused("the platform refused the token")
        return raw == "disconnect"


@contextmanager
def gateway(session):
    """A WebSocket server on loopback running ``session(conn, n)`` for the n-th connection (from 1)."""
    count = iter(range(1, 10_000))
    server = serve(lambda conn: session(conn, next(count)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}/"
    finally:
        server.shutdown()


def run(link: Link) -> threading.Thread:
    thread = threading.Thread(target=link.run, daemon=True)
    thread.start()
    return thread


def test_a_gateway_that_takes_the_handshake_and_closes_at_once_is_not_reconnected_in_a_hot_loop():
    """The delay is the link's: each reconnection after a drop waits it (with jitter) and doubles it, and
    nothing resets it while no frame arrives. Without that, the loop reconnected some 800 times in 3 s."""
    opened: list[int] = []

    def session(conn: ServerConnection, n: int) -> None:
        opened.append(n)
        conn.close()

    with gateway(session) as url:
        stopping = threading.Event()
        link = Link(url, stopping)
        thread = run(link)
        assert wait_until(lambda: len(opened) >= 2, 10)  # it does reconnect
        stopping.wait(2.5)  # then a couple of seconds of the gateway closing every connection at once
        count = len(opened)
        stopping.set()
        thread.join(5)
    # waits of 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6 s...: a handful of connections, not hundreds
    assert count <= 8, count
    assert link.frames == [] and link._delay > link.backoff_initial


def test_a_gateway_that_asks_every_connection_to_move_on_at_once_is_not_reconnected_without_a_wait():
    """A move the platform asks for opens the next connection at once, but not when the connection carried
    nothing first: that is a gateway in trouble, and the move waits the link's delay like a reconnection.
    Without that, every connection's drain (0.3 s) was the only pause: some 10 connections in 3 s."""
    opened: list[int] = []

    def session(conn: ServerConnection, n: int) -> None:
        opened.append(n)
        conn.send("disconnect")
        try:
            conn.recv()  # open until the link closes it
        except Exception:  # noqa: BLE001 - closed
            pass

    with gateway(session) as url:
        stopping = threading.Event()
        link = Link(url, stopping)
        thread = run(link)
        assert wait_until(lambda: len(opened) >= 2, 10)  # it does move on
        stopping.wait(3)
        count = len(opened)
        stopping.set()
        thread.join(5)
    assert count <= 7, count
    assert set(link.frames) == {"disconnect"} and link._delay > link.backoff_initial


def test_the_delay_goes_back_to_the_start_only_once_a_frame_arrived():
    def session(conn: ServerConnection, n: int) -> None:
        if n <= 3:
            conn.close()  # three connections closed at once: the delay grows
            return
        conn.send("hello")
        conn.recv()  # then kept open until the link closes it

    with gateway(session) as url:
        stopping = threading.Event()
        link = Link(url, stopping)
        thread = run(link)
        assert wait_until(lambda: link.connections_opened >= 3, 10)
        assert link._delay > link.backoff_initial  # nothing came through yet
        assert wait_until(lambda: link.frames == ["hello"], 10)
        assert wait_until(lambda: link._delay == link.backoff_initial, 5)
        stopping.set()
        thread.join(5)


def test_a_frame_that_raises_while_the_old_connection_drains_still_closes_it_and_the_new_one_is_the_links():
    sent = threading.Event()

    def session(conn: ServerConnection, n: int) -> None:
        if n == 1:
            conn.send("boom")  # waits on the old connection, read only when it drains
            sent.set()
        try:
            conn.recv()  # open until the link closes it
        except Exception:  # noqa: BLE001 - closed
            pass

    with gateway(session) as url:
        link = Link(url, threading.Event())
        old = link.conn = link._open()
        assert sent.wait(10)  # (so the old connection is the gateway's first: its handler numbered it first)
        with pytest.raises(ValueError):
            link._hand_over(old)
        new = link.conn
        assert new is not old and new.state.name == "OPEN"
        assert old.state.name == "CLOSED"
        assert link.frames == ["boom"] and link.connections_opened == 2
        new.close()


def test_start_link_hands_a_refusal_and_a_failure_to_the_worker():
    def session(conn: ServerConnection, n: int) -> None:
        conn.send("refused" if n == 1 else "boom")
        try:
            conn.recv()
        except Exception:  # noqa: BLE001 - closed
            pass

    with gateway(session) as url:
        for expected in (LinkRefused, ValueError):
            refusals, failures = [], []
            thread = start_link(Link(url, threading.Event()), name="test-link", refused=refusals.append,
                                failed=failures.append)
            thread.join(10)
            assert not thread.is_alive()
            got = refusals if expected is LinkRefused else failures
            assert [type(e) for e in refusals + failures] == [expected] and got
