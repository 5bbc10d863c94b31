"""The live call's WebSocket on the real daemon (rundaemon embedded, uvicorn in servers mode), with a real
client (websocket-client) over TCP: the handshake is accepted and the call closed with the spec's code and
why, where it used to fail the handshake (the ASGI app routed HTTP only)."""
from __future__ import annotations

import struct
import uuid

import pytest
import websocket

from channels_app import voice
from channels_app.api_voice import close_reason


def close_frame(daemon, query: str, key: str | None):
    ws = websocket.create_connection(f"ws://127.0.0.1:{daemon.port}/v1/ugent/live?{query}", timeout=20,
                                     header=[f"x-api-key: {key}"] if key else [])
    try:
        opcode, data = ws.recv_data(control_frame=True)
        assert opcode == websocket.ABNF.OPCODE_CLOSE
        return struct.unpack("!H", data[:2])[0], data[2:].decode()
    finally:
        ws.close()


def test_a_live_call_closes_with_4422_and_why(daemon):
    code, reason = close_frame(daemon, f"conversation_id=live-{uuid.uuid4().hex[:8]}&user=alice", daemon.key)
    assert (code, reason) == (4422, close_reason(voice.LIVE_UNAVAILABLE))


def test_a_live_call_without_a_key_closes_with_4401(daemon):
    assert close_frame(daemon, "conversation_id=live-x&user=alice", None)[0] == 4401


def test_another_websocket_path_is_refused_at_the_handshake(daemon):
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(f"ws://127.0.0.1:{daemon.port}/v1/ugent/events", timeout=20,
                                    header=[f"x-api-key: {daemon.key}"])
    assert info.value.status_code == 403
