"""OpenAI's usage: in every answer (the upstream's where it reports it, counted otherwise), in the stream's
final chunk when the client asks stream_options.include_usage, stored per turn, summed per key and caller."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from channels_app.models import ApiKey, Receipt, Turn
from plugins_app.agent.models import AgentProfile
from tests.fakes.upstream import Script, run_stub_upstream
from tests.support.http import body_bytes, parse_sse

pytestmark = pytest.mark.django_db(transaction=True)


def chat(key, text, **extra):
    body = {"messages": [{"role": "user", "content": text}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


def chunks(resp) -> list[dict]:
    return [f["data"] for f in parse_sse(body_bytes(resp)) if f["event"] is None and isinstance(f["data"], dict)]


def test_an_answer_carries_counted_usage_when_the_engine_reports_none(tcast):
    resp = chat(tcast.keys["operator"], "script:answer=three little words", user="alice")
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    turn = Turn.objects.get()
    assert (turn.prompt_tokens, turn.completion_tokens, turn.total_tokens) == (
        usage["prompt_tokens"], 3, usage["total_tokens"])
    assert turn.usage_source == "counted" and turn.caller == tcast.operator
    assert turn.api_key == ApiKey.objects.get(caller=tcast.operator)


def test_the_upstreams_usage_is_the_turns_and_the_streams_final_chunk_carries_it(tcast):
    with run_stub_upstream(script=Script(answer="Upstream says hi.")) as url:
        AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": str(url), "model": "stub-model"})
        resp = chat(tcast.keys["operator"], "hello", model="up", stream=True,
                    stream_options={"include_usage": True})
        data = chunks(resp)
        sent = url.requests[-1].json
    assert sent["stream_options"] == {"include_usage": True}  # asked of the upstream too
    last = data[-1]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    turn = Turn.objects.get()
    assert turn.usage_source == "upstream" and turn.prompt_tokens == 1  # the stub's own figures
    assert last["usage"] == {"prompt_tokens": 1, "completion_tokens": turn.completion_tokens,
                             "total_tokens": turn.total_tokens}
    assert all(c["usage"] is None for c in data[:-1])  # every other chunk says null, as OpenAI's do


def test_a_stream_without_include_usage_carries_no_usage(tcast):
    data = chunks(chat(tcast.keys["operator"], "script:answer=hi there", user="alice", stream=True))
    assert data and all("usage" not in c for c in data)


def test_a_non_streamed_upstream_answer_keeps_the_upstreams_usage(tcast):
    with run_stub_upstream(script=Script(answer="Hi.")) as url:
        AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": str(url), "model": "m", "stream_usage": False})
        resp = chat(tcast.keys["operator"], "hello", model="up")
        sent = url.requests[-1].json
    assert "stream_options" not in sent  # stream_usage = false: an upstream that refuses the option
    assert resp.json()["usage"]["total_tokens"] == Turn.objects.get().total_tokens
    assert Turn.objects.get().usage_source == "counted"


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, {"include_usage": 1}, "on"])
def test_bad_stream_options_are_refused_and_change_nothing(tcast, options):
    resp = chat(tcast.keys["operator"], "hi", user="alice", stream=True, stream_options=options)
    assert resp.status_code == 400
    assert "stream_options" in json.dumps(resp.json()["error"])
    assert not Receipt.objects.exists() and not Turn.objects.exists()


def test_the_admin_sums_usage_per_caller_and_per_key(tcast):
    for _ in range(2):
        chat(tcast.keys["app"], "script:answer=one two three four", federation_issuer="example-crm",
             federation_subject="carol")
    chat(tcast.keys["operator"], "script:answer=five", user="alice")
    turns = Turn.objects.filter(caller=tcast.app)
    app_total = sum(t.total_tokens for t in turns)
    assert turns.count() == 2 and app_total > 8
    admin = Client()
    admin.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    callers = admin.get("/admin/channels_app/caller/").content.decode()
    assert f'<td class="field-total_tokens">{app_total}</td>' in callers
    keys = admin.get("/admin/channels_app/apikey/").content.decode()
    assert f'<td class="field-total_tokens">{app_total}</td>' in keys
    assert f'<td class="field-turns_count">2</td>' in keys
    operator_total = Turn.objects.get(caller=tcast.operator).total_tokens
    assert f'<td class="field-total_tokens">{operator_total}</td>' in callers
