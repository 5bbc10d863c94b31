"""ugent_site.broker: kombu's memory transport, woken by publishes and acks instead of polled.

Where a wake-up matters, one wait may last the whole drain timeout (MAX_WAIT_SECONDS is raised) and
the broker's condition is watched: the tests check that the consumer waited on it, that a publish, ack
or reject ended the wait (not its timeout) and what arrived, never how long anything took.
"""
from __future__ import annotations

import socket
import threading
import uuid

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from ugent_site import broker

TRANSPORT = "ugent_site.broker:Transport"


class _SpyCondition(threading.Condition):
    """The broker's condition, noting when a consumer starts waiting and how each wait ended."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()
        self.notified: list[bool] = []  # per wait: True when a signal ended it, False on its timeout

    def wait(self, timeout=None):
        self.waiting.set()  # still holding the lock: a signal can only come once the wait has begun
        woken = super().wait(timeout)
        self.notified.append(woken)
        return woken

    def reset(self):
        self.waiting.clear()
        self.notified.clear()


@pytest.fixture
def long_waits(monkeypatch):
    """One wait may last the whole drain timeout, so only a signal can end it early; the condition is
    watched, so a test can act once the consumer waits and see that a signal (not a timeout) woke it."""
    monkeypatch.setattr(broker, "MAX_WAIT_SECONDS", 60.0)
    spy = _SpyCondition()
    monkeypatch.setattr(broker, "_changed", spy)
    return spy


@pytest.fixture
def names():
    tag = uuid.uuid4().hex
    return {"exchange": f"ex-{tag}", "queue": f"q-{tag}", "key": f"rk-{tag}"}


@pytest.fixture
def conn():
    c = Connection(transport=TRANSPORT)
    yield c
    c.release()


def _queue(names) -> Queue:
    return Queue(names["queue"], Exchange(names["exchange"], type="direct"), routing_key=names["key"])


def _publisher(names):
    """A publish function on its own connection, as Celery's producer and worker have theirs."""
    c = Connection(transport=TRANSPORT)
    producer = Producer(c.channel(), exchange=Exchange(names["exchange"], type="direct"))

    def publish(body):
        producer.publish(body, routing_key=names["key"], serializer="json", declare=[_queue(names)])

    return c, publish


def _run(fn, limit: float = 20.0):
    """Run fn in a thread; its result or exception. A call that never returns fails the test."""
    out = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "the call never returned"
    return out


def _when_waiting(spy: _SpyCondition, action, limit: float = 5.0):
    """In another thread: once a consumer waits on the broker's condition (or after `limit`), do `action`.

    The returned event is set when the action ran; its `waited` is set if the consumer was seen waiting
    on the condition (a transport that polled with sleeps never is)."""
    done = threading.Event()
    done.waited = threading.Event()

    def target():
        if spy.waiting.wait(limit):
            done.waited.set()
        try:
            action()
        finally:
            done.set()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, done


def test_the_transport_is_kombus_memory_transport_with_its_own_channel(conn):
    from kombu.transport import memory
    assert isinstance(conn.transport, broker.Transport)
    assert isinstance(conn.transport, memory.Transport)
    assert isinstance(conn.default_channel, broker.Channel)


def test_a_message_published_while_the_consumer_waits_is_delivered(conn, names, long_waits):
    got = []
    pub_conn, publish = _publisher(names)
    try:
        with Consumer(conn, queues=[_queue(names)], accept=["json"],
                      callbacks=[lambda body, message: (got.append(body), message.ack())]):
            thread, published = _when_waiting(long_waits, lambda: publish({"n": 1}))
            conn.drain_events(timeout=5)  # socket.timeout here means the publish did not wake it
            thread.join(10)
            assert published.is_set() and published.waited.is_set()
            assert got == [{"n": 1}]
            # The publish woke the waiting consumer; it did not sit out its wait.
            assert long_waits.notified and long_waits.notified[-1] is True
    finally:
        pub_conn.release()


def test_drain_with_nothing_published_times_out(conn, names):
    got = []
    with Consumer(conn, queues=[_queue(names)], accept=["json"], callbacks=[lambda b, m: got.append(b)]):
        out = _run(lambda: conn.drain_events(timeout=0.2))
        assert isinstance(out.get("error"), socket.timeout), out
        assert got == []


