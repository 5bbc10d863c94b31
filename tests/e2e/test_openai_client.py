"""The real daemon on a free port, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import concurrent.futures
import json
import time
import uuid

import httpx
import openai
import pytest

from tests.support.http import answer_text, parse_sse
from tests.support.schema import validate


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key=daemon.key, max_retries=2)


def test_openai_client_non_stream(client):
    resp = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}])
    assert resp.choices[0].message.content == "echo: hello (history=0)"
    validate(resp.model_dump(exclude_unset=True), "CreateChatCompletionResponse")


def test_openai_client_stream_naive_loop_is_unharmed(client):
    stream = client.chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "script:answer=streamed words here"}],
        extra_body={"include_thinking": True, "echo_user_message": True})
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
    assert text == "streamed words here"


def test_openai_client_streams_the_offline_notes_engine(client):
    stream = client.chat.completions.create(
        model="ugent-notes", stream=True,
        messages=[{"role": "user", "content": "How do I point UGENT at my Ollama server?"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert "UGENT_LLM_BASE_URL" in text or "configure-model" in text


def test_a_failure_mid_stream_raises_api_error_in_the_client(client):
    stream = client.chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "script:answer=so far|fail=it broke"}])
    got = ""
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got += chunk.choices[0].delta.content or ""
    assert got == "so far"
    assert "it broke" in str(info.value)


def test_a_conversation_the_request_did_not_name_is_told_to_the_client(client):
    """A request without conversation_id starts one: the x-ugent-conversation-id header (and the non-stream
    body's ugent_conversation_id) names it, beside x-ugent-turn-id, and the next message continues it."""
    marker = f"new-{uuid.uuid4().hex}"
    raw = client.chat.completions.with_raw_response.create(model="scripted",
                                                            messages=[{"role": "user", "content": marker}])
    conversation_id = raw.headers["x-ugent-conversation-id"]
    completion = raw.parse()
    assert completion.choices[0].message.content == f"echo: {marker} (history=0)"
    assert completion.model_extra["ugent_conversation_id"] == conversation_id
    assert completion.model_extra["ugent_turn_id"] == raw.headers["x-ugent-turn-id"]
    raw = client.chat.completions.with_raw_response.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "and then"}],
        extra_body={"conversation_id": conversation_id})
    assert raw.headers["x-ugent-conversation-id"] == conversation_id and raw.headers["x-ugent-turn-id"]
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse()) == "echo: and then (history=2)"
    # a stream that names none is told its new one too, a conversation of its own
    raw = client.chat.completions.with_raw_response.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "elsewhere"}])
    other = raw.headers["x-ugent-conversation-id"]
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse()) == "echo: elsewhere (history=0)"
    assert other and other != conversation_id


def test_a_duplicate_is_a_conflict_the_client_does_not_retry(client, daemon):
    marker = f"dup-{uuid.uuid4().hex}"
    body = {"conversation_id": marker, "client_message_id": "m1"}
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": marker}],
                                   extra_body=body)
    with pytest.raises(openai.ConflictError) as info:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": marker}],
                                       extra_body=body)
    assert info.value.response.headers["x-should-retry"] == "false"
    assert info.value.body["code"] == "DuplicateProcessed"
    assert daemon.scripted_calls().count(marker) == 1


@pytest.mark.parametrize("with_id", [False, True], ids=["no_client_message_id", "client_message_id"])
def test_a_turn_that_fails_after_it_started_is_not_sent_again_by_the_client(client, daemon, with_id):
    """The turn may already have acted: the 502 carries x-should-retry: false, so the client (max_retries=2)
    raises the real error at once and the engine ran once, not three times (nor a 409 for the resend)."""
    marker = f"fails-{uuid.uuid4().hex}"
    body = {"conversation_id": marker, **({"client_message_id": "m1"} if with_id else {})}
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="scripted", extra_body=body, messages=[
            {"role": "user", "content": f"script:answer=acted|fail=it broke {marker}"}])
    assert info.value.status_code == 502
    assert info.value.response.headers["x-should-retry"] == "false"
    assert info.value.response.headers["x-ugent-turn-id"]
    assert info.value.response.headers["x-ugent-conversation-id"] == marker == info.value.body["conversation_id"]
    assert f"it broke {marker}" in info.value.message
    assert sum(1 for c in daemon.scripted_calls() if marker in c) == 1


