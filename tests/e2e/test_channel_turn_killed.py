"""kill -9 in the middle of a chat channel's work, in the pass's run mode, then start again: nothing lost,
nothing doubled.

* The process running a channel's turn, mid-answer: the embedded daemon (which also hosts the channel's
  worker), or the Celery worker (servers mode, with `runsupervisor` and beat as processes of their own). A
  second chat's message waits behind it (one turn at a time). After the restart each message has one turn,
  the engine was called once for each, the killed turn ended `interrupted` once, and each chat got exactly one
  message: the part of the answer that had streamed with the notice after it, and the waiting message's answer.
  The echo channel's worker reads its inbox again when it starts again, so the hub sees both messages a second
  time and answers neither again.
* The channel workers' host, mid-delivery: the embedded daemon, or `runsupervisor` (servers mode), killed after
  the worker wrote a send to the chat and before it acknowledged it. The delivery is handed out again after the
  restart, and the worker's outbox knows it was sent: the chat gets it once.
* The channel workers' host, mid-inbound: killed while a chat's messages keep arriving, some accepted by the
  hub, one likely between the worker's submit and the hub's answer, the rest not yet read. After the restart
  the worker reads its inbox again: every message has one turn and the chat one answer to each.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from plugins_app.channel.services import ANSWER_FOR_STATE
from tests.plugins_app.conftest import wait_until
from tests.support.daemon import PY, ROOT, Daemon

#: A lapsed lease is found within seconds (servers mode: beat's sweep; embedded: at the next start)
FAST = {"UGENT_TURN_LEASE_SECONDS": "3", "UGENT_TURN_LEASE_RENEW_SECONDS": "0.5",
        "UGENT_TURN_SWEEP_SECONDS": "1", "UGENT_TURN_REQUEUE_SECONDS": "2"}
LONG = "script:slow=0.1|answer=" + " ".join(f"w{i}" for i in range(300))


class Deployment:
    """A daemon in the pass's mode with the echo channel; in servers mode its `runsupervisor` beside it."""

    def __init__(self, tmp: Path, env: dict | None = None):
        self.tmp = tmp
        self.inbox, self.sent = tmp / "inbox.jsonl", tmp / "sent.jsonl"
        env = {**FAST, "ECHO_INBOX": str(self.inbox), "ECHO_SENT": str(self.sent), **(env or {})}
        (tmp / "d").mkdir()
        self.d = Daemon(tmp / "d", beat=True, concurrency=1, extra_env=env)
        self.d.prepare()
        refs = ", ".join(f'"{name}"' for name in env if name.startswith("ECHO_"))
        (tmp / "plugins.toml").write_text(
            'schema_version = 1\n[[plugins]]\nid = "echo-main"\nkind = "channel-echo"\nenabled = true\n'
            f'env_refs = [{refs}]\n[plugins.limits]\nheartbeat_secs = 1\n')
        self.d.manage("plugins", "import", str(tmp / "plugins.toml"))
        self.supervisor: subprocess.Popen | None = None
        self.d.spawn()
        if self.d.servers:
            self.start_supervisor()

    def start_supervisor(self) -> None:
        """Servers mode: the channel workers' host is a process of its own."""
        self.supervisor = subprocess.Popen([PY, "manage.py", "runsupervisor"], cwd=ROOT, env=self.d.env,
                                           stdout=open(self.tmp / "supervisor.log", "ab"), stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def kill_host(self) -> None:
        """kill -9 whatever hosts the channel workers: runsupervisor (servers), the daemon (embedded)."""
        if self.d.servers:
            os.killpg(self.supervisor.pid, signal.SIGKILL)
            self.supervisor.wait()
        else:
            self.d.kill_worker()

    def restart_host(self) -> None:
        if self.d.servers:
            self.start_supervisor()
        else:
            self.d.spawn()

    def say(self, chat: str, message_id: str, sender: str, text: str) -> None:
        with self.inbox.open("a") as fh:
            fh.write(json.dumps({"conversation_id": chat, "message_id": message_id, "sender_id": sender,
                                 "text": text}) + "\n")

    def turns(self, *message_ids: str) -> dict:
        marks = ", ".join("?" for _ in message_ids)
        return dict(self.d.sql("SELECT r.client_message_id, t.state FROM channels_app_turn t JOIN channels_app_receipt"
                               f" r ON r.id = t.receipt_id WHERE r.client_message_id IN ({marks})", message_ids))

    def sends(self) -> list[dict]:
        return [json.loads(line) for line in self.sent.read_text().splitlines()] if self.sent.exists() else []

    def logs(self) -> str:
        supervisor = self.tmp / "supervisor.log"
        return ((self.tmp / "d" / "daemon.log").read_text()[-3000:]
                + (supervisor.read_text()[-2000:] if supervisor.exists() else ""))

    def close(self) -> None:
        if self.supervisor is not None and self.supervisor.poll() is None:
            os.killpg(self.supervisor.pid, signal.SIGTERM)
            try:
                self.supervisor.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.supervisor.pid, signal.SIGKILL)
                self.supervisor.wait()
        self.d.close()


