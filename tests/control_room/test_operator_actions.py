"""Operator actions in the admin, through Django's test client: each calls a service and says what it did."""
from __future__ import annotations

import json

import pytest
from django.contrib.messages import get_messages
from django.test import Client

from tests.control_room.test_health_board import _turn

pytestmark = pytest.mark.django_db(transaction=True)


def said(resp) -> str:
    return " | ".join(str(m) for m in get_messages(resp.wsgi_request))


def act(client, model: str, action: str, pks) -> object:
    return client.post(f"/admin/{model}/", {"action": action, "_selected_action": [str(p) for p in pks]},
                       follow=True)


@pytest.fixture
def accounts(django_user_model):
    """The operator (a superuser), a staff account that may only look, and an account with no admin access."""
    from django.contrib.auth.models import Permission
    root = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    outsider = django_user_model.objects.create_user("someone", password="pw")
    clients = {}
    for name, user in (("operator", root), ("viewer", viewer), ("outsider", outsider)):
        clients[name] = Client()
        clients[name].force_login(user)
    return clients


# --- turns ------------------------------------------------------------------------------------

def test_the_stop_action_asks_a_running_turn_to_stop_and_records_the_admin_account(tcast, accounts):
    from channels_app.models import Event, Turn
    turn = _turn(tcast, "running", "t-stop-1")
    resp = act(accounts["operator"], "channels_app/turn", "stop", [turn.pk])
    assert "Asked 1 turn(s) to stop (by admin:ops)" in said(resp)
    turn.refresh_from_db()
    assert turn.cancel_requested and turn.stop_requested_by == "admin:ops"
    event = Event.objects.get(turn=turn, type="turn.stop_requested")
    assert event.data == {"turn_id": "t-stop-1", "by": "admin:ops"}
    # asked again: nothing more is written, and the admin is told who asked first
    again = act(accounts["operator"], "channels_app/turn", "stop", [turn.pk])
    assert "already stopping (asked by admin:ops)" in said(again)
    assert Event.objects.filter(turn=turn, type="turn.stop_requested").count() == 1
    assert Turn.objects.get(pk=turn.pk).stop_requested_by == "admin:ops"


def test_stopping_an_ended_turn_changes_nothing_and_says_so(tcast, accounts):
    from channels_app.models import Event
    turn = _turn(tcast, "completed", "t-done-2")
    resp = act(accounts["operator"], "channels_app/turn", "stop", [turn.pk])
    assert "has ended (completed): there is nothing to stop" in said(resp)
    turn.refresh_from_db()
    assert not turn.cancel_requested and turn.stop_requested_by == ""
    assert not Event.objects.filter(turn=turn).exists()


def test_the_stop_button_on_a_running_turns_page_stops_it(tcast, accounts):
    turn = _turn(tcast, "running", "t-button")
    page = accounts["operator"].get(f"/admin/channels_app/turn/{turn.pk}/change/").content.decode()
    assert 'id="turn-stop"' in page
    assert accounts["operator"].get(f"/admin/channels_app/turn/{turn.pk}/stop/").status_code == 405
    resp = accounts["operator"].post(f"/admin/channels_app/turn/{turn.pk}/stop/", follow=True)
    assert "Asked turn t-button to stop (by admin:ops)" in said(resp)
    turn.refresh_from_db()
    assert turn.cancel_requested and turn.stop_requested_by == "admin:ops"
    assert 'id="turn-stop"' not in resp.content.decode() and "Stop asked by admin:ops" in resp.content.decode()


def test_the_stop_button_for_an_id_that_is_no_turn_is_a_404_and_tells_the_unpermitted_nothing(tcast, accounts):
    for object_id in ("abc", "999999", "1%2F2"):
        assert accounts["operator"].post(f"/admin/channels_app/turn/{object_id}/stop/").status_code == 404
    turn = _turn(tcast, "running", "t-ids")
    # an account that may not stop gets the same answer for a turn that is and one that is not
    for object_id in (turn.pk, "999999", "abc"):
        resp = accounts["viewer"].post(f"/admin/channels_app/turn/{object_id}/stop/")
        assert resp.status_code == 302 and resp["Location"] == "/admin/channels_app/turn/"
    turn.refresh_from_db()
    assert not turn.cancel_requested


