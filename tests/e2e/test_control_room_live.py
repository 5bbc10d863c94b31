"""The running daemon, in the mode the environment picks (servers when REDIS_URL is set): a /metrics
scrape (multiprocess in servers mode: the turn's figures come from the worker process, the
request's from the web process), JSON log lines with the request and turn-end fields and no key in
them, and `rules status` reporting the running daemon's own record."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import Daemon, free_port

RULES = '[[rules]]\nname = "hush"\ndecision = "Ignore"\nmatch = { field = "text", equals = "hush" }\n'


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("control-room")
    (tmp / "workspace").mkdir()
    (tmp / "rules.toml").write_text(RULES)
    (tmp / "workspace" / "ugent.toml").write_text(f'[rules]\nfile = "{tmp / "rules.toml"}"\n')
    servers = bool(os.environ.get("REDIS_URL"))
    extra = {"UGENT_LOG_FORMAT": "json", "UGENT_RULES_HEARTBEAT_SECONDS": "1"}
    if servers:
        (tmp / "prom").mkdir()
        extra["PROMETHEUS_MULTIPROC_DIR"] = str(tmp / "prom")
    else:
        extra["UGENT_METRICS_BIND"] = f"127.0.0.1:{free_port()}"
    d = Daemon(tmp, extra_env=extra).start()
    yield d
    d.close()


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def chat(d, text):
    return httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key}, timeout=30,
                      json={"messages": [{"role": "user", "content": text}], "user": "alice"})


def test_a_scrape_counts_what_the_daemon_did(live):
    assert chat(live, "script:answer=hi there").status_code == 200
    assert chat(live, "hush").json()["choices"][0]["message"]["content"] == "rule engine: message ignored"
    assert httpx.get(live.base + "/metrics", timeout=10).status_code == 401
    resp = httpx.get(live.base + "/metrics", headers={"x-api-key": live.key}, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    got = samples(resp.text)
    assert got[("ugent_requests_total", (("endpoint", "/v1/chat/completions"), ("method", "POST"),
                                        ("status", "200")))] == 2
    assert got[("ugent_turns_ended_total", (("state", "completed"),))] == 1  # the worker's count, in servers mode
    assert got[("ugent_turns_ended_total", (("state", "refused"),))] == 1
    assert got[("ugent_turn_time_to_first_token_seconds_count", ())] == 1
    assert got[("ugent_rule_decisions_total", (("decision", "Ignore"), ("rule", "hush")))] == 1
    assert got[("ugent_turn_queue_depth", ())] == 0
    bind = live.env.get("UGENT_METRICS_BIND")
    if bind:  # embedded: the separate listener answers without a key
        own = httpx.get(f"http://{bind}/metrics", timeout=10)
        assert own.status_code == 200 and "ugent_turns_ended_total" in own.text


def test_the_log_is_json_lines_with_the_request_and_turn_fields_and_no_key(live):
    assert chat(live, "script:answer=logged").status_code == 200
    text = (live.tmp / "daemon.log").read_text()
    assert live.key not in text
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    requests = [line for line in lines if line.get("logger") == "ugent.requests"]
    chat_line = next(r for r in requests if r["path"] == "/v1/chat/completions")
    assert {"method", "path", "status", "ms", "caller", "actor", "turn"} <= set(chat_line)
    assert chat_line["caller"] == "default" and chat_line["actor"] == "web:alice" and chat_line["status"] == 200
    ends = [line for line in lines if line.get("logger") == "ugent.turns" and line["message"].startswith("turn ended")]
    assert ends and {"turn", "model", "state", "ms", "ttft_ms", "tokens"} <= set(ends[-1])
    assert any(e["turn"] == chat_line["turn"] for e in ends)


def test_rules_status_reports_the_running_daemons_rules(live):
    chat(live, "hush")
    out = live.manage("rules", "status").stdout
    first = out.splitlines()[0]
    assert first.startswith("reporting the running daemon's rules (pid ")
    pid = int(first.split("(pid ")[1].split()[0].rstrip(","))
    assert pid in {p.pid for p in live.procs}
    assert f"rules file: {live.tmp / 'rules.toml'} (loaded, 1 rules" in out
    test = live.manage("rules", "test", "hush")
    assert test.stdout.strip() == '[dry-run] matched rule "hush"'
    assert test.stderr.startswith("testing the running daemon's rules (pid ")
