"""The real daemon keeps nothing per turn, per stream or per request once they are done (issue #17, item 5).

Turns of every kind go through the embedded daemon over HTTP (non-stream, stream, a stream whose client
hangs up mid-turn, a request whose client leaves before the answer, event-stream subscribers that come
and go); then the daemon's memory report (UGENT_MEMSTATS, ugent_site/memstats.py) must show every
structure the hub fills per turn, stream or writer back at zero, and none of their objects alive."""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.streams.live import read_events
from tests.support.daemon import Daemon

pytestmark = pytest.mark.skipif(bool(os.environ.get("REDIS_URL")), reason="the embedded daemon's own structures")

#: Objects of these types belong to one turn, stream or subscriber: none may outlive it.
PER_TURN_TYPES = ("channels_app.notify.Waiter", "channels_app.notify.BlockingWaiter", "channels_app.fanout.Tap",
                  "channels_app.fanout.Reader", "channels_app.streams.Subscription", "channels_app.notify.TurnBatch",
                  "channels_app.sse.ChunkRenderer")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("memory-held"), extra_env={"UGENT_MEMSTATS": "true"}).start()
    # The daemon numbers its reports for its whole life; a rerun of the test, on the same daemon,
    # must wait for the next one rather than read an earlier attempt's.
    d.reports = itertools.count(1)
    yield d
    d.close()


def memory_report(d: Daemon, **request) -> dict:
    n = next(d.reports)
    pid = d.procs[0].pid
    path = d.tmp / "var" / "memstats" / f"{pid}-{n}.json"
    (d.tmp / "var" / "memstats" / "request.json").write_text(json.dumps({"collect": True, **request}))
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "the daemon wrote no memory report"
        time.sleep(0.05)
    return json.loads(path.read_text())


def chat(d: Daemon, conv: str, i: int, *, stream: bool, text: str | None = None):
    body = {"messages": [{"role": "user", "content": text or f"hello {i}"}], "stream": stream,
            "conversation_id": conv, "client_message_id": f"m-{i}", "user": "alice"}
    r = httpx.post(d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def hang_up_mid_stream(d: Daemon, conv: str, i: int):
    body = {"messages": [{"role": "user", "content": "script:slow=0.02|answer=" + " ".join(f"w{k}" for k in range(20))}],
            "stream": True, "conversation_id": conv, "client_message_id": f"m-{i}", "user": "alice"}
    with httpx.stream("POST", d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key},
                      timeout=30) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the turn runs; now hang up


def leave_before_the_answer(d: Daemon, conv: str, i: int):
    body = {"messages": [{"role": "user", "content": "script:sleep=0.5|answer=late"}], "stream": False,
            "conversation_id": conv, "client_message_id": f"m-{i}", "user": "alice"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key},
                   timeout=httpx.Timeout(0.2, connect=5))


def settled(d: Daemon) -> dict:
    """A report once the turns left running by the clients that left have ended (leases released)."""
    deadline = time.monotonic() + 30
    while True:
        rep = memory_report(d, cache_keys=True)
        if not any(rep["held"].values()) or time.monotonic() > deadline:
            return rep
        time.sleep(0.3)


def one_of_each(d: Daemon, attempt: str, c: int) -> None:
    """In one new conversation: a subscriber of it (leaving after four turns) and one of the whole log
    (after one); non-stream and stream turns; a stream whose client hangs up; a request whose client
    leaves."""
    conv = f"held-{attempt}-{c}"  # new conversations and message ids for every attempt, reruns included
    completed = lambda ev: any(e["event"] == "turn.completed" for e in ev)  # noqa: E731
    four_completed = lambda ev: sum(e["event"] == "turn.completed" for e in ev) >= 4  # noqa: E731
    joined = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The conversation's subscriber reads it from its start (it exists once the first turn is in):
        # its first event says its process's reader of the conversation listens, so the turns after
        # it append with a listener (the statement that hands the reader its rows runs, warm-up included)
        subscribers = [pool.submit(read_events, d.base, d.key, conversation_id=conv, user="alice",
                                   last_event_id=0, until=four_completed, on_event=lambda _e: joined.set()),
                       pool.submit(read_events, d.base, d.key, user="alice", until=completed)]
        time.sleep(0.2)  # the log's subscriber has joined: it reads from the log's head
        for i in range(4):
            # the warm-up's third turn is quiet for three times as long as a reader waits for a wake-up
            # (notify.POLL_INTERVAL): its reader then reads the log, which a busy machine's pauses can make
            # any turn do
            quiet = i == 2 and c == 0
            chat(d, conv, 10 * c + i, stream=bool(i % 2), text="script:sleep=1.5|answer=slow" if quiet else None)
            if i == 0:
                assert joined.wait(30), "the conversation's subscriber never joined"
        hang_up_mid_stream(d, conv, 10 * c + 5)
        leave_before_the_answer(d, conv, 10 * c + 6)
        for job in subscribers:
            job.result(timeout=60)


def test_after_turns_of_every_kind_nothing_per_turn_or_stream_is_held(daemon):
    attempt = uuid.uuid4().hex[:8]
    one_of_each(daemon, attempt, 0)  # warm: every statement, the engine and the threads exist from here on
    before = settled(daemon)
    assert before["held"] == {k: 0 for k in before["held"]}, before["held"]

    for c in range(1, 6):
        one_of_each(daemon, attempt, c)

    after = settled(daemon)
    assert after["held"] == {k: 0 for k in after["held"]}, after["held"]
    alive = {t: after["gc_types"].get(t, 0) for t in PER_TURN_TYPES}
    if any(alive.values()):  # say what holds them, so that a failure names its cause
        held_by = {t: memory_report(daemon, referrers=t)["referrers"] for t, n in alive.items() if n}
        assert alive == {t: 0 for t in PER_TURN_TYPES}, json.dumps({"alive": alive, "held_by": held_by}, indent=1)
    # the caches keyed by a thing (a statement, a key, a profile) stop growing once each was seen
    new_sql = sorted(set(after["cache_keys"]["rows_sql"]) - set(before["cache_keys"]["rows_sql"]))
    assert after["caches"] == before["caches"], new_sql
