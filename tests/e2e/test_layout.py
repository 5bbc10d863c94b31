"""Servers mode as docs/deploy.md lays it out, on several processes (tests/support/layout.py).

HAProxy in front of two uvicorn web processes, two Celery workers, beat and the supervisor, over a
PostgreSQL cluster and a Redis of the test's own (ports 5441 and 6391), which the tests restart:

  * a stream is served by one web process while its turn runs on a worker (each process's own log,
    HAProxy's X-Ugent-Web header and each worker's scripted-engine log say which did what);
  * a stream read on web-a resumes by Last-Event-ID on web-b, missing and repeating nothing;
  * a web process killed (kill -9) mid-stream: the resume on the other misses nothing, the turn completes once;
  * a worker killed (kill -9) mid-turn: the turn ends interrupted once, never answered twice;
  * Redis restarted (empty): readers reconnect and every accepted message is answered, once;
  * PostgreSQL restarted: a request while it is down gets a 503 `database_unavailable` error object
    (never a 500 page), and every process serves again without a restart.

The layout is servers mode whatever the run mode, so `make test` runs this file in its servers pass
only; it needs Debian's postgresql, redis-server and haproxy (installed when missing, as root).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.streams.live import iter_frames
from tests.support.layout import WEBS, WORKERS, Layout, LayoutError, ensure_haproxy, ensure_services

pytestmark = pytest.mark.skipif(
    not os.environ.get("REDIS_URL"),
    reason="the layout is servers mode: make test runs this file in its servers pass (REDIS_URL set)")

#: Short leases, so a killed worker's turn is seen to lapse in seconds (docs/turns.md).
FAST_LEASE = {"UGENT_TURN_LEASE_SECONDS": "3", "UGENT_TURN_LEASE_RENEW_SECONDS": "0.5",
              "UGENT_TURN_SWEEP_SECONDS": "1", "UGENT_TURN_REQUEUE_SECONDS": "2"}
TERMINAL = ("turn.completed", "turn.failed", "turn.cancelled")


def words(n: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {value!r})")


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    try:
        ensure_services()
        ensure_haproxy()
    except LayoutError as exc:  # the Debian packages could not be installed here
        pytest.skip(f"the layout's services are not available: {exc}")
    lay = Layout(tmp_path_factory.mktemp("layout"), extra_env=FAST_LEASE).start()
    # Each worker's first turn loads the engines: warm both before anything is measured.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: chat(lay, "warm up", f"c-warm-{i}", timeout=120), range(8)))
    yield lay
    lay.close()


#: This attempt's tag (a new one for each test and each rerun of it): the layout outlives a failed attempt,
#: so a rerun that sent the same conversation ids would be refused as a repeat (409) and would count the
#: first attempt's engine calls as its own.
ATTEMPT = {"tag": ""}


@pytest.fixture(autouse=True)
def attempt():
    ATTEMPT["tag"] = uuid.uuid4().hex[:8]


def fresh(name: str) -> str:
    """`name` made this attempt's own: a conversation id."""
    return f"{name}-{ATTEMPT['tag']}"


def scripted(script: str) -> str:
    """A scripted message of this attempt's own (tests/support/scripted.py ignores the tag step)."""
    return f"script:{script}|tag={ATTEMPT['tag']}"


def body(text: str, conversation_id: str, client_message_id: str = "m1", **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "conversation_id": conversation_id,
            "client_message_id": client_message_id, "user": "alice", **extra}


def chat(lay: Layout, text: str, conversation_id: str, client_message_id: str = "m1", *, timeout: float = 60):
    return httpx.post(lay.base + "/v1/chat/completions", json=body(text, conversation_id, client_message_id),
                      headers={"x-api-key": lay.key}, timeout=timeout)


def receipt(lay: Layout, conversation_id: str, client_message_id: str = "m1") -> dict:
    r = httpx.get(lay.base + "/v1/ugent/receipt", headers={"x-api-key": lay.key}, timeout=10,
                  params={"conversation_id": conversation_id, "client_message_id": client_message_id,
                          "user": "alice"})
    return r.json() if r.status_code == 200 else {}


