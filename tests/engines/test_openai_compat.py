"""OpenAICompatibleEngine against the live stub upstream (real sockets, no mocking)."""
import json
import socket
import threading
from pathlib import Path

import pytest
from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole, ToolCall

from plugins_app.agent.engines.base import (ANSWER, THINKING, TOOL, USAGE, EngineError, StreamItem,
                                      stream_items)
from plugins_app.agent.engines.openai_compat import OpenAICompatibleEngine
from tests.fakes.upstream import DEFAULT_ANSWER, Script, StubUpstream, run_stub_upstream

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

SPEC = Path(__file__).resolve().parents[1] / "data" / "openai-chat-subset.json"
USER = [AgentMessage(role=MessageRole.USER, content="Say hello.")]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture
def stub():
    with run_stub_upstream() as base_url:
        yield base_url


@pytest.fixture
def engine(stub):
    eng = OpenAICompatibleEngine({"base_url": stub, "api_key": "sk-test", "model": "test-model"})
    yield eng
    eng.close()


def kinds(items, kind):
    return [i for i in items if i.kind == kind]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- answers -----------------------------------------------------------------------

def test_continue_chat_answers(engine, stub):
    msg = engine.continue_chat(USER)
    assert msg.role == MessageRole.ASSISTANT
    assert msg.content == DEFAULT_ANSWER
    assert msg.tool_calls is None
    req = stub.requests[-1]
    assert req.path == "/v1/chat/completions"
    assert req.json["model"] == "test-model"
    assert req.json["messages"] == [{"role": "user", "content": "Say hello."}]
    assert "stream" not in req.json


def test_stream_tokens_join_to_the_answer(engine, stub):
    tokens = list(engine.stream_tokens(USER))
    assert len(tokens) > 3
    assert "".join(tokens) == DEFAULT_ANSWER
    assert stub.requests[-1].json["stream"] is True


def test_stream_events_answer_only(engine):
    items = list(engine.stream_events(USER))
    *answer, usage = items  # the upstream's usage comes last (stream_options.include_usage)
    assert all(i.kind == ANSWER for i in answer)
    assert "".join(i.text for i in answer) == DEFAULT_ANSWER
    assert usage.kind == USAGE and usage.data["prompt_tokens"] == 1
    assert usage.data["total_tokens"] == 1 + usage.data["completion_tokens"]


def test_auth_header_and_options_sent(stub):
    eng = OpenAICompatibleEngine({"base_url": stub + "/", "api_key": "sk-secret", "model": "m1",
                                  "temperature": 0.3, "max_tokens": 42,
                                  "extra_body": {"top_k": 5, "temperature": None}})
    eng.continue_chat(USER)
    req = stub.requests[-1]
    assert req.auth == "Bearer sk-secret"
    assert req.json["max_tokens"] == 42
    assert req.json["top_k"] == 5
    assert "temperature" not in req.json  # removed by extra_body
    eng.close()


def test_no_auth_header_without_key(stub, monkeypatch):
    monkeypatch.delenv("UGENT_LLM_API_KEY", raising=False)
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m"})
    list(eng.stream_tokens(USER))
    assert stub.requests[-1].auth is None
    eng.close()


def test_env_fallback(stub, monkeypatch):
    monkeypatch.setenv("UGENT_LLM_BASE_URL", str(stub))
    monkeypatch.setenv("UGENT_LLM_API_KEY", "sk-env")
    monkeypatch.setenv("UGENT_LLM_MODEL", "env-model")
    eng = OpenAICompatibleEngine({})
    assert eng.continue_chat(USER).content == DEFAULT_ANSWER
    req = stub.requests[-1]
    assert req.json["model"] == "env-model"
    assert req.auth == "Bearer sk-env"
    # config wins over the environment
    eng2 = OpenAICompatibleEngine({"model": "cfg-model"})
    eng2.continue_chat(USER)
    assert stub.requests[-1].json["model"] == "cfg-model"
    eng.close()
    eng2.close()


