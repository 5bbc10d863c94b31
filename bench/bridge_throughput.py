"""Bridge throughput, each figure beside a bare Unix-socket echo of the same payloads in the same run.

    .venv/bin/python bench/bridge_throughput.py [--messages 300] [--roundtrips 2000]

1. inbound msgs/s: ``inbound.submit`` through a real BridgeServer into the
   Django hub (each message a receipt, a turn on the scripted engine run
   eagerly, and its outbound delivery row), on a throwaway SQLite database
   (or the DATABASE_URL's, in servers mode);
2. round-trips/s: ``heartbeat`` calls through the bridge (JSON-RPC framing,
   dispatch, the hub's heartbeat write);
3. the physical limit: the same frames sent to a bare Unix-socket echo server
   that answers each line with itself.

Prints each figure and the ratio bridge / bare echo. Figures, never assertions.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_TMP = tempfile.mkdtemp(prefix="ugb-")
os.environ.setdefault("UGENT_VAR_DIR", _TMP)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
os.environ.setdefault("UGENT_LOG_LEVEL", "WARNING")


def bare_echo_server(path: str) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        buf = b""
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    conn.sendall(line + b"\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def bare_roundtrips(path: str, frames: list[bytes]) -> float:
    bare_echo_server(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    f = s.makefile("rb")
    start = time.perf_counter()
    for frame in frames:
        s.sendall(frame)
        f.readline()
    elapsed = time.perf_counter() - start
    s.close()
    return len(frames) / elapsed


def django_ready() -> None:
    """Django on the scratch database, migrated, with the scripted engine and turns run eagerly."""
    import django
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)

    from plugins_app.agent.engines.registry import register_engine
    from tests.support.scripted import ScriptedEngine
    register_engine("scripted", ScriptedEngine)
    from ugent_site.celery import app
    app.conf.task_always_eager = True
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.get_or_create(name="scripted", provider="scripted", defaults={"is_default": False})


def hub_inbound(n: int, sock_dir: str):
    """``inbound.submit`` straight into the hub through a real BridgeServer: (msgs/s, client, frames, stop)."""
    import json

    from plugins_app.channel.bridge import BridgeServer, ServerThread
    from plugins_app.channel.hub import DjangoHub
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.sdk.client import RpcClient
    from plugins_app.channel.sdk.messages import InboundMessage

    run_id = f"{int(time.time())}-{os.getpid()}"
    plugin_id = f"bench-{run_id}"
    Plugin.objects.get_or_create(plugin_id=plugin_id, defaults=dict(kind="channel-bench", command="true",
                                                                    max_in_flight=64))
    bridge_path = os.path.join(sock_dir, f"bridge-{run_id}.sock")
    token = "bench-token"
    server = ServerThread(BridgeServer(socket_path=bridge_path, plugin_id=plugin_id, token=token,
                                       hub=DjangoHub())).start()
    client = RpcClient(bridge_path)
    client.call("hello", {"plugin_id": plugin_id, "token": token, "kind": "channel-bench", "version": "1"})
    msgs = [InboundMessage(channel="bench", conversation_id=f"c-{run_id}-{i % 20}", message_id=f"m-{run_id}-{i}",
                           sender_id=f"u{i % 20}", text="script:answer=ok", source_type="user").to_dict()
            for i in range(n)]
    frames = [(json.dumps({"jsonrpc": "2.0", "id": i, "method": "inbound.submit",
                           "params": {"message": m}}) + "\n").encode() for i, m in enumerate(msgs)]
    start = time.perf_counter()
    for m in msgs:
        client.call("inbound.submit", {"message": m}, timeout=60)
    rate = len(msgs) / (time.perf_counter() - start)

    def stop():
        client.close()
        server.stop()

    return rate, client, frames, stop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--roundtrips", type=int, default=2000)
    opts = ap.parse_args()
    import json

    django_ready()
    sock_dir = tempfile.mkdtemp(prefix="ugb-")
    inbound_rate, client, inbound_frames, stop = hub_inbound(opts.messages, sock_dir)
    bare_inbound = bare_roundtrips(os.path.join(sock_dir, "bare1.sock"), inbound_frames)

    beat_frames = [(json.dumps({"jsonrpc": "2.0", "id": i, "method": "heartbeat", "params": {"stats": {}}})
                    + "\n").encode() for i in range(opts.roundtrips)]
    start = time.perf_counter()
    for _ in range(opts.roundtrips):
        client.call("heartbeat", {"stats": {}}, timeout=30)
    rt_rate = opts.roundtrips / (time.perf_counter() - start)
    bare_rt = bare_roundtrips(os.path.join(sock_dir, "bare2.sock"), beat_frames)

    stop()
    from django.db import connection
    print(f"database: {connection.vendor}")
    print(f"inbound.submit into the hub : {inbound_rate:10.1f} msgs/s | bare echo {bare_inbound:10.1f} /s "
          f"| ratio {inbound_rate / bare_inbound:.4f}")
    print(f"bridge round-trips (heartbeat): {rt_rate:8.1f} /s    | bare echo {bare_rt:10.1f} /s "
          f"| ratio {rt_rate / bare_rt:.4f}")


if __name__ == "__main__":
    main()
