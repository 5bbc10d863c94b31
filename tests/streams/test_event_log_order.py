"""The cursor is commit-ordered: "everything after cursor N" never skips an event that commits late.

Proved on PostgreSQL, where ids are handed out before commit (SQLite serialises writers anyway).
"""
from __future__ import annotations

import random
import threading
import time

import pytest
from django.db import connection, transaction

from channels_app import streams
from channels_app.events import events_append
from channels_app.models import Conversation, Event

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("not __import__('os').environ.get('DATABASE_URL', '').startswith('postgres')",
                                 reason="commit order under concurrent writers is a PostgreSQL property")]


def _operator_sub(tcast):
    viewer = streams.viewer_resolve(caller=tcast.operator)
    return streams.subscription_open(viewer=viewer, raw_cursor="0")


def _conv(tcast):
    from channels_app.services import actor_resolve
    actor = actor_resolve(caller=tcast.operator, user="alice")
    return Conversation.objects.create(external_id="c-order", owner=actor)


def _append(conv_pk, n=1):
    events_append(conversation_id=conv_pk, turn_pk=None, items=[("ugent.test", {"n": i}, []) for i in range(n)])


def test_a_later_writer_waits_for_an_earlier_uncommitted_one_so_no_reader_skips_it(tcast):
    conv = _conv(tcast)
    holding, release, second_done = threading.Event(), threading.Event(), threading.Event()

    def first():
        with transaction.atomic():
            _append(conv.pk)
            holding.set()
            release.wait(10)
        connection.close()

    def second():
        holding.wait(10)
        _append(conv.pk)
        second_done.set()
        connection.close()
    t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
    t1.start(), t2.start()
    holding.wait(10)
    sub = _operator_sub(tcast)
    assert not second_done.wait(0.5), "the second append committed while the first was open"
    frames, _ = streams.subscription_read(sub)
    assert frames == []  # nothing is visible while the earlier event is uncommitted
    release.set()
    t1.join(10), t2.join(10)
    frames, _ = streams.subscription_read(sub)
    assert len(frames) == 2 and sub.cursor == Event.objects.order_by("-id").first().id


def test_a_reader_polling_beside_many_writers_sees_every_event_in_commit_order(tcast):
    conv = _conv(tcast)
    stop = threading.Event()
    seen: list[int] = []

    def writer(seed):
        rnd = random.Random(seed)
        for _ in range(15):
            with transaction.atomic():
                _append(conv.pk, rnd.randint(1, 3))
                time.sleep(rnd.random() * 0.004)  # commit late
        connection.close()

    def reader():
        sub = _operator_sub(tcast)
        while True:
            last = stop.is_set()
            frames, _ = streams.subscription_read(sub)
            seen.extend(int(f.split(b"\n", 1)[0][4:]) for f in frames)
            if last:
                break
        connection.close()
    r = threading.Thread(target=reader)
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    r.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    stop.set()
    r.join(60)
    everything = list(Event.objects.order_by("id").values_list("id", flat=True))
    assert seen == everything and len(everything) > 8 * 15
