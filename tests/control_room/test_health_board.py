"""The admin index is a health board: the same figures as GET /v1/ugent/status, each linked to its list."""
from __future__ import annotations

import re
import time

import pytest
from django.test import Client
from django.utils import timezone

from tests.rules_app.conftest import site  # noqa: F401  (the fixture: a workspace with its own rules file)

pytestmark = pytest.mark.django_db(transaction=True)

BROKEN_RULES = '[[rules]]\nname = "x"\nmatch = { always = true\ndecision = "Ignore"\n'


def board(admin_client) -> str:
    resp = admin_client.get("/admin/")
    assert resp.status_code == 200
    return resp.content.decode()


def card(page: str, slug: str) -> str:
    found = re.search(rf'<section class="card[^"]*" data-card="{slug}">(.*?)</section>', page, re.S)
    assert found, f"no {slug} card"
    return found.group(1)


def _turn(tcast, state, turn_id, created_secs_ago=0):
    from channels_app.models import Actor, Conversation, Receipt, Turn
    actor, _ = Actor.objects.get_or_create(key="web:alice", defaults={"user_id": "alice"})
    conv, _ = Conversation.objects.get_or_create(external_id="c-board", defaults={"owner": actor})
    receipt = Receipt.objects.create(conversation=conv, client_message_id=turn_id, content_hash="x", actor=actor,
                                     state=state)
    turn = Turn.objects.create(turn_id=turn_id, conversation=conv, actor=actor, receipt=receipt, state=state,
                               model="scripted")
    if created_secs_ago:
        Turn.objects.filter(pk=turn.pk).update(created_at=timezone.now() - timezone.timedelta(seconds=created_secs_ago))
    return turn


def test_the_rules_card_shows_the_file_and_its_load_error_with_line_and_column(site, tcast, admin_client):  # noqa: F811
    path = site.rules(BROKEN_RULES)
    status = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["rules"]
    rules = card(board(admin_client), "rules-in-force")
    assert str(path) in rules
    assert status["file"]["status"] in rules and status["file"]["last_error"]
    line, col = re.search(r"line (\d+), column (\d+)", status["file"]["last_error"]).groups()
    assert f"line {line}, column {col}:" in rules
    assert 'href="/admin/rules_app/ruleset/?source=file"' in rules


def test_the_rules_card_shows_fields_the_section_gains(site, tcast, admin_client, settings):  # noqa: F811
    settings.UGENT_STATUS_SECTIONS = {**settings.UGENT_STATUS_SECTIONS, "rules": "tests.control_room.sections.rules_plus"}
    from channels_app import status
    status._contributors.pop("rules", None)
    try:
        rules = card(board(admin_client), "rules-in-force")
    finally:
        status._contributors.pop("rules", None)
    assert "enforcer_pid" in rules and "4242" in rules and "heartbeat_at" in rules


def test_turns_deliveries_and_events_are_counted_and_linked(tcast, admin_client):
    from plugins_app.channel.models import OutboundDelivery, Plugin
    running = _turn(tcast, "running", "t-run-1", created_secs_ago=125)
    aged_at = time.monotonic()
    _turn(tcast, "accepted", "t-queued-1")
    _turn(tcast, "completed", "t-done-1")
    plugin = Plugin.objects.create(plugin_id="tg-main", kind="channel-telegram", state="running")
    for i, state in enumerate(["pending", "pending", "dead_letter"]):
        # ids no random token on the page can hold by chance (a CSRF token once held "d0")
        OutboundDelivery.objects.create(delivery_id=f"delivery-board-{i}", plugin=plugin, conversation=running.conversation,
                                        state=state, text="hi")
    page = board(admin_client)
    elapsed = time.monotonic() - aged_at  # the oldest turn aged this much more before the board was drawn
    turns = card(page, "turns")
    assert re.search(r'data-figure="running"><a href="/admin/channels_app/turn/\?state__exact=running">1</a>', turns)
    assert re.search(r'data-figure="queued"><a href="/admin/channels_app/turn/\?state__exact=accepted">1</a>', turns)
    oldest = re.search(r'data-figure="oldest-running">(\d+)m (\d+)s<', turns)
    assert oldest, turns
    assert 125 <= int(oldest[1]) * 60 + int(oldest[2]) <= 125 + elapsed + 1
    assert f'/admin/channels_app/turn/{running.pk}/change/' in turns
    deliveries = card(page, "deliveries")
    assert re.search(r'data-figure="pending"><a [^>]*state__exact=pending">2</a>', deliveries)
    assert re.search(r'data-figure="dead-letters"><a [^>]*state__exact=dead_letter">1</a>', deliveries)
    plugins = card(page, "plugins")
    assert f"state__exact=dead_letter&amp;plugin__id__exact={plugin.pk}" in plugins
    from channels_app.models import Event
    events = card(page, "events-retained")
    assert re.search(rf'data-figure="events"><a href="/admin/channels_app/event/">{Event.objects.count()}</a>', events)
    # the links filter for real: the running turn's list holds that turn only
    listed = admin_client.get("/admin/channels_app/turn/?state__exact=running").content.decode()
    assert "t-run-1" in listed and "t-queued-1" not in listed and "t-done-1" not in listed
    dead = admin_client.get(f"/admin/plugins_app/outbounddelivery/?state__exact=dead_letter&plugin__id__exact={plugin.pk}")
    assert (dead.status_code == 200 and "delivery-board-2" in dead.content.decode()
            and "delivery-board-0" not in dead.content.decode())


