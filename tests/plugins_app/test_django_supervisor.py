"""The supervisor wired to Plugin rows, with the echo worker as a real process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from plugins_app.channel.models import OutboundDelivery, Plugin
from plugins_app.channel.supervisor.process import group_members, pid_alive, pid_file_path
from tests.plugins_app.conftest import PY, database_url, make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")
REPO = Path(__file__).resolve().parents[2]


def test_end_to_end_inbound_turn_delivery_ack(tcast, echo, start_runtime):
    plugin = make_plugin()
    rt = start_runtime()
    echo.say("m-1", "script:answer=hello from the agent")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").exists(), 15), rt.log("echo-main")
    delivery = OutboundDelivery.objects.select_related("turn__receipt").get()
    assert delivery.turn.receipt.client_message_id == "m-1"
    assert delivery.channel_message_id == f"echo-{delivery.delivery_id}"
    assert [(s["delivery_id"], s["conversation_id"], s["text"]) for s in echo.sends()] == \
        [(delivery.delivery_id, "chat-1", "hello from the agent")]
    plugin.refresh_from_db()
    assert plugin.state == "running" and plugin.pid == rt.worker_pid("echo-main")
    assert wait_until(lambda: Plugin.objects.get().last_heartbeat is not None, 5)
    # the socket is private
    assert os.stat(rt.runtime.socket_path("echo-main")).st_mode & 0o777 == 0o600
    rt.stop()
    assert Plugin.objects.get().state == "stopped"


def test_a_worker_killed_in_the_middle_of_a_delivery_delivers_it_exactly_once_after_the_restart(
        tcast, echo, start_runtime, monkeypatch):
    monkeypatch.setenv("ECHO_DELIVER_DELAY", "30")  # lingers after the send, before the ack
    make_plugin(env_refs=["ECHO_INBOX", "ECHO_SENT", "ECHO_DELIVER_DELAY"])
    rt = start_runtime()
    echo.say("m-1", "script:answer=only once")
    assert wait_until(lambda: echo.sends(), 15), rt.log("echo-main")
    first = rt.worker_pid("echo-main")
    row = OutboundDelivery.objects.get()
    assert row.state == "in_flight"
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: OutboundDelivery.objects.get().state == "delivered", 15), rt.log("echo-main")
    assert rt.worker_pid("echo-main") not in (None, first)
    assert [s["delivery_id"] for s in echo.sends()] == [row.delivery_id]


def test_a_worker_that_exits_at_once_trips_the_breaker_and_stays_down(tcast, start_runtime, admin_client):
    make_plugin("crasher", command=PY, args=["-c", "raise SystemExit(3)"], env_refs=[])
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 15)
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason.startswith("circuit breaker: 3 consecutive cooldown rounds")
    wait_until(lambda: False, 0.5)
    assert rt.runtime.supervisor.status().get("crasher") is None  # out of the desired set: nothing restarts it
    plugin.refresh_from_db()
    assert (plugin.enabled, plugin.state, plugin.pid) == (False, "disabled", None)
    assert not pid_file_path(rt.root / "pids", "crasher").exists()
    page = admin_client.get("/admin/plugins_app/plugin/").content.decode()
    assert "circuit breaker: 3 consecutive cooldown rounds" in page
    # the admin's action enables it again, with a clean breaker
    admin_client.post("/admin/plugins_app/plugin/", {"action": "enable_again",
                                                     "_selected_action": [plugin.pk]})
    plugin.refresh_from_db()
    assert plugin.enabled and plugin.disabled_reason == ""
    assert wait_until(lambda: rt.runtime.supervisor.status().get("crasher") is not None, 5)


def test_a_worker_that_stops_heartbeating_is_restarted(tcast, echo, start_runtime, monkeypatch, caplog):
    monkeypatch.setenv("ECHO_MUTE_HEARTBEAT", "1")
    make_plugin(env_refs=["ECHO_INBOX", "ECHO_SENT", "ECHO_MUTE_HEARTBEAT"], heartbeat_secs=0.1)
    rt = start_runtime(limits={"startup_grace_secs": 0.3})
    first = wait_until(lambda: rt.worker_pid("echo-main"), 10)
    assert wait_until(lambda: rt.worker_pid("echo-main") not in (None, first), 10), rt.log("echo-main")
    assert not pid_alive(first)
    assert any(f"pid {first} missed its heartbeats" in r.getMessage() for r in caplog.records)


def test_a_heartbeating_worker_is_left_running(tcast, echo, start_runtime):
    make_plugin(heartbeat_secs=0.2)
    # a grace a loaded machine's worker start fits in; the watchdog then judges beats for a while after it
    rt = start_runtime(limits={"startup_grace_secs": 2.0})
    first = wait_until(lambda: rt.worker_pid("echo-main"), 10)
    assert wait_until(lambda: Plugin.objects.get().last_heartbeat is not None, 10)
    wait_until(lambda: False, 3.0)
    assert rt.worker_pid("echo-main") == first


def test_an_admin_edit_takes_effect_without_a_restart(tcast, echo, start_runtime):
    plugin = make_plugin()
    rt = start_runtime()
    first = wait_until(lambda: rt.worker_pid("echo-main"), 10)
    Plugin.objects.filter(pk=plugin.pk).update(args=["-m", "plugins_app.channel.workers.echo", "--edited"])
    assert wait_until(lambda: rt.worker_pid("echo-main") not in (None, first), 10)
    Plugin.objects.filter(pk=plugin.pk).update(enabled=False)
    assert wait_until(lambda: rt.worker_pid("echo-main") is None, 10)
    assert wait_until(lambda: Plugin.objects.get().state == "stopped", 5)


def data_size_limit(pid: int) -> str:
    """The soft "Max data size" of a process (RLIMIT_DATA), as /proc shows it."""
    line = next(l for l in Path(f"/proc/{pid}/limits").read_text().splitlines() if l.startswith("Max data size"))
    return line.split()[3]


def test_each_worker_runs_under_its_plugins_memory_cap_or_the_default(tcast, echo, start_runtime, monkeypatch):
    from plugins_app.channel import conf
    monkeypatch.setattr(conf, "MEMORY_MAX_MB", 1536)
    make_plugin()  # the echo worker, with no cap of its own
    sleeper = dict(command=PY, args=["-c", "import time; time.sleep(60)"], env_refs=[], heartbeat_secs=0)
    make_plugin("own-cap", memory_max_mb=512, **sleeper)
    make_plugin("no-cap", memory_max_mb=0, **sleeper)
    rt = start_runtime()
    names = ("echo-main", "own-cap", "no-cap")
    pids = wait_until(lambda: all(rt.worker_pid(n) for n in names) and [rt.worker_pid(n) for n in names], 15)
    assert pids, rt.log("echo-main")
    assert [data_size_limit(pid) for pid in pids] == [str(1536 * 1024 * 1024), str(512 * 1024 * 1024), "unlimited"]
    # the echo worker (the SDK, its threads) says hello and heartbeats under its cap
    assert wait_until(lambda: Plugin.objects.get(plugin_id="echo-main").last_heartbeat is not None, 10)
    # an edit of the cap restarts the worker under the new one
    Plugin.objects.filter(plugin_id="own-cap").update(memory_max_mb=256)
    assert wait_until(lambda: rt.worker_pid("own-cap") not in (None, pids[1]), 10)
    assert data_size_limit(rt.worker_pid("own-cap")) == str(256 * 1024 * 1024)


# --- a supervisor in its own process (manage.py runsupervisor) ------------------------------

def start_supervisor_process(root: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(DATABASE_URL=database_url(), UGENT_PLUGIN_RUN_DIR=str(root / "run"),
               UGENT_PLUGIN_PID_DIR=str(root / "pids"), UGENT_PLUGIN_LOG_DIR=str(root / "logs"),
               UGENT_PLUGIN_STATE_DIR=str(root / "state"), UGENT_PLUGIN_REAP_GRACE_SECS="1")
    log = (root / "supervisor.log").open("w")
    return subprocess.Popen([PY, "manage.py", "runsupervisor", "--interval", "0.05", "--skip-checks"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


# A worker left behind by a crashed supervisor: it clears its parent-death signal and does not
# depend on the bridge (a real worker would exit once the bridge stays unreachable, which makes
# "still alive after the kill" a race on a loaded machine).
CLEARS_PDEATHSIG = ("import ctypes, pathlib, time; ctypes.CDLL(None).prctl(1, 0, 0, 0, 0); "
                    "pathlib.Path({marker!r}).touch(); time.sleep(120)")


def test_kill_9_on_the_supervisor_kills_its_workers_and_a_new_one_reaps_what_was_left(
        tcast, echo, short_dir, start_runtime):
    make_plugin()
    marker = short_dir / "survivor-ready"
    make_plugin("survivor", args=["-c", CLEARS_PDEATHSIG.format(marker=str(marker))])  # outlives a killed supervisor
    sup = start_supervisor_process(short_dir)
    try:
        def pids():
            files = [pid_file_path(short_dir / "pids", p) for p in ("echo-main", "survivor")]
            if all(f.exists() for f in files):
                return [json.loads(f.read_text())["pid"] for f in files]
        worker, survivor = wait_until(pids, 20) or pytest.fail((short_dir / "supervisor.log").read_text())
        assert wait_until(marker.exists, 20)  # its parent-death signal is cleared
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(5)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait()
    assert wait_until(lambda: not pid_alive(worker), 5)  # parent-death signal
    assert pid_alive(survivor)
    rt = start_runtime()  # a new supervisor on the same pid directory
    assert wait_until(lambda: not pid_alive(survivor), 10)
    assert wait_until(lambda: rt.runtime.supervisor.reaped, 10)  # set once reap_stale returns
    assert [r.plugin_id for r in rt.runtime.supervisor.reaped] == ["survivor"]
    assert wait_until(lambda: rt.worker_pid("survivor") not in (None, survivor), 10)


def _enqueue(plugin, text):
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from plugins_app.channel import services
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id=plugin.plugin_id, external_id="chat-1",
                                   actor=actor, caller=None)
    return services.delivery_enqueue(plugin=plugin, conversation=conv, text=text).delivery_id


def test_kill_9_on_the_supervisor_takes_a_worker_started_through_a_shell_with_it_and_nothing_is_lost_or_doubled(
        tcast, echo, short_dir, start_runtime):
    """`sh -c "python -m worker ; true"`: the supervisor's parent-death signal reaches only the shell;
    the worker itself must not outlive a supervisor killed with kill -9."""
    plugin = make_plugin(command="sh", args=["-c", f"{PY} -m plugins_app.channel.workers.echo ; true"])
    sup = start_supervisor_process(short_dir)
    try:
        pid_file = pid_file_path(short_dir / "pids", "echo-main")
        assert wait_until(pid_file.exists, 20), (short_dir / "supervisor.log").read_text()
        pgid = json.loads(pid_file.read_text())["pgid"]
        before = _enqueue(plugin, "before the crash")
        assert wait_until(lambda: OutboundDelivery.objects.get(delivery_id=before).state == "delivered", 20), \
            (short_dir / "logs" / "echo-main.log").read_text()
        assert len(group_members(pgid)) == 2  # the shell and, under it, the worker
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(5)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait()
    assert wait_until(lambda: not group_members(pgid), 15), [m.pid for m in group_members(pgid)]
    after = _enqueue(plugin, "after the restart")  # queued while no supervisor runs
    start_runtime()
    assert wait_until(lambda: OutboundDelivery.objects.get(delivery_id=after).state == "delivered", 30)
    assert sorted((s["delivery_id"], s["text"]) for s in echo.sends()) == \
        sorted([(before, "before the crash"), (after, "after the restart")])  # each once


def test_a_worker_the_platform_refuses_is_disabled_with_the_reason_and_not_restarted(
        tcast, echo, start_runtime, monkeypatch, admin_client):
    monkeypatch.setenv("ECHO_REFUSE", "401 Unauthorized: the bot token was revoked")
    make_plugin(env_refs=["ECHO_INBOX", "ECHO_SENT", "ECHO_REFUSE"])
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 15), rt.log("echo-main")
    plugin = Plugin.objects.get()
    assert plugin.state == "disabled"
    assert plugin.disabled_reason == "the channel refused the worker: 401 Unauthorized: the bot token was revoked"
    wait_until(lambda: False, 1.0)
    # One start only: no restart loop against a platform that said no.
    assert rt.log("echo-main").count("the channel refused this worker") == 1
    page = admin_client.get("/admin/plugins_app/plugin/").content.decode()
    assert "the bot token was revoked" in page
    # Once the operator fixed it, enabling again starts it afresh and it runs.
    monkeypatch.setenv("ECHO_REFUSE", "")
    admin_client.post("/admin/plugins_app/plugin/", {"action": "enable_again", "_selected_action": [plugin.pk]})
    assert wait_until(lambda: Plugin.objects.get().state == "running", 15), rt.log("echo-main")


@pytest.mark.django_db  # (the command first checks the database has its tables: ugent_common.dbconn)
def test_a_second_supervisor_refuses_to_start_in_one_line(monkeypatch, tmp_path):
    """docs/plugins.md: "a second one on the same pid directory refuses to start" (it printed "running", then two
    SupervisorAlreadyRunning tracebacks)."""
    import fcntl
    import io

    from django.core.management import CommandError, call_command

    from plugins_app.channel import conf
    from plugins_app.channel.supervisor.core import LOCK_FILE
    monkeypatch.setattr(conf, "PID_DIR", tmp_path)
    held = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first supervisor's hold
    out = io.StringIO()
    try:
        with pytest.raises(CommandError) as err:
            call_command("runsupervisor", "--interval", "0.05", stdout=out)
    finally:
        os.close(held)
    assert str(err.value) == (f"another supervisor holds {tmp_path / LOCK_FILE}: one supervisor runs per pid "
                              f"directory; this one did not start")
    assert err.value.returncode == 1 and out.getvalue() == ""
