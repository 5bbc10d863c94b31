"""A turn's liveness against the real daemon, in the run mode the environment names, with kill -9.

A killed worker's turn ends interrupted within 30 s (the lease lapses), keeping what streamed; a
healthy turn streaming for many leases is never swept; the runner's own limit fails a turn with a
reason and nothing follows its terminal event; and (servers mode) a message accepted while the
broker is down is answered as queued and runs when the broker is back, empty.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.support.daemon import Daemon, free_port

SERVERS = bool(os.environ.get("REDIS_URL"))
#: Short leases so a lapse is seen in seconds; the sweep every second (beat, in either mode).
FAST_LEASE = {"UGENT_TURN_LEASE_SECONDS": "3", "UGENT_TURN_LEASE_RENEW_SECONDS": "0.5",
              "UGENT_TURN_SWEEP_SECONDS": "1", "UGENT_TURN_REQUEUE_SECONDS": "2"}
TERMINAL = ("turn.completed", "turn.failed", "turn.cancelled")


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def chat(d: Daemon, text: str, conversation_id: str, *, stream: bool = False, timeout: float = 60):
    body = {"messages": [{"role": "user", "content": text}], "conversation_id": conversation_id,
            "client_message_id": "m1", "user": "alice", "stream": stream}
    return httpx.post(d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key}, timeout=timeout)


def receipt(d: Daemon, conversation_id: str) -> dict:
    return httpx.get(d.base + "/v1/ugent/receipt", headers={"x-api-key": d.key}, timeout=10,
                     params={"conversation_id": conversation_id, "client_message_id": "m1",
                             "user": "alice"}).json()


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(interval)
    return None


def turn_events(d: Daemon, conversation_id: str) -> list[tuple[str, str]]:
    return [(t, json.loads(data) if isinstance(data, str) else data) for t, data in d.sql(
        "SELECT e.type, e.data FROM channels_app_event e JOIN channels_app_turn t ON t.id = e.turn_id "
                 "JOIN channels_app_conversation c ON c.id = t.conversation_id WHERE c.external_id = ? "
        "ORDER BY e.id", (conversation_id,))]


def deltas(d: Daemon, conversation_id: str) -> int:
    return sum(1 for t, _ in turn_events(d, conversation_id) if t == "turn.delta")


@pytest.fixture
def daemon(tmp_path):
    made = []

    def start(concurrency=None, **env):
        d = Daemon(tmp_path / f"d{len(made)}", extra_env={**FAST_LEASE, **env}, beat=True, concurrency=concurrency)
        (tmp_path / f"d{len(made)}").mkdir()
        made.append(d)
        d.start()
        # The first turn of a process loads the engines (entry points: seconds on a busy machine), which
        # a short run limit cuts off (502); once they are loaded a turn answers.
        assert wait_for(lambda: chat(d, "warm up", f"c-warm-{time.monotonic()}", timeout=180).status_code == 200,
                        timeout=300, interval=1)
        return d
    yield start
    for d in made:
        d.close()


def test_a_killed_workers_turn_ends_interrupted_within_30s_keeping_what_it_streamed(daemon):
    d = daemon()

    def send():
        try:
            chat(d, "script:slow=0.1|answer=" + words(600), "c-kill", stream=True, timeout=5)
        except httpx.HTTPError:
            pass
    threading.Thread(target=send, daemon=True).start()
    assert wait_for(lambda: deltas(d, "c-kill") >= 5, timeout=30)
    d.kill_worker()
    streamed_before = "".join(data["text"] for t, data in turn_events(d, "c-kill") if t == "turn.delta")
    if SERVERS:
        d.spawn_worker()  # another worker runs the sweep; the web process never stopped
    else:
        d.spawn()  # the daemon comes back; its start-up ends what the dead process left running
    r = wait_for(lambda: (lambda r: r if r.get("state") == "interrupted" else None)(receipt(d, "c-kill")),
                 timeout=30)
    assert r, receipt(d, "c-kill")
    assert r["reason"] == "the process running it stopped"
    assert r["answer"].startswith(streamed_before) and r["answer"].startswith("w0 w1 w2")
    types = [t for t, _ in turn_events(d, "c-kill")]
    assert types[-1] == "turn.failed" and types.count("turn.failed") == 1


def test_turns_accepted_behind_a_killed_one_run_once_each_after_the_restart(daemon):
    """One turn at a time: a long turn streams while three more wait accepted behind it (embedded: in the
    daemon's own queue; servers: in the broker's queue, the worker prefetching one task at a time). kill -9
    the process running turns: after the restart the running one ends interrupted and the three waiting
    run, each once, each with one answer and one end."""
    d = daemon(concurrency=1)
    long_text = "script:slow=0.1|answer=" + words(600)
    waiting = {f"c-wait-{i}": f"script:answer=waited {i} " + words(3) for i in range(3)}

    def send(text, conversation_id):
        try:
            chat(d, text, conversation_id, timeout=5)
        except httpx.HTTPError:
            pass  # the answer goes with the killed process; the message was accepted
    threading.Thread(target=send, args=(long_text, "c-first"), daemon=True).start()
    assert wait_for(lambda: deltas(d, "c-first") >= 3, timeout=30)
    for conversation_id, text in waiting.items():
        threading.Thread(target=send, args=(text, conversation_id), daemon=True).start()
    assert wait_for(lambda: all(receipt(d, c).get("state") == "accepted" for c in waiting), timeout=30), \
        [receipt(d, c) for c in waiting]
    assert deltas(d, "c-first") < 600 and receipt(d, "c-first")["state"] == "running"
    d.kill_worker()
    assert not any(text in d.scripted_calls() for text in waiting.values()), "a waiting turn ran before the kill"
    if SERVERS:
        d.spawn_worker(concurrency=1)
    else:
        d.spawn()

    def ended(conversation_id, state):
        return lambda: (lambda r: r if r.get("state") == state else None)(receipt(d, conversation_id))
    first = wait_for(ended("c-first", "interrupted"), timeout=60)
    assert first and first["reason"] == "the process running it stopped", receipt(d, "c-first")
    for conversation_id, text in waiting.items():
        r = wait_for(ended(conversation_id, "completed"), timeout=60)
        assert r and r["answer"] == text.split("answer=", 1)[1], receipt(d, conversation_id)
    time.sleep(3)  # past a requeue interval and a few sweeps: a second run would have started by now
    calls = d.scripted_calls()
    assert calls.count(long_text) == 1  # an interrupted turn is not run again
    for conversation_id, text in waiting.items():
        assert calls.count(text) == 1, (conversation_id, calls.count(text))
        types = [t for t, _ in turn_events(d, conversation_id)]
        assert sum(t in TERMINAL for t in types) == 1 and types[-1] == "turn.completed", types
        assert d.sql("SELECT count(*) FROM channels_app_message m JOIN channels_app_conversation c "
                     "ON c.id = m.conversation_id WHERE c.external_id = ? AND m.role = 'assistant'",
                     (conversation_id,))[0][0] == 1
    types = [t for t, _ in turn_events(d, "c-first")]
    assert sum(t in TERMINAL for t in types) == 1 and types[-1] == "turn.failed", types
    assert first["answer"].startswith("w0 w1 w2")  # what streamed before the kill is its answer, kept once
    assert d.sql("SELECT count(*) FROM channels_app_message m JOIN channels_app_conversation c "
                 "ON c.id = m.conversation_id WHERE c.external_id = ? AND m.role = 'assistant'",
                 ("c-first",))[0][0] == 1


def test_a_healthy_turn_streaming_for_many_leases_is_never_swept(daemon):
    # Celery's own limits are far below the turn's run time here: nothing may take them for liveness.
    d = daemon(UGENT_TURN_SOFT_TIME_LIMIT="1", UGENT_TURN_TIME_LIMIT="2", UGENT_TURN_RUN_LIMIT="120")
    text = words(100)
    resp = chat(d, "script:slow=0.08|answer=" + text, "c-long")  # ~8 s: more than two leases
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == text
    r = receipt(d, "c-long")
    assert r["state"] == "completed" and r["answer"] == text
    types = [t for t, _ in turn_events(d, "c-long")]
    assert types[-1] == "turn.completed" and "turn.failed" not in types


def test_a_turn_past_the_runners_limit_fails_with_a_reason_and_nothing_follows(daemon):
    d = daemon(UGENT_TURN_RUN_LIMIT="2")
    resp = chat(d, "script:slow=0.05|answer=" + words(400), "c-limit")
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "time_limit"
    r = receipt(d, "c-limit")
    assert r["state"] == "failed" and r["reason"] == "The turn ran out of time."
    assert r["answer"].startswith("w0") and "w399" not in r["answer"]
    time.sleep(1.0)  # the runner had its chance to write more: it must not have
    types = [t for t, _ in turn_events(d, "c-limit")]
    assert types[-1] == "turn.failed" and types.count("turn.failed") == 1


def test_an_engine_that_never_returns_costs_a_thread_not_the_daemon(daemon):
    # One turn at a time: before turn threads were written off, the first hung engine held the only
    # one for ever, every later turn waited in the queue, and the stop waited on it.
    d = daemon(concurrency=1, UGENT_TURN_RUN_LIMIT="2")
    for n in (1, 2):
        resp = chat(d, "script:answer=stuck|hang=3600", f"c-hang-{n}")
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "time_limit", resp.text
        assert receipt(d, f"c-hang-{n}")["state"] == "failed"
    resp = chat(d, "hello", "c-after")
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"].startswith("echo: hello")
    log = (d.tmp / "daemon.log").read_text()
    assert log.count("turn thread stuck past its turn's limit, written off and replaced") == 2, log[-3000:]
    if not SERVERS:  # (in servers mode the web process runs no turns: the worker's log says it)
        threads = httpx.get(d.base + "/v1/ugent/status", headers={"x-api-key": d.key},
                            timeout=10).json()["status"]["queues"]["turn"]["threads"]
        assert threads == {"running": 0, "queued": 0, "stuck": 2, "stuck_max": 16}
    # The stop waits for healthy turns only: the stuck threads do not hold it (nor the worker's warm shutdown).
    codes = d.stop(timeout=30)
    assert codes and all(code == 0 for code in codes), (codes, (d.tmp / "daemon.log").read_text()[-2000:])


# --- servers mode: the broker goes away ----------------------------------------------------------

class OwnRedis:
    """A Redis of the test's own (no persistence), so stopping or emptying it touches nobody else."""

    def __init__(self, tmp):
        self.port, self.tmp, self.proc = free_port(), tmp, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(self.tmp)], stdout=subprocess.DEVNULL, start_new_session=True)
        assert wait_for(lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                                               text=True).stdout.strip() == "PONG", timeout=10)

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def cli(self, *args):
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True).stdout


