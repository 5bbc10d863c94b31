"""The MCP toolbox UGENT runs: ovos-tool-adapters' MCPToolBox, with its session owned by one task.

MCPToolBox (0.1.2) enters the MCP client's transport and session in one task of its event loop and
leaves them from another. mcp's transports are anyio task groups, whose cancel scope must be left by
the task that entered it: leaving from another raised ("Attempted to exit cancel scope in a different
task"), left the transport's own tasks behind, and now and then hung a later call until its timeout.
Here one task per connection enters both, waits until the toolbox closes, and leaves both; one connection
at a time, the one before it ended first. An attempt that gets no answer within the toolbox's timeout
(a server that never answers) stops when its caller gives up, as does one still connecting at a close,
and the server's process ends. A call that finds the session's streams closed (the server's process ended)
marks the toolbox broken, and the kept toolbox connects again at its next use (tools/plugins.py).

A call stops at its timeout: the adapter's caller gave up then, but the call went on waiting on the
loop. A call still waiting when its connection ends (a close, a reconnect) fails at once with
"closed its connection during the call": mcp's session exit cancels its reader before it tells the
waiting requests, which then waited out their whole timeout. Only a failure of the connection a call
was made on marks the toolbox broken, not one of a connection already replaced.

Its close() also ran again from ``__del__`` once the toolbox was garbage, on an event loop already
stopped, and so waited its full 10-second timeout in whichever thread collected it (a request's, a
turn's). Here a second close() does nothing.
No Django here.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

import anyio
from mcp.shared.exceptions import McpError
from mcp.types import CONNECTION_CLOSED
from ovos_tool_adapters.mcp import MCPToolBox


class OwnedMCPToolBox(MCPToolBox):
    _owner: asyncio.Task | None = None
    _ready: asyncio.Future | None = None
    _closing: asyncio.Event | None = None
    _guard: asyncio.Lock | None = None  # made on the toolbox's event loop at its first use
    _closed = False
    broken = False  # the session's streams closed under a call: the server is gone

    def __init__(self, *args, **kwargs):
        self._close_lock = threading.Lock()
        self._calls: set[asyncio.Task] = set()  # the calls waiting now
        self._cut: dict[asyncio.Task, str] = {}  # calls cancelled because their connection ended, and why
        super().__init__(*args, **kwargs)  # (connects: the base class lists the tools at once)

    def _connecting(self) -> asyncio.Lock:
        if self._guard is None:
            self._guard = asyncio.Lock()
        return self._guard

    async def _connect_and_list(self):
        # One connection at a time, the one before it left first and in full: the adapter keeps one
        # session's context managers on the toolbox, which a second connection would overwrite.
        # The caller's wait began when it asked (the same timeout): a wait for the lock counts against it.
        deadline = asyncio.get_running_loop().time() + self._timeout
        async with self._connect_lock(deadline):
            if self._closed:
                raise RuntimeError(f"MCP toolbox {self.toolbox_id} is closed")
            await self._end_owner()
            loop = asyncio.get_running_loop()
            ready: asyncio.Future = loop.create_future()
            closing = asyncio.Event()
            adapter = super()

            async def own():
                try:
                    tools = await adapter._connect_and_list()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller; a cancel is a close
                    if not ready.done():
                        ready.set_exception(exc) if not isinstance(exc, asyncio.CancelledError) else ready.cancel()
                    # what was entered is left, by this same task; shielded, or anyio would cancel the
                    # transport's own shutdown too (closing the server's stdin, waiting, then terminating it)
                    with anyio.CancelScope(shield=True):
                        await adapter._close_async()
                    self._session = self._session_cm = self._transport_cm = None
                    return
                self.broken = False
                ready.set_result(tools)
                try:
                    await closing.wait()
                finally:
                    if not closing.is_set():
                        # the transport's task group cancelled this task: its server's process ended (a
                        # write to its stdin broke). The calls waiting would wait out their timeout.
                        self.broken = True
                        self._cut_calls("the MCP server's connection ended during the call")
                        # left shielded, as a failed connect is: still cancelled, the session's exit
                        # raised and the transport was never left (its server kept running)
                        with anyio.CancelScope(shield=True):
                            await adapter._close_async()
                    else:
                        await adapter._close_async()
                    self._session = self._session_cm = self._transport_cm = None

            self._ready, self._closing = ready, closing
            self._owner = loop.create_task(own(), name=f"mcp session {self.toolbox_id}")
        try:
            return await asyncio.wait_for(asyncio.shield(ready), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            # the caller gives up now (its own wait has the same timeout): the attempt stops too, and
            # its server's process ends, rather than connecting on in the background
            async with self._connecting():
                if self._ready is ready:
                    await self._end_owner()
            raise

    @contextlib.asynccontextmanager
    async def _connect_lock(self, deadline: float):
        """The connect lock, waited for until `deadline` at most (TimeoutError then)."""
        lock = self._connecting()
        async with asyncio.timeout_at(deadline):
            await lock.acquire()
        try:
            yield
        finally:
            lock.release()

    async def _end_owner(self) -> None:
        """The connection ended, by the task that made it (its lock held)."""
        owner, self._owner = self._owner, None
        if owner is None:
            return
        self._closing.set()
        self._cut_calls("closed its connection during the call")  # they would wait out their timeout
        if not self._ready.done():
            owner.cancel()  # still connecting (a server that never answers): stop trying
        await asyncio.wait({owner})

    def _cut_calls(self, why: str) -> None:
        """Each call waiting now fails at once, saying why (on the toolbox's loop)."""
        for task in list(self._calls):
            self._cut[task] = why
            task.cancel()

    async def _close_async(self) -> None:
        async with self._connecting():
            await self._end_owner()

    async def _call_tool_async(self, name, arguments):
        session, task = self._session, asyncio.current_task()
        if session is None or self._owner is None:
            raise ConnectionError(f"MCP toolbox {self.toolbox_id} is not connected")
        self._calls.add(task)
        try:
            async with asyncio.timeout(self._timeout):  # its caller gives up then: so does the call
                return await session.call_tool(name, arguments)
        except asyncio.CancelledError:
            why = self._cut.get(task)
            if why:
                raise ConnectionError(f"MCP toolbox {self.toolbox_id}: {why}") from None
            raise
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            self._server_gone(session)
            raise
        except McpError as exc:
            if exc.error.code == CONNECTION_CLOSED:  # it ended while the call waited for its answer
                self._server_gone(session)
            raise
        finally:
            self._calls.discard(task)
            self._cut.pop(task, None)

    def _server_gone(self, session) -> None:
        """The server's process ended under a call: the kept toolbox connects again (tools/plugins.py),
        unless the call's connection is one already replaced."""
        if session is self._session:
            self.broken = True

    def _call_mcp_tool(self, name, args):
        if self._closed:
            raise RuntimeError(f"MCP toolbox {self.toolbox_id} is closed")  # its event loop is stopped
        return super()._call_mcp_tool(name, args)

    def discover_tools(self):
        if self._closed:  # its event loop is stopped: asking it would wait out the whole timeout
            return []
        return super().discover_tools()

    def close(self) -> None:
        lock = getattr(self, "_close_lock", None)
        if lock is None:  # __del__ of a toolbox whose __init__ failed before anything was made
            return
        with lock:
            if self._closed:
                return
            self._closed = True
        super().close()
