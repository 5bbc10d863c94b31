"""kill -9 in the middle of a rule's compaction, a native action the turn runner runs as the message's turn,
against the real daemon in the run mode the environment names (embedded: the daemon; servers: the Celery
worker). After the restart the turn is interrupted, once; the summariser's half-done work hid nothing; no
message is lost; the message is not run again; and the next compaction runs once, as if nothing happened."""
from __future__ import annotations

import threading

import httpx

from tests.channels_app.test_turn_liveness import FAST_LEASE, SERVERS, wait_for
from tests.support.daemon import Daemon

RULES = """
[[rules]]
name = "compact"
priority = 30
match = { field = "text", equals = "compact please" }

[rules.decision.RunNativeAction]
action = "compact_conversation"
"""
COMPACTED = "Compacted the conversation: 4 earlier messages summarised; the last 1 exchange kept as they are."


def chat(d: Daemon, text: str, message_id: str, *, timeout: float = 180) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "conversation_id": "k-kill",
            "client_message_id": message_id, "user": "alice"}
    return httpx.post(d.base + "/v1/chat/completions", json=body, headers={"x-api-key": d.key}, timeout=timeout)


def receipt(d: Daemon, message_id: str) -> dict:
    return httpx.get(d.base + "/v1/ugent/receipt", headers={"x-api-key": d.key}, timeout=10,
                     params={"conversation_id": "k-kill", "client_message_id": message_id, "user": "alice"}).json()


def summariser(d: Daemon, name: str) -> None:
    d.manage("shell", "-c", "from plugins_app.models import AgentProfile as P; p = P.objects.get(name='scripted'); "
                            f"p.summarizer_engine = '{name}'; p.save()")


def messages(d: Daemon) -> list[tuple]:
    return d.sql("SELECT m.role, m.content, m.hidden FROM channels_app_message m JOIN channels_app_conversation c "
                 "ON c.id = m.conversation_id WHERE c.external_id = 'k-kill' ORDER BY m.id")


def test_a_rule_compaction_killed_mid_summary_is_interrupted_hides_nothing_and_runs_again_once(tmp_path):
    mark = tmp_path / "summarising"
    d = Daemon(tmp_path / "d", beat=True, extra_env={
        **FAST_LEASE, "UGENT_COMPACT_KEEP_EXCHANGES": "1",
        "UGENT_EXTRA_SUMMARIZERS": "test-slow=tests.support.slow_summarizer:SlowSummarizer",
        "UGENT_TEST_SUMMARIZER_MARK": str(mark)})
    try:
        d.prepare()
        rules = tmp_path / "rules.toml"
        rules.write_text(RULES)
        d.manage("rules", "import", str(rules))
        summariser(d, "test-slow")
        d.spawn()  # the rule set and the profile as the daemon starts with them
        for i in range(2):  # two exchanges: the older one is what a compaction summarises
            assert chat(d, f"script:answer=answer {i}", f"h{i}").status_code == 200

        threading.Thread(target=lambda: _quietly(chat, d, "compact please", "m-compact", timeout=10),
                         daemon=True).start()
        assert wait_for(mark.exists, timeout=60), "the summariser never started"
        d.kill_worker()
        if SERVERS:
            d.spawn_worker()  # the web process never stopped; another worker's sweep ends the turn
        else:
            d.spawn()  # the daemon's start-up ends what the dead process left running

        r = wait_for(lambda: (lambda r: r if r.get("state") == "interrupted" else None)(receipt(d, "m-compact")),
                     timeout=60)
        assert r, receipt(d, "m-compact")
        assert r["reason"] == "the process running it stopped"
        # nothing hidden, no summary, every message there once: the compaction commits whole or not at all
        assert messages(d) == [("user", "script:answer=answer 0", False), ("assistant", "answer 0", False),
                               ("user", "script:answer=answer 1", False), ("assistant", "answer 1", False),
                               ("user", "compact please", False)]
        (turn_pk,) = d.sql("SELECT t.id FROM channels_app_turn t JOIN channels_app_receipt r ON r.id = t.receipt_id "
                           "WHERE r.client_message_id = 'm-compact'")[0]
        types = [t for (t,) in d.sql("SELECT type FROM channels_app_event WHERE turn_id = ? ORDER BY id", (turn_pk,))]
        assert types.count("turn.failed") == 1 and "turn.completed" not in types and types[-1] == "turn.failed"
        # the same message again is refused: its first copy may have acted
        again = chat(d, "compact please", "m-compact")
        assert again.status_code == 409 and again.json()["error"]["code"] == "DuplicateAfterFailure", again.text

        summariser(d, "")  # the offline default: a new compaction runs once and hides what it says
        done = chat(d, "compact please", "m-compact-2")
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["message"]["content"] == COMPACTED
        rows = messages(d)
        assert [h for _, _, h in rows[:4]] == [True] * 4 and sum(1 for *_, h in rows if h) == 4
        assert sum(1 for role, content, _ in rows if role == "system") == 1
        assert [c for role, c, _ in rows if role == "assistant"][-1] == COMPACTED
    finally:
        d.close()


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except httpx.HTTPError:
        pass  # the daemon was killed under it
