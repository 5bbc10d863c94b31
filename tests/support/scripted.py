"""A scripted chat engine for tests: the user's message says what it streams, on cue.

A message starting with "script:" is a list of steps separated by "|":
  answer=TEXT     stream TEXT as answer tokens (split on spaces)
  thinking=TEXT   stream TEXT as thinking
  reset           withdraw the answer so far (answer_reset)
  tool=NAME       report a tool call the engine ran itself (nothing for the turn to run)
  call=NAME{json} ask the turn to call tool NAME with these arguments: the engine's step ends
                  there (consecutive call= steps are one step's parallel calls); when the engine
                  is called again with the results, the script goes on after them
  result          stream the last tool results (the TOOL messages' content) as answer text
  cite=A,B        report citations
  sleep=SECONDS   pause (between steps; checks should_stop while sleeping)
  slow=SECONDS    pause between every later token
  hang=SECONDS    block, never looking at should_stop (an engine stuck in a call that does not return)
  fail=TEXT       fail the turn with TEXT (EngineError)
  crash=TEXT      raise a plain exception (a plugin bug)
Any other message is answered "echo: <message>" with the history length.
"""
from __future__ import annotations

import json
import os
import time
from typing import Iterator

from ovos_plugin_manager.templates.agents import AgentMessage, ChatEngine, MessageRole

from plugins_app.agent.engines.base import (ANSWER, ANSWER_RESET, CITATIONS, THINKING, TOOL, EngineError,
                                      StreamItem, never_stop)

CALLS: list[dict] = []  # what the engine was asked, for in-process tests (the latest CALLS_KEPT)
CALLS_KEPT = 1000  # a bench's or a live daemon's thousands of turns must not pile up here


class ScriptedEngine(ChatEngine):
    supports_tools = True

    def continue_chat(self, messages, session_id="default", lang=None, units=None, tools=None):
        text = "".join(i.text for i in self.stream_events(messages, session_id=session_id) if i.kind == ANSWER)
        return AgentMessage(role=MessageRole.ASSISTANT, content=text)

    def stream_events(self, messages, *, session_id="default", lang=None, tools=None,
                      should_stop=never_stop) -> Iterator[StreamItem]:
        from ovos_plugin_manager.templates.agent_tools import ToolBox
        users = [i for i, m in enumerate(messages) if m.role == MessageRole.USER]
        after = messages[users[-1] + 1:] if users else []
        last = messages[users[-1]].content if users else (messages[-1].content if messages else "")
        if not after or after[-1].role != MessageRole.TOOL:
            last, after = (messages[-1].content if messages else ""), []
        done_groups = sum(1 for m in after if m.role == MessageRole.ASSISTANT and m.tool_calls)
        offered = [t["function"]["name"] for t in ToolBox.normalize_tools(tools)]
        call = {"session_id": session_id, "messages": [(m.role.value, m.content) for m in messages],
                "config": dict(self.config), "tools": offered}
        CALLS.append(call)
        if len(CALLS) > CALLS_KEPT:
            del CALLS[:len(CALLS) - CALLS_KEPT]
        if os.environ.get("UGENT_SCRIPTED_LOG"):  # a live daemon's calls, for tests in another process
            with open(os.environ["UGENT_SCRIPTED_LOG"], "a") as fh:
                fh.write(json.dumps({"session_id": session_id, "last": last}) + "\n")
        if not last.startswith("script:"):
            prefix = self.config.get("prefix", "echo")
            words = f"{prefix}: {last} (history={len(messages) - 1})".split(" ")
            for i, w in enumerate(words):
                yield StreamItem(ANSWER, w if i == 0 else " " + w)
            return
        delay = 0.0
        steps = last[len("script:"):].split("|")
        groups = 0  # call groups passed so far; those up to done_groups were streamed in earlier steps
        at = 0
        while at < len(steps):
            name, _, arg = steps[at].partition("=")
            name = name.strip()
            if name == "call":
                group = []
                while at < len(steps) and steps[at].strip().startswith("call="):
                    group.append(steps[at].strip()[len("call="):])
                    at += 1
                groups += 1
                if groups <= done_groups:
                    continue
                for n, spec in enumerate(group):
                    tool, brace, rest = spec.partition("{")
                    yield StreamItem(TOOL, tool, {"id": f"call-{groups}-{n}", "name": tool.strip(),
                                                  "arguments": (brace + rest) if brace else "{}"})
                return
            at += 1
            if groups < done_groups:
                continue  # streamed in an earlier step, before its tool results
            if name == "result":
                results = [m.content for m in after[len(after) - _trailing_tools(after):]]
                yield StreamItem(ANSWER, "\n".join(results))
            elif name in ("answer", "thinking"):
                for i, w in enumerate(arg.split(" ")):
                    if should_stop():
                        return
                    if delay:
                        _sleep(delay, should_stop)
                    yield StreamItem(ANSWER if name == "answer" else THINKING, w if i == 0 else " " + w)
            elif name == "reset":
                yield StreamItem(ANSWER_RESET)
            elif name == "tool":
                yield StreamItem(TOOL, arg, {"id": "call-1", "name": arg, "arguments": "{}", "executed": True})
            elif name == "cite":
                yield StreamItem(CITATIONS, data={"ids": arg.split(",")})
            elif name == "sleep":
                _sleep(float(arg), should_stop)
            elif name == "slow":
                delay = float(arg)
            elif name == "hang":
                time.sleep(float(arg))
            elif name == "fail":
                raise EngineError(arg, code="scripted_failure")
            elif name == "crash":
                raise RuntimeError(arg)


def _trailing_tools(messages) -> int:
    n = 0
    for m in reversed(messages):
        if m.role != MessageRole.TOOL:
            break
        n += 1
    return n


def _sleep(seconds: float, should_stop) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not should_stop():
        time.sleep(min(0.01, max(0.0, end - time.monotonic())))
