"""Generate a working channel plugin skeleton (the role of the seed's cargo-generate template).

    python manage.py startplugin NAME [--directory DIR]

Writes DIR (default ./plugins/NAME): the worker module (built on the SDK: the
lifecycle, heartbeat, outbox, outbound polling and graceful shutdown are
done; fill in connect, normalise, deliver and optionally media), its
plugins.toml entry, MockBridge tests (`pytest DIR` passes as generated: the
round trip, and the crash-recovery outbox under kill -9), a CI workflow
(format, lint, test) and a README.
"""
from __future__ import annotations

import re
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

WORKER = '''"""The {name} channel worker. Run by the UGENT supervisor: python {module}_worker.py

Until you connect the real platform, a stand-in channel plays it: a directory
({env_dir}) where each line appended to inbox.jsonl is an incoming message and
each send is appended to sent.jsonl. Replace ``StandInChannel`` with your
platform's client; keep the shape of listen/deliver/already_delivered.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from plugins_app.channel.sdk import ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage

KIND = "{kind}"
DESCRIPTION = "{name}: describe your channel here."
ENV_REFS = ("{env}",)


class StandInChannel:
    """Plays the platform until you connect the real one: inbox.jsonl in, sent.jsonl out (fsynced)."""

    def __init__(self, directory: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inbox, self.sent = self.dir / "inbox.jsonl", self.dir / "sent.jsonl"
        self.offset = 0

    def receive(self) -> list[dict]:
        """New complete lines of inbox.jsonl (all of them again after a restart: the host dedupes)."""
        if not self.inbox.exists():
            return []
        with self.inbox.open() as fh:
            fh.seek(self.offset)
            lines = []
            while (line := fh.readline()).endswith("\\n"):
                self.offset = fh.tell()
                if line.strip():
                    lines.append(json.loads(line))
        return lines

    def send(self, chat_id: str, text: str, delivery_id: str) -> str:
        with self.sent.open("a") as fh:
            fh.write(json.dumps({{"delivery_id": delivery_id, "chat_id": chat_id, "text": text}}) + "\\n")
            fh.flush()
            os.fsync(fh.fileno())
        return f"{name}-{{delivery_id}}"

    def was_sent(self, delivery_id: str) -> bool:
        if not self.sent.exists():
            return False
        return any(json.loads(line)["delivery_id"] == delivery_id for line in self.sent.read_text().splitlines())


class {cls}(ChannelWorker):
    kind = KIND
    version = "0.1.0"
    capabilities = ()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.channel: StandInChannel | None = None

    # 1. Channel API connection
    def connect(self) -> None:
        """Open the channel API (websocket, HTTP client, webhook server) with os.environ["{env}"].

        A platform that refuses the credentials (401, revoked) raises ChannelRefused: the supervisor
        then shows the reason in the admin and does not restart the worker into the platform.
        """
        if os.environ.get("{env}") == "revoked":
            raise ChannelRefused("the token was revoked")
        self.channel = StandInChannel(os.environ.get("{env_dir}") or "{name}-standin")

    # 2. Inbound normalisation
    def normalise(self, raw: dict) -> InboundMessage:
        """Map one channel event to UGENT's inbound format; the platform's own id is the dedupe key."""
        return InboundMessage(channel=KIND.removeprefix("channel-"), conversation_id=str(raw["chat_id"]),
                              message_id=str(raw["id"]), sender_id=str(raw["from"]),
                              text=raw.get("text", ""), source_type=raw.get("source_type", "user"))

    def listen(self, submit) -> None:
        while not self.stopping.is_set():
            for raw in self.channel.receive():
                submit(self.normalise(raw))  # in the outbox once this returns: acknowledge it to the channel now
            self.stopping.wait(0.05)

    # 3. Outbound delivery
    def deliver(self, delivery) -> str | None:
        """Send one message; return the channel's message id, or raise DeliveryFailed."""
        if not delivery.text and not delivery.attachments:
            raise DeliveryFailed("nothing to send", permanent=True)
        return self.channel.send(delivery.conversation_id, delivery.text, delivery.delivery_id)

    def already_delivered(self, delivery) -> bool:
        """After a crash between send and ack: did the send reach the channel? (Look it up there.)"""
        return self.channel.was_sent(delivery.delivery_id)

    # 4. Media handling (optional): fetch_media / put_media, see plugins_app.channel.sdk.worker.


if __name__ == "__main__":
    {cls}.main()
'''

