"""The Celery brokers' transports: embedded mode's in-process one, and servers mode's Redis one.

Embedded mode: kombu's memory transport, woken instead of polled.

kombu's `memory://` transport has no file descriptor, so Celery's worker drains
it in a loop that sleeps `polling_interval` between empty looks. A short
interval costs a slice of a core while idle (about 10% of one at 2 ms, measured
with py-spy) and a long one delays every turn. This transport keeps the memory
transport's queues and semantics and replaces the sleep with a wait on a
condition that every publish, ack and reject signals, so the worker sleeps
until there is something to do and wakes at once when there is.

Selected in settings with `CELERY_BROKER_TRANSPORT = "ugent_site.broker:Transport"`.
Like `memory://`, messages live only in this process: embedded mode re-queues
accepted turns at start-up (channels_app.runner.turns_requeue_accepted).

Servers mode: kombu's Redis transport, with one client kept per channel.
kombu's `Channel.conn_or_acquire` builds a new `redis.Redis` for every
publish, every ack's bookkeeping and every restore, over the channel's one
connection pool; building one copies redis-py's response callbacks and costs
more CPU than the command it sends (about 150 us against a 120 us LPUSH on the
2-core VM). A `redis.Redis` over a pool is safe to share between threads:
each command takes a connection from the pool for its own duration, and a
pipeline is a new object each time. So `RedisTransport`'s channel makes its
client once per pool (a reconnect that replaces the pool makes a new one).
Selected in settings with `CELERY_BROKER_TRANSPORT = "ugent_site.broker:RedisTransport"`.
"""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from queue import Empty
from time import monotonic

from kombu.transport import memory
from kombu.transport import redis as kombu_redis

_changed = threading.Condition()
_generation = 0
#: Longest single wait; the worker loop passes its own timeout too (2 s in Celery's synloop).
MAX_WAIT_SECONDS = 1.0


def _signal() -> None:
    """Something a consumer may be waiting for happened: a message arrived or a slot freed."""
    global _generation
    with _changed:
        _generation += 1
        _changed.notify_all()


class Channel(memory.Channel):
    queues: dict = {}

    def _put(self, queue, message, **kwargs):
        super()._put(queue, message, **kwargs)
        _signal()

    def _put_fanout(self, exchange, message, routing_key=None, **kwargs):
        super()._put_fanout(exchange, message, routing_key, **kwargs)
        _signal()

    def basic_ack(self, delivery_tag, multiple=False):
        super().basic_ack(delivery_tag, multiple=multiple)
        _signal()  # prefetch was full: the consumer may take the next message now

    def basic_reject(self, delivery_tag, requeue=False):
        super().basic_reject(delivery_tag, requeue=requeue)
        _signal()


class Transport(memory.Transport):
    Channel = Channel
    global_state = memory.virtual.BrokerState()
    driver_name = "ugent-memory"

    def drain_events(self, connection, timeout=None):
        started = monotonic()
        while True:
            with _changed:
                seen = _generation
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                pass
            remaining = MAX_WAIT_SECONDS
            if timeout is not None:
                remaining = min(remaining, timeout - (monotonic() - started))
                if remaining <= 0:
                    raise socket.timeout()
            with _changed:
                # Only a change after `seen` was read can have made a message available.
                if _generation == seen:
                    _changed.wait(remaining)


class RedisChannel(kombu_redis.Channel):
    _kept_client = None

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client:
            yield client
            return
        pool = self.pool
        kept = self._kept_client
        if kept is None or kept.connection_pool is not pool:
            kept = self._kept_client = self._create_client()
        yield kept


class RedisTransport(kombu_redis.Transport):
    Channel = RedisChannel
