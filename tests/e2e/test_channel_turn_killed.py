"""kill -9 the process running a chat channel's turn in the middle of it, in the pass's run mode: the embedded
daemon (which also hosts the channel's worker), or the Celery worker (servers mode, with `runsupervisor` and
beat as processes of their own). A second chat's message waits behind it (one turn at a time).

After the restart: each message has one turn, the engine was called once for each, the killed turn ended
`interrupted` once, and each chat got exactly one message: the part of the answer that had streamed with the
notice after it, and the waiting message's answer. The echo channel's worker reads its inbox again when it
starts again, so the hub sees both messages a second time and answers neither again.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from plugins_app.channel.services import ANSWER_FOR_STATE
from tests.plugins_app.conftest import wait_until
from tests.support.daemon import PY, ROOT, Daemon

#: A lapsed lease is found within seconds (servers mode: beat's sweep; embedded: at the next start)
FAST = {"UGENT_TURN_LEASE_SECONDS": "3", "UGENT_TURN_LEASE_RENEW_SECONDS": "0.5",
        "UGENT_TURN_SWEEP_SECONDS": "1", "UGENT_TURN_REQUEUE_SECONDS": "2"}
LONG = "script:slow=0.1|answer=" + " ".join(f"w{i}" for i in range(300))
PLUGINS = ('schema_version = 1\n[[plugins]]\nid = "echo-main"\nkind = "channel-echo"\nenabled = true\n'
           'env_refs = ["ECHO_INBOX", "ECHO_SENT"]\n[plugins.limits]\nheartbeat_secs = 1\n')


def test_a_channel_turn_killed_mid_answer_is_interrupted_once_and_the_chat_behind_it_answered_once(tmp_path):
    inbox, sent = tmp_path / "inbox.jsonl", tmp_path / "sent.jsonl"
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", beat=True, concurrency=1,
               extra_env={**FAST, "ECHO_INBOX": str(inbox), "ECHO_SENT": str(sent)})
    d.prepare()
    plugins = tmp_path / "plugins.toml"
    plugins.write_text(PLUGINS)
    d.manage("plugins", "import", str(plugins))
    supervisor = None
    log = open(tmp_path / "supervisor.log", "ab")

    def start_supervisor():  # servers mode: the channel workers' host is a process of its own
        return subprocess.Popen([PY, "manage.py", "runsupervisor"], cwd=ROOT, env=d.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def turns() -> dict:
        return dict(d.sql("SELECT r.client_message_id, t.state FROM channels_app_turn t JOIN channels_app_receipt r "
                          "ON r.id = t.receipt_id WHERE r.client_message_id IN ('m-1', 'm-2')"))

    def logs() -> str:
        return ((tmp_path / "d" / "daemon.log").read_text()[-3000:]
                + (tmp_path / "supervisor.log").read_text()[-2000:])

    d.spawn()
    try:
        if d.servers:
            supervisor = start_supervisor()
        with inbox.open("a") as fh:
            fh.write(json.dumps({"conversation_id": "chat-1", "message_id": "m-1", "sender_id": "42",
                                 "text": LONG}) + "\n")
        streamed = ("SELECT count(*) FROM channels_app_event e JOIN channels_app_turn t ON t.id = e.turn_id "
                    "JOIN channels_app_receipt r ON r.id = t.receipt_id WHERE r.client_message_id = 'm-1' "
                    "AND e.type = 'turn.delta'")
        assert wait_until(lambda: d.sql(streamed)[0][0] >= 5, 90), logs()
        with inbox.open("a") as fh:
            fh.write(json.dumps({"conversation_id": "chat-2", "message_id": "m-2", "sender_id": "43",
                                 "text": "script:answer=the one behind"}) + "\n")
        assert wait_until(lambda: "m-2" in turns(), 30), logs()
        assert turns()["m-1"] == "running" and turns()["m-2"] == "accepted"  # it waits behind m-1

        d.kill_worker()  # kill -9: the daemon (embedded), the Celery worker (servers)
        if d.servers:
            d.spawn_worker()
        else:
            d.spawn()

        def settled():
            states = turns()
            deliveries = d.sql("SELECT state FROM plugins_app_outbounddelivery")
            return (set(states.values()) <= {"interrupted", "completed"} and len(states) == 2
                    and deliveries and all(s == "delivered" for (s,) in deliveries))
        assert wait_until(settled, 120), (turns(), logs())
        time.sleep(3)  # anything doubled would come by now: a redelivered task, a resubmitted inbox line

        assert turns() == {"m-1": "interrupted", "m-2": "completed"}
        per_message = d.sql("SELECT r.client_message_id, count(t.id) FROM channels_app_receipt r JOIN "
                            "channels_app_turn t ON t.receipt_id = r.id WHERE r.client_message_id IN ('m-1', 'm-2') "
                            "GROUP BY r.client_message_id ORDER BY r.client_message_id")
        assert per_message == [("m-1", 1), ("m-2", 1)]
        ended = d.sql("SELECT e.type FROM channels_app_event e JOIN channels_app_turn t ON t.id = e.turn_id JOIN "
                      "channels_app_receipt r ON r.id = t.receipt_id WHERE r.client_message_id = 'm-1' AND e.type IN "
                      "('turn.failed', 'turn.completed', 'turn.cancelled')")
        assert ended == [("turn.failed",)]
        calls = d.scripted_calls()
        assert calls.count(LONG) == 1 and calls.count("script:answer=the one behind") == 1, calls
        sends = [json.loads(line) for line in sent.read_text().splitlines()]
        assert sorted(s["conversation_id"] for s in sends) == ["chat-1", "chat-2"], sends  # one each
        texts = {s["conversation_id"]: s["text"] for s in sends}
        notice = ANSWER_FOR_STATE["interrupted"]
        assert texts["chat-1"].startswith("w0 w1 w2 w3 w4") and texts["chat-1"].endswith("\n\n" + notice)
        assert "w299" not in texts["chat-1"]
        assert texts["chat-2"] == "the one behind"
    finally:
        if supervisor is not None and supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGTERM)
            try:
                supervisor.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(supervisor.pid, signal.SIGKILL)
                supervisor.wait()
        d.close()
