"""Fixtures of the Django side of the plugins room: plugin rows, the echo worker, a running runtime."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

PY = sys.executable

# Supervision timings small enough for tests; the policy's shape is unchanged.
FAST_LIMITS = {"stop_grace_secs": 2.0, "backoff_initial_secs": 0.05, "backoff_max_secs": 0.2,
               "restarts_per_round": 1, "cooldown_secs": 0.2, "stable_secs": 30.0,
               "startup_grace_secs": 3.0}


def database_url() -> str:
    """The test database, for a management command run in another process."""
    from django.db import connection
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    return f"postgres://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def wait_until(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class Running:
    """One channel worker's run() in a thread (signals are the main thread's, so none are installed), stopped at
    the end of the test; ``stop()`` returns run()'s exit code."""

    def __init__(self, worker):
        self.worker = worker
        self.code = None
        self.thread = threading.Thread(target=self._run, name=f"{worker.kind}-worker", daemon=True)
        self.thread.start()

    def _run(self):
        self.code = self.worker.run()

    def stop(self):
        self.worker.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the worker did not stop"
        return self.code


@pytest.fixture
def short_dir():
    """A private directory with a short path (a Unix socket path must fit in 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ugp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_retry_backoff(monkeypatch):
    from plugins_app.channel import conf
    monkeypatch.setattr(conf, "RETRY_BACKOFF_SECS", 0.0)
    monkeypatch.setattr(conf, "POLL_RECHECK_SECS", 0.2)


def make_plugin(plugin_id="echo-main", **over):
    from plugins_app.channel.models import Plugin
    fields = dict(plugin_id=plugin_id, kind="channel-echo", command="python",
                  args=["-m", "plugins_app.channel.workers.echo"], env_refs=["ECHO_INBOX", "ECHO_SENT"],
                  max_in_flight=8, max_retries=2, heartbeat_secs=0.2)
    fields.update(over)
    return Plugin.objects.create(**fields)


class Echo:
    """The echo channel's two files, and the variables that point the worker at them."""

    def __init__(self, root: Path, monkeypatch):
        self.inbox = root / "inbox.jsonl"
        self.sent = root / "sent.jsonl"
        monkeypatch.setenv("ECHO_INBOX", str(self.inbox))
        monkeypatch.setenv("ECHO_SENT", str(self.sent))

    def say(self, message_id, text, *, conversation_id="chat-1", sender_id="42"):
        with self.inbox.open("a") as fh:
            fh.write(json.dumps({"conversation_id": conversation_id, "message_id": message_id,
                                 "sender_id": sender_id, "text": text}) + "\n")

    def sends(self) -> list[dict]:
        if not self.sent.exists():
            return []
        return [json.loads(line) for line in self.sent.read_text().splitlines() if line.strip()]


@pytest.fixture
def echo(short_dir, monkeypatch):
    return Echo(short_dir, monkeypatch)


class RunningRuntime:
    """A PluginRuntime stepping in its own thread, as rundaemon runs it."""

    def __init__(self, root: Path, **kwargs):
        from plugins_app.channel.runtime import PluginRuntime
        self.root = root
        self.stop_event = threading.Event()
        self.runtime = PluginRuntime(run_dir=root / "run", pid_dir=root / "pids", log_dir=root / "logs",
                                     state_dir=root / "state", interval=0.05,
                                     limits={**FAST_LIMITS, **kwargs.pop("limits", {})}, **kwargs)
        self.error = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self):
        try:
            self.runtime.run(self.stop_event)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def worker_pid(self, plugin_id) -> int | None:
        status = self.runtime.supervisor.status().get(plugin_id)
        return status.pid if status else None

    def log(self, plugin_id) -> str:
        path = self.root / "logs" / f"{plugin_id}.log"
        return path.read_text() if path.exists() else ""

    def stop(self):
        self.stop_event.set()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the runtime did not stop"
        assert self.error is None, self.error


def enqueue_with_files(plugin, *, channel: str, user_id: str, external_id: str, text: str,
                       files: tuple[tuple[bytes, str, str], ...]):
    """A delivery of ``plugin`` to the chat ``external_id`` carrying ``files`` ((data, content type, name)), each
    stored on the host first, as an agent's answer with files is."""
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    actor = channel_actor_resolve(channel=channel, user_id=user_id)
    conv, _ = conversation_resolve(channel=channel, client_id=plugin.plugin_id, external_id=external_id, actor=actor,
                                   caller=None)
    attachments = []
    for data, ctype, name in files:
        media_id = services.media_store(plugin_id=plugin.plugin_id, data=data, content_type=ctype, filename=name)
        kind = {"image": "image", "audio": "audio", "video": "video"}.get(ctype.split("/")[0], "document")
        attachments.append({"kind": kind, "content_type": ctype, "media_id": media_id, "filename": name})
    return services.delivery_enqueue(plugin=plugin, conversation=conv, text=text, attachments=attachments)


@pytest.fixture
def start_runtime(short_dir):
    started = []

    def start(**kwargs):
        rt = RunningRuntime(short_dir, **kwargs)
        started.append(rt)
        return rt

    yield start
    for rt in started:
        if rt.thread.is_alive():
            rt.stop()
