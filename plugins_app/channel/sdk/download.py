"""``download()``: GET one of a user's files from a platform, telling "not now" from "never".

A 5xx, a 429, or no answer at all (a network error, a timeout) raises ``MediaNotReady``: the platform
cannot give the file now, so the SDK holds the message (its chat only) and fetches again at the next
replay, for up to the worker's ``media_wait_secs``. Any other answer is returned as it came: the worker
decides what a 4xx or a wrong page means for its platform (a refused token, an expired link).
"""
from __future__ import annotations

from .worker import MediaNotReady

#: How long a fetch for ``fetch_media`` may wait to connect, and between two reads (seconds). Short, and no
#: retries of its own: the SDK's hold tries again at each replay, and while a fetch runs the later messages of
#: its chat wait for it (a chat's submits are made one at a time, to keep its order; other chats go on).
MEDIA_TIMEOUT_SECS = 15.0


def says_later(status: int) -> bool:
    """Whether an HTTP status means "not now" (the platform busy or failing), not "never": the one rule of
    ``download()`` and of the workers that download through their own API client (LINE, WhatsApp)."""
    return status >= 500 or status == 429


def download(url: str, *, headers: dict[str, str] | None = None, timeout: float = MEDIA_TIMEOUT_SECS):
    """``httpx.get`` the file at ``url`` (redirects followed); ``MediaNotReady`` for a 5xx, a 429 or no answer."""
    import httpx
    try:
        response = httpx.get(url, headers=headers or {}, timeout=timeout, follow_redirects=True)
    except httpx.TransportError as exc:  # refused, reset, timed out: the platform may answer in a while
        raise MediaNotReady(f"{type(exc).__name__}: {exc}") from exc
    if says_later(response.status_code):
        raise MediaNotReady(f"the download answered HTTP {response.status_code}")
    return response
