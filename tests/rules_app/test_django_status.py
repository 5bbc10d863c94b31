"""The "rules" section of GET /v1/ugent/status: in force or not, how many, the last load error."""
from __future__ import annotations

import pytest
from django.test import Client

from rules_app import services
from rules_app.models import Rule
from tests.rules_app.conftest import answer
from tests.support.http import chat

RULES = '''
[[rules]]
name = "ignore-a"
decision = "Ignore"
match = { field = "text", equals = "a" }

[[rules]]
name = "bad-action"
match = { always = true }
[rules.decision.RunNativeAction]
action = "memory_compaction"
'''


def status(key):
    return Client().get("/v1/ugent/status", HTTP_X_API_KEY=key) if key else Client().get("/v1/ugent/status")


@pytest.mark.parametrize("who,code", [("operator", 200), ("app", 403), ("outsider", 403), (None, 401)])
def test_status_is_for_operator_keys_only(site, tcast, who, code):
    site.rules(RULES)
    resp = status(tcast.keys[who] if who else None)
    assert resp.status_code == code
    if code != 200:
        assert "rules" not in resp.content.decode()


def test_status_shows_rules_in_force_and_dropped(site, tcast):
    path = site.rules(RULES)
    rules = status(tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["in_force"] is True and rules["rules"] == 1 and rules["refusing_all"] is False
    assert rules["file"]["path"] == str(path) and rules["file"]["status"] == "loaded"
    assert rules["file"]["dropped"] == [{"rule": "bad-action", "reason": "unknown native action "
                                         "'memory_compaction'; the actions are compact_conversation and extract_memory"}]
    assert rules["file"]["last_error"] is None and rules["watching"] is True


def test_status_shows_the_last_load_error_when_failing_open(site, tcast):
    site.rules("[[rules]]\nname = 'x'\n")
    rules = status(tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["in_force"] is False and rules["rules"] == 0
    assert rules["file"]["status"] == "failed"
    assert "missing field `match`" in rules["file"]["last_error"]


def test_status_with_no_file(site, tcast):
    rules = status(tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["in_force"] is False and rules["file"]["status"] == "missing" and rules["file"]["path"] is None


def test_status_counts_admin_rules(site, tcast):
    rs = services.rule_set_admin_ensure()
    services.rule_save(rule=Rule(ruleset=rs, name="r", condition={"always": True}, decision="Ignore"))
    rules = status(tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["in_force"] is True and rules["rules"] == 1 and rules["admin"]["rules"] == 1
    assert answer(chat(tcast.alice, "anything")) == "rule engine: message ignored"


def test_status_under_on_error_closed(site, tcast):
    site.config('[rules]\non_error = "closed"\n')
    site.rules("nope nope")
    rules = status(tcast.keys["operator"]).json()["status"]["rules"]
    assert rules["refusing_all"] is True and rules["in_force"] is True and rules["file"]["status"] == "closed"
    assert rules["on_error"] == "closed"


@pytest.mark.django_db(transaction=True)
def test_two_processes_recording_the_first_load_together_leave_one_row_with_the_later_load(monkeypatch):
    """Both found no row for the rules file; the other committed its insert first: ours records over it."""
    from rules_app import services
    from rules_app.models import RuleSet
    real_save = RuleSet.save
    raced = []

    def save(self, *args, **kwargs):
        if self.pk is None and not raced:  # the other process's insert commits in between
            raced.append(True)
            RuleSet.objects.create(name=services.FILE_SET_NAME, source="file", status="ok", digest="theirs")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(RuleSet, "save", save)
    record = services.LoadRecord(status="ok", path="/w/rules.toml", rule_count=0, raw_rules=[])
    assert services.rule_set_record_load(record=record) is True
    rows = list(RuleSet.objects.filter(source="file"))
    assert len(rows) == 1 and rows[0].digest == record.digest() and rows[0].name == services.FILE_SET_NAME
