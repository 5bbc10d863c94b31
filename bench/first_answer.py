"""The first answer after a start: warmed at start (the default) beside a cold start, in one run.

Each round starts a fresh daemon on a fresh install whose default profile is the offline notes engine
over a notes folder (the project's notes plus --notes generated ones), waits for GET /v1/health to
answer, then at once sends one chat turn and times it. The baseline is the same start with
UGENT_WARM_AT_START=false (discovery and the notes index then happen in the first turn). Rounds
alternate between the two so both see the same machine.

Usage: python bench/first_answer.py [--rounds 3] [--notes 2000] [--servers]
  --servers  uvicorn and a Celery worker over Redis and PostgreSQL (REDIS_URL, default
             redis://127.0.0.1:6379/12; each round's database is created and dropped)
Prints figures; asserts nothing. Target: the first answer within 2 s of /v1/health.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.daemon import Daemon  # noqa: E402

WORDS = ("agent gateway channel plugin worker rule cron turn receipt stream cursor snapshot model profile "
         "engine notes index operator caller actor conversation message delivery outbox bridge socket").split()


class _Daemon(Daemon):
    def wait_ready(self, timeout: float = 120):
        """Up when /v1/health answers: no settling pause, the first turn follows at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError((self.tmp / "daemon.log").read_text()[-3000:])
            try:
                if httpx.get(self.base + "/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("no health: " + (self.tmp / "daemon.log").read_text()[-3000:])


def notes_folder(dest: Path, count: int) -> None:
    shutil.copytree(ROOT / "workspace" / "notes", dest)
    rng = random.Random(12)
    for i in range(count):
        sections = "\n\n".join(f"## {' '.join(rng.choices(WORDS, k=3))}\n\n" +
                               " ".join(rng.choices(WORDS, k=120)) + "." for _ in range(4))
        (dest / f"generated-{i:05d}.md").write_text(f"# Note {i}\n\n{sections}\n")


def one_round(warm: bool, notes: int, servers: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ugent-first-"))
    d = _Daemon(tmp, servers=servers, extra_env={"UGENT_WARM_AT_START": "true" if warm else "false",
                                                 "UGENT_LLM_BASE_URL": "", "UGENT_CPU_AFFINITY": "off"})
    try:
        (tmp / "workspace").mkdir(parents=True)
        notes_folder(tmp / "workspace" / "notes", notes)
        if servers:
            d._pg(f'CREATE DATABASE "{d.dbname}"')
        d.manage("migrate", "--noinput")
        t0 = time.perf_counter()
        d.spawn()
        healthy = time.perf_counter()
        body = {"messages": [{"role": "user", "content": "How do I configure a model?"}]}
        with httpx.Client(timeout=120, headers={"x-api-key": d.key}) as client:
            r = client.post(d.base + "/v1/chat/completions", json=body)
            first = time.perf_counter()
            r.raise_for_status()
            answer = r.json()["choices"][0]["message"]["content"]
            client.post(d.base + "/v1/chat/completions", json=body).raise_for_status()
            second = time.perf_counter()
        return {"health": healthy - t0, "first": first - healthy, "second": second - first, "answer": answer}
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run_mode(servers: bool) -> None:
    """The run mode the bench's daemons start in: servers over REDIS_URL (redis://127.0.0.1:6379/12 unless
    set) and DATABASE_URL's PostgreSQL, or embedded, whatever this shell has set."""
    if servers:
        os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/12")
    else:
        os.environ.pop("REDIS_URL", None)
        os.environ.pop("DATABASE_URL", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--notes", type=int, default=2000, help="generated notes beside the project's own")
    ap.add_argument("--servers", action="store_true")
    args = ap.parse_args()
    run_mode(args.servers)
    results = {True: [], False: []}
    for i in range(args.rounds):
        for warm in (False, True):
            r = one_round(warm, args.notes, args.servers)
            results[warm].append(r)
            print(f"  round {i + 1} {'warmed' if warm else 'cold  '}: health {r['health']:.2f} s, first answer "
                  f"{r['first']:.2f} s after it, second {r['second'] * 1000:.0f} ms", file=sys.stderr, flush=True)
    mode = "servers mode (uvicorn + celery worker)" if args.servers else "embedded daemon"
    print(f"first answer after /v1/health: {mode}, notes engine over {args.notes + 6} notes, {args.rounds} rounds")
    print(f"{'start':<34}{'health s':>10}{'first p50 s':>13}{'first max s':>13}{'start→answer s':>16}"
          f"{'second ms':>11}")
    for warm, label in ((False, "cold (UGENT_WARM_AT_START=false)"), (True, "warmed at start (default)")):
        rs = results[warm]
        print(f"{label:<34}{statistics.median(r['health'] for r in rs):>10.2f}"
              f"{statistics.median(r['first'] for r in rs):>13.2f}{max(r['first'] for r in rs):>13.2f}"
              f"{statistics.median(r['health'] + r['first'] for r in rs):>16.2f}"
              f"{statistics.median(r['second'] for r in rs) * 1000:>11.0f}")
    print("target: the first answer within 2 s of /v1/health")
    print("answer:", results[True][0]["answer"][:100])


if __name__ == "__main__":
    main()