def test_drain_times_out_even_when_one_wait_could_be_longer(conn, names, long_waits):
    with Consumer(conn, queues=[_queue(names)], accept=["json"], callbacks=[lambda b, m: None]):
        out = _run(lambda: conn.drain_events(timeout=0.3))
        assert isinstance(out.get("error"), socket.timeout), out


def test_messages_published_before_draining_arrive_in_order(conn, names):
    pub_conn, publish = _publisher(names)
    try:
        for i in range(6):
            publish({"n": i})
        got = []
        with Consumer(conn, queues=[_queue(names)], accept=["json"],
                      callbacks=[lambda body, message: (got.append(body["n"]), message.ack())]):
            for _ in range(6):
                conn.drain_events(timeout=5)
            assert got == list(range(6))
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.2)
    finally:
        pub_conn.release()


def test_only_the_consumed_queue_is_delivered(conn, names, long_waits):
    other = {"exchange": names["exchange"], "queue": names["queue"] + "-other", "key": names["key"] + "-other"}
    other_conn, publish_other = _publisher(other)
    pub_conn, publish = _publisher(names)
    try:
        got = []
        with Consumer(conn, queues=[_queue(names)], accept=["json"],
                      callbacks=[lambda body, message: (got.append(body), message.ack())]):
            publish_other({"to": "other"})
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)
            publish({"to": "mine"})
            conn.drain_events(timeout=5)
            assert got == [{"to": "mine"}]
    finally:
        pub_conn.release()
        other_conn.release()


@pytest.mark.parametrize("how", ["consumer", "basic_qos"])
def test_an_ack_with_prefetch_full_lets_the_next_message_in(conn, names, long_waits, how):
    pub_conn, publish = _publisher(names)
    try:
        publish({"n": 1})
        publish({"n": 2})
        held = []
        kwargs = {"prefetch_count": 1} if how == "consumer" else {}
        with Consumer(conn, queues=[_queue(names)], accept=["json"],
                      callbacks=[lambda body, message: held.append((body, message))], **kwargs) as consumer:
            if how == "basic_qos":
                consumer.channel.basic_qos(0, 1, False)  # prefetch_size, prefetch_count, global
            conn.drain_events(timeout=5)
            assert [b for b, _ in held] == [{"n": 1}]
            # The window is full: the second message waits for the ack.
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)
            assert len(held) == 1
            # The ack lands while the consumer waits; it must wake it.
            long_waits.reset()
            thread, acked = _when_waiting(long_waits, held[0][1].ack)
            conn.drain_events(timeout=5)
            thread.join(10)
            assert acked.is_set() and acked.waited.is_set()
            assert [b for b, _ in held] == [{"n": 1}, {"n": 2}]
            assert long_waits.notified and long_waits.notified[-1] is True
    finally:
        pub_conn.release()


@pytest.mark.parametrize("requeue", [False, True])
def test_a_reject_while_waiting_lets_the_next_message_in(conn, names, long_waits, requeue):
    pub_conn, publish = _publisher(names)
    try:
        publish({"n": 1})
        publish({"n": 2})
        held = []
        with Consumer(conn, queues=[_queue(names)], accept=["json"], prefetch_count=1,
                      callbacks=[lambda body, message: held.append((body, message))]):
            conn.drain_events(timeout=5)
            assert [b for b, _ in held] == [{"n": 1}]
            long_waits.reset()
            thread, rejected = _when_waiting(long_waits, lambda: held[0][1].reject(requeue=requeue))
            conn.drain_events(timeout=5)
            thread.join(10)
            assert rejected.is_set() and rejected.waited.is_set()
            assert long_waits.notified and long_waits.notified[-1] is True
            assert len(held) == 2
            held[1][1].ack()
            if requeue:  # the rejected message comes round again
                conn.drain_events(timeout=5)
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)
        assert [b["n"] for b, _ in held] == ([1, 2, 1] if requeue else [1, 2])
    finally:
        pub_conn.release()


