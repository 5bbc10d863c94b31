"""The operator's view in the admin: the file's set read-only, admin rules validated and in force on
save, and the "Test a message" page."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from rules_app import services
from rules_app.models import Rule, RuleSet
from tests.rules_app.conftest import answer
from tests.support.http import chat

FILE_RULES = '''
[[rules]]
name = "ignore-spam"
priority = 100
decision = "Ignore"
match = { field = "text", contains_any = ["unsubscribe"] }

[[rules]]
name = "groups"
priority = 50
decision = "Ignore"
[rules.match]
all_of = [ { field = "source_type", equals = "group" }, { not = { field = "text", starts_with = "/ask" } } ]
'''

TEST_URL = "/admin/rules_app/ruleset/test-message/"


def rule_form(ruleset, **over):
    data = {"ruleset": ruleset.pk, "name": "r1", "priority": 10, "condition": '{"always": true}',
            "decision": "Ignore", "params": "{}", "position": 0}
    data.update(over)
    return data


def test_the_file_set_is_shown_read_only_with_path_and_status(site, admin_client):
    path = site.rules(FILE_RULES)
    chat_site_loads()
    rs = RuleSet.objects.get(source="file")
    url = reverse("admin:rules_app_ruleset_change", args=[rs.pk])
    page = admin_client.get(url).content.decode()
    assert str(path) in page and "loaded: rules in force" in page
    assert "ignore-spam" in page and "groups" in page
    assert 'name="_save"' not in page
    resp = admin_client.post(url, {"name": "renamed"})
    assert resp.status_code == 403
    assert RuleSet.objects.get(pk=rs.pk).name == "rules.toml"
    listing = admin_client.get(reverse("admin:rules_app_ruleset_changelist")).content.decode()
    assert "Test a message" in listing and "rules.toml" in listing


def test_a_file_rule_cannot_be_edited_or_deleted_in_the_admin(site, admin_client):
    site.rules(FILE_RULES)
    chat_site_loads()
    rule = Rule.objects.get(name="ignore-spam")
    url = reverse("admin:rules_app_rule_change", args=[rule.pk])
    assert 'name="_save"' not in admin_client.get(url).content.decode()
    assert admin_client.post(url, rule_form(rule.ruleset, name="x")).status_code == 403
    assert admin_client.post(reverse("admin:rules_app_rule_delete", args=[rule.pk]),
                             {"post": "yes"}).status_code == 403
    assert Rule.objects.filter(name="ignore-spam").exists()


def test_a_failed_file_load_shows_its_error(site, admin_client):
    site.rules('[[rules]]\nname = "x"\ndecision = "Ignore"\nmatch = { field = "text", matches = "a" }\n')
    chat_site_loads()
    rs = RuleSet.objects.get(source="file")
    page = admin_client.get(reverse("admin:rules_app_ruleset_change", args=[rs.pk])).content.decode()
    assert "failed to load: no rules in force (fail-open)" in page
    assert "condition of no known shape" in page


@pytest.mark.parametrize("over,field,message", [
    ({"condition": '{"field": "text", "matches": "x"}'}, "condition", "condition of no known shape"),
    ({"condition": '{"field": "color", "equals": "x"}'}, "condition", "color"),
    ({"condition": "not json"}, "condition", "Enter a valid JSON"),
    ({"decision": "RunNativeAction", "params": '{"action": "memory_compaction"}'}, "params",
     "unknown native action 'memory_compaction'; the actions are compact_conversation and extract_memory"),
    ({"decision": "RunNativeAction", "params": '{"action": "extract_memory", "params": {"a": 1}}'}, "params",
     "takes no params"),
    ({"decision": "StartWorkflow", "params": "{}"}, "params", "missing field `workflow`"),
    ({"decision": "Ignore", "params": '{"x": 1}'}, "params", "Ignore takes no params"),
])
def test_an_invalid_rule_is_refused_and_nothing_changes(site, admin_client, over, field, message):
    rs = services.rule_set_admin_ensure()
    resp = admin_client.post(reverse("admin:rules_app_rule_add"), rule_form(rs, **over))
    assert resp.status_code == 200
    errors = resp.context["adminform"].form.errors
    assert field in errors and message in " ".join(errors[field])
    assert not Rule.objects.exists()
    assert RuleSet.objects.get(pk=rs.pk).version == 0


def test_two_admin_rules_with_one_name_are_refused(site, admin_client):
    rs = services.rule_set_admin_ensure()
    assert admin_client.post(reverse("admin:rules_app_rule_add"), rule_form(rs)).status_code == 302
    resp = admin_client.post(reverse("admin:rules_app_rule_add"), rule_form(rs, priority=1))
    assert resp.status_code == 200 and Rule.objects.count() == 1


def test_an_admin_rule_is_in_force_on_save_and_gone_on_delete(site, tcast, admin_client):
    assert answer(chat(tcast.alice, "hello", conversation_id="c1")) == "echo: hello (history=0)"
    rs = services.rule_set_admin_ensure()
    resp = admin_client.post(reverse("admin:rules_app_rule_add"), rule_form(
        rs, condition=json.dumps({"field": "text", "starts_with": "hel"})))
    assert resp.status_code == 302
    assert RuleSet.objects.get(pk=rs.pk).version == 1
    assert answer(chat(tcast.alice, "hello again", conversation_id="c2")) == "rule engine: message ignored"
    rule = Rule.objects.get()
    admin_client.post(reverse("admin:rules_app_rule_change", args=[rule.pk]),
                      rule_form(rs, condition=json.dumps({"field": "text", "equals": "x"})))
    assert answer(chat(tcast.alice, "hello 3", conversation_id="c3")) == "echo: hello 3 (history=0)"
    assert admin_client.post(reverse("admin:rules_app_rule_delete", args=[rule.pk]),
                             {"post": "yes"}).status_code == 302
    assert RuleSet.objects.get(pk=rs.pk).version == 3
    assert answer(chat(tcast.alice, "x", conversation_id="c4")) == "echo: x (history=0)"


def test_file_rules_win_priority_ties_against_admin_rules(site, tcast):
    site.rules('[[rules]]\nname = "file-pass"\ndecision = "PassToDefaultAgent"\nmatch = { always = true }\n')
    rs = services.rule_set_admin_ensure()
    services.rule_save(rule=Rule(ruleset=rs, name="admin-ignore", condition={"always": True}, decision="Ignore"))
    assert answer(chat(tcast.alice, "hi")) == "echo: hi (history=0)"
    services.rule_save(rule=Rule(ruleset=rs, name="admin-first", priority=1, condition={"always": True},
                                 decision="Ignore"))
    assert answer(chat(tcast.bob, "hi")) == "rule engine: message ignored"


def test_test_a_message_shows_the_deciding_rule_and_the_conditions(site, admin_client):
    site.rules(FILE_RULES)
    resp = admin_client.post(TEST_URL, {"text": "hello there", "channel": "line", "source_type": "group",
                                        "user_id": "U1", "conversation_id": "", "input_mode": ""})
    page = resp.content.decode()
    assert resp.status_code == 200
    assert 'Rule &quot;groups&quot; decides: Ignore' in page
    assert "rule engine: message ignored" in page
    assert "[x] source_type equals &quot;group&quot;" in page
    assert "[ ] text starts with &quot;/ask&quot;" in page
    assert "[ ] text contains any of [&quot;unsubscribe&quot;]" in page
    assert '[dry-run] matched rule &quot;groups&quot;' in page


def test_test_a_message_with_no_match_and_a_missing_field(site, admin_client):
    site.rules(FILE_RULES)
    page = admin_client.post(TEST_URL, {"text": "/ask me", "channel": "", "source_type": "",
                                        "input_mode": ""}).content.decode()
    assert "No rule matched: the agent answers." in page
    assert "message has no source_type" in page
    assert admin_client.get(TEST_URL).status_code == 200


def test_pages_need_a_staff_login(site):
    user = User.objects.create_user("plain", password="pw")
    client = Client()
    client.force_login(user)
    for url in (TEST_URL, reverse("admin:rules_app_ruleset_changelist"), reverse("admin:rules_app_rule_add")):
        resp = client.get(url)
        assert resp.status_code == 302 and "/admin/login/" in resp["Location"]
        assert Client().get(url).status_code == 302
    resp = client.post(TEST_URL, {"text": "x"})
    assert resp.status_code == 302


def test_staff_without_rule_permissions_cannot_test_or_edit(site):
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(TEST_URL).status_code == 403
    assert client.get(reverse("admin:rules_app_rule_add")).status_code == 403


def test_workspace_trust_is_listed_and_can_be_revoked(site, admin_client):
    site.approve()
    page = admin_client.get(reverse("admin:rules_app_workspacetrust_changelist")).content.decode()
    assert str(site.ws.resolve()) in page
    from rules_app.models import WorkspaceTrust
    trust = WorkspaceTrust.objects.get()
    admin_client.post(reverse("admin:rules_app_workspacetrust_changelist"),
                      {"action": "revoke", "_selected_action": [trust.pk]})
    trust.refresh_from_db()
    assert trust.revoked_at is not None


def chat_site_loads():
    """Load the rule engine in this process (as the first message would)."""
    from rules_app.runtime import runtime
    runtime.ruleset()
