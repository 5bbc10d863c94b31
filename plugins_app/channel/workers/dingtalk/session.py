"""The session webhooks a worker without app credentials answers through: each conversation's newest one.

Every robot message DingTalk POSTs carries a ``sessionWebhook``, a URL that posts into that chat without any
token until ``sessionWebhookExpiredTime`` (about 90 minutes). A worker with no ``DINGTALK_APP_KEY`` has no
other way to answer, so the newest message's URL of each conversation is kept here (the newest by the
message's ``createAt``, whatever order messages are recorded in, and only a message recorded for the first
time brings one: a message DingTalk sends again is not newer; never the one that says it lasts longest: a
body's expiry is the body's word, and the worker caps it at ``MAX_SESSION_MS`` from its arrival): a JSON file of the worker's own, beside its outbox, replaced whole at each change (so a restarted
worker still answers a message taken before the restart); expired entries are dropped as it is written.
"""
from __future__ import annotations

import json
import os
import threading
import time


#: The longest a session webhook is trusted from the message that brought it (DingTalk's last about 90 minutes).
MAX_SESSION_MS = 2 * 3600 * 1000


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
                                           if isinstance(v, list) and len(v) in (2, 3)} if isinstance(loaded, dict) else {}

    def remember(self, conversation_id: str, url: str, expires_ms: int, created_ms: int = 0) -> bool:
        """Keep ``url`` as the conversation's session webhook until ``expires_ms`` (never past ``MAX_SESSION_MS``
        from now, whatever the body said of its own expiry), unless the one kept came with a message created
        later (``created_ms``, the message's ``createAt``: two messages recorded side by side, or one taken late,
        must not put an older session in place of a newer); written before it returns. False when the one kept
        stays."""
        with self._lock:
            now = int(time.time() * 1000)
            self._sessions = {k: v for k, v in self._sessions.items() if int(v[1]) > now}
            kept = self._sessions.get(conversation_id)
            if kept is not None and len(kept) == 3 and int(kept[2]) > created_ms:
                return False
            self._sessions[conversation_id] = [url, min(int(expires_ms), now + MAX_SESSION_MS), int(created_ms)]
            tmp = f"{self.path}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self._sessions, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            return True

    def get(self, conversation_id: str) -> tuple[str, int] | None:
        """(url, expiry in ms since the epoch) of the conversation's newest session webhook."""
        with self._lock:
            kept = self._sessions.get(conversation_id)
        return (str(kept[0]), int(kept[1])) if kept else None