def test_a_plugin_row_shows_heartbeat_circuit_restarts_and_its_workers_last_lines(tcast, admin_client, settings,
                                                                                     tmp_path, monkeypatch):
    from plugins_app.channel import conf
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.services import plugin_secret_set, plugin_state_record
    monkeypatch.setattr(conf, "LOG_DIR", tmp_path)
    plugin = Plugin.objects.create(plugin_id="slack-ops", kind="channel-slack", state="running",
                                   last_heartbeat=timezone.now() - timezone.timedelta(seconds=42))
    plugin_secret_set(plugin=plugin, name="SLACK_TOKEN", value="xoxb-very-secret-token")
    (tmp_path / "slack-ops.log").write_text("".join(f"line {i}\n" for i in range(20))
                                            + "auth failed for xoxb-very-secret-token\n")
    for n in (1, 2):
        plugin_state_record(plugin_id="slack-ops", state="backoff", reason=f"exited with code 1; restart {n}/5 in 1 s")
    page = card(board(admin_client), "plugins")
    row = re.search(r'<tr data-plugin="slack-ops">(.*?)</tr>', page, re.S).group(1)
    assert ">backoff<" in row and ">closed<" in row and ">2<" in row
    assert "line 19" in page and "line 10" not in page  # the last lines only
    assert "xoxb-very-secret-token" not in page and "auth failed for ••••" in page
    status = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["plugins"]
    assert status["plugins"][0]["restarts"] == 2 and status["plugins"][0]["circuit"] == "closed"


def test_a_workers_last_lines_read_across_its_log_rotation(tcast, admin_client, tmp_path, monkeypatch):
    """The log was rotated just before its last two lines: the other three come from <plugin>.log.1."""
    from plugins_app.channel import conf
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.supervisor.process import RotatingLog, log_file_path
    monkeypatch.setattr(conf, "LOG_DIR", tmp_path)
    Plugin.objects.create(plugin_id="slack-ops", kind="channel-slack", state="running")
    log = RotatingLog(log_file_path(tmp_path, "slack-ops"), max_bytes=len("line 00\n") * 10)
    for i in range(12):
        log.write(f"line {i:02d}\n".encode())
    log.close()
    assert (tmp_path / "slack-ops.log").read_text() == "line 10\nline 11\n"
    page = card(board(admin_client), "plugins")
    tail = re.search(r"<pre class=\"tail\" data-log-tail>(.*?)</pre>", page, re.S).group(1)
    assert tail.splitlines() == [f"line {i:02d}" for i in range(7, 12)]


def test_the_cron_card_shows_next_runs_and_last_failures(tcast, admin_client):
    from cron_app.models import CronRun
    from tests.cron_app.conftest import import_cron
    import_cron('enabled = true\n[[jobs]]\nid = "nightly"\nenabled = true\nschedule = "30 2 * * *"\n'
                '[[jobs.tasks]]\nid = "t"\nprompt = "p"\n')
    bad = CronRun.objects.create(job_name="nightly", trigger="manual", state="failed", error="task 't' failed: boom")
    good = CronRun.objects.create(job_name="nightly", trigger="manual", state="completed")
    page = card(board(admin_client), "cron")
    assert "Next runs" in page and "nightly" in page and "T02:30:00" in page
    assert f"/admin/cron_app/cronrun/{bad.pk}/change/" in page and "boom" in page
    assert "state__in=failed%2Ctimed_out%2Cinterrupted" in page
    failed = admin_client.get("/admin/cron_app/cronrun/?state__in=failed,timed_out,interrupted")
    assert failed.status_code == 200
    assert f'name="_selected_action" value="{bad.pk}"' in failed.content.decode()
    assert f'name="_selected_action" value="{good.pk}"' not in failed.content.decode()


@pytest.mark.parametrize("who,code", [("superuser", 200), ("staff_without_perms", 200), ("outsider", 302),
                                      ("anonymous", 302)])
def test_the_board_is_for_admin_accounts_only(tcast, who, code, django_user_model):
    client = Client()
    if who == "superuser":
        client.force_login(django_user_model.objects.create_superuser("root", "r@example.com", "pw"))
    elif who == "staff_without_perms":
        client.force_login(django_user_model.objects.create_user("staff", password="pw", is_staff=True))
    elif who == "outsider":
        client.force_login(django_user_model.objects.create_user("someone", password="pw"))
    resp = client.get("/admin/")
    assert resp.status_code == code
    if code == 302:
        assert "/admin/login/" in resp["Location"]
    else:
        assert 'id="health-board"' in resp.content.decode()