def test_missing_base_url_is_an_engine_error(monkeypatch):
    monkeypatch.delenv("UGENT_LLM_BASE_URL", raising=False)
    eng = OpenAICompatibleEngine({})
    with pytest.raises(EngineError) as err:
        eng.continue_chat(USER)
    assert err.value.code == "engine_misconfigured"
    with pytest.raises(EngineError):
        list(eng.stream_events(USER))


def test_keep_alive_reuses_one_connection(engine, stub):
    engine.continue_chat(USER)
    list(engine.stream_tokens(USER))
    list(engine.stream_events(USER))
    engine.continue_chat(USER)
    assert len({r.conn_id for r in stub.requests}) == 1
    assert stub.stub.connections_opened == 1


def test_concurrent_turns_share_the_engine(engine, stub):
    results, errors = [], []

    def turn():
        try:
            results.append("".join(engine.stream_tokens(USER)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=turn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert results == [DEFAULT_ANSWER] * 8


def test_close_releases_and_engine_recovers(engine, stub):
    engine.continue_chat(USER)
    assert stub.stub.wait_for(lambda: stub.stub.open_connections == 1)
    engine.close()
    assert stub.stub.wait_for(lambda: stub.stub.open_connections == 0)
    assert engine.continue_chat(USER).content == DEFAULT_ANSWER


# -- reasoning -----------------------------------------------------------------------

@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_streams_as_thinking(engine, stub, field):
    stub.script = Script(reasoning=["Let me ", "think."], reasoning_field=field)
    items = list(engine.stream_events(USER))
    assert [i.kind for i in items[:2]] == [THINKING, THINKING]
    assert "".join(i.text for i in kinds(items, THINKING)) == "Let me think."
    assert "".join(i.text for i in kinds(items, ANSWER)) == DEFAULT_ANSWER
    # stream_tokens carries the answer only
    assert "".join(engine.stream_tokens(USER)) == DEFAULT_ANSWER


def test_think_tags_in_content_split_across_chunks(engine, stub):
    stub.script = Script(tokens=["<th", "ink>Pondering", " deeply</th", "ink>\n\n", "The answer", " is 4 < 5."])
    items = list(engine.stream_events(USER))
    assert "".join(i.text for i in kinds(items, THINKING)) == "Pondering deeply"
    assert "".join(i.text for i in kinds(items, ANSWER)) == "The answer is 4 < 5."
    assert engine.continue_chat(USER).content == "The answer is 4 < 5."


def test_think_tag_fragment_at_the_end_is_not_lost(engine, stub):
    stub.script = Script(tokens=["a <", "b", " <thi"])
    items = list(engine.stream_events(USER))
    assert "".join(i.text for i in items if i.kind == ANSWER) == "a <b <thi"


# -- tool calls ------------------------------------------------------------------------

def test_tool_calls_assembled_from_pieces(engine, stub):
    stub.script = Script(tool_calls=[
        {"id": "call_a", "name": "get_weather", "arguments": {"city": "Ghent"}},
        {"id": "call_b", "name": "get_weather", "arguments": {"city": "Bruges, Belgium"}},
    ], tool_call_pieces=4)
    items = list(engine.stream_events(USER, tools=TOOLS))
    tools = kinds(items, TOOL)
    assert [t.data["id"] for t in tools] == ["call_a", "call_b"]
    assert all(t.data["name"] == "get_weather" for t in tools)
    assert [json.loads(t.data["arguments"]) for t in tools] == [{"city": "Ghent"},
                                                               {"city": "Bruges, Belgium"}]
    assert not kinds(items, ANSWER)
    assert stub.requests[-1].json["tools"] == TOOLS


def test_tool_call_emitted_when_complete_not_at_end(stub):
    # the first call is emitted as soon as the second one starts
    stub.script = Script(tool_calls=[{"id": "c1", "name": "a", "arguments": {"x": 1}},
                                     {"id": "c2", "name": "b", "arguments": {"y": 2}}],
                         delay=0.05)
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m"})
    seen = []
    for item in eng.stream_events(USER, tools=TOOLS):
        if item.kind == TOOL:
            seen.append((item.data["id"], stub.requests[-1].events_sent))
    # c1 reached the caller before the stub had sent all of c2's pieces
    assert seen[0][0] == "c1" and seen[0][1] < seen[1][1]
    eng.close()


def test_continue_chat_parses_tool_calls(engine, stub):
    stub.script = Script(tool_calls=[{"id": "call_1", "name": "get_weather",
                                      "arguments": {"city": "Ghent"}}])
    msg = engine.continue_chat(USER, tools=TOOLS)
    assert msg.content == ""
    assert msg.tool_calls == [ToolCall(id="call_1", name="get_weather", arguments={"city": "Ghent"})]
    assert stub.requests[-1].json["tools"] == TOOLS


def test_a_system_prompt_the_context_already_starts_with_is_sent_once(stub):
    """A profile's memory engine starts its context with the profile's system prompt (seed 001: "start from
    self.system_prompt"), which the chat engine was given as its own as well."""
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m", "system_prompt": "You are Bob."})
    eng.continue_chat([AgentMessage(MessageRole.SYSTEM, "You are Bob."), AgentMessage(MessageRole.USER, "hi")])
    assert stub.requests[-1].json["messages"][0] == {"role": "system", "content": "You are Bob."}


def test_message_conversion_round_trips_a_tool_loop(stub):
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m", "system_prompt": "Be brief."})
    history = [
        AgentMessage(MessageRole.SYSTEM, "You are UGENT."),
        AgentMessage(MessageRole.DEVELOPER, "Answer in English."),
        AgentMessage(MessageRole.USER, "Weather in Ghent?"),
        AgentMessage(MessageRole.ASSISTANT, "", tool_calls=[
            ToolCall(id="call_1", name="get_weather", arguments={"city": "Ghent"})]),
        AgentMessage(MessageRole.TOOL, '{"temp": 12}', tool_call_id="call_1", name="get_weather"),
    ]
    eng.continue_chat(history, tools=TOOLS)
    sent = stub.requests[-1].json["messages"]
    assert sent == [
        {"role": "system", "content": "Be brief.\n\nYou are UGENT.\n\nAnswer in English."},
        {"role": "user", "content": "Weather in Ghent?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Ghent"}'}}]},
        {"role": "tool", "content": '{"temp": 12}', "tool_call_id": "call_1"},
    ]
    eng.close()


def test_request_matches_the_openai_schema(stub):
    jsonschema = pytest.importorskip("jsonschema")
    spec = json.loads(SPEC.read_text()) if SPEC.exists() else pytest.skip("spec bundle missing")
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m", "temperature": 0.1,
                                  "max_tokens": 10})
    history = [AgentMessage(MessageRole.DEVELOPER, "d"), AgentMessage(MessageRole.USER, "u"),
               AgentMessage(MessageRole.ASSISTANT, "", tool_calls=[ToolCall("c", "f", {"a": 1})]),
               AgentMessage(MessageRole.TOOL, "r", tool_call_id="c")]
    eng.continue_chat(history, tools=TOOLS)
    list(eng.stream_events(history, tools=TOOLS))

    def validate(name, instance):
        schema = {"$schema": spec["$schema"], "$defs": spec["$defs"], "$ref": f"#/$defs/{name}"}
        jsonschema.Draft202012Validator(schema).validate(instance)

    for req in stub.requests:
        validate("CreateChatCompletionRequest", req.json)
    # and the stub answers in the documented shapes
    fake = StubUpstream()
    for script in (Script(), Script(reasoning=["r"]), Script(tool_calls=[{"name": "f", "arguments": {}}])):
        for event in fake._stream_events(script, "m", {"stream_options": {"include_usage": True}}):
            data = event[len(b"data: "):].strip()
            if data != b"[DONE]":
                validate("CreateChatCompletionStreamResponse", json.loads(data))
        validate("CreateChatCompletionResponse", json.loads(fake._completion(script, "m")))
    eng.close()