def test_a_channel_turn_killed_mid_answer_is_interrupted_once_and_the_chat_behind_it_answered_once(tmp_path):
    dep = Deployment(tmp_path)
    d = dep.d
    try:
        dep.say("chat-1", "m-1", "42", LONG)
        streamed = ("SELECT count(*) FROM channels_app_event e JOIN channels_app_turn t ON t.id = e.turn_id "
                    "JOIN channels_app_receipt r ON r.id = t.receipt_id WHERE r.client_message_id = 'm-1' "
                    "AND e.type = 'turn.delta'")
        assert wait_until(lambda: d.sql(streamed)[0][0] >= 5, 90, 0.2), dep.logs()
        dep.say("chat-2", "m-2", "43", "script:answer=the one behind")
        assert wait_until(lambda: "m-2" in dep.turns("m-1", "m-2"), 30, 0.2), dep.logs()
        assert dep.turns("m-1", "m-2") == {"m-1": "running", "m-2": "accepted"}  # it waits behind m-1

        d.kill_worker()  # kill -9: the daemon (embedded), the Celery worker (servers)
        if d.servers:
            d.spawn_worker()
        else:
            d.spawn()

        def settled():
            states = dep.turns("m-1", "m-2")
            deliveries = d.sql("SELECT state FROM plugins_app_outbounddelivery")
            return (set(states.values()) <= {"interrupted", "completed"} and len(states) == 2
                    and deliveries and all(s == "delivered" for (s,) in deliveries))
        assert wait_until(settled, 120, 0.2), (dep.turns("m-1", "m-2"), dep.logs())
        time.sleep(3)  # anything doubled would come by now: a redelivered task, a resubmitted inbox line

        assert dep.turns("m-1", "m-2") == {"m-1": "interrupted", "m-2": "completed"}
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
        sends = dep.sends()
        assert sorted(s["conversation_id"] for s in sends) == ["chat-1", "chat-2"], sends  # one each
        texts = {s["conversation_id"]: s["text"] for s in sends}
        notice = ANSWER_FOR_STATE["interrupted"]
        assert texts["chat-1"].startswith("w0 w1 w2 w3 w4") and texts["chat-1"].endswith("\n\n" + notice)
        assert "w299" not in texts["chat-1"]
        assert texts["chat-2"] == "the one behind"
    finally:
        dep.close()


def test_the_channel_host_killed_after_a_send_and_before_its_ack_sends_it_once(tmp_path):
    dep = Deployment(tmp_path, {"ECHO_DELIVER_DELAY": "4"})  # the worker lingers 4 s between the send and the ack
    d = dep.d
    try:
        dep.say("chat-3", "m-3", "44", "script:answer=sent before the crash")
        assert wait_until(lambda: any(s["text"] == "sent before the crash" for s in dep.sends()), 90, 0.05), \
            dep.logs()
        assert [s for (s,) in d.sql("SELECT state FROM plugins_app_outbounddelivery")] == ["in_flight"]
        dep.kill_host()  # kill -9 before the ack
        dep.restart_host()
        assert wait_until(lambda: d.sql("SELECT state FROM plugins_app_outbounddelivery") == [("delivered",)],
                          90, 0.2), (d.sql("SELECT state, handed_out FROM plugins_app_outbounddelivery"), dep.logs())
        time.sleep(3)  # a second send would be written by now
        assert [s["text"] for s in dep.sends()] == ["sent before the crash"]  # once
        assert d.sql("SELECT count(*) FROM plugins_app_outbounddelivery")[0][0] == 1
        assert dep.turns("m-3") == {"m-3": "completed"}
        assert d.scripted_calls().count("script:answer=sent before the crash") == 1
    finally:
        dep.close()


