"""Holes a review found: actor keys that collide, roles that are not exactly operator, an empty log after
pruning, accepted turns whose task was lost."""
from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from channels_app import runner, services, streams
from channels_app.errors import ApplicationError
from channels_app.models import Caller, Event, Turn

pytestmark = pytest.mark.django_db(transaction=True)


def test_federated_actor_keys_cannot_collide_across_issuers(tcast):
    a = Caller.objects.create(name="a", role="application", issuers=["https://idp.example.com"])
    b = Caller.objects.create(name="b", role="application", issuers=["https://idp.example.com:8443"])
    sneaky = services.actor_resolve(caller=a, federation_issuer="https://idp.example.com",
                                    federation_subject="8443:alice")
    alice = services.actor_resolve(caller=b, federation_issuer="https://idp.example.com:8443",
                                   federation_subject="alice")
    assert sneaky.pk != alice.pk and sneaky.key != alice.key


def test_a_role_that_is_not_exactly_operator_gets_the_application_rules(tcast):
    odd = Caller.objects.create(name="typo", role="applicaton", issuers=[])
    with pytest.raises(ApplicationError) as info:
        services.actor_resolve(caller=odd, user="alice")
    assert info.value.status == 403


def test_config_keys_with_an_unknown_role_or_the_reserved_name_are_refused(tmp_path, settings, monkeypatch):
    from ugent_common import config
    path = tmp_path / "ugent.toml"
    path.write_text('[[web.auth.keys]]\nname = "x"\nkey_env = "K_X"\nrole = "app"\n'
                    '[[web.auth.keys]]\nname = "default"\nkey_env = "K_D"\nrole = "operator"\n'
                    '[[web.auth.keys]]\nname = "ok"\nkey_env = "K_OK"\nrole = "application"\n')
    settings.UGENT_CONFIG = str(path)
    settings.UGENT_WEB_API_KEY = ""
    for k in ("K_X", "K_D", "K_OK"):
        monkeypatch.setenv(k, k.lower())
    config.reset_caches()
    try:
        assert [k.caller for k in config.configured_keys()] == ["ok"]
    finally:
        config.reset_caches()


def test_an_emptied_log_still_knows_how_far_it_went(tcast):
    import json

    from django.test import Client
    Client().post("/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                  content_type="application/json", HTTP_X_API_KEY=tcast.keys["operator"])
    last = Event.objects.order_by("-id").first().id
    Event.objects.update(created_at=timezone.now() - timedelta(days=30))
    assert streams.events_prune(older_than_seconds=60) > 0
    assert not Event.objects.exists()
    assert streams.log_head() == last  # so a cursor at the end is "pruned" at worst, never a loop of gaps


def test_an_accepted_turn_whose_task_was_lost_is_queued_again(tcast):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):  # the broker swallowed it
        result = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator,
                                                                         text="hello"))
    Turn.objects.filter(pk=result.turn.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    runner.turns_sweep_stale()  # eager Celery in tests: the re-queued task runs now
    assert Turn.objects.get(pk=result.turn.pk).state == "completed"
