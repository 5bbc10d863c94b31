"""A turn row locked for a state change must not block an event append for that turn (PostgreSQL).

An append holds the log's advisory lock while its foreign keys take KEY SHARE on the turn row. A
stop or completion that locked the turn FOR UPDATE and then appended deadlocked with it.
"""
from __future__ import annotations

import threading
from unittest import mock

import pytest
from django.db import connection, transaction

from channels_app import services
from channels_app.events import event_append
from channels_app.models import Event, Turn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row-lock modes are a PostgreSQL property")
def test_an_append_goes_through_while_the_turn_row_is_locked_for_a_state_change(tcast):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        turn = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                       text="hi")).turn
    locked, appended = threading.Event(), threading.Event()

    def appender():
        from django.db import connection as conn
        locked.wait(5)
        try:
            event_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, type="turn.delta",
                         data={"segment": "answer", "text": "x"})
            appended.set()
        finally:
            conn.close()

    t = threading.Thread(target=appender)
    t.start()
    with transaction.atomic():
        Turn.objects.select_for_update(no_key=True).filter(pk=turn.pk).values_list("pk", flat=True).first()
        locked.set()
        # With FOR UPDATE here the append would wait for this transaction, and this one (appending
        # next, under the log lock the appender holds) for it.
        assert appended.wait(5), "the append was blocked by the turn's row lock"
        event_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, type="turn.stop_requested", data={})
    t.join(5)
    assert Event.objects.filter(turn=turn, type__in=["turn.delta", "turn.stop_requested"]).count() == 2