@pytest.mark.parametrize("who", ["viewer", "outsider"])
def test_only_an_operator_account_may_stop_a_turn(tcast, accounts, who):
    turn = _turn(tcast, "running", f"t-{who}")
    client = accounts[who]
    client.post(f"/admin/channels_app/turn/{turn.pk}/stop/")
    client.post("/admin/channels_app/turn/", {"action": "stop", "_selected_action": [turn.pk]})
    turn.refresh_from_db()
    assert not turn.cancel_requested and turn.stop_requested_by == ""
    if who == "viewer":  # sees the turn, is offered no stop
        page = client.get(f"/admin/channels_app/turn/{turn.pk}/change/").content.decode()
        assert "t-viewer" in page and 'id="turn-stop"' not in page
        assert 'value="stop"' not in client.get("/admin/channels_app/turn/").content.decode()
    else:
        assert client.get("/admin/channels_app/turn/").status_code == 302


@pytest.mark.parametrize("model", ["turn", "receipt", "message", "event"])
def test_records_are_read_only_in_the_admin(tcast, accounts, model):
    from channels_app.models import Event, Message, Receipt, Turn
    turn = _turn(tcast, "completed", f"t-ro-{model}")
    Message.objects.create(conversation=turn.conversation, role="user", content="hello", turn=turn)
    Event.objects.create(conversation=turn.conversation, turn=turn, type="turn.completed", data={})
    row = {"turn": Turn, "receipt": Receipt, "message": Message, "event": Event}[model].objects.order_by("-pk").first()
    client = accounts["operator"]
    page = client.get(f"/admin/channels_app/{model}/{row.pk}/change/")
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()
    assert client.post(f"/admin/channels_app/{model}/{row.pk}/change/", {"state": "failed"}).status_code == 403
    assert client.get(f"/admin/channels_app/{model}/add/").status_code == 403
    assert client.post(f"/admin/channels_app/{model}/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert type(row).objects.filter(pk=row.pk).exists()


# --- keys ------------------------------------------------------------------------------------

def _models(key):
    return Client().get("/v1/models", HTTP_X_API_KEY=key).status_code


def test_revoking_a_key_refuses_it_at_once(tcast, accounts):
    from channels_app.models import ApiKey
    key = ApiKey.objects.get(caller__name="crm")
    assert _models(tcast.keys["app"]) == 200
    resp = act(accounts["operator"], "channels_app/apikey", "revoke", [key.pk])
    assert f"Revoked 1 key(s): {key}" in said(resp)
    assert _models(tcast.keys["app"]) == 401
    again = act(accounts["operator"], "channels_app/apikey", "revoke", [key.pk])
    assert "Revoked 0 key(s); 1 already revoked" in said(again)


def test_rotating_a_key_shows_the_new_one_once_and_revokes_the_old(tcast, accounts):
    from channels_app.models import ApiKey
    key = ApiKey.objects.get(caller__name="crm")
    resp = act(accounts["operator"], "channels_app/apikey", "rotate", [key.pk])
    text = said(resp)
    raw = text.split("not shown again): ")[1].split(" ")[0]
    assert raw.startswith("ugk_") and raw != tcast.keys["app"]
    assert _models(tcast.keys["app"]) == 401 and _models(raw) == 200
    new = ApiKey.objects.get(caller__name="crm", active=True)
    assert new.label == (key.label or "rotated in the admin") and new.prefix == raw[:8]
    assert raw not in accounts["operator"].get(f"/admin/channels_app/apikey/{new.pk}/change/").content.decode()
    # a revoked key cannot be rotated: nothing new is issued
    again = act(accounts["operator"], "channels_app/apikey", "rotate", [key.pk])
    assert "is revoked: nothing to rotate" in said(again)
    assert ApiKey.objects.filter(caller__name="crm").count() == 2


@pytest.mark.parametrize("who", ["viewer", "outsider"])
def test_only_an_operator_account_may_revoke_or_rotate(tcast, accounts, who):
    from channels_app.models import ApiKey
    key = ApiKey.objects.get(caller__name="crm")
    for action in ("revoke", "rotate"):
        accounts[who].post("/admin/channels_app/apikey/", {"action": action, "_selected_action": [key.pk]})
    assert list(ApiKey.objects.filter(caller__name="crm").values_list("active", flat=True)) == [True]
    assert _models(tcast.keys["app"]) == 200


# --- dead letters and plugins ---------------------------------------------------------------

@pytest.fixture
def letters(tcast):
    from plugins_app.channel.models import OutboundDelivery, Plugin
    turn = _turn(tcast, "completed", "t-letters")
    plugin = Plugin.objects.create(plugin_id="tg", kind="channel-telegram")
    return {state: OutboundDelivery.objects.create(delivery_id=f"d-{state}", plugin=plugin, state=state,
                                                   conversation=turn.conversation, text="hi", attempt=5,
                                                   last_error="403 Forbidden" if state == "dead_letter" else "")
            for state in ("dead_letter", "delivered")}


def test_requeueing_a_dead_letter_sends_it_again_with_a_new_attempt_and_its_whole_retry_budget(letters, accounts):
    resp = act(accounts["operator"], "plugins_app/outbounddelivery", "retry_dead_letters",
               [d.pk for d in letters.values()])
    assert "Queued 1 dead letter(s) again; 1 selected were not dead letters and were left alone." in said(resp)
    dead, delivered = (letters["dead_letter"], letters["delivered"])
    dead.refresh_from_db()
    delivered.refresh_from_db()
    # the worker's outbox sends again only a higher attempt than the one it failed; the budget counts from here
    assert (dead.state, dead.attempt, dead.attempt_base, dead.last_error) == ("pending", 6, 5, "")
    assert delivered.state == "delivered"


def test_discarding_a_dead_letter_keeps_it_on_record_and_never_sends_it(letters, accounts):
    from plugins_app.channel.services import deliveries_claim
    resp = act(accounts["operator"], "plugins_app/outbounddelivery", "discard_dead_letters",
               [d.pk for d in letters.values()])
    assert "Discarded 1 dead letter(s); 1 selected were not dead letters" in said(resp)
    dead = letters["dead_letter"]
    dead.refresh_from_db()
    assert dead.state == "discarded" and dead.last_error == "403 Forbidden"
    assert deliveries_claim(plugin_id="tg", max_items=10) == []
    # a discarded letter is not a dead letter any more: requeueing it does nothing
    act(accounts["operator"], "plugins_app/outbounddelivery", "retry_dead_letters", [dead.pk])
    dead.refresh_from_db()
    assert dead.state == "discarded"


@pytest.mark.parametrize("who", ["viewer", "outsider"])
def test_only_an_operator_account_may_requeue_or_discard(letters, accounts, who):
    dead = letters["dead_letter"]
    for action in ("retry_dead_letters", "discard_dead_letters"):
        accounts[who].post("/admin/plugins_app/outbounddelivery/", {"action": action, "_selected_action": [dead.pk]})
    dead.refresh_from_db()
    assert dead.state == "dead_letter"


def test_enabling_a_plugin_again_clears_its_circuit_breaker(tcast, accounts):
    from plugins_app.channel.models import Plugin
    plugin = Plugin.objects.create(plugin_id="wa", kind="channel-whatsapp", enabled=False, state="disabled",
                                   disabled_reason="circuit breaker: 3 consecutive cooldown rounds")
    resp = act(accounts["operator"], "plugins_app/plugin", "enable_again", [plugin.pk])
    assert "Enabled 1 plugin(s) (wa); the supervisor starts them on its next step." in said(resp)
    plugin.refresh_from_db()
    assert plugin.enabled and plugin.state == "stopped" and plugin.disabled_reason == ""


# --- cron runs ------------------------------------------------------------------------------------

JOB = 'enabled = true\n[[jobs]]\nid = "report"\nenabled = true\n[[jobs.tasks]]\nid = "t"\nprompt = "write it"\n'


def test_cancelling_a_queued_run_frees_its_place_and_says_who(tcast, accounts):
    from cron_app.models import CronRun
    from tests.cron_app.conftest import import_cron
    import_cron(JOB)
    run = CronRun.objects.create(job_name="report", trigger="manual", state="queued")
    resp = act(accounts["operator"], "cron_app/cronrun", "cancel", [run.pk])
    assert f"Cancelled 1 run(s) (by admin:ops): #{run.pk} of 'report'." in said(resp)
    run.refresh_from_db()
    assert run.state == "cancelled" and run.error == "cancelled by admin:ops" and run.finished_at
    again = act(accounts["operator"], "cron_app/cronrun", "cancel", [run.pk])
    assert "has ended (cancelled): there is nothing to cancel" in said(again)


def test_cancelling_a_running_run_asks_its_live_turn_to_stop(tcast, accounts):
    from cron_app.models import CronRun
    from tests.cron_app.conftest import import_cron
    import_cron(JOB)
    turn = _turn(tcast, "running", "t-cron-live")
    run = CronRun.objects.create(job_name="report", trigger="manual", state="running",
                                 outputs=[{"task": "t", "turn_id": "t-cron-live", "state": "running"}])
    act(accounts["operator"], "cron_app/cronrun", "cancel", [run.pk])
    turn.refresh_from_db()
    assert turn.cancel_requested and turn.stop_requested_by == "admin:ops"


def test_retrying_an_ended_run_starts_a_new_one_and_refuses_a_live_one(tcast, accounts):
    from cron_app.models import CronRun
    from tests.cron_app.conftest import import_cron
    import_cron(JOB)
    failed = CronRun.objects.create(job_name="report", trigger="scheduled", state="failed", error="boom")
    text = said(act(accounts["operator"], "cron_app/cronrun", "retry", [failed.pk]))
    new = CronRun.objects.exclude(pk=failed.pk).get()
    assert f"Retried run #{failed.pk} of 'report': run #{new.pk} is" in text
    assert new.trigger == "manual" and new.job_name == "report"
    live = CronRun.objects.create(job_name="report", trigger="manual", state="queued")
    text = said(act(accounts["operator"], "cron_app/cronrun", "retry", [live.pk]))
    assert f"run #{live.pk} of 'report' is still queued: cancel it first" in text
    assert CronRun.objects.count() == 3


@pytest.mark.parametrize("who", ["viewer", "outsider"])
def test_only_an_operator_account_may_cancel_or_retry(tcast, accounts, who):
    from cron_app.models import CronRun
    from tests.cron_app.conftest import import_cron
    import_cron(JOB)
    queued = CronRun.objects.create(job_name="report", trigger="manual", state="queued")
    failed = CronRun.objects.create(job_name="report", trigger="manual", state="failed")
    accounts[who].post("/admin/cron_app/cronrun/", {"action": "cancel", "_selected_action": [queued.pk]})
    accounts[who].post("/admin/cron_app/cronrun/", {"action": "retry", "_selected_action": [failed.pk]})
    assert CronRun.objects.count() == 2
    queued.refresh_from_db()
    assert queued.state == "queued"


def test_a_conversations_page_shows_its_messages_without_letting_them_be_edited(tcast, accounts):
    from channels_app.models import Message
    turn = _turn(tcast, "completed", "t-inline")
    msg = Message.objects.create(conversation=turn.conversation, role="user", content="keep me", turn=turn)
    page = accounts["operator"].get(f"/admin/channels_app/conversation/{turn.conversation.pk}/change/").content.decode()
    assert "keep me" in page
    assert 'name="messages-0-hidden"' not in page and 'name="messages-0-DELETE"' not in page
    msg.refresh_from_db()
    assert msg.content == "keep me" and msg.hidden is False
