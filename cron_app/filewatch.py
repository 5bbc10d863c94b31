"""The daemon's watch of UGENT_CRON_FILE: an edit to cron.toml counts without a restart.

The process that fires the schedules (the embedded daemon; beat in servers mode) imports the file when it
starts and whenever it changes, through `services.cron_file_sync`: only a text other than the one last
imported is imported, so a restart with the same file leaves the admin's edits alone, and a file refused
(a bad schedule, an unknown key, nothing in it) changes nothing and is logged with the reason. The watch
is watchfiles' on the file's folder (a change of the file, and any name added or removed beside it: an
editor that saves by renaming, a Kubernetes ConfigMap's swapped `..data` link), with a look every `poll`
seconds besides, for filesystems that send no events. A look compares the file's signature (through
symlinks) with the last one, and reads a file only once it has stopped changing.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

import watchfiles
from django.db import close_old_connections, connection

from ugent_common.filestat import file_signature

log = logging.getLogger("ugent.cron")

LOG_IMPORTED = "cron file imported (path=%s, jobs=%d, removed=%d)"
LOG_REFUSED = "cron file refused (path=%s, reason=%s); the jobs stay as they were"
LOG_MISSING = "cron file missing (path=%s); the jobs stay as they were"
LOG_WATCHING = "cron file watched (path=%s, state=%s)"

#: A file changed less than this long ago may still be being written: it is read at a later look.
SETTLE_SECS = 0.3


class CronFileWatcher:
    def __init__(self, path: str, *, poll: float = 1.0):
        # absolute, not resolved: a symlink swapped later (a ConfigMap, a `current` link) is followed then
        self.path = Path(path).expanduser().absolute()
        self.poll = poll
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: object = ()  # the signature last looked at (() : never)
        self._said: Optional[tuple] = None  # the last outcome logged, so a broken file is logged once

    def sync_once(self) -> Optional[dict]:
        """Look at the file: import it if it changed since the last look. The outcome, or None if unchanged
        (or still being written: then the next look reads it)."""
        sig = file_signature(self.path)
        if sig == self._seen:
            return None
        if sig is not None and 0 <= time.time() - sig[0] / 1e9 < SETTLE_SECS:
            return None  # (a time in the future, a clock set back, is no write under way: read it)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = None  # (cron_file_sync reads it again, and says why it cannot)
        if file_signature(self.path) != sig:  # changed while it was read: the next look reads it again
            return None
        from cron_app.services import cron_file_sync
        try:
            out = cron_file_sync(path=str(self.path), text=text)
        except Exception as exc:  # the database is down, say: looked at again at every poll until it works
            out = {"state": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            if self._said is None or self._said[0] != "failed":
                log.exception("cron file import failed (path=%s); trying again at every look", self.path)
            self._said = ("failed", None)
            return out
        finally:
            close_old_connections()
        self._seen = sig
        said = (out["state"], out.get("reason"))
        if out["state"] == "imported":
            log.info(LOG_IMPORTED, self.path, out["jobs"], out["removed"])
        elif said != self._said and out["state"] == "refused":
            log.error(LOG_REFUSED, self.path, out["reason"])
        elif said != self._said and out["state"] == "missing":
            log.warning(LOG_MISSING, self.path)
        self._said = said
        return out

    def start(self) -> "CronFileWatcher":
        """Import now (so what starts next sees the file's jobs), then watch on a thread of its own."""
        out = self.sync_once()
        if out is None and self._seen == ():  # still being written: give it its moment, once
            time.sleep(SETTLE_SECS)
            out = self.sync_once()
        log.info(LOG_WATCHING, self.path, out["state"] if out else "pending")
        self._thread = threading.Thread(target=self._run, name="ugent-cron-file", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _wants(self, change: watchfiles.Change, changed: str) -> bool:
        """Any change of the file, and any name added or deleted beside it (a rename-save, a ConfigMap's
        swapped link); not the writes to other files (a log file kept in the same folder)."""
        return Path(changed).name == self.path.name or change != watchfiles.Change.modified

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                folder = self.path.parent
                if not folder.is_dir():
                    self._stop.wait(self.poll)
                    self.sync_once()
                    continue
                try:
                    for _changes in watchfiles.watch(
                            folder, watch_filter=self._wants, stop_event=self._stop,
                            rust_timeout=max(100, int(self.poll * 1000)), yield_on_timeout=True,
                            recursive=False, raise_interrupt=False):
                        if self._stop.is_set():
                            return
                        self.sync_once()
                except Exception:  # the folder went away, a notify error: look again later
                    log.warning("cron file watch error (path=%s); retrying", self.path, exc_info=True)
                    self._stop.wait(self.poll)
        finally:
            connection.close()  # this thread's own
