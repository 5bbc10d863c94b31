"""The project's ChatSummarizerEngines as plain OPM engines, outside any conversation."""
from __future__ import annotations

import pytest
from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

from plugins_app.agent.engines.base import EngineError
from plugins_app.agent.engines.summarizers import (SUMMARY_HEADER, ExtractiveChatSummarizer,
                                                   OpenAICompatibleChatSummarizer, is_summary)
from tests.fakes.upstream import Script, run_stub_upstream

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode


def msg(role: str, text: str) -> AgentMessage:
    return AgentMessage(role=MessageRole(role), content=text)


def test_the_extractive_summary_is_each_messages_role_and_first_sentence():
    body = ExtractiveChatSummarizer().summarize([
        msg("user", "Book a table for two. Somewhere quiet, please."),
        msg("assistant", "Done: Luigi's at eight!  It is quiet."),
        msg("user", "   "),
    ])
    assert body.splitlines() == ["- user: Book a table for two.", "- assistant: Done: Luigi's at eight!"]


def test_an_earlier_summary_is_carried_over_and_the_newest_thirty_lines_are_kept():
    earlier = "\n".join([SUMMARY_HEADER.format(count=2), "- user: first.", "- assistant: second."])
    assert is_summary(earlier) and not is_summary("You are a helpful assistant.")
    body = ExtractiveChatSummarizer().summarize(
        [msg("system", earlier)] + [msg("user", f"line {i}.") for i in range(40)])
    lines = body.splitlines()
    assert len(lines) == 31 and lines[0] == "- (12 earlier lines omitted)"
    assert lines[-1] == "- user: line 39." and lines[1] == "- user: line 10."
    short = ExtractiveChatSummarizer().summarize([msg("system", earlier), msg("user", "third.")])
    assert short.splitlines() == ["- user: first.", "- assistant: second.", "- user: third."]


def test_a_long_first_sentence_is_cut_to_160_characters():
    line = ExtractiveChatSummarizer().summarize([msg("user", "x" * 500)])
    assert line == "- user: " + "x" * 159 + "…"


def test_the_openai_compatible_summariser_sends_the_transcript_and_returns_the_answer():
    with run_stub_upstream(Script(answer="  - they booked Luigi's  ")) as url:
        engine = OpenAICompatibleChatSummarizer({"base_url": url, "model": "m", "system_prompt": "not this",
                                                 "prompt": "Summarise, briefly."})
        try:
            body = engine.summarize([msg("user", "Book a table."), msg("assistant", "Luigi's at eight.")])
        finally:
            engine.close()
        sent = url.requests[-1].json
    assert body == "- they booked Luigi's"
    assert sent["messages"] == [{"role": "system", "content": "Summarise, briefly."},
                                {"role": "user", "content": "user: Book a table.\n\nassistant: Luigi's at eight."}]


def test_an_empty_answer_or_an_upstream_error_is_an_engine_error():
    with run_stub_upstream([Script(answer=""), Script(status=503)]) as url:
        engine = OpenAICompatibleChatSummarizer({"base_url": url})
        with pytest.raises(EngineError, match="answered nothing"):
            engine.summarize([msg("user", "hi")])
        with pytest.raises(EngineError):
            engine.summarize([msg("user", "hi")])
        engine.close()