def test_the_client_retrieves_each_listed_model_and_gets_a_404_for_another(client):
    listed = client.models.list().data
    assert listed
    for model in listed:
        assert client.models.retrieve(model.id).model_dump() == model.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"
    assert info.value.body["message"] == "The model 'no-such-model' does not exist or you do not have access to it."


def test_raw_stream_has_named_events_header_and_done(daemon):
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", headers={"x-api-key": daemon.key},
                      json={"messages": [{"role": "user", "content": "script:answer=a b|cite=doc-1"}],
                            "stream": True, "model": "scripted"}, timeout=30) as resp:
        assert resp.status_code == 200
        turn_id = resp.headers["x-ugent-turn-id"]
        raw = b"".join(resp.iter_bytes())
    frames = parse_sse(raw)
    assert frames[0]["event"] == "ugent.user_message"
    assert frames[0]["data"]["ugent_user_message"]["turn_id"] == turn_id
    cites = [f for f in frames if f["event"] == "ugent.citations"]
    assert cites and cites[0]["data"]["ugent_citations"] == ["doc-1"]
    assert answer_text(frames) == "a b"
    assert frames[-1]["data"] == "[DONE]"
    for f in frames[:-1]:
        validate(f["data"], "CreateChatCompletionStreamResponse")


def test_twenty_concurrent_copies_of_one_message_run_one_turn(daemon):
    marker = f"race-{uuid.uuid4().hex}"
    body = {"messages": [{"role": "user", "content": f"script:slow=0.01|answer={marker} x y z"}],
            "conversation_id": marker, "client_message_id": "same", "model": "scripted"}

    def send(_):
        r = httpx.post(daemon.base + "/v1/chat/completions", headers={"x-api-key": daemon.key}, json=body,
                       timeout=60)
        return r.status_code, r.headers.get("x-ugent-turn-id"), r.json()

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(send, range(20)))
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) == 1 and statuses.count(409) == 19, statuses
    turn_ids = {t for _, t, _ in results}
    assert len(turn_ids) == 1
    codes = {b["error"]["code"] for s, _, b in results if s == 409}
    assert codes <= {"DuplicateInFlight", "DuplicateProcessed"}
    assert sum(1 for c in daemon.scripted_calls() if marker in c) == 1


def test_the_daemon_stops_cleanly_on_sigterm(tmp_path):
    from tests.support.daemon import Daemon
    d = Daemon(tmp_path).start()
    try:
        r = httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key},
                       json={"messages": [{"role": "user", "content": "hi"}], "model": "scripted"}, timeout=30)
        assert r.status_code == 200
        codes = d.stop()
        if d.servers:  # the Celery worker (and beat) and runweb each shut down and exit 0
            assert len(codes) >= 2 and set(codes) == {0}, codes
        else:  # rundaemon shuts down in order (turn threads, worker, beat, channel workers) and exits 0
            assert codes == [0], codes
            log = (tmp_path / "daemon.log").read_text()
            assert "UGENT daemon stopping" in log and "UGENT daemon stopped" in log
    finally:
        d.close()


def test_keep_alives_are_comment_lines_the_client_ignores(daemon, client):
    """The daemon runs with UGENT_SSE_KEEPALIVE=1: a slow turn gets `: ping` lines, never data-less events."""
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", headers={"x-api-key": daemon.key},
                      json={"messages": [{"role": "user", "content": "script:sleep=2.5|answer=late"}],
                            "stream": True, "model": "scripted"}, timeout=30) as resp:
        raw = b"".join(resp.iter_bytes())
    frames = parse_sse(raw)
    assert any(f["comment"] == "ping" for f in frames)
    assert all(f["data"] is not None or f["comment"] for f in frames)
    stream = client.chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "script:sleep=2.5|answer=still fine"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "still fine"


