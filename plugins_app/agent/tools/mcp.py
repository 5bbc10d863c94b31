"""The MCP toolbox UGENT runs: ovos-tool-adapters' MCPToolBox, with its session owned by one task.

MCPToolBox (0.1.2) enters the MCP client's transport and session in one task of its event loop and
leaves them from another. mcp's transports are anyio task groups, whose cancel scope must be left by
the task that entered it: leaving from another raised ("Attempted to exit cancel scope in a different
task"), left the transport's own tasks behind, and now and then hung a later call until its timeout.
Here one task per connection enters both, waits until the toolbox closes, and leaves both. A close while
it is still connecting (a server that never answers: the caller gave up at its timeout) cancels it, and
the server's process ends.

Its close() also ran again from ``__del__`` once the toolbox was garbage, on an event loop already
stopped, and so waited its full 10-second timeout in whichever thread collected it (a request's, a
turn's). Here a second close() does nothing.
No Django here.
"""
from __future__ import annotations

import asyncio

import anyio
from ovos_tool_adapters.mcp import MCPToolBox


class OwnedMCPToolBox(MCPToolBox):
    _owner: asyncio.Task | None = None
    _ready: asyncio.Future | None = None
    _closing: asyncio.Event | None = None
    _closed = False

    async def _connect_and_list(self):
        await self._close_async()  # a reconnect (refresh_tools) ends the connection before it
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
            ready.set_result(tools)
            await closing.wait()
            await adapter._close_async()
            self._session = self._session_cm = self._transport_cm = None

        self._ready, self._closing = ready, closing
        self._owner = loop.create_task(own(), name=f"mcp session {self.toolbox_id}")
        return await ready

    async def _close_async(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        self._closing.set()
        if not self._ready.done():
            owner.cancel()  # still connecting (a server that never answers): stop trying
        await asyncio.wait({owner})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()
