"""Where a servers-mode turn's wall-clock time goes, hop by hop, read off the wire.

Starts the stub upstream and the servers layout (tests/support/layout.py), captures loopback with
tcpdump on the layout's ports (the proxy, both web processes, PostgreSQL, Redis, the stub), and sends
`--turns` chat turns one at a time, `--gap` ms apart. Every TCP segment that carries data is labelled
by who sent it to whom (a client port is mapped to its process with `ss`), and within each turn the
time since the segment before it is charged to the segment's sender: that is the time the sender took
to answer what it got, or to act on it, on a two-core machine waiting for a core included.

Prints, per turn at p50 (and the mean): the whole turn, the time charged to each process kind
(client, proxy, web, worker, PostgreSQL, Redis, stub), and the commonest sequence of hops with the
median gap before each. Asserts nothing.

Usage: python bench/servers_timeline.py [--turns 200] [--gap 30] [--stream]
Needs tcpdump (Debian's package) and root for the capture.
"""
from __future__ import annotations

import argparse
import collections
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.chat_latency import bench_profile, one_request, start_stub  # noqa: E402
from bench.servers_roundtrips import pids_by_port as ports_of  # noqa: E402
from tests.support.layout import Layout  # noqa: E402


def read_pcap(path: Path):
    """(time, src_port, dst_port, payload_len) for each TCP segment over IPv4 that carries data."""
    data = path.read_bytes()
    if len(data) < 24:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    endian, nano = ("<", False) if magic == 0xA1B2C3D4 else ("<", True) if magic == 0xA1B23C4D else (">", False)
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    link_len = {1: 14, 113: 16, 276: 20, 0: 4}.get(linktype)
    if link_len is None:
        raise SystemExit(f"unknown link type {linktype}")
    out, pos = [], 24
    while pos + 16 <= len(data):
        sec, frac, caplen, _ = struct.unpack(endian + "IIII", data[pos:pos + 16])
        pkt = data[pos + 16:pos + 16 + caplen]
        pos += 16 + caplen
        ip = pkt[link_len:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 15) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:]
        sport, dport = struct.unpack("!HH", tcp[:4])
        doff = (tcp[12] >> 4) * 4
        payload = total - ihl - doff
        if payload > 0:
            out.append((sec + frac / (1e9 if nano else 1e6), sport, dport, payload))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--gap", type=float, default=30, help="ms between turns")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    if not shutil.which("tcpdump"):
        raise SystemExit("tcpdump is not installed (apt-get install tcpdump)")
    stub, stub_url = start_stub()
    stub_port = int(stub_url.rsplit(":", 1)[1].split("/")[0])
    tmp = Path(tempfile.mkdtemp(prefix="ugent-timeline-"))
    lay = Layout(tmp)
    try:
        lay.start(profiles_shell=bench_profile(stub_url))
        url, headers = lay.base + "/v1/chat/completions", {"x-api-key": lay.key}
        servers = {lay.proxy_port: "proxy", lay.pg.port: "pg", lay.redis.port: "redis", stub_port: "stub",
                   **{port: name for name, port in lay.web_ports.items()}}
        kinds = {p.pid: name for name, p in lay.procs.items()}

        def kind_of(pid: int) -> str:
            while pid > 1:
                if pid in kinds:
                    return kinds[pid]
                try:
                    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    break
            return "other"

        with httpx.Client(timeout=60) as c:
            for _ in range(30):
                one_request(c, url, headers, "bench", args.stream)
            pcap = tmp / "turns.pcap"
            ports = " or ".join(f"port {p}" for p in servers)
            dump = subprocess.Popen(["tcpdump", "-i", "lo", "-n", "-s", "96", "-B", "16384", "-w", str(pcap),
                                     f"tcp and ({ports})"], stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            owners: dict[int, str] = {}
            for port, name in servers.items():
                if name in ("pg", "redis", "stub"):
                    owners.update({cp: kind_of(pid) for cp, pid in ports_of(port).items()})
            marks = []
            for i in range(args.turns):
                t0 = time.time()
                one_request(c, url, headers, "bench", args.stream)
                marks.append((t0, time.time()))
                time.sleep(args.gap / 1000)
                if (i + 1) % max(1, args.turns // 5) == 0:
                    print(f"  {i + 1}/{args.turns} turns", file=sys.stderr, flush=True)
            for port, name in servers.items():
                if name in ("pg", "redis", "stub"):
                    owners.update({cp: kind_of(pid) for cp, pid in ports_of(port).items()})
            time.sleep(0.5)
            dump.send_signal(signal.SIGINT)
            dump.wait(10)
        segments = read_pcap(pcap)
    finally:
        lay.close()
        stub.terminate()

    def who(src: int, dst: int) -> tuple[str, str]:
        if src in servers:
            server = servers[src]
            peer = dst
        else:
            server = servers.get(dst, "?")
            peer = src
        if server == "proxy":
            client = "client"
        elif server.startswith("web-"):
            client = "proxy"
        else:
            client = owners.get(peer, "other")
        return (server, client) if src in servers else (client, server)

    def family(name: str) -> str:
        return name.split("-")[0]

    totals, per_kind, sequences, gaps = [], collections.defaultdict(list), collections.Counter(), collections.defaultdict(list)
    j = 0
    for t0, t1 in marks:
        while j < len(segments) and segments[j][0] < t0:
            j += 1
        inside = []
        while j < len(segments) and segments[j][0] <= t1 + 0.002:
            inside.append(segments[j])
            j += 1
        start = next((k for k, s in enumerate(inside) if who(s[1], s[2]) == ("client", "proxy")), None)
        end = max((k for k, s in enumerate(inside) if who(s[1], s[2]) == ("proxy", "client")), default=None)
        if start is None or end is None or end <= start:
            continue
        turn = inside[start:end + 1]
        totals.append((turn[-1][0] - turn[0][0]) * 1000)
        charged = collections.Counter()
        hops = []
        for prev, seg in zip(turn, turn[1:]):
            src, dst = who(seg[1], seg[2])
            gap = (seg[0] - prev[0]) * 1000
            charged[family(src)] += gap
            hop = f"{src}->{dst}"
            if not hops or hops[-1] != hop:
                hops.append(hop)
                gaps[(len(hops) - 1, hop)].append(gap)
            else:
                gaps[(len(hops) - 1, hop)][-1] += gap
        for k in ("proxy", "web", "worker", "pg", "redis", "stub", "client", "other"):
            per_kind[k].append(charged.get(k, 0.0))
        sequences[tuple(hops)] += 1

    n = len(totals)
    if not n:
        raise SystemExit("no turn found in the capture")
    print(f"servers mode, {n} {'stream' if args.stream else 'non-stream'} turns at one client "
          f"(first byte in at the proxy to the last byte out), ms:")
    print(f"  whole turn on the wire: p50 {statistics.median(totals):.2f}  mean {statistics.fmean(totals):.2f}")
    print("  charged to the sender of each segment (its time to act on what it got, waits for a core included):")
    for k, xs in per_kind.items():
        if any(xs):
            print(f"    {k:8s} p50 {statistics.median(xs):6.2f}  mean {statistics.fmean(xs):6.2f}")
    common, count = sequences.most_common(1)[0]
    print(f"  the commonest sequence of hops ({count} of {n} turns), median ms before each:")
    for i, hop in enumerate(common):
        xs = gaps[(i, hop)]
        print(f"    {i:2d} {hop:28s} {statistics.median(xs):6.2f}")


if __name__ == "__main__":
    main()
