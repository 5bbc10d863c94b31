"""ApiKey.last_used_at: written when a key is used, at most once a minute per key, off the request."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from channels_app import auth
from channels_app.models import ApiKey
from tests.conftest import APP_KEY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_process_clock():
    auth._key_marked.clear()
    yield
    auth.key_use_flush()
    auth._key_marked.clear()


def use(key: str = APP_KEY) -> None:
    assert Client().get("/v1/models", HTTP_X_API_KEY=key).status_code == 200
    auth.key_use_flush()


def stored(cast) -> object:
    return ApiKey.objects.get(caller=cast.app).last_used_at


def test_a_keys_use_is_recorded(tcast):
    assert stored(tcast) is None
    before = timezone.now()
    use()
    assert stored(tcast) is not None and stored(tcast) >= before


def test_within_a_minute_this_process_does_not_write_again(tcast):
    use()
    old = timezone.now() - timedelta(minutes=10)
    ApiKey.objects.filter(caller=tcast.app).update(last_used_at=old)
    use()
    assert stored(tcast) == old  # no write was even tried: the in-process clock held it back
    auth._key_marked[ApiKey.objects.get(caller=tcast.app).pk] -= auth.KEY_USE_EVERY_SECS + 1  # a minute on
    use()
    assert stored(tcast) > old


def test_another_process_within_the_minute_leaves_the_stored_time(tcast):
    use()
    first = stored(tcast)
    auth._key_marked.clear()  # a second process, which has not written for this key yet
    use()
    assert stored(tcast) == first  # the conditional UPDATE found it fresh


def test_a_refused_key_records_nothing(tcast):
    assert Client().get("/v1/models", HTTP_X_API_KEY="ugk_not_a_key").status_code == 401
    auth.key_use_flush()
    assert not ApiKey.objects.filter(last_used_at__isnull=False).exists()
