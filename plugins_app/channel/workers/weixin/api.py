"""The Weixin (WeChat Official Account, 微信公众号) server API: the access token, customer service messages,
temporary media.

Every answer of the JSON API is HTTP 200 with ``{"errcode": N, "errmsg": "..."}`` on error (0, or no
errcode at all, is success), so the errcode, not the status, says what happened:

* 40001 (the token is invalid or not the latest), 40014 (invalid), 42001 (expired) at a call: the access
  token is stale; it is fetched again at once and the call made once more;
* -1 (system busy), 45009 (the API's call quota), 45011 (its minute quota), and HTTP 5xx: waited out in place, 1 s doubling to
  30 s, up to ``max_wait_secs``; then ``RateLimited``;
* at ``stable_token`` 40001/40125 (the AppSecret is wrong), 40013 (the AppID), 41002/41004 (missing),
  and anywhere 40164 (this server's IP is not in the account's IP whitelist) or 48001 (the account has
  no right to the API): ``AppRefused``, which only the operator can fix;
* 45015 (the user last wrote more than 48 hours ago, or unfollowed), 45047 (the customer service
  message quota for the user's last message is spent), 43004 (the user does not follow the account),
  40003 (not this account's OpenID): ``UserUnreachable``.

The token comes from ``POST /cgi-bin/stable_token`` (the stable token: the platform renews it five
minutes before it expires, and a second caller with the same AppID does not invalidate the first);
when WeChat says a token is stale and the normal call gives that same token back, the worker asks once
with ``force_refresh``. A forced refresh invalidates the token every other program of the AppID holds,
and WeChat allows 20 a day, 30 s apart: the worker forces at most once in ``FORCE_GAP_SECS`` and
``FORCE_PER_DAY`` times in 24 hours, and otherwise lets the call fail (retryable) with WeChat's answer.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

import httpx

DEFAULT_API_BASE_URL = "https://api.weixin.qq.com"

#: The access token is stale: fetch a new one and make the call again (once).
TOKEN_STALE = {40001, 40014, 42001}
#: Busy or over a quota: wait and make the call again.
RATE_LIMITED = {-1, 45009, 45011}   # 45011: "api minute-quota reach limit, try again in a minute"
#: Answers to stable_token only the operator can fix: the AppID, the AppSecret.
TOKEN_REFUSED = {40001, 40013, 40125, 41002, 41004}
#: Answers to any call only the operator can fix: the IP whitelist, the account's rights.
APP_REFUSED = {40164, 48001}
#: The user cannot be sent to now: sending again cannot help.
USER_UNREACHABLE = {45015, 45047, 43004, 40003}

#: force_refresh: at most once in this many seconds (WeChat: 30 s apart) ...
FORCE_GAP_SECS = 30.0
#: ... and this many times in 24 hours (WeChat: 20 a day, shared with every other program of the AppID).
FORCE_PER_DAY = 5

#: Fetch a new token this long before the one in hand expires (WeChat gives 7,200 s).
REFRESH_MARGIN_SECS = 300.0
#: The longest text of one customer service message, in bytes of UTF-8. WeChat's docs give no number;
#: a longer text is refused with 45002 (content size out of limit), and 2,048 bytes is the length
#: measured and answered on WeChat's developer community.
TEXT_LIMIT_BYTES = 2048


class WeixinError(Exception):
    """WeChat answered a call with a non-zero errcode (or an HTTP error: errcode -1)."""

    def __init__(self, where: str, errcode: int, errmsg: str):
        super().__init__(f"{where}: errcode {errcode}: {errmsg}")
        self.where, self.errcode, self.errmsg = where, errcode, errmsg


class AppRefused(WeixinError):
    """The AppID, the AppSecret, the server's IP or the account's rights are refused: the operator must fix it."""


class UserUnreachable(WeixinError):
    """45015/45047/43004/40003: the user cannot be sent to (the 48-hour window, the quota, unfollowed)."""


class RateLimited(WeixinError):
    """-1/45009/5xx for longer than the call waits in place."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


def errcode_of(body) -> int:
    try:
        return int((body or {}).get("errcode", 0))
    except (TypeError, ValueError, AttributeError):
        return -1


