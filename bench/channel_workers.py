"""Inbound messages per second through each channel worker into the hub, beside the bare bridge.

    .venv/bin/python bench/channel_workers.py [--messages 100] [--only telegram,slack,discord,email,line,whatsapp,wecom,dingtalk]

For each built-in worker: its fake platform (tests/fakes/, the platform's wire format on loopback)
and the real supervisor running the worker as a process, on a scratch SQLite database (or the
DATABASE_URL's, in servers mode), with the scripted engine run eagerly (a fast stub: the figure is
the channel's path, not a model's). N messages are pushed on the fake at once; the clock runs from
the first push until the hub holds N receipts ("in"), and until N answers reached the fake ("out").

The baseline, measured in the same run: the same number of ``inbound.submit`` calls straight into
the hub through a bare BridgeServer (bench/bridge_throughput.py's first figure), with no worker and
no platform. Prints each figure and its ratio to the baseline. Figures, never assertions.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
_TMP = tempfile.mkdtemp(prefix="ugc-")
os.environ.setdefault("UGENT_VAR_DIR", _TMP)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
os.environ.setdefault("UGENT_LOG_LEVEL", "WARNING")

from bridge_throughput import django_ready, hub_inbound  # noqa: E402

# Supervision for a bench run: a slow-importing worker must not be taken for a hung one.
LIMITS = {"stop_grace_secs": 2.0, "backoff_initial_secs": 0.05, "backoff_max_secs": 0.2, "restarts_per_round": 1,
          "cooldown_secs": 0.2, "stable_secs": 30.0, "startup_grace_secs": 30.0}


class Channel:
    """One worker and its fake: start both, say when it is listening, push a message, count answers."""

    kind = ""
    env_refs: list[str] = []
    args: list[str] = []

    def start(self) -> dict[str, str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def push(self, i: int, run_id: str) -> None:
        raise NotImplementedError

    def answers(self) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        self.fake.stop()


class Telegram(Channel):
    kind = "channel-telegram"
    env_refs = ["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL"]
    args = ["--mode", "polling", "--poll-timeout", "2", "--per-chat-secs", "0", "--group-secs", "0"]

    def start(self):
        from tests.fakes.telegram import FakeTelegram
        self.fake = FakeTelegram().start()
        return {"TELEGRAM_BOT_TOKEN": self.fake.token, "TELEGRAM_API_BASE_URL": self.fake.base_url}

    def ready(self):
        return self.fake.count("getUpdates") >= 1

    def push(self, i, run_id):
        self.fake.push_message(1000 + i % 20, "script:answer=ok")

    def answers(self):
        return len(self.fake.sent("sendMessage"))


class Slack(Channel):
    kind = "channel-slack"
    env_refs = ["SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_API_BASE_URL"]
    args = ["--mode", "socket"]

    def start(self):
        from tests.fakes.slack import FakeSlack
        self.fake = FakeSlack(mode="socket").start()
        return self.fake.env()

    def ready(self):
        return bool(self.fake.sockets())

    def push(self, i, run_id):
        self.fake.say("script:answer=ok", channel=f"D0DM{i % 20:05d}", user=f"U0USER{i % 20:03d}")

    def answers(self):
        return len(self.fake.posts())


class Discord(Channel):
    kind = "channel-discord"
    env_refs = ["DISCORD_BOT_TOKEN", "DISCORD_API_BASE_URL"]

    def start(self):
        from tests.fakes.discord import FakeDiscord
        self.fake = FakeDiscord().start()
        return {"DISCORD_BOT_TOKEN": self.fake.token, "DISCORD_API_BASE_URL": self.fake.api_base_url}

    def ready(self):
        return self.fake.connected() and self.fake.current is not None

    def push(self, i, run_id):
        self.fake.push_message(f"33000000000000{i % 20:05d}", "script:answer=ok", guild_id="4400000000000000004")

    def answers(self):
        return len(self.fake.sent())


class Email(Channel):
    kind = "channel-email"
    env_refs = ["EMAIL_IMAP_HOST", "EMAIL_IMAP_PORT", "EMAIL_IMAP_USER", "EMAIL_IMAP_PASSWORD", "EMAIL_SMTP_HOST",
                "EMAIL_SMTP_PORT"]
    args = ["--imap-security", "none", "--smtp-security", "none", "--start-at", "unseen", "--timeout-secs", "10",
            "--smtp-retry-secs", "0.2"]

    def start(self):
        from tests.fakes.email import MailServer
        self.fake = MailServer(user="bot@example.org", password="app-password").start()
        return {"EMAIL_IMAP_HOST": "127.0.0.1", "EMAIL_IMAP_PORT": str(self.fake.imap_port),
                "EMAIL_IMAP_USER": "bot@example.org", "EMAIL_IMAP_PASSWORD": "app-password",
                "EMAIL_SMTP_HOST": "127.0.0.1", "EMAIL_SMTP_PORT": str(self.fake.smtp_port)}

    def ready(self):
        return self.fake.idle_count >= 1

    def push(self, i, run_id):
        from tests.fakes.email import make_mail
        self.fake.deliver(make_mail(sender=f"user{i % 20}@example.com", subject=f"bench {i}",
                                    text="script:answer=ok", message_id=f"<bench-{run_id}-{i}@example.com>"))

    def answers(self):
        return len(self.fake.sent())


class Webhook(Channel):
    """A channel the platform calls: ready once the worker's log names the URL it listens on, which the fake
    then posts to."""

    listening = re.compile(r"(?:webhook|callback) listening on (http://\S+)")
    log_path: Path | None = None

    def ready(self):
        text = self.log_path.read_text() if self.log_path and self.log_path.exists() else ""
        found = self.listening.findall(text)
        if found:
            self.point(found[-1])
        return bool(found)

    def point(self, url: str) -> None:
        self.fake.webhook_url = url


class Line(Webhook):
    kind = "channel-line"
    env_refs = ["LINE_CHANNEL_ACCESS_TOKEN", "LINE_CHANNEL_SECRET", "LINE_API_BASE_URL", "LINE_DATA_API_BASE_URL"]
    args = ["--bind", "127.0.0.1:0"]

    def start(self):
        from tests.fakes.line import FakeLine
        self.fake = FakeLine().start()
        return self.fake.env()

    def push(self, i, run_id):
        self.fake.say("script:answer=ok", source={"type": "user", "userId": f"U{i % 20:032x}"})

    def answers(self):
        return len(self.fake.texts())


class WhatsApp(Webhook):
    kind = "channel-whatsapp"
    env_refs = ["WHATSAPP_ACCESS_TOKEN", "WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN", "WHATSAPP_PHONE_NUMBER_ID",
                "WHATSAPP_API_BASE_URL"]
    args = ["--bind", "127.0.0.1:0"]

    def start(self):
        from tests.fakes.whatsapp import FakeWhatsApp
        self.fake = FakeWhatsApp().start()
        return self.fake.env()

    def push(self, i, run_id):
        self.fake.say("script:answer=ok", wa_id=f"3161{i % 20:08d}")

    def answers(self):
        return len(self.fake.texts())


class WeCom(Webhook):
    kind = "channel-wecom"
    env_refs = ["WECOM_CORP_ID", "WECOM_AGENT_ID", "WECOM_SECRET", "WECOM_TOKEN", "WECOM_ENCODING_AES_KEY",
                "WECOM_API_BASE_URL"]
    args = ["--bind", "127.0.0.1:0"]

    def start(self):
        from tests.fakes.wecom import FakeWeCom
        self.fake = FakeWeCom().start()
        self.fake.users.update(f"user{i}" for i in range(20))  # the app's visible range
        return self.fake.env()

    def point(self, url: str) -> None:
        self.fake.callback_url = url

    def push(self, i, run_id):
        # a different answer each: WeCom's duplicate check holds back a text sent to the same user within 30 min
        self.fake.say(f"script:answer=ok {i}", user=f"user{i % 20}")

    def answers(self):
        return len(self.fake.texts())


class DingTalk(Webhook):
    kind = "channel-dingtalk"
    env_refs = ["DINGTALK_APP_KEY", "DINGTALK_APP_SECRET", "DINGTALK_API_BASE_URL"]
    args = ["--bind", "127.0.0.1:0"]

    def start(self):
        from tests.fakes.dingtalk import FakeDingTalk
        self.fake = FakeDingTalk().start()
        self.fake.staff.update(f"staff{i}" for i in range(20))  # the organisation's users
        return self.fake.env()

    def push(self, i, run_id):
        self.fake.say("script:answer=ok", staff=f"staff{i % 20}")

    def answers(self):
        return len(self.fake.texts())


CHANNELS = {"telegram": Telegram, "slack": Slack, "discord": Discord, "email": Email, "line": Line,
            "whatsapp": WhatsApp, "wecom": WeCom, "dingtalk": DingTalk}


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.01)


def bench_channel(name: str, channel: Channel, n: int) -> tuple[float, float]:
    from channels_app.models import Receipt
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.runtime import PluginRuntime

    root = Path(tempfile.mkdtemp(prefix=f"ugc-{name[:3]}-"))
    os.environ.update(channel.start())
    plugin_id = f"{name}-bench-{os.getpid()}"
    Plugin.objects.exclude(plugin_id=plugin_id).update(enabled=False)  # this runtime runs this worker alone
    Plugin.objects.create(plugin_id=plugin_id, kind=channel.kind, command="", args=channel.args,
                          env_refs=channel.env_refs, max_in_flight=64, max_retries=2, heartbeat_secs=5.0)
    runtime = PluginRuntime(run_dir=root / "run", pid_dir=root / "pids", log_dir=root / "logs",
                            state_dir=root / "state", interval=0.05, limits=LIMITS)
    stop = threading.Event()
    thread = threading.Thread(target=runtime.run, args=(stop,), daemon=True)
    thread.start()
    channel.log_path = root / "logs" / f"{plugin_id}.log"  # (where a webhook worker says its URL)
    try:
        wait(channel.ready, 60, f"{name}: the worker to listen")
        run_id = str(int(time.time()))
        receipts = Receipt.objects.filter(conversation__client_id=plugin_id)
        start = time.perf_counter()
        for i in range(n):
            channel.push(i, run_id)
        step = max(1, n // 5)
        seen = 0
        while (count := receipts.count()) < n:
            if count // step > seen // step:
                print(f"  {name}: {count}/{n} in", file=sys.stderr, flush=True)
            seen = count
            if time.perf_counter() - start > 300:
                raise TimeoutError(f"{name}: {count}/{n} receipts after 300 s")
            time.sleep(0.01)
        t_in = time.perf_counter() - start
        wait(lambda: channel.answers() >= n, 300, f"{name}: {n} answers out")
        t_out = time.perf_counter() - start
    finally:
        stop.set()
        thread.join(30)
        channel.stop()
        shutil.rmtree(root, ignore_errors=True)
    return n / t_in, n / t_out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100)
    ap.add_argument("--only", default=",".join(CHANNELS))
    opts = ap.parse_args()
    names = [n.strip() for n in opts.only.split(",") if n.strip()]
    django_ready()
    from django.db import connection
    print(f"database: {connection.vendor}; {opts.messages} messages per channel; scripted engine, eager turns")
    _warm, _client, _frames, stop = hub_inbound(10, tempfile.mkdtemp(prefix="ugb-"))  # the first turn's start-up
    stop()
    bare, _client, _frames, stop = hub_inbound(opts.messages, tempfile.mkdtemp(prefix="ugb-"))
    stop()
    print(f"{'bare bridge (baseline)':<24} in {bare:8.1f} msgs/s")
    for name in names:
        rate_in, rate_out = bench_channel(name, CHANNELS[name](), opts.messages)
        print(f"{name:<24} in {rate_in:8.1f} msgs/s | answered {rate_out:8.1f} msgs/s "
              f"| in / bare bridge {rate_in / bare:.2f}")
    bare2, _client, _frames, stop = hub_inbound(opts.messages, tempfile.mkdtemp(prefix="ugb-"))
    stop()
    print(f"{'bare bridge, again':<24} in {bare2:8.1f} msgs/s  (the machine's drift over the run: "
          f"{bare2 / bare:.2f}x)")


if __name__ == "__main__":
    main()
