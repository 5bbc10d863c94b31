"""An MCP server plugged in as a toolbox (ovos-tool-adapters' MCP ToolBox), driven by a real turn.

The server is a real process on stdio (tests/data/mcp_server.py, the `mcp` package's own server),
configured in ugent.toml `[[tools.mcp]]`; the scripted engine calls its tools and reads their results.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from channels_app.models import ToolCall
from plugins_app.agent.tools.plugins import toolboxes_close
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)

SERVER = Path(__file__).resolve().parents[1] / "data" / "mcp_server.py"  # not in tests/support: its http.py would shadow the stdlib's


@pytest.fixture
def mcp_enabled(tools_toml):
    tools_toml('[tools]\nenabled = ["mcp"]\n\n[[tools.mcp]]\nname = "calc"\n'
               f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVER))}]\n')
    yield
    toolboxes_close()  # the server's process ends with its session


def chat(client, who, text):
    body = {"messages": [{"role": "user", "content": text}], "user": who["user"], "conversation_id": "c-mcp"}
    return client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                       headers={"x-api-key": who["key"]})


def test_a_turn_calls_an_mcp_servers_tools_and_gets_their_results(tcast, mcp_enabled, client):
    resp = chat(client, tcast.alice, 'script:call=add{"a": 2, "b": 3}|call=shout{"text": "hi"}|result|answer= ok')
    assert resp.status_code == 200, resp.content
    text = resp.json()["choices"][0]["message"]["content"]
    calls = {c.name: c for c in ToolCall.objects.all()}
    assert set(calls) == {"add", "shout"} and not any(c.error for c in calls.values())
    assert "5" in json.dumps(calls["add"].result) and "HI" in json.dumps(calls["shout"].result)
    assert "5" in text and "HI" in text and text.endswith("ok")


def test_a_narrowed_turn_is_not_offered_the_mcp_tools(tcast, mcp_enabled, client):
    body = {"messages": [{"role": "user", "content": 'script:call=add{"a": 1, "b": 1}|result'}],
            "user": "alice", "conversation_id": "c-mcp2", "ugent_denied_tools": ["add"]}
    resp = client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                       headers={"x-api-key": tcast.alice["key"]})
    assert resp.status_code == 200
    call = ToolCall.objects.get()
    assert call.name == "add" and call.error  # asked for a tool it was not offered: an error result, not a run


def test_an_mcp_image_is_a_file_of_the_conversation_for_its_owner(tcast, mcp_enabled, client, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "ugent_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "files")}}}
    resp = chat(client, tcast.alice, "script:call=chart|answer=here")
    assert resp.status_code == 200, resp.content
    [entry] = resp.json()["ugent_artifacts"]
    assert (entry["name"], entry["mime"]) == ("image-1.png", "image/png")
    got = client.get(entry["url"], {"user": "alice"}, headers={"x-api-key": tcast.alice["key"]})
    assert got.status_code == 200 and got.content.startswith(b"\x89PNG\r\n\x1a\n")
    assert client.get(entry["url"], {"user": "bob"}, headers={"x-api-key": tcast.alice["key"]}).status_code == 404
    call = ToolCall.objects.get()
    assert call.result["raw"] == [{"type": "image", "artifact_id": entry["artifact_id"], "name": "image-1.png"}]
