"""The MCP toolbox's session is entered and left by one task, and a second close does nothing
(plugins_app/agent/tools/mcp.py): against the real MCP server of tests/data/mcp_server.py over stdio."""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest

import mcp.client.stdio
from plugins_app.agent.tools import plugins
from plugins_app.agent.tools.mcp import OwnedMCPToolBox

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

SERVER = Path(__file__).resolve().parents[1] / "data" / "mcp_server.py"
DEAF = Path(__file__).resolve().parents[1] / "data" / "mcp_server_deaf.py"  # stops reading after the tool list


def server_pids(server: Path = SERVER) -> set[int]:
    """This process's children running the test server (the toolbox's MCP server)."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and str(server).encode() in cmd:
            out.add(int(pid))
    return out


@pytest.fixture
def tasks_seen(monkeypatch):
    """The asyncio task that entered and the one that left each stdio transport."""
    seen = []
    real = mcp.client.stdio.stdio_client

    @contextlib.asynccontextmanager
    async def watched(*args, **kwargs):
        entry = {"entered": asyncio.current_task()}
        seen.append(entry)
        async with real(*args, **kwargs) as streams:
            try:
                yield streams
            finally:
                entry["left"] = asyncio.current_task()
    monkeypatch.setattr(mcp.client.stdio, "stdio_client", watched)
    return seen


def toolbox():
    return OwnedMCPToolBox(toolbox_id="mcp-test", config={"transport": "stdio", "command": sys.executable,
                                                          "args": [str(SERVER)], "timeout": 30})


def test_the_session_is_left_by_the_task_that_entered_it_and_its_server_ends(tasks_seen):
    before = server_pids()
    box = toolbox()  # connects and lists its tools
    assert set(box.tools) >= {"add", "shout"}
    assert len(server_pids() - before) == 1
    box.refresh_tools()  # a reconnect: the first connection is left before the second is made
    box.close()
    assert len(tasks_seen) == 2
    for entry in tasks_seen:
        assert entry["left"] is entry["entered"]
    assert server_pids() - before == set()


def test_a_second_close_does_nothing(monkeypatch):
    """__del__ closes again once the toolbox is garbage: that must not wait on the stopped event loop."""
    box = toolbox()
    box.close()

    asked = []

    def run(coro, *_a, **_k):  # the stopped loop would never run it: the caller waits out its timeout
        coro.close()
        asked.append(coro)
    monkeypatch.setattr(box._runner, "run", run)
    box.close()
    box.__del__()
    assert asked == []


def test_a_kept_mcp_toolbox_is_this_class_and_its_calls_answer():
    box = plugins.mcp_toolbox("calc", command=sys.executable, args=[str(SERVER)])
    try:
        assert isinstance(box, OwnedMCPToolBox)
        add = box.tools["add"]
        for _ in range(3):
            out = add.tool_call(add.argument_schema(a=2, b=3))
            assert out.content == "5"
    finally:
        plugins.toolboxes_close()


def gone(pids_before: set[int], timeout: float = 20.0, server: Path = SERVER) -> bool:
    """Whether every test server started since `pids_before` has ended (within `timeout`)."""
    import time
    deadline = time.monotonic() + timeout
    while server_pids(server) - pids_before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SILENT = ["-c", "import sys, time; time.sleep(120)", str(SERVER)]  # a server that never answers


def silent_box(timeout=1):
    return OwnedMCPToolBox(toolbox_id="mcp-silent", config={"transport": "stdio", "command": sys.executable,
                                                            "args": SILENT, "timeout": timeout})


def test_a_server_that_never_answers_gives_no_tools_and_its_attempt_stops_at_the_timeout():
    """The connection gives up at its timeout, and so does the attempt: the server's process ends then,
    not at some later close (the adapter's attempt went on, and its close waited 10 s and left it)."""
    before = server_pids()
    box = silent_box()
    assert box.tools == {}
    assert gone(before)
    box.close()


def test_reconnects_one_after_another_or_at_once_leave_one_server_and_a_close_none():
    before = server_pids()
    box = silent_box()
    for _ in range(3):
        box.refresh_tools()
    box.close()
    assert gone(before)
    import threading
    box = toolbox()
    threads = [threading.Thread(target=box.refresh_tools) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and set(box.tools) >= {"add"}
    assert len(server_pids() - before) == 1
    add = box.tools["add"]
    assert add.tool_call(add.argument_schema(a=2, b=3)).content == "5"
    box.close()
    assert gone(before)


def test_a_closed_toolbox_refuses_calls_at_once():
    box = toolbox()
    add = box.tools["add"]
    box.close()
    with pytest.raises(Exception, match="closed"):
        box._call_mcp_tool("add", add.argument_schema(a=2, b=3))


def test_a_toolbox_being_built_holds_up_no_other_toolbox():
    """A build can take its whole timeout (a server that never answers): only the turns that want that
    toolbox wait on it; another one (here a working MCP server) is handed out meanwhile."""
    import threading
    started, release = threading.Event(), threading.Event()
    real_build = plugins._build

    def build(entry, toolbox_id, config):
        if toolbox_id == "mcp-slow":
            started.set()
            release.wait(60)  # as a server that has not answered yet
        return real_build(entry, toolbox_id, config)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plugins, "_build", build)
            slow = threading.Thread(target=plugins.mcp_toolbox, args=("slow",),  # (its own config: its own box)
                                    kwargs={"command": sys.executable, "args": [str(SERVER)],
                                            "env": {"PATH": os.environ.get("PATH", ""), "UGENT_TEST": "slow"}})
            slow.start()
            assert started.wait(10)
            got = []
            other = threading.Thread(target=lambda: got.append(
                plugins.mcp_toolbox("calc", command=sys.executable, args=[str(SERVER)])))
            other.start()
            other.join(60)
            assert not other.is_alive() and "add" in got[0].tools
            assert slow.is_alive()  # still being built all along
            release.set()
            slow.join(60)
    finally:
        release.set()
        plugins.toolboxes_close()


def test_a_toolbox_without_tools_is_asked_again_at_most_every_retry_interval(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(plugins, "_clock", lambda: now[0])
    asked = []

    class Down:
        tools: dict = {}

        def __init__(self, *a, **k):
            asked.append("build")

        def refresh_tools(self):
            asked.append("refresh")

        def close(self):
            pass
    monkeypatch.setattr(plugins, "_build", lambda entry, toolbox_id, config: Down())
    try:
        first = plugins.toolbox_plugin("down")
        for _ in range(5):  # turns right after: handed the same toolbox at once, nobody waits on it
            assert plugins.toolbox_plugin("down") is first
        assert asked == ["build"]
        now[0] += plugins.RETRY_SECS
        plugins.toolbox_plugin("down")
        plugins.toolbox_plugin("down")
        assert asked == ["build", "refresh"]
    finally:
        plugins.toolboxes_close()


def test_a_server_that_died_is_started_again_at_the_next_use():
    """Killed, the server fails the call under way at once, by either way mcp notices: its reader sees the
    end of the output ("Connection closed"), or the write to its input breaks, which ends the transport's
    task group with the session's own task in it (the call then waited out its whole timeout, and the
    toolbox was never marked broken). Killed several times, to meet both."""
    import signal
    import time
    before = server_pids()
    try:
        box = plugins.mcp_toolbox("calc", command=sys.executable, args=[str(SERVER)])
        killed = set()
        for _ in range(4):
            [pid] = server_pids() - before - killed
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            add = box.tools["add"]
            start = time.monotonic()
            with pytest.raises(Exception):
                add.tool_call(add.argument_schema(a=2, b=3))  # the session's streams are closed
            assert time.monotonic() - start < 10
            assert box.broken
            again = plugins.mcp_toolbox("calc", command=sys.executable, args=[str(SERVER)])
            assert again is box and not box.broken
            assert len(server_pids() - before - killed) == 1  # a new server process
            add = box.tools["add"]
            assert add.tool_call(add.argument_schema(a=2, b=3)).content == "5"
    finally:
        plugins.toolboxes_close()
    assert server_pids() - before == set()

def call_in_thread(box, name, **args):
    """Call a tool in a thread, as a turn does: (thread, outcome dict with "result" or "error", "secs")."""
    import threading
    import time
    out: dict = {}
    tool = box.tools[name]

    def run():
        start = time.monotonic()
        try:
            out["result"] = tool.tool_call(tool.argument_schema(**args))
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test reads
            out["error"] = exc
        out["secs"] = time.monotonic() - start
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def call_waiting(started: Path) -> bool:
    """Whether the server has begun the `wait` call that writes `started` (within 10 s)."""
    import time
    deadline = time.monotonic() + 10
    while not started.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def tasks_on_loop(box) -> int:
    """How many tasks the toolbox's event loop holds now (counted on that loop)."""
    async def count():
        return len(asyncio.all_tasks()) - 1  # not this one
    return box._runner.run(count(), timeout=10)


def test_a_call_waiting_when_its_toolbox_closes_fails_at_once(tmp_path):
    """mcp's session exit cancels its reader before it tells the waiting requests: such a call waited out
    its whole timeout (30 s here), holding up the shutdown's turn."""
    before = server_pids()
    box = toolbox()
    thread, out = call_in_thread(box, "wait", seconds=60, started=str(tmp_path / "started"))
    assert call_waiting(tmp_path / "started")
    box.close()
    thread.join(20)
    assert not thread.is_alive()
    assert "closed its connection during the call" in str(out["error"]) and out["secs"] < 15
    assert gone(before)


def test_a_call_waiting_at_a_reconnect_fails_at_once_and_breaks_nothing(tmp_path):
    """A reconnect ends the connection a call waits on: the call fails at once, and its failure does not
    mark the new connection broken (only the connection a call was made on counts)."""
    before = server_pids()
    box = toolbox()
    try:
        thread, out = call_in_thread(box, "wait", seconds=60, started=str(tmp_path / "started"))
        assert call_waiting(tmp_path / "started")
        box.refresh_tools()
        thread.join(20)
        assert not thread.is_alive()
        assert "closed its connection during the call" in str(out["error"]) and out["secs"] < 15
        assert not box.broken
        add = box.tools["add"]
        assert add.tool_call(add.argument_schema(a=2, b=3)).content == "5"
        assert len(server_pids() - before) == 1
    finally:
        box.close()
    assert gone(before)


def test_a_failure_on_a_replaced_connection_does_not_mark_the_new_one_broken():
    box = toolbox()
    try:
        old = box._session
        box.refresh_tools()
        assert box._session is not old
        box._server_gone(old)
        assert not box.broken
        box._server_gone(box._session)
        assert box.broken
    finally:
        box.close()


def test_a_call_that_runs_out_of_time_stops_waiting():
    """The adapter's caller gave up at the timeout while the call went on waiting on the toolbox's loop,
    one more waiting request for every slow call, until the toolbox closed."""
    import concurrent.futures
    import time
    # Connected with a long timeout (a server's start takes over a second on a loaded machine, and a
    # connect that runs out of time leaves the box without tools); then the calls get one second.
    box = OwnedMCPToolBox(toolbox_id="mcp-test", config={"transport": "stdio", "command": sys.executable,
                                                         "args": [str(SERVER)], "timeout": 30})
    try:
        box._timeout = 1
        idle = tasks_on_loop(box)
        tool = box.tools["wait"]
        with pytest.raises((TimeoutError, concurrent.futures.TimeoutError)):
            tool.tool_call(tool.argument_schema(seconds=30))
        deadline = time.monotonic() + 5
        while tasks_on_loop(box) > idle and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tasks_on_loop(box) == idle
        add = box.tools["add"]
        assert add.tool_call(add.argument_schema(a=2, b=3)).content == "5"
    finally:
        box.close()


def test_a_toolbox_that_fails_to_build_fails_again_at_once_until_the_retry_interval(monkeypatch):
    """A plugin whose start raises (after waiting out a timeout, say) was started again by every turn
    that wanted it, each waiting as long."""
    now = [1000.0]
    monkeypatch.setattr(plugins, "_clock", lambda: now[0])
    built = []

    def build(entry, toolbox_id, config):
        built.append(entry)
        raise OSError("the server would not start")
    monkeypatch.setattr(plugins, "_build", build)
    try:
        with pytest.raises(OSError, match="would not start"):
            plugins.toolbox_plugin("failing")
        for _ in range(3):
            with pytest.raises(RuntimeError, match=r"failed to start \(OSError: the server would not start\)"):
                plugins.toolbox_plugin("failing")
        assert built == ["failing"]
        now[0] += plugins.RETRY_SECS
        with pytest.raises(OSError):
            plugins.toolbox_plugin("failing")
        assert built == ["failing", "failing"]
    finally:
        plugins.toolboxes_close()


def test_a_toolbox_whose_start_never_returns_fails_in_time_and_is_not_started_again_at_once(monkeypatch):
    """A plugin whose constructor never returned held every turn that wanted it (and each one's wait on the
    build lock) for ever: now it is a failed start after `start_timeout`, refused at once until RETRY_SECS."""
    now = [1000.0]
    monkeypatch.setattr(plugins, "_clock", lambda: now[0])
    gate = threading.Event()
    built = []

    def build(entry, toolbox_id, config):
        built.append(entry)
        gate.wait(60)
        raise OSError("late")
    monkeypatch.setattr(plugins, "_build", build)
    try:
        with pytest.raises(TimeoutError, match=r"the toolbox hung did not start within 0\.2 s"):
            plugins.toolbox_plugin("hung", start_timeout=0.2)
        with pytest.raises(RuntimeError, match="failed to start"):
            plugins.toolbox_plugin("hung", start_timeout=0.2)
        assert built == ["hung"]
    finally:
        gate.set()
        plugins.toolboxes_close()


def test_a_toolbox_slower_to_start_than_its_start_timeout_is_kept_once_started(monkeypatch):
    """A start past `start_timeout` fails its turn, and the toolbox it made after all is kept: dropped, it was
    never closed (an MCP server's process left running) and each try after RETRY_SECS started another from
    nothing, so a toolbox slower to start than the timeout never came up. One made after the toolboxes were
    closed is closed too."""
    from ugent_common import bounded

    class Box:
        tools = {"t": None}

        def __init__(self, toolbox_id):
            self.toolbox_id, self.closed = toolbox_id, False

        def close(self):
            self.closed = True

    gate = threading.Event()
    built = []

    def build(entry, toolbox_id, config):
        gate.wait(60)
        built.append(Box(toolbox_id))
        return built[-1]

    def started() -> None:
        for _ in range(500):
            if not bounded.overrunning("start:toolbox slow"):
                return
            threading.Event().wait(0.02)
        raise AssertionError("the start never ended")
    monkeypatch.setattr(plugins, "_build", build)
    try:
        with pytest.raises(TimeoutError):
            plugins.toolbox_plugin("slow", start_timeout=0.2)
        gate.set()
        started()
        assert plugins.toolbox_plugin("slow", start_timeout=0.2) is built[0]  # at once, not refused
        assert len(built) == 1 and not built[0].closed

        gate.clear()
        with pytest.raises(TimeoutError):
            plugins.toolbox_plugin("slow", {"other": 1}, start_timeout=0.2)
        plugins.toolboxes_close()  # (a shutdown) while it starts
        gate.set()
        started()
        assert len(built) == 2 and built[1].closed and built[1] not in plugins.toolboxes_kept()
    finally:
        gate.set()
        plugins.toolboxes_close()


def test_a_toolbox_whose_tools_cannot_be_listed_is_kept_and_asked_again_after_the_interval(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(plugins, "_clock", lambda: now[0])
    asked = []

    class Flaky:
        tools: dict = {}

        def __init__(self, *a, **k):
            pass

        def refresh_tools(self):
            asked.append("refresh")
            raise ConnectionError("down")

        def close(self):
            pass
    monkeypatch.setattr(plugins, "_build", lambda entry, toolbox_id, config: Flaky())
    try:
        first = plugins.toolbox_plugin("flaky")
        now[0] += plugins.RETRY_SECS
        assert plugins.toolbox_plugin("flaky") is first  # its refresh raised: still handed out, without tools
        for _ in range(3):
            assert plugins.toolbox_plugin("flaky") is first
        assert asked == ["refresh"]
    finally:
        plugins.toolboxes_close()


def test_a_toolbox_built_while_the_toolboxes_close_is_closed_not_kept(monkeypatch):
    import threading
    started, release = threading.Event(), threading.Event()
    closed = []

    class Box:
        tools = {"t": object()}

        def __init__(self, *a, **k):
            started.set()
            release.wait(30)

        def close(self):
            closed.append(self)
    monkeypatch.setattr(plugins, "_build", lambda entry, toolbox_id, config: Box())
    out = {}

    def want():
        try:
            out["box"] = plugins.toolbox_plugin("late")
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc
    thread = threading.Thread(target=want)
    thread.start()
    try:
        assert started.wait(10)
        plugins.toolboxes_close()  # shutdown, while the build runs
        release.set()
        thread.join(10)
        assert "closed as it started" in str(out["error"])
        assert len(closed) == 1 and plugins.toolboxes_kept() == []
    finally:
        release.set()
        plugins.toolboxes_close()


def test_a_closed_mcp_toolbox_lists_no_tools_at_once():
    import time
    box = toolbox()
    box.close()
    start = time.monotonic()
    box.refresh_tools()  # its event loop is stopped: this waited out the whole 30 s timeout
    assert time.monotonic() - start < 5 and box.tools == {}


def test_an_attempt_that_waited_for_the_connect_lock_stops_when_its_caller_gives_up():
    """The caller's wait starts when it asks; the attempt's used to start once it had the connect lock, so
    an attempt held up behind another could connect after its caller had given up: a live server behind
    a toolbox that listed no tools, taken for down until the retry interval."""
    import time
    before = server_pids()
    slow_start = ["-c", f"import runpy, time; time.sleep(1); runpy.run_path({str(SERVER)!r}, run_name='__main__')",
                  str(SERVER)]  # (its path in the command line: server_pids() finds it)
    # (connected first with time to spare: on a loaded machine the server's imports alone took 3.7 s)
    box = OwnedMCPToolBox(toolbox_id="mcp-test", config={"transport": "stdio", "command": sys.executable,
                                                         "args": slow_start, "timeout": 60})
    try:
        assert "add" in box.tools
        box._timeout = 3  # the adapter's timeout, for the wait and the attempt below
        held = asyncio.run_coroutine_threadsafe(hold_connect_lock(box, 2.9), box._runner._loop)
        time.sleep(0.2)
        box.refresh_tools()  # waits 2.7 s for the lock, then has 0.3 s: too little for a 1 s start
        held.result(10)
        assert box.tools == {}
        time.sleep(3)  # an attempt still going would have connected by now
        assert box._owner is None and server_pids() - before == set()
    finally:
        box.close()


async def hold_connect_lock(box, secs: float):
    async with box._connecting():
        await asyncio.sleep(secs)


def test_a_server_that_stops_reading_fails_the_call_at_once_and_is_replaced():
    """A write to a server's input that breaks ends the transport's task group, the session's own task in it
    (the end of the server's output, the other way a dead server shows, never comes here). The call waited
    out its whole timeout, the toolbox was never marked broken, and the transport was never left: its server
    kept running beside the next one."""
    import time
    before = server_pids(DEAF)
    try:
        box = plugins.mcp_toolbox("deaf", command=sys.executable, args=[str(DEAF)])
        assert len(server_pids(DEAF) - before) == 1
        add = box.tools["add"]
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="connection ended during the call"):
            add.tool_call(add.argument_schema(a=2, b=3))
        assert time.monotonic() - start < 10 and box.broken
        again = plugins.mcp_toolbox("deaf", command=sys.executable, args=[str(DEAF)])
        assert again is box and not box.broken and "add" in box.tools
        assert len(server_pids(DEAF) - before) == 1  # the first one ended with its transport
    finally:
        plugins.toolboxes_close()
    assert gone(before, server=DEAF)


def test_a_build_that_fails_after_a_close_leaves_no_memo_and_a_waiting_turn_starts_none(monkeypatch):
    """toolboxes_close() forgets everything (shutdown; a test's reset): a build that began before it and
    failed after it must not make the next use fail for RETRY_SECS, and a turn that waited behind that
    build must not start another server after the close."""
    import threading
    import time
    started, release = threading.Event(), threading.Event()
    builds = []

    def failing(entry, toolbox_id, config):
        builds.append(time.monotonic())
        started.set()
        release.wait(10)
        raise OSError("slow start failed")
    monkeypatch.setattr(plugins, "_build", failing)
    out = []

    def want():
        try:
            out.append(plugins.toolbox_plugin("x"))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    first = threading.Thread(target=want)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=want)
    second.start()
    time.sleep(0.2)  # it waits on the toolbox's build lock
    plugins.toolboxes_close()
    closed_at = time.monotonic()
    release.set()
    first.join(10)
    second.join(10)
    try:
        assert [t for t in builds if t > closed_at] == []
        assert any("the toolboxes were closed" in str(e) for e in out), out

        class Box:
            tools = {"t": object()}

            def close(self):
                pass
        monkeypatch.setattr(plugins, "_build", lambda entry, toolbox_id, config: Box())
        assert isinstance(plugins.toolbox_plugin("x"), Box)  # not "failed to start" from before the close
    finally:
        plugins.toolboxes_close()


def test_two_entries_naming_the_same_server_are_two_toolboxes_under_their_own_ids():
    """Two `[[tools.mcp]]` entries with the same command, args and env used to share one toolbox: the
    first's id for both, so the second entry's tools were reported under the first's name."""
    before = server_pids()
    try:
        a = plugins.mcp_toolbox("a", command=sys.executable, args=[str(SERVER)])
        b = plugins.mcp_toolbox("b", command=sys.executable, args=[str(SERVER)])
        assert a is not b
        assert (a.toolbox_id, b.toolbox_id) == ("mcp-a", "mcp-b")
        assert "add" in a.tools and "add" in b.tools
        assert plugins.mcp_toolbox("a", command=sys.executable, args=[str(SERVER)]) is a  # each still kept
        assert len(server_pids() - before) == 2
    finally:
        plugins.toolboxes_close()
    assert gone(before)