def turn_events(lay: Layout, conversation_id: str) -> list[tuple[int, str, dict]]:
    return [(i, t, json.loads(d) if isinstance(d, str) else d) for i, t, d in lay.sql(
        "SELECT e.id, e.type, e.data FROM channels_app_event e JOIN channels_app_turn t ON t.id = e.turn_id "
        "JOIN channels_app_conversation c ON c.id = t.conversation_id WHERE c.external_id = ? ORDER BY e.id",
        (conversation_id,))]


def assistant_messages(lay: Layout, conversation_id: str) -> int:
    return lay.sql("SELECT count(*) FROM channels_app_message m JOIN channels_app_conversation c "
                   "ON c.id = m.conversation_id WHERE c.external_id = ? AND m.role = 'assistant'",
                   (conversation_id,))[0][0]


def engine_calls(lay: Layout, text: str) -> dict[str, int]:
    """How many times each worker's engine was asked to answer `text`."""
    calls = {}
    for w in WORKERS:
        path = lay.scripted_log(w)
        lines = path.read_text().splitlines() if path.exists() else []
        calls[w] = sum(1 for line in lines if line.strip() and json.loads(line)["last"] == text)
    return calls


def open_events_on(lay: Layout, web: str, params: dict, last_event_id=None, tries: int = 40):
    """An events stream through the proxy, opened again until HAProxy gave it to `web`."""
    headers = {"x-api-key": lay.key, **({"Last-Event-ID": str(last_event_id)} if last_event_id else {})}
    for _ in range(tries):
        cm = httpx.stream("GET", lay.base + "/v1/ugent/events", params=params, headers=headers,
                          timeout=httpx.Timeout(30, connect=5))
        resp = cm.__enter__()
        if resp.status_code == 200 and resp.headers.get("x-ugent-web") == web:
            return cm, resp
        cm.__exit__(None, None, None)
    raise AssertionError(f"the proxy never gave a stream to {web}")


def read_frames(resp, until) -> list[dict]:
    got = []
    for frame in iter_frames(resp):
        if "event" in frame:
            got.append(frame)
            if until(got):
                return got
    raise AssertionError(f"the stream ended after {len(got)} events")


def read_to_the_end_on(lay: Layout, web: str, params: dict, after: int) -> list[dict]:
    """A resume (Last-Event-ID `after`) through the proxy on `web`, read until the turn's terminal event."""
    cm, resp = open_events_on(lay, web, params, last_event_id=after)
    try:
        return read_frames(resp, lambda evs: evs[-1]["event"] in TERMINAL)
    finally:
        cm.__exit__(None, None, None)


