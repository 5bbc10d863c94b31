"""What Tencent's two server APIs share, for the Weixin (WeChat Official Account) and WeCom workers: the access
token kept until shortly before it expires, the error classes, and the call loop.

Both APIs answer HTTP 200 with ``{"errcode": N, "errmsg": "..."}`` (0, or no errcode at all, is success), so
the errcode, not the status, says what happened. ``TencentApi._call`` makes one call with the access token:

* an errcode in ``token_stale``: the token is fetched again at once (``fresh``) and the call made once more;
* one in ``rate_limited``: waited out in place, ``backoff_initial`` doubling to ``backoff_max``, up to
  ``max_wait_secs``; then ``RateLimited``; a stop meanwhile raises ``Stopped``;
* one in ``app_refused``: ``AppRefused`` (only the operator can fix it); in ``user_unreachable``:
  ``UserUnreachable``; anything else: ``ApiError``.

What differs stays in each worker's ``api.py``: how the token is fetched (``gettoken`` or ``stable_token``, and
Weixin's rationed forced refresh), the errcodes of each set, how an HTTP error or a downloaded file is told
from an answer. The token itself is ``TokenCache`` (``sdk/token.py``).
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable
from urllib.parse import quote, unquote

import httpx

from .token import TokenCache

__all__ = ["ApiError", "AppRefused", "RateLimited", "Stopped", "TencentApi", "TokenCache",
           "UserUnreachable", "errcode_of", "media_id_of", "media_url"]

class ApiError(Exception):
    """The platform answered a call with a non-zero errcode (or an HTTP error: errcode -1)."""

    def __init__(self, where: str, errcode: int, errmsg: str):
        super().__init__(f"{where}: errcode {errcode}: {errmsg}")
        self.where, self.errcode, self.errmsg = where, errcode, errmsg


class AppRefused(ApiError):
    """The app's credentials, the server's IP or the app's rights are refused: the operator must fix them."""


class UserUnreachable(ApiError):
    """The user cannot be sent to: sending again cannot help."""


class RateLimited(ApiError):
    """Busy or over a quota for longer than the call waits in place."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


def errcode_of(body) -> int:
    """An answer's errcode: 0 when it has none, -1 when it is no number."""
    try:
        return int((body or {}).get("errcode", 0))
    except (TypeError, ValueError, AttributeError):
        return -1


def media_url(base_url: str, media_id: str) -> str:
    """Where a media file is downloaded from (the access token is added at download, never stored)."""
    return f"{base_url.rstrip('/')}/cgi-bin/media/get?media_id={quote(media_id, safe='')}"


def media_id_of(base_url: str, url: str | None) -> str | None:
    """The media id of a ``media_url`` of this base URL; None for any other URL."""
    prefix = media_url(base_url, "")
    return unquote(url[len(prefix):]) if (url or "").startswith(prefix) else None


class TencentApi:
    """The access token and the call loop of a Tencent server API; a worker's subclass sets the errcode sets,
    fetches the token (``_fetch_token``) and makes the calls."""

    #: The access token is stale: fetch a new one and make the call again (once).
    token_stale: frozenset[int] = frozenset()
    #: Busy or over a quota: wait and make the call again.
    rate_limited: frozenset[int] = frozenset()
    #: Answers to any call only the operator can fix.
    app_refused: frozenset[int] = frozenset()
    #: The user cannot be sent to.
    user_unreachable: frozenset[int] = frozenset()
    #: What ``RateLimited`` and ``Stopped`` say after a wait (``{waited}``: the seconds waited).
    still_limited = "still refused after waiting {waited:.0f} s"
    stopped_waiting = "stopping while waiting out a busy answer"

    def __init__(self, *, base_url: str, stopping: threading.Event | None = None, backoff_initial: float = 1.0,
                 backoff_max: float = 30.0, max_wait_secs: float = 120.0, timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], bool] | None = None):
        self.base_url = base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        self._clock = clock
        self._sleep = sleep or self.stopping.wait   # returns True when stopping
        self.client = httpx.Client(timeout=timeout)
        self._tokens = TokenCache(self._fetch_token, clock=clock)

    def close(self) -> None:
        self.client.close()

    def token(self, *, fresh: bool = False, stale: str | None = None) -> str:
        """The access token, fetched when there is none, it is near its expiry, or ``fresh`` (the platform said
        ``stale`` is no longer valid: a token another thread already replaced is kept)."""
        return self._tokens.get(fresh=fresh, stale=stale)

    def _fetch_token(self, stale: str | None) -> tuple[str, float]:
        raise NotImplementedError

    def _keep_token(self, answer: dict, where: str, refused) -> tuple[str, float]:
        """The token and its lifetime from a token endpoint's answer; ``AppRefused`` for an errcode in ``refused``."""
        code = errcode_of(answer)
        if code in refused:
            raise AppRefused(where, code, str(answer.get("errmsg")))
        if code != 0 or not answer.get("access_token"):
            raise ApiError(where, code, str(answer.get("errmsg") or "no access_token"))
        return str(answer["access_token"]), float(answer.get("expires_in") or 7200)

    # ------------------------------------------------------------------ calls

    def _body(self, response: httpx.Response, where: str, binary: bool) -> dict | None:
        """The answer's JSON object, or None when ``binary`` and the response is the file itself."""
        raise NotImplementedError

    def _call(self, where: str, request: Callable[[str], httpx.Response], *, binary: bool = False) -> dict:
        refreshed = False
        waited, backoff = 0.0, self.backoff_initial
        token = self.token()
        while True:
            body = self._body(request(token), where, binary)
            if body is None:
                return {}  # the file itself
            code = errcode_of(body)
            if code == 0:
                return body
            errmsg = str(body.get("errmsg") or "")
            if code in self.token_stale and not refreshed:
                refreshed = True
                token = self.token(fresh=True, stale=token)
                continue
            if code in self.rate_limited:
                if waited + backoff > self.max_wait_secs:
                    raise RateLimited(where, code, f"{errmsg} ({self.still_limited.format(waited=waited)})")
                if self._sleep(backoff):
                    raise Stopped(self.stopped_waiting)
                waited += backoff
                backoff = min(backoff * 2, self.backoff_max)
                continue
            if code in self.app_refused:
                raise AppRefused(where, code, errmsg)
            if code in self.user_unreachable:
                raise UserUnreachable(where, code, errmsg)
            raise ApiError(where, code, errmsg)

    @staticmethod
    def _json(response: httpx.Response, where: str) -> dict:
        if response.status_code != 200:
            raise ApiError(where, -1, f"HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise ApiError(where, -1, "the answer is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(where, -1, "the answer is not a JSON object")
        return body

    def _media(self, media_id: str, *, where: str = "media/get") -> tuple[httpx.Response, dict]:
        """``GET /cgi-bin/media/get``: the response that carries the file, and the JSON answer when it is one."""
        holder: dict = {}

        def get(token):
            holder["response"] = self.client.get(f"{self.base_url}/cgi-bin/media/get",
                                                 params={"access_token": token, "media_id": media_id}, timeout=120)
            return holder["response"]
        answer = self._call(where, get, binary=True)
        return holder["response"], answer

    @staticmethod
    def file_of(response: httpx.Response) -> tuple[bytes, str, str | None]:
        """A downloaded file's bytes, content type and name (from ``Content-Disposition``)."""
        ctype = (response.headers.get("Content-Type") or "application/octet-stream").split(";")[0].strip()
        found = re.search(r'filename="?([^";]+)"?', response.headers.get("Content-Disposition") or "")
        return response.content, ctype, found.group(1) if found else None
