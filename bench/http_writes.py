"""One send() per HTTP answer against uvicorn's two (status line and headers, then the body): what it costs.

uvicorn's httptools protocol writes an answer's head and its body with a `transport.write` each. This bench
runs two bare uvicorn servers (httptools, uvloop), each in its own process, answering a chat-sized JSON body:
uvicorn's own protocol (the baseline), and the same protocol over a transport that holds writes until the
loop's next turn (`call_soon`) or the next write, so a whole answer leaves in one send(). One client on one
keep-alive connection per server sends `--requests` requests a round, the two servers interleaved over
`--rounds`; prints each server's CPU per answer (user + system, /proc/<pid>/stat) and the client's round
trip, and the ratio. Figures, never assertions (docs/performance.md, "One send() per answer").

Usage: python bench/http_writes.py [--requests 5000] [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

SERVER = r'''
import asyncio, sys
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

class CoalescedWrites:
    """Writes within one turn of the loop go to the socket as one; a close sends what is held first."""
    __slots__ = ("_transport", "_loop", "_held", "_due")

    def __init__(self, transport, loop):
        self._transport, self._loop, self._held, self._due = transport, loop, [], False

    def write(self, data):
        if data:
            self._held.append(bytes(data))
            if not self._due:
                self._due = True
                self._loop.call_soon(self._flush)

    def _flush(self):
        self._due = False
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self):
        self._flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)

class Coalescing(HttpToolsProtocol):
    def connection_made(self, transport):
        super().connection_made(CoalescedWrites(transport, self.loop))

BODY = (b'{"id":"chatcmpl-x","object":"chat.completion","created":1,"model":"stub","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}]}')

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})

proto = Coalescing if sys.argv[2] == "one-send" else HttpToolsProtocol
uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http=proto,
                              lifespan="off", log_level="warning")).run()
'''
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
           b"Content-Length: 2\r\n\r\n{}")
KINDS = ("two-sends", "one-send")


def cpu_secs(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port: int, deadline: float) -> socket.socket:
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    servers = {}
    for kind in KINDS:
        port = free_port()
        servers[kind] = (subprocess.Popen([sys.executable, "-c", SERVER, str(port), kind]), port)
    totals = {kind: [0.0, 0.0] for kind in KINDS}
    try:
        socks = {kind: connect(port, time.monotonic() + 20) for kind, (_, port) in servers.items()}
        for r in range(args.rounds):
            for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
                proc, sock = servers[kind][0], socks[kind]
                cpu0, t0 = cpu_secs(proc.pid), time.perf_counter()
                for _ in range(args.requests):
                    sock.sendall(REQUEST)
                    got = b""
                    while not got.endswith(b"}]}"):
                        chunk = sock.recv(65536)
                        if not chunk:
                            raise SystemExit(f"{kind}: the server closed the connection")
                        got += chunk
                totals[kind][0] += cpu_secs(proc.pid) - cpu0
                totals[kind][1] += time.perf_counter() - t0
            print(f"round {r + 1}/{args.rounds}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    n = args.requests * args.rounds
    for kind in KINDS:
        cpu, wall = totals[kind]
        print(f"{kind:>10}: server CPU {cpu / n * 1e6:7.1f} us an answer, round trip {wall / n * 1e6:7.1f} us")
    (c1, w1), (c0, w0) = totals["one-send"], totals["two-sends"]
    print(f"one-send over two-sends: server CPU {c1 / c0:.3f}x, round trip {w1 / w0:.3f}x")


if __name__ == "__main__":
    main()
