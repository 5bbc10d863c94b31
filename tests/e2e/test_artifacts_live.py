"""End to end on the real daemon: a tool returns a file (a real MCP server's image), the client sees
ugent.artifacts_pending then ugent.artifacts, downloads it with the owner's key, another caller's key gets
a 404, and the official openai client still parses the stream."""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.http import answer_text, parse_sse
from tests.support.schema import validate

SERVER = Path(__file__).resolve().parents[1] / "data" / "mcp_server.py"
OTHER_KEY = "ugk_e2e_other_" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("daemon-artifacts")
    conf = tmp / "ugent.toml"
    conf.write_text('[tools]\nenabled = ["mcp"]\n\n[[tools.mcp]]\nname = "charts"\n'
                    f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVER))}]\n\n'
                    '[[web.auth.keys]]\nname = "other"\nkey_env = "UGENT_WEB_API_KEY_OTHER"\nrole = "application"\n')
    d = Daemon(tmp, extra_env={"UGENT_CONFIG": str(conf), "UGENT_WEB_API_KEY_OTHER": OTHER_KEY}).start()
    yield d
    d.close()


def test_a_tools_file_reaches_the_client_and_downloads_for_the_owner_alone(daemon):
    conv = f"art-{uuid.uuid4().hex}"
    body = {"model": "scripted", "stream": True, "user": "alice", "conversation_id": conv,
            "messages": [{"role": "user", "content": "script:answer=drawing|call=chart|answer= here it is"}]}
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", headers={"x-api-key": daemon.key},
                      json=body, timeout=60) as resp:
        assert resp.status_code == 200
        frames = parse_sse(b"".join(resp.iter_bytes()))
    events = [f["event"] for f in frames if f["event"] in ("ugent.artifacts_pending", "ugent.artifacts")]
    assert events == ["ugent.artifacts_pending", "ugent.artifacts"]
    [pending] = [f["data"]["ugent_artifacts_pending"] for f in frames if f["event"] == "ugent.artifacts_pending"]
    [[ready]] = [f["data"]["ugent_artifacts"] for f in frames if f["event"] == "ugent.artifacts"]
    assert pending[0]["artifact_id"] == ready["artifact_id"] and pending[0]["pending"] is True
    assert ready["name"] == "image-1.png" and ready["url"] == f"/v1/files/{ready['id']}"
    assert answer_text(frames) == "drawing here it is"
    for f in frames[:-1]:
        if f["comment"] is None:  # keep-alives are comment lines
            validate(f["data"], "CreateChatCompletionStreamResponse")

    got = httpx.get(daemon.base + ready["url"], params={"user": "alice"}, headers={"x-api-key": daemon.key})
    assert got.status_code == 200 and got.content.startswith(b"\x89PNG\r\n\x1a\n")
    assert int(got.headers["content-length"]) == ready["bytes"] and got.headers["content-type"] == "image/png"
    other = httpx.get(daemon.base + ready["url"], headers={"x-api-key": OTHER_KEY})
    assert other.status_code == 404 and other.json()["error"]["code"] == "file_not_found"
    bob = httpx.get(daemon.base + ready["url"], params={"user": "bob"}, headers={"x-api-key": daemon.key})
    assert bob.status_code == 404
    # the receipt keeps it, for a page that closed first
    receipt = httpx.get(daemon.base + "/v1/ugent/conversation/snapshot", params={"conversation_id": conv,
                        "user": "alice"}, headers={"x-api-key": daemon.key}).json()
    assert receipt["receipts"][-1]["files"] == [ready]


def test_the_openai_client_parses_a_stream_carrying_artifacts(daemon):
    client = openai.OpenAI(base_url=daemon.base + "/v1", api_key=daemon.key, max_retries=2)
    stream = client.chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "script:call=chart|answer=done"}],
        extra_body={"user": "alice", "conversation_id": f"art-{uuid.uuid4().hex}"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "done"
    plain = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "script:call=chart|answer=done"}],
        extra_body={"user": "alice", "conversation_id": f"art-{uuid.uuid4().hex}"})
    [entry] = plain.model_extra["ugent_artifacts"]
    assert entry["name"] == "image-1.png" and not entry.get("pending")
