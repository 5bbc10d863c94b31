"""Both backends' connections let go of the error that spoiled an atomic block once it is rolled back
(ugent_site/db/rollback.py): Django's own kept it for the thread's life, and with it every frame of
the work that raised it. Runs on SQLite and, with DATABASE_URL set, on PostgreSQL."""
from __future__ import annotations

import gc
import weakref

import pytest
from django.db import IntegrityError, connection, transaction

from channels_app.models import Caller

pytestmark = pytest.mark.django_db(transaction=True)


class Held:
    """Something the work that lost the race had in hand (a request, a subscription)."""


def lose_a_get_or_create_race(name: str):
    """What get_or_create does when the row appeared between its get and its create: the create's block
    is rolled back, and the row the other request made is read after it, on the same connection."""
    held = Held()  # a local of the frame that catches the error: its traceback keeps it, as it kept a request
    try:
        with transaction.atomic():
            Caller.objects.create(name=name)  # the other request created it first
    except IntegrityError:
        Caller.objects.get(name=name)
    else:
        pytest.fail("the create did not lose the race")
    return weakref.ref(held)


def test_the_backend_is_the_projects():
    from django.db import connections
    assert type(connections["default"]).__module__ in ("ugent_site.db.base", "ugent_site.db.postgresql.base")


def test_get_or_create_that_lost_the_race_keeps_neither_its_error_nor_what_its_frames_held():
    Caller.objects.create(name="raced")
    held = lose_a_get_or_create_race("raced")
    gc.collect()
    assert connection.rollback_exc is None
    assert held() is None, [type(r).__name__ for r in gc.get_referrers(held())]


def test_inside_the_spoiled_block_the_error_is_still_named():
    """What Django keeps it for: a statement after the error, in the same block, names its cause."""
    from django.db.transaction import TransactionManagementError
    Caller.objects.create(name="spoiled")
    with transaction.atomic():
        with pytest.raises(IntegrityError):
            Caller.objects.create(name="spoiled")  # no savepoint of its own: the outer block is spoiled
        assert connection.needs_rollback
        assert isinstance(connection.rollback_exc, IntegrityError)
        with pytest.raises(TransactionManagementError) as caught:
            Caller.objects.count()
        assert isinstance(caught.value.__cause__, IntegrityError)
    assert connection.rollback_exc is None
