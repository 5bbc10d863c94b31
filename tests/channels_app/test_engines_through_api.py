"""Real engines behind the chat API: ours (openai-compatible) and a third-party OPM engine, unchanged."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app.models import Receipt
from plugins_app.agent.models import AgentProfile
from tests.fakes.upstream import Script, run_stub_upstream
from tests.support.http import answer_text, body_bytes, parse_sse
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


def chat(key, model, text, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


def test_openai_compatible_engine_streams_thinking_and_answer(tcast):
    with run_stub_upstream(script=Script(reasoning=["let ", "me think"], answer="Upstream says hi.")) as url:
        AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": str(url), "api_key": "sk-up", "model": "stub-model"})
        frames = parse_sse(body_bytes(chat(tcast.keys["operator"], "up", "hello", stream=True,
                                           include_thinking=True)))
        sent = url.requests[-1]
    assert answer_text(frames) == "Upstream says hi."
    thinking = "".join(f["data"]["choices"][0]["delta"].get("reasoning_content") or "" for f in frames
                       if f["event"] is None and isinstance(f["data"], dict) and f["data"].get("choices"))
    assert thinking == "let me think"
    assert sent.json["model"] == "stub-model" and sent.json["messages"][-1]["content"] == "hello"
    assert sent.headers.get("authorization") == "Bearer sk-up"


def test_an_upstream_error_becomes_the_turns_error(tcast):
    with run_stub_upstream(script=Script(status=401, error_message="Incorrect API key provided.")) as url:
        AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": str(url), "model": "m"})
        resp = chat(tcast.keys["operator"], "up", "hello")
    assert resp.status_code == 502
    assert "Incorrect API key provided." in resp.json()["error"]["message"]
    assert Receipt.objects.get().state == "failed"


def test_an_unreachable_upstream_fails_the_turn_cleanly(tcast):
    AgentProfile.objects.create(name="down", provider="openai-compatible",
                                config={"base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout": 2})
    resp = chat(tcast.keys["operator"], "down", "hello")
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unavailable"


def test_the_env_points_the_default_profile_at_an_upstream(tcast, monkeypatch, settings):
    AgentProfile.objects.all().delete()
    with run_stub_upstream(script=Script(answer="From the env upstream.")) as url:
        settings.UGENT_LLM_BASE_URL = str(url)
        settings.UGENT_LLM_MODEL = "env-model"
        monkeypatch.setenv("UGENT_LLM_BASE_URL", str(url))
        monkeypatch.setenv("UGENT_LLM_MODEL", "env-model")
        resp = chat(tcast.keys["operator"], "ugent-default", "hi")
        assert url.requests[-1].json["model"] == "env-model"
    assert resp.json()["choices"][0]["message"]["content"] == "From the env upstream."
    assert resp.json()["model"] == "env-model"


def test_a_third_party_opm_engine_plugs_into_a_profile_unchanged(tcast):
    """ovos-openai-plugin's engine, found by its opm.agents.chat entry point, answers through our API."""
    from ovos_plugin_manager.agents import find_chat_plugins
    assert "ovos-chat-openai-plugin" in find_chat_plugins()
    with run_stub_upstream(script=Script(answer="Third party works.")) as url:
        AgentProfile.objects.create(name="ovos", provider="ovos-chat-openai-plugin",
                                    config={"api_url": str(url), "key": "k", "model": "stub-model"})
        plain = chat(tcast.keys["operator"], "ovos", "hello")
        frames = parse_sse(body_bytes(chat(tcast.keys["operator"], "ovos", "again", stream=True)))
    assert plain.json()["choices"][0]["message"]["content"] == "Third party works."
    assert answer_text(frames) == "Third party works."


def test_the_admin_lists_installed_chat_engines(tcast, admin_client):
    page = admin_client.get("/admin/plugins_app/agentprofile/")
    assert page.status_code == 200
    html = page.content.decode()
    for name in ("openai-compatible", "ugent-notes", "ovos-chat-openai-plugin"):
        assert name in html


def test_a_third_party_engine_that_supports_tools_calls_the_turns_tools(tcast, tools_toml):
    """Seed 001: an engine with supports_tools = True consumes `tools` and returns tool_calls on its message;
    the turn runs each call and asks the engine again with the results."""
    from channels_app.models import ToolCall
    tools_toml('[tools]\nenabled = ["testing"]\n')
    steps = [Script(tool_calls=[{"id": "call_1", "name": "echo", "arguments": {"text": "hi there"}}]),
             Script(answer="The tool said hi there.")]
    with run_stub_upstream(script=steps) as url:
        AgentProfile.objects.create(name="ovos", provider="ovos-chat-openai-plugin",
                                    config={"api_url": str(url), "key": "k", "model": "stub-model"})
        resp = chat(tcast.keys["operator"], "ovos", "call the echo tool")
        first, second = list(url.requests)[-2:]
    assert resp.json()["choices"][0]["message"]["content"] == "The tool said hi there."
    assert "echo" in [t["function"]["name"] for t in first.json["tools"]]
    call = ToolCall.objects.get()
    assert (call.name, call.arguments, call.state, call.result) == ("echo", {"text": "hi there"}, "done",
                                                                   {"echo": "hi there"})
    assert [m["role"] for m in second.json["messages"]][-2:] == ["assistant", "tool"]


def test_a_third_party_engine_streams_when_its_profile_offers_no_tools(tcast):
    """OPM's stream_tokens takes no tools: an engine that supports tools answers whole while tools are offered
    (the default [tools]), and streams when its profile narrows them to none."""
    with run_stub_upstream(script=Script(answer="Streamed, token by token.")) as url:
        AgentProfile.objects.create(name="ovos", provider="ovos-chat-openai-plugin",
                                    config={"api_url": str(url), "key": "k", "model": "stub-model", "tools": []})
        AgentProfile.objects.create(name="ovos-tools", provider="ovos-chat-openai-plugin",
                                    config={"api_url": str(url), "key": "k", "model": "stub-model"})
        frames = parse_sse(body_bytes(chat(tcast.keys["operator"], "ovos", "hello", stream=True)))
        streamed = url.requests[-1].json
        whole = parse_sse(body_bytes(chat(tcast.keys["operator"], "ovos-tools", "hello", stream=True)))
        asked = url.requests[-1].json
    assert answer_text(frames) == answer_text(whole) == "Streamed, token by token."
    assert streamed.get("stream") is True and "tools" not in streamed
    assert not asked.get("stream") and asked["tools"]
