"""A test toolbox (hub-registered as "testing") and a fixture that enables toolboxes through ugent.toml."""
from __future__ import annotations

import base64
import time

import pytest
from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput

from channels_app import tools as hub_tools


#: What the finish_pending tool runs with the turn's ToolContext (a test sets it).
AFTER_MAKE_FILE = None


class NoArgs(ToolArguments):
    pass


class EchoArgs(ToolArguments):
    text: str


class PathArgs(ToolArguments):
    path: str


class SleepArgs(ToolArguments):
    seconds: float


class AnyOut(ToolOutput):
    model_config = {"extra": "allow"}


class TestingToolBox(ToolBox):
    """noop, echo, sleep, boom, make_file, file_at, finish_pending, link_file: what the loop's tests call."""

    def __init__(self, ctx=None):
        self.ctx = ctx
        super().__init__(toolbox_id="testing")

    def discover_tools(self):
        def tool(name, args, fn):
            return AgentTool(name=name, description=name, argument_schema=args, output_schema=AnyOut, tool_call=fn)
        return [
            tool("noop", NoArgs, lambda a: {}),
            tool("echo", EchoArgs, lambda a: {"echo": a.text}),
            tool("sleep", SleepArgs, lambda a: (time.sleep(a.seconds), {"slept": a.seconds})[1]),
            tool("boom", NoArgs, lambda a: (_ for _ in ()).throw(RuntimeError("the tool broke"))),
            tool("make_file", NoArgs, lambda a: {"artifacts": [
                {"name": "report.txt", "mime": "text/plain", "content_base64": base64.b64encode(b"hello").decode()},
                {"name": "big.bin", "mime": "application/octet-stream", "pending": True, "artifact_id": "big-1"}]}),
            tool("file_at", PathArgs, lambda a: {"artifacts": [{"name": a.path.rsplit("/", 1)[-1], "path": a.path}]}),
            tool("finish_pending", NoArgs, lambda a: (AFTER_MAKE_FILE(self.ctx), {"finished": True})[1]),
            tool("link_file", NoArgs, lambda a: {"artifacts": [{"name": "far.pdf", "url": "https://example.test/far.pdf"}]}),
        ]


hub_tools.hub_toolbox_register("testing", lambda ctx: TestingToolBox(ctx))


@pytest.fixture
def tools_toml(tmp_path, settings):
    """enable(text): write ugent.toml with `text` and read it anew; undone after the test."""
    from ugent_common import config

    def enable(text: str):
        path = tmp_path / "ugent.toml"
        path.write_text(text)
        settings.UGENT_CONFIG = str(path)
        config.reset_caches()
        return path

    yield enable
    config.reset_caches()