# -- errors --------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_upstream_500_carries_the_upstream_message(engine, stub, stream):
    stub.script = Script(status=500, error_message="model crashed: out of memory")
    with pytest.raises(EngineError) as err:
        if stream:
            list(engine.stream_events(USER))
        else:
            engine.continue_chat(USER)
    assert err.value.code == "upstream_error"
    assert "500" in err.value.message
    assert "model crashed: out of memory" in err.value.message
    # the connection stays usable after an error response
    stub.script = None
    assert engine.continue_chat(USER).content == DEFAULT_ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_401_carries_the_upstream_message(stub, stream):
    stub.script = Script(require_key="sk-right")
    eng = OpenAICompatibleEngine({"base_url": stub, "api_key": "sk-wrong", "model": "m"})
    with pytest.raises(EngineError) as err:
        if stream:
            list(eng.stream_tokens(USER))
        else:
            eng.continue_chat(USER)
    assert err.value.code == "upstream_error"
    assert "401" in err.value.message and "Incorrect API key provided" in err.value.message
    ok = OpenAICompatibleEngine({"base_url": stub, "api_key": "sk-right", "model": "m"})
    assert ok.continue_chat(USER).content == DEFAULT_ANSWER
    eng.close()
    ok.close()


@pytest.mark.parametrize("stream", [False, True])
def test_connection_refused_is_upstream_unavailable(stream):
    eng = OpenAICompatibleEngine({"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m"})
    with pytest.raises(EngineError) as err:
        if stream:
            list(eng.stream_events(USER))
        else:
            eng.continue_chat(USER)
    assert err.value.code == "upstream_unavailable"
    assert "cannot reach upstream" in err.value.message