def test_the_channel_host_killed_while_messages_arrive_answers_each_message_once(tmp_path):
    dep = Deployment(tmp_path)
    d = dep.d
    count = 40
    texts = {f"in-{i}": f"script:answer=reply {i}" for i in range(count)}
    accepted = "SELECT count(*) FROM channels_app_receipt WHERE client_message_id LIKE ?"
    try:
        def arrive():  # one message every 30 ms, to 40 chats, whatever happens to the host meanwhile
            for i, (message_id, text) in enumerate(texts.items()):
                dep.say(f"chat-in-{i}", message_id, "45", text)
                time.sleep(0.03)
        sender = threading.Thread(target=arrive, daemon=True)
        sender.start()
        assert wait_until(lambda: d.sql(accepted, ("in-%",))[0][0] >= 8, 90, 0.01), dep.logs()
        dep.kill_host()  # kill -9 mid-inbound: the worker dies with its host
        at_kill = d.sql(accepted, ("in-%",))[0][0]
        sender.join(10)
        dep.restart_host()

        # Embedded mode: the daemon is the host and runs the turns, so the one running at the kill (one at a
        # time) ends interrupted, as any turn killed mid-answer. Servers mode: the Celery worker lives on.
        ends = {"completed"} if d.servers else {"completed", "interrupted"}

        def states() -> dict:
            return dict(d.sql("SELECT r.client_message_id, t.state FROM channels_app_turn t JOIN channels_app_receipt "
                              "r ON r.id = t.receipt_id WHERE r.client_message_id LIKE ?", ("in-%",)))

        def settled():
            deliveries = d.sql("SELECT state FROM plugins_app_outbounddelivery")
            return (len(states()) == count and set(states().values()) <= ends
                    and len(deliveries) == count and all(s == "delivered" for (s,) in deliveries))
        assert wait_until(settled, 180, 0.2), (states(), dep.logs())
        time.sleep(3)  # a resubmitted message or a second delivery would come by now
        assert at_kill < count, "every message was in before the kill: nothing was tested"
        per_message = dict(d.sql("SELECT r.client_message_id, count(t.id) FROM channels_app_receipt r JOIN "
                                 "channels_app_turn t ON t.receipt_id = r.id WHERE r.client_message_id LIKE ? "
                                 "GROUP BY r.client_message_id", ("in-%",)))
        assert per_message == {message_id: 1 for message_id in texts}
        final = states()
        interrupted = [m for m, state in final.items() if state == "interrupted"]
        assert len(interrupted) <= 1, final
        calls = d.scripted_calls()
        # the engine ran each completed turn once; the interrupted one at most once (killed before or after its
        # engine was called, it is never run again)
        wrong = {m: (final[m], calls.count(text)) for m, text in texts.items()
                 if calls.count(text) > 1 or (calls.count(text) == 0 and final[m] != "interrupted")}
        assert not wrong, wrong
        sends = {}
        for s in dep.sends():
            sends.setdefault(s["conversation_id"], []).append(s["text"])
        assert sorted(sends) == sorted(f"chat-in-{i}" for i in range(count))
        for i, message_id in enumerate(texts):
            assert len(sends[f"chat-in-{i}"]) == 1, (message_id, sends[f"chat-in-{i}"])  # one answer each
            if message_id in interrupted:
                assert sends[f"chat-in-{i}"][0].endswith(ANSWER_FOR_STATE["interrupted"])
            else:
                assert sends[f"chat-in-{i}"] == [f"reply {i}"]
    finally:
        dep.close()
