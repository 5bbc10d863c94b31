"""A MultimodalChatEngine is shown every message as a MultimodalAgentMessage (seed 001), every field kept:
a tool round's calls and results must still pair up (plugins_app.agent.engines.base.messages_for)."""
from __future__ import annotations

import pytest
from ovos_plugin_manager.templates.agents import (AgentMessage, MessageRole, MultimodalAgentMessage,
                                                  MultimodalChatEngine)

from plugins_app.agent.engines.base import messages_for

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode


class Multimodal(MultimodalChatEngine):
    def continue_chat(self, messages, session_id="default", lang=None, units=None):
        return MultimodalAgentMessage(role=MessageRole.ASSISTANT, content="ok")


def test_a_tool_round_keeps_its_calls_and_results_and_a_plain_engine_gets_the_messages_as_they_are():
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages = [AgentMessage(role=MessageRole.USER, content="read it"),
                AgentMessage(role=MessageRole.ASSISTANT, content="", tool_calls=[call]),
                AgentMessage(role=MessageRole.TOOL, content="the file", tool_call_id="call_1", name="read")]
    shown = messages_for(Multimodal({}), messages)
    assert all(isinstance(m, MultimodalAgentMessage) and m.image_content == [] for m in shown)
    assert shown[1].tool_calls == [call] and (shown[2].tool_call_id, shown[2].name) == ("call_1", "read")
    assert [m.content for m in shown] == ["read it", "", "the file"]
    assert messages_for(object(), messages) is messages
