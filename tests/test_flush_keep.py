"""The tests' flush keeps the content types and permissions while they are as post_migrate made them
(tests/support/flush_keep.py), and is Django's own flush whenever they are not: in either case the flush
ends with every other table empty and exactly post_migrate's rows in those two."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.db.models.signals import post_migrate

from tests.support import flush_keep
from tests.support.flush_keep import flush_as_pytest_django_does

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def post_migrates(monkeypatch):
    """The post_migrate signals flushes send (counted without a receiver of the signal's own, which would
    make every flush Django's)."""
    from django.core.management import sql as management_sql
    sent = []
    real = management_sql.emit_post_migrate_signal

    def counted(*args, **kwargs):
        sent.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(management_sql, "emit_post_migrate_signal", counted)
    flush_keep.forget()
    flush_as_pytest_django_does()  # Django's own: records what post_migrate made
    sent.clear()
    return sent


def _tables_with_rows() -> set[str]:
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    with connection.cursor() as cur:
        left = set()
        for table in tables:
            cur.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            if cur.fetchone()[0]:
                left.add(table)
    return left


def _made() -> tuple:
    return (tuple(ContentType.objects.order_by("id").values_list("id", "app_label", "model")),
            tuple(Permission.objects.order_by("id").values_list("id", "codename", "content_type_id")))


def test_a_flush_with_them_untouched_empties_the_rest_and_sends_no_post_migrate(post_migrates):
    from channels_app.models import Actor, Caller
    before = _made()
    Actor.objects.create(key="web:alice", user_id="alice")
    flush_as_pytest_django_does()
    assert post_migrates == []
    assert _tables_with_rows() == {"django_content_type", "auth_permission"}
    assert _made() == before  # the same rows, the same ids
    assert ContentType.objects.get_for_model(Caller).model == "caller"


@pytest.mark.parametrize("change", ["add", "delete", "rename"])
def test_a_flush_after_a_test_changed_them_is_djangos_and_brings_post_migrates_rows_back(post_migrates, change):
    before = {(ct, codename) for _, codename, ct in _made()[1]}
    if change == "add":
        ct = ContentType.objects.get(app_label="auth", model="user")
        Permission.objects.create(codename="test_only", name="test only", content_type=ct)
    elif change == "delete":
        Permission.objects.filter(codename="view_user").delete()
    else:
        Permission.objects.filter(codename="view_user").update(codename="renamed")
    flush_as_pytest_django_does()
    assert post_migrates  # Django's flush ran post_migrate
    after = {(ct, codename) for _, codename, ct in _made()[1]}
    assert {codename for _, codename in after} == {codename for _, codename in before}
    assert not Permission.objects.filter(codename__in=["test_only", "renamed"]).exists()
    # and the next flush, with them as that post_migrate made them, keeps them
    post_migrates.clear()
    flush_as_pytest_django_does()
    assert post_migrates == []


def test_a_flush_that_resets_sequences_or_cascades_is_djangos(post_migrates):
    call_command("flush", verbosity=0, interactive=False, reset_sequences=True, inhibit_post_migrate=False)
    assert post_migrates
    post_migrates.clear()
    call_command("flush", verbosity=0, interactive=False, reset_sequences=False, allow_cascade=True,
                 inhibit_post_migrate=False)
    assert post_migrates


def test_with_a_receiver_of_post_migrate_besides_contenttypes_and_auth_every_flush_is_djangos(post_migrates):
    def another_apps_rows(**kwargs):
        pass
    post_migrate.connect(another_apps_rows)
    try:
        flush_as_pytest_django_does()
    finally:
        post_migrate.disconnect(another_apps_rows)
    assert post_migrates
