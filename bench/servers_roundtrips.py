"""Round trips per chat turn in servers mode: PostgreSQL statements and Redis commands.

Starts the stub upstream and the servers layout (tests/support/layout.py: HAProxy, two uvicorn web
processes, two Celery workers, beat, the supervisor, over the private PostgreSQL and Redis), with
`log_min_duration_statement = 0` for the layout's own database only (a connection option, so no other database
of the cluster logs anything). Sends `--turns` chat turns one after another, then counts, per turn:

  * the statements PostgreSQL received from the layout's processes (its log; BEGIN and COMMIT are
    statements too, each a round trip), by process kind (web, worker) and by shape (literals out; an
    EXECUTE of a prepared statement shown as that statement);
  * the Redis commands the layout's processes sent (`MONITOR` on the private Redis, attributed to
    the processes by their client ports, so another run sharing that Redis is not counted).

Usage: python bench/servers_roundtrips.py [--turns 50] [--stream] [--shapes 40] [--py-spy SECONDS]
  --py-spy   then keep sending turns for SECONDS while py-spy samples each web and worker process
             (`--gil`: the threads holding the GIL), and print where their CPU went
Prints counts; asserts nothing. Round trips bound servers mode's latency at one client: each is a
wake-up of another process on the same cores (docs/performance.md).
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.chat_latency import bench_profile, one_request, start_stub  # noqa: E402
from tests.support.layout import Layout  # noqa: E402

LITERALS = re.compile(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")


def shape(sql: str) -> str:
    sql = LITERALS.sub("?", " ".join(sql.split()))
    return re.sub(r"\(\?(?:, \?)+\)", "(?..)", sql)[:160]


def pg_log_path(layout: Layout) -> Path:
    return Path(f"/var/log/postgresql/postgresql-{layout.pg.version}-{layout.pg.cluster}.log")


def pids_by_port(port: int) -> dict[int, int]:
    """Local client port -> pid, for the TCP connections to 127.0.0.1:port (ss, as root)."""
    out = subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.search(r"127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:\d+.*pid=(\d+)", line)
        if m:
            found[int(m.group(1))] = int(m.group(2))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--shapes", type=int, default=40, help="how many statement shapes to list")
    ap.add_argument("--py-spy", type=float, default=0, metavar="SECONDS")
    args = ap.parse_args()
    stub, stub_url = start_stub()
    lay = Layout(Path(tempfile.mkdtemp(prefix="ugent-roundtrips-")))
    # Only this database's sessions log their statements (the setting is a connection option).
    lay.env["DATABASE_URL"] += "?options=" + quote("-c log_min_duration_statement=0")
    try:
        lay.start(profiles_shell=bench_profile(stub_url))
        kinds = {p.pid: name for name, p in lay.procs.items()}
        url, headers = lay.base + "/v1/chat/completions", {"x-api-key": lay.key}
        with httpx.Client(timeout=60) as c:
            for _ in range(20):  # warm-up: connections, imports, pools
                one_request(c, url, headers, "bench", args.stream)
            time.sleep(1.0)
            log = pg_log_path(lay)
            start = log.stat().st_size
            monitor = subprocess.Popen(["redis-cli", "-p", str(lay.redis.port), "monitor"], stdout=subprocess.PIPE,
                                       text=True)
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(monitor.stdout), daemon=True)
            reader.start()
            time.sleep(0.3)
            ports = pids_by_port(lay.redis.port)
            for i in range(args.turns):
                one_request(c, url, headers, "bench", args.stream)
                if (i + 1) % max(1, args.turns // 5) == 0:
                    print(f"  {i + 1}/{args.turns} turns", file=sys.stderr, flush=True)
            time.sleep(0.5)
            ports.update(pids_by_port(lay.redis.port))
            # PostgreSQL logs its backend's pid: map it to the client process through the client port
            pg_ports = pids_by_port(lay.pg.port)
            backends = {pid: pg_ports.get(port) for pid, port in lay.pg.sql(
                "SELECT pid, client_port FROM pg_stat_activity WHERE datname = %s", "postgres", (lay.dbname,))}
            monitor.terminate()
            monitor.wait(5)
            reader.join(5)
        # children (celery's pool is threads, uvicorn one process): a process's parent stands for it
        def kind_of(pid: int) -> str | None:
            while pid > 1:
                if pid in kinds:
                    return kinds[pid].split("-")[0]
                try:
                    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    return None
            return None

        # PostgreSQL: "<ts> [pid] user@db LOG:  duration: X ms  statement: SQL" (SQL continues on tab lines)
        with open(log, errors="replace") as fh:
            fh.seek(start)
            text = fh.read()
        per_kind: collections.Counter = collections.Counter()
        server_ms: collections.Counter = collections.Counter()
        shapes: collections.Counter = collections.Counter()
        shapes_ms: collections.Counter = collections.Counter()
        entry = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] (\S+)@(\S+) LOG:  duration: ([\d.]+) ms  "
                           r"(?:statement|execute [^:]*): (.*)$")
        current = None

        # Statements run prepared (UGENT_PG_PREPARE) arrive as `EXECUTE ugent_N(...)`: each is shown as the
        # statement its backend prepared under that name (in the warm-up, so read from the log's start).
        with open(log, errors="replace") as fh:
            prepared = {(int(m.group(1)), m.group(2)): m.group(3) for m in re.finditer(
                r"^\S+ \S+ \S+ \[(\d+)\] \S+ LOG:  duration: [\d.]+ ms  statement: "
                r"(?:SAVEPOINT ugent_prepare; )?PREPARE (ugent_\d+) AS (.*?)(?:; RELEASE SAVEPOINT ugent_prepare)?$",
                fh.read(), re.M)}

        def done(cur):
            if cur:
                sql = re.sub(r"EXECUTE (ugent_\d+)(?:\((?:'(?:[^']|'')*'|[^;'])*\))?",
                             lambda m: prepared.get((cur[3], m.group(1)), m.group(0)), cur[1])
                key = cur[0] + " | " + shape(sql)
                shapes[key] += 1
                shapes_ms[key] += cur[2]

        for line in text.splitlines():
            m = entry.match(line)
            if m:
                done(current)
                current = None
                if m.group(3) != lay.dbname:
                    continue
                client = backends.get(int(m.group(1)))
                k = (kind_of(client) if client else None) or "other"
                per_kind[k] += 1
                server_ms[k] += float(m.group(4))
                current = [k, m.group(5), float(m.group(4)), int(m.group(1))]
            elif current and line.startswith("\t"):
                current[1] += " " + line.strip()
            else:
                done(current)
                current = None
        done(current)
        n = args.turns
        print(f"servers mode, {n} {'stream' if args.stream else 'non-stream'} turns at one client, per turn:")
        print(f"  PostgreSQL statements: {sum(per_kind.values()) / n:.1f} "
              + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(per_kind.items())))
        print("  PostgreSQL's own execution time: "
              + ", ".join(f"{k} {v / n:.2f} ms" for k, v in sorted(server_ms.items())))
        # Redis: '<ts> [<db> 127.0.0.1:<port>] "CMD" ...'
        redis_kind: collections.Counter = collections.Counter()
        redis_cmds: collections.Counter = collections.Counter()
        rx = re.compile(r'^\S+ \[\d+ 127\.0\.0\.1:(\d+)\] "(\w+)"')
        for line in lines:
            m = rx.match(line)
            if not m:
                continue
            pid = ports.get(int(m.group(1)))
            k = kind_of(pid) if pid else None
            if k is None:
                continue
            redis_kind[k] += 1
            redis_cmds[f"{k} {m.group(2).upper()}"] += 1
        print(f"  Redis commands: {sum(redis_kind.values()) / n:.1f} "
              + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(redis_kind.items())))
        for cmd, v in redis_cmds.most_common():
            print(f"    {v / n:6.2f}  {cmd}")
        print("  statement shapes (per turn):")
        print("    count  server ms  process | statement")
        for s, v in shapes.most_common(args.shapes):
            print(f"    {v / n:5.2f}  {shapes_ms[s] / n:9.3f}  {s}")
        if args.py_spy:
            profile(lay, url, headers, args.stream, args.py_spy)
    finally:
        lay.close()
        stub.terminate()


def profile(lay: Layout, url: str, headers: dict, stream: bool, seconds: float) -> None:
    """py-spy on each web and worker process while one client sends turns; the functions that held the
    GIL most, by process kind, as a share of the samples (self, and with what they called)."""
    spy = ROOT / ".venv" / "bin" / "py-spy"
    if not spy.exists():
        print("py-spy is not installed in .venv: no profile", file=sys.stderr)
        return
    out = Path(tempfile.mkdtemp(prefix="ugent-pyspy-"))
    names = [n for n in lay.procs if n.startswith(("web", "worker"))]
    stop = threading.Event()
    sent = [0]

    def load():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                one_request(c, url, headers, "bench", stream)
                sent[0] += 1
    t = threading.Thread(target=load, daemon=True)
    t.start()
    spies = [subprocess.Popen([str(spy), "record", "--gil", "--nonblocking", "-r", "200", "-d", str(int(seconds)),
                               "-f", "raw", "-o", str(out / f"{n}.txt"), "-p", str(lay.procs[n].pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in names]
    for p in spies:
        p.wait()
    stop.set()
    t.join(60)
    print(f"\npy-spy --gil, {seconds:.0f} s at one client ({sent[0]} turns), files in {out}:")
    for kind in ("web", "worker"):
        selfc: collections.Counter = collections.Counter()
        incl: collections.Counter = collections.Counter()
        total = 0
        for n in names:
            f = out / f"{n}.txt"
            if not n.startswith(kind) or not f.exists():
                continue
            for line in f.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if not stack:
                    continue
                c = int(count)
                total += c
                frames = stack.split(";")
                selfc[frames[-1]] += c
                for fr in set(frames):
                    incl[fr] += c
        if not total:
            continue
        print(f"  {kind}: {total} samples, {total / 200 / max(1, sent[0]) * 1000:.2f} ms of GIL per turn")
        print("    self:")
        for fr, c in selfc.most_common(25):
            print(f"      {100 * c / total:5.1f}%  {fr[:150]}")
        print("    inclusive:")
        for fr, c in incl.most_common(60):
            print(f"      {100 * c / total:5.1f}%  {fr[:150]}")


if __name__ == "__main__":
    main()