def test_mid_stream_error_after_answer_items(engine, stub):
    stub.script = Script(error_after=2, error_message="upstream overloaded")
    received = []
    with pytest.raises(EngineError) as err:
        for item in engine.stream_events(USER):
            received.append(item)
    assert [i.kind for i in received] == [ANSWER, ANSWER]
    assert "".join(i.text for i in received) == "Hello from"
    assert err.value.code == "upstream_error"
    assert "upstream overloaded" in err.value.message


def test_connection_dropped_mid_stream(engine, stub):
    stub.script = Script(drop_after=3)
    received = []
    with pytest.raises(EngineError) as err:
        for item in engine.stream_events(USER):
            received.append(item)
    assert len(received) == 3
    assert err.value.code == "upstream_error"


def test_malformed_json_in_stream(engine, stub):
    stub.script = Script(events=[
        ": keep-alive comment",
        "event: message",
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        "",
        "data: {not json",
        "",
    ])
    received = []
    with pytest.raises(EngineError) as err:
        for item in engine.stream_events(USER):
            received.append(item)
    assert [i.text for i in received] == ["ok"]
    assert err.value.code == "upstream_error"
    assert "malformed JSON" in err.value.message


def test_sse_without_space_and_crlf_lines(engine, stub):
    stub.script = Script(events=[
        'data:{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\r\n\r',
        'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}\r\n\r',
        'data: {"choices":[],"usage":{"total_tokens":3}}\r\n\r',
    ])
    assert "".join(engine.stream_tokens(USER)) == "ab"


def test_stream_without_events_is_an_error(engine, stub):
    stub.script = Script(events=["<html>a proxy login page</html>"], done=False)
    with pytest.raises(EngineError) as err:
        list(engine.stream_events(USER))
    assert err.value.code == "upstream_error"
    assert "no stream events" in err.value.message and "proxy login page" in err.value.message


