"""Telegram polling's lanes while the hub is away: the submits tried and the CPU they cost.

    .venv/bin/python bench/host_away_lanes.py [--secs 20] [--pending 3000] [--chats 16]

The hub's database down (every ``inbound.submit`` answered -32006, as hub.py does) for ``--secs``;
``--chats`` chats each with a message waiting on its lane; the worker's outbox already owes
``--pending`` other messages (a backlog), so each try, which reads every pending row
(``inbound_pending``), costs what a real backlog would. The Telegram worker runs in this process
against the SDK's MockBridge and tests/fakes' Telegram on loopback (heartbeats 60 s apart: the
replay stays out of the figure).

The baseline, measured in the same run: the lanes trying again each second
(``HOST_AWAY_MAX_WAIT_SECS`` = 1, as the lanes did before they backed off). Prints, for each, the
submits the hub refused and the process's CPU seconds over the outage, and the ratios. Figures,
never assertions.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UGENT_LOG_LEVEL", "WARNING")

import logging  # noqa: E402

from plugins_app.channel.bridge import HostUnavailable  # noqa: E402
from plugins_app.channel.sdk.messages import InboundMessage  # noqa: E402
from plugins_app.channel.sdk.mock import MockBridge  # noqa: E402
from plugins_app.channel.sdk.outbox import Outbox  # noqa: E402

ARGS = ("--mode", "polling", "--poll-timeout", "1", "--per-chat-secs", "0", "--group-secs", "0")


def run(secs: float, pending: int, chats: int, max_wait: float) -> tuple[int, float]:
    """One outage; returns (submits the hub refused, CPU seconds of this process meanwhile)."""
    from plugins_app.channel.workers.telegram import TelegramWorker, parse_args
    from plugins_app.channel.workers.telegram import worker as telegram_module
    from tests.fakes.telegram import FakeTelegram

    telegram_module.HOST_AWAY_MAX_WAIT_SECS = max_wait
    refused: list[str] = []
    with MockBridge("bench-telegram", heartbeat_secs=60) as bridge, tempfile.TemporaryDirectory() as state:
        with Outbox(plugin_id=bridge.plugin_id, state_dir=state) as box:  # the backlog, owed already
            for i in range(pending):
                box.inbound_record(InboundMessage(
                    channel="telegram", conversation_id=f"backlog-{i % 200}", message_id=str(i), sender_id="u1",
                    text="hello " * 30, metadata={"telegram": {"chat_id": i}}))

        async def down(plugin_id, msg):
            refused.append(msg.message_id)
            raise HostUnavailable("database unavailable")

        bridge.hub.submit_inbound = down
        fake = FakeTelegram().start()
        os.environ["TELEGRAM_BOT_TOKEN"] = fake.token
        os.environ["TELEGRAM_API_BASE_URL"] = fake.base_url
        worker = TelegramWorker(options=parse_args(list(ARGS)), **bridge.worker_kwargs(state_dir=state))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while fake.polls_begun < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            for chat in range(chats):
                fake.push_message(1000 + chat, "hello")
            while len(set(refused)) < chats and time.monotonic() < deadline:
                time.sleep(0.01)  # every lane has tried once: the outage is counted from here
            tried, cpu = len(refused), time.process_time()
            time.sleep(secs)
            return len(refused) - tried, time.process_time() - cpu
        finally:
            worker.stop()
            thread.join(20)
            fake.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--secs", type=float, default=20.0)
    parser.add_argument("--pending", type=int, default=3000)
    parser.add_argument("--chats", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    base_tries, base_cpu = run(args.secs, args.pending, args.chats, max_wait=1.0)
    tries, cpu = run(args.secs, args.pending, args.chats, max_wait=30.0)
    print(f"hub away {args.secs:.0f} s, {args.chats} chats waiting, {args.pending} rows owed")
    print(f"  baseline (a try each second): {base_tries:5d} submits tried, {base_cpu:6.2f} s CPU "
          f"({100 * base_cpu / args.secs:.0f}% of a CPU)")
    print(f"  backing off (1, 2, 4 ... 30 s): {tries:5d} submits tried, {cpu:6.2f} s CPU "
          f"({100 * cpu / args.secs:.0f}% of a CPU)")
    print(f"  ratio: tries {tries / max(base_tries, 1):.2f}x, CPU {cpu / max(base_cpu, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
