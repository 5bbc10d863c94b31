"""The plugins in the admin: secrets never shown back, dead letters with their reason, who may look;
and rundaemon's embedded supervisor."""
from __future__ import annotations

import pytest
from django.apps import apps
from django.contrib.auth.models import User

from plugins_app.channel import services
from plugins_app.channel.models import OutboundDelivery, Plugin, PluginSecret
from plugins_app.channel.secrets import secret_decrypt
from tests.plugins_app.conftest import make_plugin, wait_until


def test_a_secret_is_stored_encrypted_and_never_shown_back(db, admin_client):
    plugin = make_plugin()
    services.plugin_secret_set(plugin=plugin, name="ECHO_TOKEN", value="very-secret-value")
    secret = PluginSecret.objects.get()
    page = admin_client.get(f"/admin/plugins_app/plugin/{plugin.pk}/change/").content.decode()
    assert "ECHO_TOKEN" in page
    assert "very-secret-value" not in page and secret.ciphertext not in page
    assert secret_decrypt(secret.ciphertext) == "very-secret-value"
    assert Plugin.objects.get().secret_env_refs == ["ECHO_TOKEN"]


def test_a_secret_set_in_the_admin_is_encrypted_and_joins_secret_env_refs(db, admin_client):
    plugin = make_plugin()
    form = {"plugin_id": "echo-main", "kind": "channel-echo", "enabled": "on", "command": "python",
            "args": '["-m", "plugins_app.channel.workers.echo"]', "env_refs": "[]", "secret_env_refs": "[]",
            "max_in_flight": 8, "max_retries": 2, "heartbeat_secs": 0.2, "workspace": "",
            "allowed_senders": "[]",
            "secrets-TOTAL_FORMS": 1, "secrets-INITIAL_FORMS": 0, "secrets-MIN_NUM_FORMS": 0,
            "secrets-MAX_NUM_FORMS": 1000, "secrets-0-name": "API_TOKEN", "secrets-0-value": "typed-in",
            "secrets-0-plugin": plugin.pk}
    resp = admin_client.post(f"/admin/plugins_app/plugin/{plugin.pk}/change/", form)
    assert resp.status_code == 302, resp.content.decode()[:2000]
    secret = PluginSecret.objects.get()
    assert secret_decrypt(secret.ciphertext) == "typed-in"
    assert Plugin.objects.get().secret_env_refs == ["API_TOKEN"]
    assert "typed-in" not in admin_client.get(f"/admin/plugins_app/plugin/{plugin.pk}/change/").content.decode()


def test_a_dead_letter_shows_its_reason_and_can_be_sent_again(tcast, admin_client):
    from tests.plugins_app.test_django_hub import _queue
    plugin = make_plugin(max_retries=0)
    [delivery_id] = _queue(plugin, 1)
    services.deliveries_claim(plugin_id="echo-main", max_items=1)
    services.delivery_ack(plugin_id="echo-main", delivery_id=delivery_id, status="failed", retryable=True,
                          reason="rate limited")
    page = admin_client.get("/admin/plugins_app/outbounddelivery/?state=dead_letter").content.decode()
    assert "max_retries (0) exceeded: rate limited" in page
    row = OutboundDelivery.objects.get()
    admin_client.post("/admin/plugins_app/outbounddelivery/", {"action": "retry_dead_letters",
                                                               "_selected_action": [row.pk]})
    row.refresh_from_db()
    # a new attempt for the worker (its outbox sends only a higher one than the one it failed), with the whole
    # retry budget again: here max_retries 0, so one more failure dead-letters it again
    assert (row.state, row.attempt, row.attempt_base, row.last_error) == ("pending", 2, 1, "")
    services.deliveries_claim(plugin_id="echo-main", max_items=1)
    services.delivery_ack(plugin_id="echo-main", delivery_id=delivery_id, status="failed", retryable=True,
                          reason="rate limited again")
    row.refresh_from_db()
    assert (row.state, row.attempt, row.last_error) == ("dead_letter", 2, "max_retries (0) exceeded: rate limited again")


@pytest.mark.parametrize("who, status", [("anonymous", 302), ("staff without permissions", 403)])
def test_only_admins_with_permission_see_plugins(db, client, who, status):
    plugin = make_plugin()
    if who != "anonymous":
        client.force_login(User.objects.create_user("staff", password="x", is_staff=True))
    for url in ("/admin/plugins_app/plugin/", f"/admin/plugins_app/plugin/{plugin.pk}/change/",
                "/admin/plugins_app/outbounddelivery/"):
        assert client.get(url).status_code == status


def test_rundaemon_runs_the_supervisor_in_embedded_mode_only(tcast, echo, short_dir, monkeypatch):
    from plugins_app.channel import conf
    for name, sub in (("RUN_DIR", "run"), ("PID_DIR", "pids"), ("LOG_DIR", "logs"), ("STATE_DIR", "state")):
        monkeypatch.setattr(conf, name, short_dir / sub)
    config = apps.get_app_config("plugins_app")
    assert config.background_services("servers") == []
    [service] = config.background_services("embedded")
    make_plugin()
    service.start()
    try:
        assert wait_until(lambda: Plugin.objects.get().state == "running", 10)
        echo.say("m-1", "script:answer=embedded")
        assert wait_until(lambda: [s["text"] for s in echo.sends()] == ["embedded"], 15)
    finally:
        service.stop()
    assert not service.thread.is_alive()
    assert Plugin.objects.get().state == "stopped"


def test_the_status_report_has_a_plugins_section(db):
    from channels_app.status import status_report
    make_plugin()
    section = status_report()["status"]["plugins"]["plugins"]
    assert [(p["plugin_id"], p["pending"], p["dead_letters"]) for p in section] == [("echo-main", 0, 0)]


def test_the_admin_and_the_status_show_the_memory_cap_each_worker_runs_under(db, admin_client, monkeypatch):
    from channels_app.status import status_report
    from plugins_app.channel import conf
    monkeypatch.setattr(conf, "MEMORY_MAX_MB", 1536)
    make_plugin("a-default")
    make_plugin("b-own", memory_max_mb=512)
    make_plugin("c-none", memory_max_mb=0)
    section = status_report()["status"]["plugins"]["plugins"]
    assert sorted((p["plugin_id"], p["memory_max_mb"]) for p in section) == [("a-default", 1536), ("b-own", 512),
                                                                             ("c-none", 0)]
    page = admin_client.get("/admin/plugins_app/plugin/").content.decode()
    assert "1536 MiB (default)" in page and "512 MiB" in page and '<td class="field-memory_cap">none</td>' in page


def test_a_negative_memory_cap_is_refused_in_the_admin_and_changes_nothing(db, admin_client):
    plugin = make_plugin()
    form = {"plugin_id": "echo-main", "kind": "channel-echo", "enabled": "on", "command": "python",
            "args": '["-m", "plugins_app.channel.workers.echo"]', "env_refs": "[]", "secret_env_refs": "[]",
            "max_in_flight": 8, "max_retries": 2, "heartbeat_secs": 0.2, "memory_max_mb": -1, "workspace": "",
            "allowed_senders": "[]", "secrets-TOTAL_FORMS": 0, "secrets-INITIAL_FORMS": 0,
            "secrets-MIN_NUM_FORMS": 0, "secrets-MAX_NUM_FORMS": 1000}
    resp = admin_client.post(f"/admin/plugins_app/plugin/{plugin.pk}/change/", form)
    assert resp.status_code == 200 and "Ensure this value is greater than or equal to 0." in resp.content.decode()
    assert Plugin.objects.get().memory_max_mb is None
