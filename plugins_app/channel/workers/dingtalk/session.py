"""The session webhooks a worker without app credentials answers through: each conversation's newest one.

Every robot message DingTalk POSTs carries a ``sessionWebhook``, a URL that posts into that chat without any
token until ``sessionWebhookExpiredTime`` (about 90 minutes). A worker with no ``DINGTALK_APP_KEY`` has no
other way to answer, so the newest URL of each conversation is kept here: a JSON file of the worker's own,
beside its outbox, replaced whole at each change (so a restarted worker still answers a message taken before
the restart); expired entries are dropped as it is written.
"""
from __future__ import annotations

import json
import os
import threading
import time


class SessionStore:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        try:
            with open(path, encoding="utf-8") as fh:
                loaded = json.load(fh)
        except (OSError, ValueError):
            loaded = {}
        self._sessions: dict[str, list] = {k: v for k, v in loaded.items()
                                           if isinstance(v, list) and len(v) == 2} if isinstance(loaded, dict) else {}

    def remember(self, conversation_id: str, url: str, expires_ms: int) -> None:
        """Keep ``url`` for the conversation unless the one kept lasts longer; written before it returns."""
        with self._lock:
            kept = self._sessions.get(conversation_id)
            if kept and int(kept[1]) > expires_ms:
                return
            now = int(time.time() * 1000)
            self._sessions = {k: v for k, v in self._sessions.items() if int(v[1]) > now}
            self._sessions[conversation_id] = [url, int(expires_ms)]
            tmp = f"{self.path}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self._sessions, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)

    def get(self, conversation_id: str) -> tuple[str, int] | None:
        """(url, expiry in ms since the epoch) of the conversation's newest session webhook."""
        with self._lock:
            kept = self._sessions.get(conversation_id)
        return (str(kept[0]), int(kept[1])) if kept else None
