"""The streams against the real daemon: disconnects, a killed server, and (servers mode) several processes."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.streams.live import has, post_chat, read_events
from tests.support.daemon import PY, ROOT, Daemon, free_port

SLOW = "script:slow=0.05|answer=" + " ".join(f"w{i}" for i in range(60))
SERVERS = bool(os.environ.get("REDIS_URL"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("streams")).start()
    yield d
    d.close()


def receipt(d, conversation_id, client_message_id, user="alice"):
    return httpx.get(d.base + "/v1/ugent/receipt", headers={"x-api-key": d.key}, timeout=10,
                     params={"conversation_id": conversation_id, "client_message_id": client_message_id,
                             "user": user}).json()


def wait_receipt(d, conversation_id, client_message_id, states, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = receipt(d, conversation_id, client_message_id)
        if r.get("state") in states:
            return r
        time.sleep(0.1)
    raise AssertionError(f"receipt never reached {states}: {r}")


def test_a_client_that_disconnects_does_not_stop_its_turn(daemon):
    words = " ".join(f"w{i}" for i in range(30))
    body = {"messages": [{"role": "user", "content": "script:slow=0.02|answer=" + words}],
            "stream": True, "conversation_id": "c-disc", "client_message_id": "m1", "user": "alice"}
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", json=body,
                      headers={"x-api-key": daemon.key}, timeout=30) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the first chunk arrived: the turn runs; now hang up
    r = wait_receipt(daemon, "c-disc", "m1", {"completed", "cancelled", "failed", "interrupted"})
    assert r["state"] == "completed" and r["answer"] == words
    events = read_events(daemon.base, daemon.key, until=has("turn.completed"), cursor="0",
                         conversation_id="c-disc", user="alice")
    assert events[-1]["data"]["data"]["answer"] == r["answer"]
    snap = httpx.get(daemon.base + "/v1/ugent/conversation/snapshot", headers={"x-api-key": daemon.key},
                     params={"conversation_id": "c-disc", "user": "alice"}).json()
    assert snap["receipts"][-1]["state"] == "completed"


def test_stop_and_steering_over_http_reach_a_turn_running_in_the_worker(daemon):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(post_chat, daemon.base, daemon.key, SLOW, conversation_id="c-steer",
                           client_message_id="m1", user="alice")
        read_events(daemon.base, daemon.key, until=has("turn.delta"), cursor="0", conversation_id="c-steer",
                    user="alice")
        resp = httpx.post(daemon.base + "/v1/ugent/steering", headers={"x-api-key": daemon.key},
                          json={"conversation_id": "c-steer", "user": "alice", "message": "script:answer=steered"})
        assert resp.status_code == 202
        answer = chat.result(timeout=30).json()["choices"][0]["message"]["content"]
    assert answer.startswith("w0") and answer.endswith("steered") and "w59" not in answer
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(post_chat, daemon.base, daemon.key, SLOW, conversation_id="c-stop",
                           client_message_id="m1", user="alice")
        read_events(daemon.base, daemon.key, until=has("turn.delta"), cursor="0", conversation_id="c-stop",
                    user="alice")
        resp = httpx.post(daemon.base + "/v1/ugent/stop", headers={"x-api-key": daemon.key},
                          json={"conversation_id": "c-stop", "user": "alice"})
        assert resp.status_code == 202
        body = chat.result(timeout=30).json()
    assert body["ugent_stopped"] is True
    r = receipt(daemon, "c-stop", "m1")
    assert r["state"] == "cancelled" and r["answer"] == body["choices"][0]["message"]["content"]


@pytest.mark.skipif(not SERVERS, reason="two daphne processes over Redis is servers mode")
def test_two_daphne_processes_serve_one_conversations_subscribers_the_same_sequence(daemon):
    port = free_port()
    log = open(daemon.tmp / "daphne2.log", "ab")
    second = subprocess.Popen([PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "ugent_site.asgi:application"],
                              cwd=ROOT, env=daemon.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base2 = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base2 + "/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "second daphne did not come up"
            time.sleep(0.2)
        post_chat(daemon.base, daemon.key, "hello", conversation_id="c-two", user="alice")
        head = read_events(daemon.base, daemon.key, until=has("turn.completed"), cursor="0",
                           conversation_id="c-two", user="alice")[-1]["id"]
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            readers = [pool.submit(read_events, base, daemon.key, until=has("turn.completed"), cursor=str(head),
                                   conversation_id="c-two", user="alice")
                       for base in (daemon.base, base2, daemon.base, base2)]
            time.sleep(0.5)  # all four are live before the turn starts: this is the live path
            post_chat(daemon.base, daemon.key, "script:slow=0.01|answer=one two three four five",
                      conversation_id="c-two", user="alice")
            seqs = [[e["id"] for e in f.result(timeout=30)] for f in readers]
        assert seqs[0] and all(s == seqs[0] for s in seqs)
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(10)


#: A lapsed lease is found within seconds: beat's sweep (servers mode; embedded's start-up ends it at once)
FAST_LEASE = {"UGENT_TURN_LEASE_SECONDS": "3", "UGENT_TURN_LEASE_RENEW_SECONDS": "0.5",
              "UGENT_TURN_SWEEP_SECONDS": "1", "UGENT_TURN_REQUEUE_SECONDS": "2"}


def test_the_server_killed_mid_stream_and_restarted_the_client_resumes_and_misses_nothing(tmp_path):
    d = Daemon(tmp_path, beat=True, extra_env=FAST_LEASE).start()
    try:
        seen: list[dict] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # the turn's own HTTP request dies with the server; its events are what the client follows
            pool.submit(lambda: _swallow(post_chat, d.base, d.key, SLOW, conversation_id="c-kill",
                                         client_message_id="m1", user="alice"))
            read_events(d.base, d.key, until=has("turn.delta", 5), cursor="0", conversation_id="c-kill",
                        user="alice", on_event=seen.append)
            d.stop(signal.SIGKILL)
        d.spawn()
        last = seen[-1]["id"]
        post_chat(d.base, d.key, "after the restart", conversation_id="c-kill", client_message_id="m2", user="alice")
        after = read_events(d.base, d.key, until=has("turn.completed"), last_event_id=last,
                            conversation_id="c-kill", user="alice")
        whole = read_events(d.base, d.key, until=has("turn.completed"), cursor="0", conversation_id="c-kill",
                            user="alice")
        assert [e["id"] for e in seen + after] == [e["id"] for e in whole]
        assert after[-1]["data"]["data"]["answer"].startswith("echo: after the restart")
        if not d.servers:  # embedded start-up marks the killed turn interrupted, with an event, before m2 runs
            interrupted = [e for e in after if e["event"] == "turn.failed"]
            assert interrupted and interrupted[0]["data"]["data"]["state"] == "interrupted"
        # servers mode: beat's sweep, once the killed worker's lease lapsed. Either way the turn ends once,
        # keeping what streamed, and is never run again
        r = wait_receipt(d, "c-kill", "m1", {"interrupted", "completed", "failed", "cancelled"}, timeout=60)
        assert r["state"] == "interrupted" and r["reason"] == "the process running it stopped", r
        streamed = "".join(e["data"]["data"]["text"] for e in seen if e["event"] == "turn.delta")
        assert r["answer"].startswith(streamed) and streamed
        ends = read_events(d.base, d.key, until=lambda evs: sum(e["event"] == "turn.failed" for e in evs) >= 1
                           and sum(e["event"] == "turn.completed" for e in evs) >= 1, cursor="0",
                           conversation_id="c-kill", user="alice")
        assert [e["event"] for e in ends].count("turn.failed") == 1
        assert d.scripted_calls().count(SLOW) == 1
    finally:
        d.close()


def _swallow(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except httpx.HTTPError:
        return None


def test_keep_alives_and_retry_reach_a_real_client(daemon):
    with httpx.stream("GET", daemon.base + "/v1/ugent/events", headers={"x-api-key": daemon.key},
                      timeout=10) as resp:
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            if line == ": ping":
                break
    assert lines[0].startswith("retry: ") and ": ping" in lines