TEST = '''"""{cls} against a MockBridge: no daemon needed. Run: pytest {directory}

The second test is the crash-recovery outbox: the worker is killed (SIGKILL) between the host
accepting a message and the worker hearing so, and between a send and its ack; after a restart
nothing is lost and nothing is doubled.
"""
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from plugins_app.channel.sdk.mock import AFTER, DROP, MockBridge

from {module}_worker import {cls}

HERE = Path(__file__).resolve().parent


def say(standin: Path, message_id: str, text: str) -> None:
    with (standin / "inbox.jsonl").open("a") as fh:
        fh.write(json.dumps({{"id": message_id, "chat_id": "c-1", "from": "u-1", "text": text}}) + "\\n")


def sent(standin: Path) -> list[dict]:
    path = standin / "sent.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_worker_submits_inbound_and_delivers_outbound(tmp_path, monkeypatch):
    monkeypatch.setenv("{env_dir}", str(tmp_path / "standin"))
    with MockBridge("{name}-main", heartbeat_secs=0.05) as bridge:
        worker = {cls}(**bridge.worker_kwargs(state_dir=str(tmp_path / "state")))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            bridge.wait_for(lambda: bridge.heartbeats >= 1)
            say(tmp_path / "standin", "m-1", "hi")
            bridge.wait_for(lambda: bridge.submits)
            assert bridge.submits[0].message_id == "m-1"
            delivery_id = bridge.queue_delivery("c-1", "hello back")
            bridge.wait_for(lambda: (bridge.delivery(delivery_id) or {{}}).get("state") == "delivered")
            assert [(s["chat_id"], s["text"]) for s in sent(tmp_path / "standin")] == [("c-1", "hello back")]
        finally:
            worker.stop()
            thread.join(5)


def start_worker(bridge, tmp_path) -> subprocess.Popen:
    env = {{**os.environ, **bridge.env(UGENT_WORKER_STATE_DIR=str(tmp_path / "state"),
                                     {env_dir}=str(tmp_path / "standin"), {env}="test")}}
    return subprocess.Popen([sys.executable, str(HERE / "{module}_worker.py")], env=env, cwd=str(HERE))


def test_a_worker_killed_between_accept_and_ack_loses_nothing_and_doubles_nothing(tmp_path):
    standin = tmp_path / "standin"
    standin.mkdir()
    with MockBridge("{name}-main", heartbeat_secs=0.05) as bridge:
        # Inbound: the host accepts the message, and the worker is killed before it hears so.
        bridge.hold("inbound.submit", AFTER)
        worker = start_worker(bridge, tmp_path)
        try:
            say(standin, "m-1", "hi")
            bridge.wait_for(lambda: bridge.held, timeout=20)
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            bridge.release("inbound.submit")
            # Outbound: the send reaches the channel, and the worker is killed before its ack reaches the host.
            bridge.hold("outbound.ack", DROP)
            worker = start_worker(bridge, tmp_path)
            bridge.wait_for(lambda: len(bridge.submit_log) >= 2, timeout=20)  # the outbox submitted m-1 again
            delivery_id = bridge.queue_delivery("c-1", "the answer")
            bridge.wait_for(lambda: sent(standin), timeout=20)
            bridge.wait_for(lambda: any(m == "outbound.ack" for m, _ in bridge.held), timeout=20)
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            bridge.release("outbound.ack")
            worker = start_worker(bridge, tmp_path)
            bridge.wait_for(lambda: (bridge.delivery(delivery_id) or {{}}).get("state") == "delivered", timeout=20)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(10)
        assert [m.message_id for m in bridge.submits] == ["m-1"]           # accepted once, not lost
        assert [s["delivery_id"] for s in sent(standin)] == [delivery_id]  # sent once, not doubled
'''

