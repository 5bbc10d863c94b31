"""An in-process bench's scratch install: a var dir of its own, its own ugent.toml, embedded mode.

Call `scratch_install(prefix, toml)` before Django is set up (bench/tool_loop.py, bench/memory.py)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def scratch_install(prefix: str, toml: str = "[web.auth]\n", *, keep_database_url: bool = False) -> Path:
    """A fresh var dir and ugent.toml (returned) for this process; Redis off, the scratch SQLite unless
    keep_database_url (the caller then names its own database). By default the file says `[web.auth]` alone:
    no tables (an empty one is refused, ugent.E001, as a write caught half-way)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("UGENT_VAR_DIR", str(tmp))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
    os.environ.setdefault("UGENT_LOG_LEVEL", "WARNING")
    os.environ.pop("REDIS_URL", None)
    if not keep_database_url:
        os.environ.pop("DATABASE_URL", None)
    config = tmp / "ugent.toml"
    config.write_text(toml)
    os.environ["UGENT_CONFIG"] = str(config)
    return config


class LoopClient:
    """Django's AsyncClient on one event loop that lasts as long as the bench, for in-process turns.

    Django's sync test `Client` runs each request on an event loop of its own (asgiref's AsyncToSync), whose
    executor threads end with the request, and with them their database connections: every turn opened a new
    connection, on PostgreSQL a new backend with cold caches, which a daemon never does (its executor threads
    live as long as it). Here the API's threads, and the connections they hold, live from turn to turn."""

    def __init__(self, headers: dict):
        import asyncio
        import threading

        from django.test import AsyncClient
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-loop", daemon=True)
        self._thread.start()
        self._client, self._headers = AsyncClient(), headers  # headers per request: AsyncClient drops its own

    def post(self, path: str, **kwargs):
        import asyncio
        request = self._client.post(path, headers=self._headers, **kwargs)
        return asyncio.run_coroutine_threadsafe(request, self._loop).result()

    def close(self) -> None:
        """The loop stopped, after its executor's threads have ended."""
        import asyncio
        asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