def test_requests_still_open_when_the_daemon_stops_end_properly(tmp_path):
    """SIGTERM with a stream and a non-stream request open: after the grace the stream gets its last chunk
    (the client resumes from the log) and the waiting request a 503 that says its message was accepted,
    with x-should-retry: false (a resend would run it again); nothing is logged as a crash."""
    import threading
    from tests.support.daemon import Daemon
    d = Daemon(tmp_path).start()
    outcome = {}

    def stream():
        try:
            with httpx.stream("POST", d.base + "/v1/chat/completions", headers={"x-api-key": d.key},
                              json={"messages": [{"role": "user", "content": "script:sleep=5|answer=late"}],
                                    "stream": True, "model": "scripted"}, timeout=30) as resp:
                outcome["stream_status"] = resp.status_code
                outcome["stream_body"] = b"".join(resp.iter_bytes())
        except httpx.HTTPError as exc:
            outcome["stream_error"] = repr(exc)

    def plain():
        try:
            r = httpx.post(d.base + "/v1/chat/completions", headers={"x-api-key": d.key},
                           json={"messages": [{"role": "user", "content": "script:sleep=5|answer=late"}],
                                 "model": "scripted"}, timeout=30)
            outcome["plain"], outcome["plain_headers"] = (r.status_code, r.json()), r.headers
        except httpx.HTTPError as exc:
            outcome["plain_error"] = repr(exc)

    clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
    try:
        for t in clients:
            t.start()
        # Stop only once both requests are in: the stream has its status and both turns are running (a fixed sleep
        # stopped a loaded servers layout before the stream's headers went out, and it got the 503 instead).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
                "stream_status" in outcome
                and d.sql("SELECT COUNT(*) FROM channels_app_turn WHERE state = 'running'")[0][0] == 2):
            time.sleep(0.05)
        codes = d.stop()
        for t in clients:
            t.join(30)
    finally:
        d.close()
    assert "stream_error" not in outcome and outcome["stream_status"] == 200
    assert b"ugent.receipt" in outcome["stream_body"] or b"data:" in outcome["stream_body"]
    assert b"[DONE]" not in outcome["stream_body"]  # cut short, not finished: the client resumes
    assert "plain_error" not in outcome
    status, body = outcome["plain"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down"
    assert outcome["plain_headers"]["x-should-retry"] == "false"
    assert outcome["plain_headers"]["x-ugent-turn-id"] in body["error"]["message"]
    log = (tmp_path / "daemon.log").read_text()
    assert "Exception in ASGI application" not in log and "never retrieved" not in log
    assert "returned without" not in log
    assert codes and set(codes) == {0}, codes  # every process (rundaemon; runweb and the worker) exited 0


def _writer_holding_the_turns(d, tmp_path):
    """Another connection in a transaction that keeps every new turn waiting until its commit()."""
    if d.servers:
        import psycopg
        conn = psycopg.connect(d.env["DATABASE_URL"])
        conn.execute("LOCK TABLE channels_app_turn IN EXCLUSIVE MODE")  # reads go on, writes wait
        return conn
    import sqlite3
    conn = sqlite3.connect(tmp_path / "var" / "ugent.sqlite3", timeout=30, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")  # commit() ends it: sqlite3 commits whatever transaction is open
    return conn


def test_a_message_accepted_while_the_daemon_stops_is_answered_as_accepted_and_not_resent(tmp_path):
    """SIGTERM while a non-stream chat message is being accepted (another writer holds the database, so
    the accept waits on it), and the accept ends after the shutdown's grace cancelled the request: the
    answer waits for it and is the 503 naming its turn, with x-should-retry: false, so the official client
    (max_retries=2) sends nothing again, and the message has one turn. Embedded: rundaemon, SQLite's
    write lock; servers: runweb, a PostgreSQL lock on the turns table."""
    import threading
    from tests.support.daemon import Daemon
    d = Daemon(tmp_path).start()
    marker = f"acc-{uuid.uuid4().hex[:8]}"
    sent = []
    http = httpx.Client(timeout=60, event_hooks={"request": [sent.append]})
    client = openai.OpenAI(base_url=d.base + "/v1", api_key=d.key, max_retries=2, http_client=http)
    outcome = {}

    def plain():
        try:
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": marker}],
                                           extra_body={"conversation_id": marker})
        except Exception as exc:
            outcome["error"] = exc

    lock = _writer_holding_the_turns(d, tmp_path)  # a long transaction, a backup
    try:
        asker = threading.Thread(target=plain)
        asker.start()
        deadline = time.monotonic() + 10
        while not sent and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the request reaches the accept, which waits on the lock
        for p in d.procs:
            p.send_signal(__import__("signal").SIGTERM)
        log = tmp_path / "daemon.log"
        deadline = time.monotonic() + 20  # the shutdown's grace (3 s), then it cancels the request
        while "timeout graceful shutdown exceeded" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "timeout graceful shutdown exceeded" in log.read_text()
        lock.commit()  # the accept goes on and takes the message
        asker.join(40)
        codes = [p.wait(40) for p in d.procs]  # (d.stop would signal it a second time)
        turns = d.sql("select turn_id from channels_app_turn where conversation_id in "
                      "(select id from channels_app_conversation where external_id = ?)", (marker,))
    finally:
        lock.close()
        d.close()
        http.close()
    exc = outcome.get("error")
    assert isinstance(exc, openai.APIStatusError), repr(exc)
    assert exc.status_code == 503 and exc.code == "server_shutting_down", exc.response.text
    assert exc.response.headers.get("x-should-retry") == "false"
    turn_id = exc.response.headers.get("x-ugent-turn-id")
    assert turn_id and turn_id in exc.message
    assert len(sent) == 1  # no resend
    assert turns == [(turn_id,)]
    assert sum(1 for c in d.scripted_calls() if marker in c) <= 1
    log = (tmp_path / "daemon.log").read_text()
    assert "Exception in ASGI application" not in log and "never retrieved" not in log
    assert codes and set(codes) == {0}, codes


def test_openai_client_parses_a_stream_carrying_tool_and_citation_events(client, daemon):
    """A turn that calls a real tool (the built-in workspace toolbox) with ugent_include_tool_events, and
    cites evidence the request supplied: the official client reads it chunk by chunk without error, the
    tool steps are deltas tagged ugent_segment "tool", and the raw stream also carries ugent.citations."""
    text = "script:answer=looking|call=workspace_list{}|answer= found it, see ev-1|cite=ev-1"
    extra = {"ugent_include_tool_events": True, "ugent_citation_ids": ["ev-1"]}
    stream = client.chat.completions.create(model="scripted", stream=True,
                                            messages=[{"role": "user", "content": text}], extra_body=extra)
    segments, answer = [], ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        segment = (delta.model_extra or {}).get("ugent_segment")
        segments.append(segment)
        if segment in (None, "answer"):
            answer += delta.content or ""
    assert "tool" in segments, segments
    assert answer == "looking found it, see ev-1"
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": text}], **extra}
    with httpx.stream("POST", daemon.base + "/v1/chat/completions", headers={"x-api-key": daemon.key},
                      json=body, timeout=30) as resp:
        frames = parse_sse(b"".join(resp.iter_bytes()))
    cites = [f for f in frames if f["event"] == "ugent.citations"]
    assert cites and cites[0]["data"]["ugent_citations"] == ["ev-1"]
    tool_chunks = [f for f in frames if f["event"] is None and isinstance(f["data"], dict)
                   and f["data"]["choices"][0]["delta"].get("ugent_segment") == "tool"]
    assert tool_chunks and any("workspace_list" in json.dumps(f["data"]) for f in tool_chunks)
    for f in frames[:-1]:
        validate(f["data"], "CreateChatCompletionStreamResponse")