def test_a_stream_served_by_one_web_process_while_its_turn_runs_on_a_worker(layout):
    """Eight streamed chats at once through the proxy: both web processes serve streams, both workers
    run turns, and each turn was served by one web process and run by exactly one worker."""
    texts = [scripted(f"slow=0.05|answer={words(12, f'p{i}-')}") for i in range(8)]

    def stream(i):
        with httpx.stream("POST", layout.base + "/v1/chat/completions", headers={"x-api-key": layout.key},
                          json=body(texts[i], fresh(f"c-split-{i}"), stream=True), timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
            return resp.headers["x-ugent-web"], resp.headers["x-ugent-turn-id"], lines
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    served = {web for web, _, _ in results}
    ran = set()
    # A process writes its line once the response (the turn) is over, which can be just after the client
    # read its last byte: wait for every line before reading the logs once.
    wait_until(lambda: all(f"turn={turn_id})" in layout.read_log(web) for web, turn_id, _ in results), 30,
               what="each web process's line for the streams it served")
    wait_until(lambda: all(any(f"turn ended (turn={turn_id}, " in layout.read_log(w) for w in WORKERS)
                           for _, turn_id, _ in results), 30, what="each turn's turn-ended line")
    web_logs = {w: layout.read_log(w) for w in WEBS}
    worker_logs = {w: layout.read_log(w) for w in WORKERS}
    for i, (web, turn_id, lines) in enumerate(results):
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("choices" in chunk for chunk in chunks), chunks
        answer = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
        assert answer == words(12, f"p{i}-")
        # the web process that served the stream logged it; the other did not see it
        assert "path=/v1/chat/completions, status=200" in web_logs[web] and f"turn={turn_id})" in web_logs[web]
        assert all(f"turn={turn_id})" not in log for w, log in web_logs.items() if w != web)
        # exactly one worker ran the turn (its engine and its turn-ended line), no web process did
        calls = engine_calls(layout, texts[i])
        runner = [w for w, n in calls.items() if n]
        assert len(runner) == 1 and calls[runner[0]] == 1, calls
        assert f"turn ended (turn={turn_id}, " in worker_logs[runner[0]]
        assert all(f"turn ended (turn={turn_id}" not in log for log in web_logs.values())
        ran.add(runner[0])
    assert served == set(WEBS), served
    assert ran == set(WORKERS), ran


def test_a_stream_read_on_web_a_resumes_by_last_event_id_on_web_b(layout):
    resume_id = fresh("c-resume")
    text = scripted("slow=0.05|answer=" + words(40))
    sender = threading.Thread(target=chat, args=(layout, text, resume_id), daemon=True)
    sender.start()
    params = {"conversation_id": resume_id, "user": "alice", "cursor": "0"}
    wait_until(lambda: receipt(layout, resume_id).get("state"), 30, what="the message to be accepted")
    cm, resp = open_events_on(layout, "web-a", params)
    try:
        first = read_frames(resp, lambda evs: sum(e["event"] == "turn.delta" for e in evs) >= 5)
    finally:
        cm.__exit__(None, None, None)
    rest = read_to_the_end_on(layout, "web-b", params, after=first[-1]["id"])
    sender.join(60)
    seen = [e["id"] for e in first + rest]
    assert seen == sorted(set(seen)), "an event was repeated or out of order"
    assert rest[0]["id"] > first[-1]["id"]
    assert seen == [i for i, _, _ in turn_events(layout, resume_id)]  # every event of the log, once
    answer = "".join(e["data"]["data"]["text"] for e in first + rest if e["event"] == "turn.delta")
    assert answer == words(40) and rest[-1]["event"] == "turn.completed"
    # each web process logged the stream it served (when it saw the client go)
    for web in WEBS:
        wait_until(lambda: "path=/v1/ugent/events, status=200" in layout.read_log(web), 30,
                   what=f"{web}'s line for the stream")


def test_a_web_process_killed_mid_stream_ends_its_stream_and_a_resume_on_the_other_misses_nothing(layout):
    """kill -9 the web process serving an events stream mid-turn: the stream ends, EventSource's reconnect
    (Last-Event-ID, through the proxy, to the other web process) reads the rest of the log once and in order,
    and the turn, which runs on a worker, completes once: a web process holds nothing accepted."""
    conv = fresh("c-webkill")
    text = scripted("slow=0.05|answer=" + words(80))
    params = {"conversation_id": conv, "user": "alice", "cursor": "0"}
    sender = threading.Thread(target=lambda: chat(layout, text, conv, timeout=90), daemon=True)
    sender.start()  # through the proxy: if it lands on the process killed below, its client gets the proxy's
    wait_until(lambda: receipt(layout, conv).get("state"), 30, what="the message to be accepted")  # error
    victim, other = WEBS
    cm, resp = open_events_on(layout, victim, params)
    first: list[dict] = []
    frames = iter_frames(resp)  # one reader of the response, before the kill and after it
    try:
        for frame in frames:
            if "event" in frame:
                first.append(frame)
                if sum(e["event"] == "turn.delta" for e in first) >= 5:
                    break
        layout.kill(victim, signal.SIGKILL)
        try:  # what the dead process's socket still held, then the end
            for frame in frames:
                if "event" in frame:
                    first.append(frame)
        except httpx.HTTPError:
            pass
    finally:
        try:
            cm.__exit__(None, None, None)
        except httpx.HTTPError:
            pass
    try:
        assert not any(e["event"] in TERMINAL for e in first), "the turn ended before the kill: nothing was tested"
        rest = read_to_the_end_on(layout, other, params, after=first[-1]["id"])
        sender.join(90)
        seen = [e["id"] for e in first + rest]
        assert seen == sorted(set(seen)), "an event was repeated or out of order"
        assert seen == [i for i, _, _ in turn_events(layout, conv)]  # every event of the log, once
        assert rest[-1]["event"] == "turn.completed"
        answer = "".join(e["data"]["data"]["text"] for e in first + rest if e["event"] == "turn.delta")
        assert answer == words(80)
        r = receipt(layout, conv)
        assert r["state"] == "completed" and r["answer"] == words(80)
        assert sum(engine_calls(layout, text).values()) == 1
        assert assistant_messages(layout, conv) == 1
    finally:
        layout.spawn_web(victim)  # the layout is whole again for the next tests
        wait_until(lambda: layout.served_by() == set(WEBS), 60, interval=0.5, what="both web processes back")


def test_a_worker_killed_mid_turn_ends_the_turn_interrupted_once_and_never_answers_twice(layout):
    kill_id = fresh("c-kill")
    text = scripted("slow=0.1|answer=" + words(300))
    threading.Thread(target=lambda: chat(layout, text, kill_id, timeout=90), daemon=True).start()
    runner = wait_until(lambda: [w for w, n in engine_calls(layout, text).items() if n], 30,
                        what="a worker to take the turn")[0]
    wait_until(lambda: sum(t == "turn.delta" for _, t, _ in turn_events(layout, kill_id)) >= 5, 30,
               what="the turn to stream")
    layout.kill(runner, signal.SIGKILL)
    streamed = "".join(d["text"] for _, t, d in turn_events(layout, kill_id) if t == "turn.delta")
    assert "w299" not in streamed, "the turn ended before the kill: nothing was tested"
    # A running turn is never run again (its claim refuses the redelivered task): the lease lapses and
    # beat's sweep ends it interrupted, keeping what streamed (docs/turns.md).
    r = wait_until(lambda: (lambda r: r if r.get("state") not in (None, "accepted", "running") else None)(
        receipt(layout, kill_id)), 60, what="the killed turn's end")
    layout.spawn_worker(runner)  # the layout is whole again for the next tests
    assert r["state"] == "interrupted", r
    assert r["reason"] == "the process running it stopped"
    assert r["answer"].startswith(streamed) and r["answer"].startswith("w0 w1 w2")
    # the other worker and the replacement had their chance to run it again: nobody did
    wait_until(layout.workers_pinged, 60, interval=0.5, what="the replacement worker")
    assert chat(layout, "after the kill", kill_id, "m2").status_code == 200
    types = [t for _, t, _ in turn_events(layout, kill_id)]
    assert sum(t in TERMINAL for t in types) == 2, types  # the killed turn's one end, and m2's
    assert types.count("turn.completed") == 1 and types.count("turn.failed") == 1, types  # m2's; the kill's
    assert sum(engine_calls(layout, text).values()) == 1  # nobody ran the killed turn again
    assert assistant_messages(layout, kill_id) == 2  # what the killed turn streamed, once; m2's answer


def test_redis_restarted_readers_reconnect_and_nothing_accepted_is_lost(layout):
    redis_id = fresh("c-redis")
    params = {"conversation_id": redis_id, "user": "alice", "cursor": "0"}
    seen: list[dict] = []
    reconnects = []
    stop = threading.Event()

    def reader():  # an EventSource's behaviour: on any end, reconnect with Last-Event-ID
        while not stop.is_set():
            headers = {"x-api-key": layout.key}
            if seen:
                headers["Last-Event-ID"] = str(seen[-1]["id"])
            try:
                with httpx.stream("GET", layout.base + "/v1/ugent/events", params=params, headers=headers,
                                  timeout=httpx.Timeout(10, connect=5)) as resp:
                    if resp.status_code != 200:
                        time.sleep(0.2)
                        continue
                    for frame in iter_frames(resp):
                        if "event" in frame:
                            seen.append(frame)
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass
            reconnects.append(time.monotonic())
            time.sleep(0.2)
    assert chat(layout, "before the restart", redis_id, "m0").status_code == 200
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    wait_until(lambda: any(e["event"] == "turn.completed" for e in seen), 30, what="the reader's first turn")
    in_flight = scripted("slow=0.05|answer=" + words(40, "f"))
    sender = concurrent.futures.ThreadPoolExecutor(4)
    pending = [sender.submit(chat, layout, in_flight, redis_id, "m1", timeout=90)]
    wait_until(lambda: receipt(layout, redis_id, "m1").get("state") == "running", 30, what="m1 to run")
    layout.redis.restart()  # empty: nothing that was queued in it survives
    codes = [chat(layout, f"while redis came back {i}", redis_id, f"m{i}", timeout=90).status_code
             for i in (2, 3, 4)]
    assert all(c in (200, 202) for c in codes), codes
    for i in range(1, 5):
        r = wait_until(lambda: (lambda r: r if r.get("state") in ("completed", "failed", "interrupted") else None)(
            receipt(layout, redis_id, f"m{i}")), 90, what=f"m{i} to end")
        if i > 1:
            assert r["state"] == "completed", r
    assert pending[0].result(timeout=90).status_code in (200, 202, 502)
    sender.shutdown()
    log_ids = [i for i, _, _ in turn_events(layout, redis_id)]
    wait_until(lambda: seen and seen[-1]["id"] == log_ids[-1], 30, what="the reader to catch up")
    stop.set()
    ids = [e["id"] for e in seen]
    assert ids == log_ids, "the reader missed or repeated events"
    types = [t for _, t, _ in turn_events(layout, redis_id)]
    assert sum(t in TERMINAL for t in types) == 5  # m0..m4: every accepted message ended, once
    assert sum(n for n in engine_calls(layout, in_flight).values()) == 1  # the in-flight turn ran once
    # both web processes still serve after the restart, and the workers ran m2..m4 (above). Not checked:
    # `celery inspect ping` (the workers' broadcast control channel), which did not answer within 60 s
    # after a Redis restart in this layout while the workers went on taking turns (noted in docs/deploy.md).
    assert layout.served_by() == set(WEBS)


def test_postgresql_restarted_requests_fail_with_a_503_and_every_process_recovers(layout):
    pg_id = fresh("c-pg")
    assert chat(layout, "before the database restart", pg_id, "m0").status_code == 200
    in_flight = scripted("slow=0.1|answer=" + words(100, "g"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        flying = pool.submit(chat, layout, in_flight, pg_id, "m1", timeout=90)
        wait_until(lambda: receipt(layout, pg_id, "m1").get("state") == "running", 30, what="m1 to run")
        layout.pg.stop()
        try:
            down = [httpx.get(layout.base + "/v1/ugent/receipt", headers={"x-api-key": layout.key}, timeout=30,
                              params={"conversation_id": pg_id, "client_message_id": "m0", "user": "alice"})
                    for _ in range(4)]  # both web processes, twice each (round robin)
            down += [chat(layout, "while the database is down", pg_id, "m2", timeout=30) for _ in range(2)]
        finally:
            layout.pg.start()
        flown = flying.result(timeout=90)
    # Each request fails cleanly: a web process answers 503 database_unavailable or, once both have failed
    # their health check (it pings the database), HAProxy answers its own 503 error object
    # (deploy/haproxy.cfg): never a 500, never an HTML page.
    for r in down:
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert (error["code"], error["message"]) in (
            ("database_unavailable", "The database is unavailable: send the request again."),
            ("service_unavailable", "No web process is available: send the request again.")), error
    by_web = {r.headers["x-ugent-web"] for r in down if "x-ugent-web" in r.headers}
    assert all(r.json()["error"]["code"] == "database_unavailable" for r in down if "x-ugent-web" in r.headers)
    assert by_web <= set(WEBS)
    # the request in flight: its answer, or an error object (the turn failed, the database went away)
    assert flown.status_code in (200, 502, 503), (flown.status_code, flown.text)
    if flown.status_code != 200:
        assert flown.json()["error"]["code"], flown.text

    # no process restarted: every web process answers from the database again, a new turn runs
    def both_webs_read():
        return {r.headers["x-ugent-web"] for r in (
            httpx.get(layout.base + "/v1/ugent/receipt", headers={"x-api-key": layout.key}, timeout=10,
                      params={"conversation_id": pg_id, "client_message_id": "m0", "user": "alice"})
            for _ in range(4)) if r.status_code == 200} == set(WEBS)
    wait_until(both_webs_read, 60, interval=0.5, what="both web processes to read the database again")
    for i in range(3, 7):  # on both workers, whichever takes them
        assert chat(layout, f"after the database restart {i}", pg_id, f"m{i}").status_code == 200
    # the turn in flight ended (however), once; nothing was answered twice
    wait_until(lambda: receipt(layout, pg_id, "m1").get("state") in ("completed", "failed", "interrupted"), 60,
               what="the in-flight turn to end")
    types = [t for _, t, _ in turn_events(layout, pg_id)]
    assert sum(t in TERMINAL for t in types) == 6  # m0, m1, m3..m6: m2 was never accepted
    # (not checked: the web logs. One run in three showed a traceback of a connection attempt while
    # PostgreSQL came back, from a request the clients above never saw fail; left open in docs/deploy.md.)
