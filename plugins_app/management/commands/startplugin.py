"""Generate a working channel plugin skeleton (the role of the seed's cargo-generate template).

    python manage.py startplugin NAME [--directory DIR]

Writes DIR (default ./plugins/NAME): the worker module (built on the SDK: the
lifecycle, heartbeat, outbox, outbound polling and graceful shutdown are
done; fill in connect, normalise, deliver and optionally media), its
plugins.toml entry, a MockBridge test (`pytest DIR` passes as generated) and
a README.
"""
from __future__ import annotations

import re
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

WORKER = '''"""The {name} channel worker. Run by the UGENT supervisor: python {module}_worker.py"""
from __future__ import annotations

import queue

from plugins_app.channel.sdk import ChannelWorker, DeliveryFailed, InboundMessage

KIND = "{kind}"
DESCRIPTION = "{name}: describe your channel here."
ENV_REFS = ("{env}",)


class {cls}(ChannelWorker):
    kind = KIND
    version = "0.1.0"
    capabilities = ()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.incoming: "queue.Queue[dict]" = queue.Queue()  # stands in for the channel API's events
        self.sent: list[dict] = []

    # 1. Channel API connection
    def connect(self) -> None:
        """Open the channel API (websocket, HTTP client, webhook server) with os.environ["{env}"]."""

    # 2. Inbound normalisation
    def normalise(self, raw: dict) -> InboundMessage:
        """Map one channel event to UGENT's inbound format."""
        return InboundMessage(channel=KIND.removeprefix("channel-"), conversation_id=str(raw["chat_id"]),
                              message_id=str(raw["id"]), sender_id=str(raw["from"]),
                              text=raw.get("text", ""), source_type=raw.get("source_type", "user"))

    def listen(self, submit) -> None:
        while not self.stopping.is_set():
            try:
                raw = self.incoming.get(timeout=0.1)
            except queue.Empty:
                continue
            submit(self.normalise(raw))  # in the outbox once this returns: acknowledge it to the channel now

    # 3. Outbound delivery
    def deliver(self, delivery) -> str | None:
        """Send one message; return the channel's message id, or raise DeliveryFailed."""
        if not delivery.text and not delivery.attachments:
            raise DeliveryFailed("nothing to send", permanent=True)
        self.sent.append({{"chat_id": delivery.conversation_id, "text": delivery.text}})
        return f"{name}-{{delivery.delivery_id}}"

    # 4. Media handling (optional): fetch_media / put_media, see plugins_app.channel.sdk.worker.


if __name__ == "__main__":
    {cls}.main()
'''

TEST = '''"""{cls} against a MockBridge: no daemon needed. Run: pytest {directory}"""
import threading

from plugins_app.channel.sdk.mock import MockBridge

from {module}_worker import {cls}


def run_worker(bridge, tmp_path):
    worker = {cls}(**bridge.worker_kwargs(state_dir=str(tmp_path)))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def test_the_worker_submits_inbound_and_delivers_outbound(tmp_path):
    with MockBridge("{name}-main", heartbeat_secs=0.05) as bridge:
        worker, thread = run_worker(bridge, tmp_path)
        try:
            bridge.wait_for(lambda: bridge.heartbeats >= 1)
            worker.incoming.put({{"id": "m-1", "chat_id": "c-1", "from": "u-1", "text": "hi"}})
            bridge.wait_for(lambda: bridge.submits)
            assert bridge.submits[0].message_id == "m-1"
            delivery_id = bridge.queue_delivery("c-1", "hello back")
            bridge.wait_for(lambda: (bridge.delivery(delivery_id) or {{}}).get("state") == "delivered")
            assert worker.sent == [{{"chat_id": "c-1", "text": "hello back"}}]
        finally:
            worker.stop()
            thread.join(5)
'''

TOML = '''schema_version = 1

[[plugins]]
id = "{name}-main"
kind = "{kind}"
enabled = true
command = "python"
args = ["{worker_path}"]
env_refs = ["{env}"]

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

1. **connect()** — open the channel API (websocket, HTTP, webhook), with `{env}`;
2. **normalise()/listen()** — map channel messages to `InboundMessage` and `submit` them;
3. **deliver()** — send an `Delivery`; return the channel's message id or raise `DeliveryFailed`;
4. **fetch_media()/put_media()** — attachments (optional).

Test without the daemon: `pytest {directory}` (a `MockBridge` plays the host).

Register it: `python manage.py plugins import {directory}/plugins.toml`, set `{env}` in the
daemon's environment, and the supervisor starts it (`python manage.py runsupervisor`, or
`rundaemon` in embedded mode). The protocol is docs/plugin-protocol.md.
'''


class Command(BaseCommand):
    help = "Generate a channel plugin skeleton: worker, plugins.toml entry, MockBridge test, README."

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
               "env": f"{module.upper()}_TOKEN", "worker_path": str(target / f"{module}_worker.py")}
        files = {f"{module}_worker.py": WORKER, f"test_{module}_worker.py": TEST, "plugins.toml": TOML,
                 "README.md": README}
        for filename, template in files.items():
            (target / filename).write_text(template.format(**ctx))
        self.stdout.write(f"Created {ctx['kind']} in {target}: " + ", ".join(files))
