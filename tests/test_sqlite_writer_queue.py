"""Embedded mode's SQLite writers queue in arrival order in the process (ugent_site/db/base.py)."""
from __future__ import annotations

import os
import threading
import time

import pytest
from django.db import OperationalError, connection, connections, transaction

from ugent_site.db.base import WriterQueue, writer_queue

embedded_only = pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")),
                                   reason="the writer queue is the SQLite backend's (embedded mode)")


def test_the_queue_hands_the_lock_over_in_arrival_order():
    q = WriterQueue()
    assert q.acquire(1)
    order, threads = [], []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (q.acquire(5), order.append(i), q.release()))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while q.waiting < i + 1 and time.monotonic() < deadline:  # each waiter in line before the next comes
            time.sleep(0.001)
    q.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]
    assert q.acquire(0.01)  # free again


def test_a_waiter_that_gives_up_leaves_no_hole_in_the_line():
    q = WriterQueue()
    assert q.acquire(1)
    assert q.acquire(0.05) is False
    assert q.waiting == 0
    got = []
    t = threading.Thread(target=lambda: got.append(q.acquire(5)))
    t.start()
    while q.waiting < 1:
        time.sleep(0.001)
    q.release()
    t.join(5)
    assert got == [True]


@embedded_only
@pytest.mark.django_db(transaction=True)
def test_concurrent_write_transactions_all_commit_and_release_the_line():
    from channels_app.models import Caller
    assert connections["default"].__class__.__module__ == "ugent_site.db.base"
    caller = Caller.objects.create(name="counter")
    errors, n_threads, per_thread = [], 8, 15

    def work():
        try:
            for i in range(per_thread):
                with transaction.atomic():
                    c = Caller.objects.get(pk=caller.pk)
                    c.name = f"counter-{int(c.name.rsplit('-', 1)[-1]) + 1 if '-' in c.name else 1}"
                    c.save(update_fields=["name"])
                if i % 5 == 0:  # a transaction that fails gives its turn back too
                    try:
                        with transaction.atomic():
                            Caller.objects.filter(pk=caller.pk).update(name=Caller.objects.get(pk=caller.pk).name)
                            raise ValueError("rolled back")
                    except ValueError:
                        pass
        except Exception as exc:  # pragma: no cover - the failure the test is for
            errors.append(repr(exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    # every read-modify-write saw the one before it: the transactions ran one at a time
    assert Caller.objects.get(pk=caller.pk).name == f"counter-{n_threads * per_thread}"
    q = writer_queue(connection.settings_dict["NAME"])
    assert q.waiting == 0 and q.acquire(0.01)
    q.release()


@embedded_only
@pytest.mark.django_db(transaction=True)
def test_a_writer_that_waits_past_the_busy_timeout_fails_as_sqlite_would(settings):
    q = writer_queue(connection.settings_dict["NAME"])
    assert q.acquire(1)  # another writer holds the line
    opts = connection.settings_dict.setdefault("OPTIONS", {})
    old = opts.get("timeout")
    opts["timeout"] = 0.05
    try:
        with pytest.raises(OperationalError, match="database is locked"):
            with transaction.atomic():
                pass
        assert not connection.in_atomic_block
    finally:
        opts["timeout"] = old
        q.release()
    with transaction.atomic():  # and the line works again
        pass
