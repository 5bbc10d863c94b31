"""GET /metrics: operator keys only; the Prometheus text format with the issue's figures."""
from __future__ import annotations

import json

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(key=None):
    return Client().get("/metrics", **({"HTTP_X_API_KEY": key} if key else {}))


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("who,status", [("operator", 200), ("app", 403), ("outsider", 403), (None, 401),
                                        ("wrong", 401), ("revoked", 401)])
def test_metrics_answer_operator_keys_only(tcast, who, status):
    if who == "revoked":  # an operator key the admin revoked
        from channels_app import services
        from channels_app.models import ApiKey
        key = ApiKey(caller=tcast.operator)
        key.set_key("ugk_test_revoked_operator_key")
        key.save()
        assert scrape("ugk_test_revoked_operator_key").status_code == 200
        services.api_key_revoke(key_pk=key.pk)
    keys = {**tcast.keys, "wrong": "ugk_not_a_key", "revoked": "ugk_test_revoked_operator_key"}
    resp = scrape(keys[who] if who else None)
    assert resp.status_code == status
    if status != 200:
        assert "ugent_" not in resp.content.decode() and resp.json()["error"]["code"]


def test_a_scrape_holds_requests_turns_queue_deliveries_and_rule_decisions(tcast, tmp_path, settings):
    from rules_app.runtime import runtime
    settings.UGENT_WORKSPACE = str(tmp_path)
    settings.UGENT_CONFIG = ""
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nname = "hush"\ndecision = "Ignore"\nmatch = { field = "text", equals = "hush" }\n')
    from rules_app.services import workspace_trust_approve
    workspace_trust_approve(path=tmp_path)
    runtime.reset()
    before = samples(scrape(tcast.keys["operator"]).content.decode())
    body = {"messages": [{"role": "user", "content": "script:answer=hello there"}], "user": "alice"}
    Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                  HTTP_X_API_KEY=tcast.keys["operator"])
    body["messages"][0]["content"] = "hush"
    Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                  HTTP_X_API_KEY=tcast.keys["operator"])
    resp = scrape(tcast.keys["operator"])
    runtime.reset()
    assert resp["Content-Type"].startswith("text/plain")
    after = samples(resp.content.decode())

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("ugent_requests_total", endpoint="/v1/chat/completions", method="POST", status="200") == 2
    assert grew("ugent_turns_ended_total", state="completed") == 1
    assert grew("ugent_turns_ended_total", state="refused") == 1
    assert grew("ugent_turn_duration_seconds_count") >= 1
    assert grew("ugent_turn_time_to_first_token_seconds_count") == 1
    assert grew("ugent_rule_decisions_total", rule="hush", decision="Ignore") == 1
    assert after[("ugent_turn_queue_depth", ())] == 0 and after[("ugent_turns_running", ())] == 0
    assert ("ugent_deliveries", (("state", "dead_letter"),)) in after
    assert after[("ugent_events_retained", ())] > 0
