"""The echo channel: a test channel whose "API" is two files, built on the worker SDK.

    python -m plugins_app.channel.workers.echo

* inbound: ECHO_INBOX names a JSON-lines file (default ``var/echo-inbox.jsonl``); each line ``{"conversation_id",
  "message_id", "sender_id", "text"[, "sender_name", "source_type", "option"]}`` is
  submitted once (the outbox and the host deduplicate a re-read after a restart); ``option`` is a
  button press: the ``value`` of one of a delivery's options, sent as ``metadata["option"]``;
* outbound: each delivery is appended to ECHO_SENT (default ``var/echo-sent.jsonl``) as a JSON line
  ``{"delivery_id", "conversation_id", "text", "attempt"[, "buttons"]}`` (fsynced), where
  ``buttons`` are a delivery's ``metadata["options"]`` as ``[{"label", "value"}]``, and
  ``already_delivered`` looks there, so a crash between send and ack never sends twice.

Knobs for tests: ECHO_DELIVER_DELAY (seconds to linger after writing a send, a
window to kill the worker in), ECHO_FAIL ("retry" or "permanent": every send
fails so), ECHO_MUTE_HEARTBEAT=1 (stop heartbeating: the watchdog's case), ECHO_REFUSE=<reason>
(connect() raises ChannelRefused: the platform's "bad token" case).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from plugins_app.channel.sdk import ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage

KIND = "channel-echo"
DESCRIPTION = "Echo: a test channel reading ECHO_INBOX and writing ECHO_SENT (files)."
ENV_REFS = ("ECHO_INBOX", "ECHO_SENT")


def _sent_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            out.add(json.loads(line)["delivery_id"])
        except (ValueError, KeyError):
            continue
    return out


def _buttons(metadata: dict) -> list[dict]:
    """A delivery's options (strings, or {"label", "value"}) as the buttons the echo channel shows."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list):
        return []
    out = []
    for opt in options:
        if isinstance(opt, dict):
            out.append({"label": str(opt.get("label") or opt.get("value") or ""),
                        "value": str(opt.get("value") or opt.get("label") or "")})
        else:
            out.append({"label": str(opt), "value": str(opt)})
    return out


class EchoWorker(ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text", "options")

    def __init__(self, *, inbox: str | None = None, sent: str | None = None, **kwargs):
        super().__init__(**kwargs)
        # Unset, the files are under var/ (ignored by git): a run without them set once left a send in the
        # checkout's root, and it was committed.
        self.inbox = Path(inbox or os.environ.get("ECHO_INBOX") or "var/echo-inbox.jsonl")
        self.sent = Path(sent or os.environ.get("ECHO_SENT") or "var/echo-sent.jsonl")
        self.deliver_delay = float(os.environ.get("ECHO_DELIVER_DELAY", "0") or 0)
        self.fail = os.environ.get("ECHO_FAIL", "")
        self.mute_heartbeat = os.environ.get("ECHO_MUTE_HEARTBEAT") == "1"

    def connect(self):
        if os.environ.get("ECHO_REFUSE"):
            raise ChannelRefused(os.environ["ECHO_REFUSE"])

    def listen(self, submit):
        offset = 0
        while not self.stopping.is_set():
            if self.inbox.exists():
                with self.inbox.open() as fh:
                    fh.seek(offset)
                    while True:
                        line = fh.readline()
                        if not line.endswith("\n"):
                            break  # a line still being written: read it next time
                        offset = fh.tell()
                        if line.strip():
                            self._submit_line(submit, line)
            self.stopping.wait(0.05)

    def _submit_line(self, submit, line: str) -> None:
        try:
            d = json.loads(line)
            msg = InboundMessage(channel="echo", conversation_id=str(d["conversation_id"]),
                                 message_id=str(d["message_id"]), sender_id=str(d["sender_id"]),
                                 text=d.get("text", ""), sender_name=d.get("sender_name"),
                                 source_type=d.get("source_type", "user"),
                                 metadata={"option": str(d["option"])} if d.get("option") else {})
            result = submit(msg)
        except Exception:
            self.log.exception("bad inbox line: %r", line)
            return
        self.log.info("submitted %s: accepted=%s duplicate=%s reason=%s", d["message_id"], result.accepted,
                      result.duplicate, result.reason)

    def deliver(self, delivery):
        if self.fail == "permanent":
            raise DeliveryFailed("echo: chat is gone", permanent=True)
        if self.fail == "retry":
            raise DeliveryFailed("echo: rate limited")
        line = {"delivery_id": delivery.delivery_id, "conversation_id": delivery.conversation_id,
                "text": delivery.text, "attempt": delivery.attempt}
        buttons = _buttons(delivery.metadata)
        if buttons:
            line["buttons"] = buttons
        self.sent.parent.mkdir(parents=True, exist_ok=True)
        with self.sent.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self.deliver_delay:
            time.sleep(self.deliver_delay)
        return f"echo-{delivery.delivery_id}"

    def already_delivered(self, delivery) -> bool:
        return delivery.delivery_id in _sent_ids(self.sent)

    def heartbeat_once(self) -> None:
        if self.mute_heartbeat:
            return
        super().heartbeat_once()


def main() -> None:
    EchoWorker.main()


if __name__ == "__main__":
    main()