def test_embedded_settings_select_this_transport():
    from django.conf import settings
    if settings.REDIS_URL:
        pytest.skip("servers mode: Celery uses Redis")
    from ugent_site.celery import app
    c = app.connection_for_write()
    try:
        assert isinstance(c.transport, broker.Transport)
    finally:
        c.release()


# --- servers mode: kombu's Redis transport, one client kept per channel ------------------------

def _redis_connection():
    from django.conf import settings
    if not settings.REDIS_URL:
        pytest.skip("embedded mode: Celery uses the in-process broker")
    from ugent_site.celery import app
    return app.connection_for_write()


def test_servers_settings_select_the_redis_transport():
    c = _redis_connection()
    try:
        assert isinstance(c.transport, broker.RedisTransport)
        assert isinstance(c.default_channel, broker.RedisChannel)
    finally:
        c.release()


def test_publishes_and_acks_share_one_client_and_lose_nothing(names, monkeypatch):
    """kombu's own channel builds a redis.Redis per publish and per ack's bookkeeping; this one builds
    one. Every message still arrives once, in order, and its ack clears the unacked bookkeeping."""
    c = _redis_connection()
    made = []
    real = broker.RedisChannel._create_client

    def counting(self, asynchronous=False):
        client = real(self, asynchronous=asynchronous)
        if not asynchronous:
            made.append((self, client))
        return client

    monkeypatch.setattr(broker.RedisChannel, "_create_client", counting)
    got, tags = [], []
    try:
        channel = c.channel()
        producer = Producer(channel, exchange=Exchange(names["exchange"], type="direct"))
        for n in range(50):
            producer.publish({"n": n}, routing_key=names["key"], serializer="json",
                             declare=[_queue(names)])
        with Consumer(c, queues=[_queue(names)], accept=["json"],
                      callbacks=[lambda body, message: (got.append(body["n"]), tags.append(message.delivery_tag),
                                                        message.ack())]):
            while len(got) < 50:
                c.drain_events(timeout=5)
        assert got == list(range(50))
        # The publishing channel and the consuming one made one client each, whatever the traffic.
        assert sorted(id(ch) for ch, _ in made) == sorted([id(channel), id(c.default_channel)])
        qos = c.default_channel.qos
        with c.default_channel.conn_or_acquire() as client:
            assert any(client is kept for _, kept in made)
            # the unacked bookkeeping is one hash per Redis database, shared with every other queue there:
            # none of this test's deliveries is left in it
            assert client.hmget(qos.unacked_key, tags) == [None] * 50
            assert [client.zscore(qos.unacked_index_key, t) for t in tags] == [None] * 50
            assert client.llen(names["queue"]) == 0
        channel.close()
    finally:
        with c.default_channel.conn_or_acquire() as client:
            client.delete(names["queue"])
        c.release()


def test_a_replaced_pool_gets_a_new_client(names):
    """After a fork or a failed connect kombu drops the channel's pools; the kept client goes with them."""
    c = _redis_connection()
    try:
        channel = c.default_channel
        with channel.conn_or_acquire() as first:
            pass
        channel._disconnect_pools()
        with channel.conn_or_acquire() as second:
            assert second is not first
            assert second.connection_pool is channel.pool
            assert second.rpush(names["queue"], "x") == 1
            second.delete(names["queue"])
    finally:
        c.release()


def test_the_kept_client_serves_several_threads_at_once(names):
    c = _redis_connection()
    try:
        channel = c.default_channel
        key = names["queue"]
        barrier = threading.Barrier(4)

        def push(t):
            barrier.wait(5)
            for n in range(200):
                with channel.conn_or_acquire() as client:
                    client.rpush(key, f"{t}:{n}")

        threads = [threading.Thread(target=push, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        with channel.conn_or_acquire() as client:
            items = [v.decode() for v in client.lrange(key, 0, -1)]
            client.delete(key)
        assert sorted(items) == sorted(f"{t}:{n}" for t in range(4) for n in range(200))
        for t in range(4):  # each thread's own pushes stay in its order
            assert [i for i in items if i.startswith(f"{t}:")] == [f"{t}:{n}" for n in range(200)]
    finally:
        c.release()