@pytest.fixture
def own_redis(tmp_path):
    if not SERVERS:
        pytest.skip("embedded mode has no broker to lose: its turns never leave the process")
    if not shutil.which("redis-server"):
        pytest.fail("servers-mode tests need redis-server on PATH")
    r = OwnRedis(tmp_path)
    r.start()
    yield r
    if r.proc.poll() is None:
        r.kill()


def test_a_message_accepted_while_the_broker_is_down_is_queued_and_runs_when_it_returns(daemon, own_redis):
    d = daemon(REDIS_URL=own_redis.url)
    own_redis.kill()
    resp = chat(d, "hello while down", "c-down")
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["ugent_receipt"]["state"] == "accepted" and body["ugent_receipt"]["queued"] is True
    assert body["ugent_turn_id"] == resp.headers["x-ugent-turn-id"]
    own_redis.start()  # back, and empty

    def completed():
        # kombu's Redis transport can end the worker on the lost connection ("Unrecoverable error:
        # AttributeError ... 'hostname'", while it restores unacked messages); its process manager starts
        # it again, as systemd's Restart=always does in docs/deploy.md. The turn must still run once.
        if d.worker.poll() is not None:
            d.procs.remove(d.worker)
            d.spawn_worker()
        r = receipt(d, "c-down")
        return r if r.get("state") == "completed" else None
    r = wait_for(completed, timeout=90)
    assert r and r["answer"].startswith("echo: hello while down")


def test_a_turn_lost_with_an_emptied_broker_is_dispatched_again(daemon, own_redis):
    d = daemon(REDIS_URL=own_redis.url)
    d.kill_worker()  # nobody takes the task...
    body = {"messages": [{"role": "user", "content": "hello into the void"}], "conversation_id": "c-flush",
            "client_message_id": "m1", "user": "alice"}
    try:
        httpx.post(d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key}, timeout=2)
    except httpx.TimeoutException:
        pass  # the answer waits for a worker; the message is accepted
    assert wait_for(lambda: receipt(d, "c-flush").get("state") == "accepted", timeout=10)
    assert wait_for(lambda: int(own_redis.cli("LLEN", d.env["UGENT_CELERY_QUEUE"]) or 0) >= 1, timeout=10)
    own_redis.cli("FLUSHALL")  # ...and the broker loses it
    d.spawn_worker()
    r = wait_for(lambda: (lambda r: r if r.get("state") == "completed" else None)(receipt(d, "c-flush")),
                 timeout=60)
    assert r and r["answer"].startswith("echo: hello into the void")