def test_server_ignoring_stream_true_still_answers(engine, stub):
    stub.script = Script(ignore_stream=True, reasoning=["r"], tokens=["<think>t</think>", "Hi"])
    items = list(engine.stream_events(USER))
    usage = StreamItem(USAGE, data={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    assert items == [StreamItem(THINKING, "r"), StreamItem(THINKING, "t"), StreamItem(ANSWER, "Hi"), usage]
    stub.script = Script(ignore_stream=True, tool_calls=[{"id": "c", "name": "f", "arguments": {"a": 1}}])
    items = list(engine.stream_events(USER, tools=TOOLS))
    assert items == [StreamItem(TOOL, data={"index": 0, "id": "c", "name": "f",
                                            "arguments": '{"a":1}'}), usage]


def test_timeout_before_headers(stub):
    stub.script = Script(first_delay=2.0)
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m", "timeout": 0.3})
    for call in (lambda: eng.continue_chat(USER), lambda: list(eng.stream_events(USER))):
        # Had the client waited out the upstream's 2 s, the answer would have come: no error.
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.code == "upstream_timeout"
        assert stub.requests[-1].events_sent == 0
    eng.close()


def test_timeout_between_chunks(stub):
    stub.script = Script(delay=2.0)
    eng = OpenAICompatibleEngine({"base_url": stub, "model": "m", "timeout": 0.3})
    received = []
    with pytest.raises(EngineError) as err:
        for item in eng.stream_events(USER):
            received.append(item)
    assert err.value.code == "upstream_timeout"
    assert received == []  # headers and the role prelude came, the first token did not
    assert stub.requests[-1].events_sent == 1
    eng.close()


# -- stopping ----------------------------------------------------------------------

def test_should_stop_ends_a_slow_stream_and_closes_the_connection(engine, stub):
    stub.script = Script(tokens=[f"t{i} " for i in range(40)], delay=0.1)
    received = []
    for item in engine.stream_events(USER, should_stop=lambda: len(received) >= 2):
        received.append(item)
    assert [i.text for i in received] == ["t0 ", "t1 "]
    req = stub.requests[-1]
    assert stub.stub.wait_for(lambda: req.aborted, timeout=1.0), "upstream connection left open"
    assert req.events_sent <= 4  # role prelude + at most one event past the stop
    assert stub.stub.wait_for(lambda: stub.stub.open_connections == 0, timeout=1.0)
    # the engine opens a fresh connection for the next turn
    stub.script = None
    assert engine.continue_chat(USER).content == DEFAULT_ANSWER


def test_stop_set_from_another_thread_takes_effect_at_the_next_chunk(engine, stub):
    stub.script = Script(tokens=[f"t{i} " for i in range(40)], delay=0.1)
    stop, first = threading.Event(), threading.Event()
    # Another thread sets the stop once the first chunk is in (a fixed timer raced the first chunk
    # on a loaded machine, and the stream then ended before anything arrived).
    threading.Thread(target=lambda: first.wait(30) and stop.set(), daemon=True).start()
    received = []
    for item in engine.stream_events(USER, should_stop=stop.is_set):
        received.append(item)
        first.set()
    # The stop lands a chunk or two in; the rest of the 40 are never read. (Counted, not timed.)
    assert 1 <= len(received) <= 10
    req = stub.requests[-1]
    assert req.events_sent < 40
    assert stub.stub.wait_for(lambda: req.aborted, timeout=1.0)


def test_stream_items_uses_stream_events(engine, stub):
    stub.script = Script(reasoning=["r"])
    items = list(stream_items(engine, USER))
    assert items[0] == StreamItem(THINKING, "r")
    assert "".join(i.text for i in kinds(items, ANSWER)) == DEFAULT_ANSWER


# -- cookies ---------------------------------------------------------------------------

def test_a_cookie_the_upstream_sets_is_sent_back(engine, stub):
    """A load balancer's affinity cookie still works: the store skips only responses without Set-Cookie."""
    stub.script = Script(headers=["Set-Cookie: lb=node-2; Path=/"])
    engine.continue_chat(USER)
    assert "cookie" not in stub.requests[-1].headers
    stub.script = Script()
    engine.continue_chat(USER)
    assert stub.requests[-1].headers.get("cookie") == "lb=node-2"
    engine.continue_chat(USER)  # a response without Set-Cookie keeps what was set
    assert stub.requests[-1].headers.get("cookie") == "lb=node-2"


def test_a_response_without_set_cookie_costs_no_cookie_parsing(engine, stub, monkeypatch):
    """httpx would build two urllib objects per response to look for Set-Cookie (11% of the daemon's
    Python time per turn); the engine's store skips that when the header is absent. Counts the stock
    extraction, so an httpx that stops reading the store this way fails here."""
    import http.cookiejar
    calls = []
    real = http.cookiejar.CookieJar.extract_cookies
    monkeypatch.setattr(http.cookiejar.CookieJar, "extract_cookies",
                        lambda self, *a: (calls.append(1), real(self, *a))[1])
    engine.continue_chat(USER)
    list(engine.stream_events(USER))
    assert calls == []
    stub.script = Script(headers=["Set-Cookie: lb=node-1; Path=/"])
    engine.continue_chat(USER)
    assert calls == [1]