class WeixinApi:
    def __init__(self, app_id: str, app_secret: str, *, base_url: str = DEFAULT_API_BASE_URL,
                 stopping: threading.Event | None = None, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 max_wait_secs: float = 120.0, timeout: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], bool] | None = None):
        self.app_id, self.app_secret = app_id, app_secret
        self.base_url = base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        self._clock = clock
        self._sleep = sleep or self.stopping.wait   # returns True when stopping
        self.client = httpx.Client(timeout=timeout)
        self._lock = threading.Lock()
        self._token: str | None = None
        self._refresh_at = 0.0
        self._forced: list[float] = []   # when force_refresh was asked, within the last 24 hours

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ the access token

    def token(self, *, fresh: bool = False, stale: str | None = None) -> str:
        """The access token, fetched with ``stable_token`` when there is none, it is near its expiry, or
        ``fresh`` (WeChat said ``stale`` is no longer valid: a token another thread already replaced is kept)."""
        with self._lock:
            if fresh and (stale is None or stale == self._token):
                self._token = None
                self._fetch_token()
                if self._token == stale and self._may_force():  # still the token it refused: force a new one
                    self._fetch_token(force=True)
            elif self._token is None or self._clock() >= self._refresh_at:
                self._fetch_token()
            return self._token

    def _may_force(self) -> bool:
        """Whether a force_refresh is within the worker's limits now; if so, it is counted."""
        now = self._clock()
        self._forced = [at for at in self._forced if now - at < 86400]
        if len(self._forced) >= FORCE_PER_DAY or (self._forced and now - self._forced[-1] < FORCE_GAP_SECS):
            return False
        self._forced.append(now)
        return True

    def _fetch_token(self, *, force: bool = False) -> None:
        body = {"grant_type": "client_credential", "appid": self.app_id, "secret": self.app_secret}
        if force:
            body["force_refresh"] = True
        answer = self._json(self.client.post(f"{self.base_url}/cgi-bin/stable_token", json=body), "stable_token")
        code = errcode_of(answer)
        if code in TOKEN_REFUSED or code in APP_REFUSED:
            raise AppRefused("stable_token", code, str(answer.get("errmsg")))
        if code != 0 or not answer.get("access_token"):
            raise WeixinError("stable_token", code, str(answer.get("errmsg") or "no access_token"))
        expires_in = float(answer.get("expires_in") or 7200)
        self._token = str(answer["access_token"])
        self._refresh_at = self._clock() + max(expires_in / 2, expires_in - REFRESH_MARGIN_SECS)

    # ------------------------------------------------------------------ calls

    def send(self, message: dict) -> dict:
        """``POST /cgi-bin/message/custom/send``: one customer service message (``touser``, ``msgtype``, ...)."""
        return self._call("message/custom/send", lambda token: self.client.post(
            f"{self.base_url}/cgi-bin/message/custom/send", params={"access_token": token},
            content=_json_bytes(message), headers={"Content-Type": "application/json; charset=utf-8"}))

    def send_text(self, openid: str, content: str) -> dict:
        return self.send({"touser": openid, "msgtype": "text", "text": {"content": content}})

    def send_image(self, openid: str, media_id: str) -> dict:
        return self.send({"touser": openid, "msgtype": "image", "image": {"media_id": media_id}})

    def upload(self, data: bytes, content_type: str, filename: str, *, kind: str = "image") -> str:
        """``POST /cgi-bin/media/upload?type=image``: a temporary media file (kept 3 days); its media_id."""
        answer = self._call("media/upload", lambda token: self.client.post(
            f"{self.base_url}/cgi-bin/media/upload", params={"access_token": token, "type": kind},
            files={"media": (filename, data, content_type)}, timeout=120))
        if not answer.get("media_id"):
            raise WeixinError("media/upload", -1, "no media_id in the answer")
        return str(answer["media_id"])

    def media(self, media_id: str) -> tuple[bytes, str, str | None]:
        """``GET /cgi-bin/media/get``: a temporary media file's bytes, type and file name. A video answers
        ``{"video_url": ...}`` instead of the bytes: they are fetched from there (no token sent)."""
        holder: dict = {}

        def get(token):
            response = self.client.get(f"{self.base_url}/cgi-bin/media/get",
                                       params={"access_token": token, "media_id": media_id}, timeout=120)
            holder["response"] = response
            return response
        answer = self._call("media/get", get, binary=True)
        response = holder["response"]
        if answer.get("video_url"):
            response = self.client.get(str(answer["video_url"]), timeout=120, follow_redirects=True)
            if response.status_code != 200:
                raise WeixinError("media/get video_url", -1, f"HTTP {response.status_code}")
        ctype = (response.headers.get("Content-Type") or "application/octet-stream").split(";")[0].strip()
        found = re.search(r'filename="?([^";]+)"?', response.headers.get("Content-Disposition") or "")
        return response.content, ctype, found.group(1) if found else None

    def _call(self, where: str, request: Callable[[str], httpx.Response], *, binary: bool = False) -> dict:
        refreshed = False
        waited, backoff = 0.0, self.backoff_initial
        token = self.token()
        while True:
            response = request(token)
            if response.status_code >= 500:
                body = {"errcode": -1, "errmsg": f"HTTP {response.status_code}"}
            elif binary and response.status_code == 200 and not _is_json(response):
                return {}  # the file itself
            else:
                body = self._json(response, where)
            code = errcode_of(body)
            if code == 0:
                return body
            errmsg = str(body.get("errmsg") or "")
            if code in TOKEN_STALE and not refreshed:
                refreshed = True
                token = self.token(fresh=True, stale=token)
                continue
            if code in RATE_LIMITED:
                if waited + backoff > self.max_wait_secs:
                    raise RateLimited(where, code, f"{errmsg} (still refused after waiting {waited:.0f} s)")
                if self._sleep(backoff):
                    raise Stopped("stopping while waiting out a busy answer")
                waited += backoff
                backoff = min(backoff * 2, self.backoff_max)
                continue
            if code in APP_REFUSED:
                raise AppRefused(where, code, errmsg)
            if code in USER_UNREACHABLE:
                raise UserUnreachable(where, code, errmsg)
            raise WeixinError(where, code, errmsg)

    @staticmethod
    def _json(response: httpx.Response, where: str) -> dict:
        if response.status_code != 200:
            raise WeixinError(where, -1, f"HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise WeixinError(where, -1, "the answer is not JSON") from None
        if not isinstance(body, dict):
            raise WeixinError(where, -1, "the answer is not a JSON object")
        return body


def _json_bytes(value: dict) -> bytes:
    """JSON in UTF-8 with Chinese as written, not as ``\\uXXXX`` escapes (as WeChat's own samples send it)."""
    import json
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _is_json(response: httpx.Response) -> bool:
    ctype = (response.headers.get("Content-Type") or "").lower()
    if ctype.startswith("application/json"):
        return True
    if ctype.startswith("text/plain") and "Content-Disposition" not in response.headers:
        return response.content[:1] == b"{"  # WeChat's errors come as text/plain JSON too
    return False
