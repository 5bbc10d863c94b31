"""A server (``start()``/``close()`` coroutines) run on its own event loop in a daemon thread."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable


class ServerThread:
    """Runs a server (``start()``/``close()`` coroutines) on its own event loop in a daemon thread.

    For tests and for a synchronous caller (a supervisor loop that is not asyncio).
    """

    def __init__(self, server: Any):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="bridge-loop", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self._thread.start()
        self.run(self.server.start(), timeout)
        return self

    def run(self, coro: Awaitable[Any], timeout: float | None = 10.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = 10.0) -> Any:
        """Run a plain function on the server's loop (to touch loop-bound state safely)."""
        async def wrapper() -> Any:
            return fn()
        return self.run(wrapper(), timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.server.close(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
