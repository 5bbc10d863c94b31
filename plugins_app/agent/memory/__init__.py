"""Durable memory per user (issue #16).

The hub and the commands read memory only through the functions here; the backends (none,
sqlite_fts, lance_embedded) live beside them. With no backend configured there is no durable
memory: recall finds nothing and says why.
"""
from __future__ import annotations


def recall_preview(*, actor_key: str, text: str) -> dict:
    """What recall would inject for this user before a turn on `text`, without injecting it.

    {"backend": the configured backend's name, or None when there is none,
     "facts": [{"text", "tier", "score"}...], "tokens_est": int}
    """
    return {"backend": None, "facts": [], "tokens_est": 0}
