"""The ecosystem's ovos-openai-plugin chat engine works unchanged against the stub upstream.

It is loaded the way a profile loads any engine: by its ``opm.agents.chat``
entry point name, with its own config keys (``api_url``, ``key``, ``model``).
"""
import pytest
from ovos_plugin_manager.templates.agents import AgentMessage, ChatEngine, MessageRole, ToolCall

from plugins_app.agent.engines.base import ANSWER, TOOL, stream_items
from tests.fakes.upstream import DEFAULT_ANSWER, Script, run_stub_upstream

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

ENTRY_POINT = "ovos-chat-openai-plugin"
USER = [AgentMessage(role=MessageRole.USER, content="Say hello.")]


@pytest.fixture
def engine_class():
    pytest.importorskip("ovos_openai_plugin")
    from ovos_plugin_manager.agents import load_chat_plugin
    cls = load_chat_plugin(ENTRY_POINT)
    assert cls is not None, f"entry point {ENTRY_POINT!r} not found in opm.agents.chat"
    assert issubclass(cls, ChatEngine)
    return cls


@pytest.fixture
def stub():
    with run_stub_upstream() as base_url:
        yield base_url


@pytest.fixture
def engine(engine_class, stub):
    return engine_class({"api_url": str(stub), "key": "sk-third-party", "model": "tp-model"})


def test_continue_chat_answers(engine, stub):
    msg = engine.continue_chat(list(USER))
    assert msg.role == MessageRole.ASSISTANT
    assert msg.content == DEFAULT_ANSWER
    req = stub.requests[-1]
    assert req.path == "/v1/chat/completions"
    assert req.json["model"] == "tp-model"
    assert req.json["messages"][-1] == {"role": "user", "content": "Say hello."}
    assert req.auth == "Bearer sk-third-party"


def test_stream_tokens_streams(engine, stub):
    tokens = list(engine.stream_tokens(list(USER)))
    assert len(tokens) > 3  # real streaming, not the one-shot default
    assert "".join(tokens) == DEFAULT_ANSWER
    assert stub.requests[-1].json["stream"] is True


def test_streams_through_the_turn_contract(engine):
    # a third-party engine has no stream_events: stream_items falls back to stream_tokens
    items = list(stream_items(engine, list(USER)))
    assert items and all(i.kind == ANSWER for i in items)
    assert "".join(i.text for i in items) == DEFAULT_ANSWER


def test_reasoning_is_not_leaked_into_its_answer(engine, stub):
    stub.script = Script(reasoning=["private thoughts"])
    assert "".join(engine.stream_tokens(list(USER))) == DEFAULT_ANSWER


def test_tool_calls(engine, stub):
    stub.script = Script(tool_calls=[{"id": "call_1", "name": "get_weather",
                                      "arguments": {"city": "Ghent"}}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msg = engine.continue_chat(list(USER), tools=tools)
    assert msg.tool_calls == [ToolCall(id="call_1", name="get_weather", arguments={"city": "Ghent"})]
    assert stub.requests[-1].json["tools"] == tools


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_offered_tools_reach_an_engine_that_supports_them_and_its_calls_come_back(engine, stub):
    """Seed 001: `supports_tools = True` means the engine consumes `tools` and returns tool_calls on its
    message. OPM's stream_tokens takes no tools, so the turn asks continue_chat with them."""
    assert engine.supports_tools is True
    stub.script = Script(tool_calls=[{"id": "call_1", "name": "get_weather", "arguments": {"city": "Ghent"}}])
    items = list(stream_items(engine, list(USER), tools=TOOLS))
    assert stub.requests[-1].json["tools"] == TOOLS
    assert [(i.kind, i.data) for i in items if i.kind == TOOL] == [
        (TOOL, {"index": 0, "id": "call_1", "name": "get_weather", "arguments": '{"city": "Ghent"}'})]


def test_without_tools_offered_it_still_streams(engine, stub):
    items = list(stream_items(engine, list(USER)))
    assert len(items) > 3 and stub.requests[-1].json["stream"] is True


class WholeAnswerEngine(ChatEngine):
    """A third-party engine that implements only continue_chat (OPM's default stream_tokens splits it on
    whitespace) and says it takes no tools."""

    ANSWER = "Steps:\n\n1. one\n2. two\n```\ncode  here\n```"

    def __init__(self, config=None):
        super().__init__(config or {})
        self.asked = []

    def continue_chat(self, messages, session_id="default", lang=None, units=None, tools=None):
        self.asked.append(tools)
        return AgentMessage(role=MessageRole.ASSISTANT, content=self.ANSWER)


def test_an_engine_with_only_continue_chat_keeps_its_answers_line_breaks_and_code_blocks():
    engine = WholeAnswerEngine()
    items = list(stream_items(engine, list(USER), tools=TOOLS))
    assert [(i.kind, i.text) for i in items] == [(ANSWER, WholeAnswerEngine.ANSWER)]
    assert engine.asked == [None]  # supports_tools is False: offered tools are not passed