CI = '''# CI for the {name} channel plugin: lint, format, and its tests against a MockBridge.
name: ci
on:
  push:
  pull_request:
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      - name: Install UGENT (the worker SDK) and the tools
        run: |
          python -m pip install --upgrade pip
          pip install "ugent-django @ git+${{{{ vars.UGENT_REPO || 'https://github.com/UGENTAI/ugent-django' }}}}" pytest ruff
      - name: Format
        run: ruff format --check .
      - name: Lint
        run: ruff check .
      - name: Test
        run: pytest -q
'''

TOML = '''schema_version = 1

[[plugins]]
id = "{name}-main"
kind = "{kind}"
enabled = true
command = "python"
args = ["{worker_path}"]
env_refs = ["{env}", "{env_dir}"]

[plugins.limits]
max_in_flight = 64
max_retries = 5
heartbeat_secs = 30

[plugins.routing]
allowed_senders = []
'''

README = '''# {name} — a UGENT channel plugin

A channel worker built on the UGENT worker SDK (`plugins_app.channel.sdk`). The SDK does
the lifecycle: hello, heartbeat, the inbound listener, outbound polling, the
crash-recovery outbox and graceful shutdown on SIGTERM. You implement:

1. **connect()** — open the channel API (websocket, HTTP, webhook), with `{env}`; raise
   `ChannelRefused` when the platform refuses the credentials;
2. **normalise()/listen()** — map channel messages to `InboundMessage` and `submit` them;
3. **deliver()** — send a `Delivery`; return the channel's message id or raise `DeliveryFailed`;
4. **already_delivered()** — after a crash between a send and its ack, look the send up on the platform;
5. **fetch_media()/put_media()** — attachments (optional).

Until then a stand-in channel plays the platform: `{env_dir}` names a directory where lines
appended to `inbox.jsonl` arrive as messages and sends are appended to `sent.jsonl`.

Test without the daemon: `pytest {directory}` (a `MockBridge` plays the host). It includes the
crash-recovery test: the worker killed between accept and ack, restarted, nothing lost or doubled.
`.github/workflows/ci.yml` runs format, lint and the tests on every push.

Register it: `python manage.py plugins import {directory}/plugins.toml`, set `{env}` in the
daemon's environment, and the supervisor starts it (`python manage.py runsupervisor`, or
`rundaemon` in embedded mode). The protocol is docs/plugin-protocol.md.
'''


class Command(BaseCommand):
    help = "Generate a channel plugin skeleton: worker, plugins.toml entry, MockBridge tests, CI workflow, README."

    def add_arguments(self, parser):
        parser.add_argument("name", help="The channel's name, e.g. matrix (kind channel-matrix).")
        parser.add_argument("--directory", default=None)

    def handle(self, *args, name: str, directory: str | None, **opts):
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,40}", name):
            raise CommandError("NAME is lower-case letters, digits, '-' and '_' (e.g. matrix).")
        target = Path(directory or Path("plugins") / name).resolve()
        if target.exists() and any(target.iterdir()):
            raise CommandError(f"{target} exists and is not empty.")
        target.mkdir(parents=True, exist_ok=True)
        module = name.replace("-", "_")
        ctx = {"name": name, "kind": f"channel-{name}", "module": module, "directory": str(target),
               "cls": "".join(p.capitalize() for p in re.split(r"[-_]", name)) + "Worker",
               "env": f"{module.upper()}_TOKEN", "env_dir": f"{module.upper()}_STANDIN_DIR",
               "worker_path": str(target / f"{module}_worker.py")}
        files = {f"{module}_worker.py": WORKER, f"test_{module}_worker.py": TEST, "plugins.toml": TOML,
                 "README.md": README, ".github/workflows/ci.yml": CI}
        for filename, template in files.items():
            (target / filename).parent.mkdir(parents=True, exist_ok=True)
            (target / filename).write_text(template.format(**ctx))
        self.stdout.write(f"Created {ctx['kind']} in {target}: " + ", ".join(files))
