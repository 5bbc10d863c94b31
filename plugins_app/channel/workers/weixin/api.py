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

import httpx

from plugins_app.channel.sdk.tencent import (ApiError, AppRefused, RateLimited, Stopped, TencentApi,
                                             UserUnreachable, errcode_of)

__all__ = ["DEFAULT_API_BASE_URL", "TEXT_LIMIT_BYTES", "TOKEN_STALE", "AppRefused",
           "RateLimited", "Stopped", "UserUnreachable", "WeixinApi", "WeixinError", "errcode_of"]

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

#: The longest text of one customer service message, in bytes of UTF-8. WeChat's docs give no number;
#: a longer text is refused with 45002 (content size out of limit), and 2,048 bytes is the length
#: measured and answered on WeChat's developer community.
TEXT_LIMIT_BYTES = 2048

#: WeChat's errors are the SDK's (``sdk/tencent.py``): AppRefused (the AppID, the AppSecret, the IP whitelist,
#: the account's rights), UserUnreachable (45015/45047/43004/40003: the 48-hour window, the quota,
#: unfollowed), RateLimited (-1/45009/45011/5xx for longer than the call waits in place).
WeixinError = ApiError


class WeixinApi(TencentApi):
    token_stale = frozenset(TOKEN_STALE)
    rate_limited = frozenset(RATE_LIMITED)
    app_refused = frozenset(APP_REFUSED)
    user_unreachable = frozenset(USER_UNREACHABLE)

    def __init__(self, app_id: str, app_secret: str, *, base_url: str = DEFAULT_API_BASE_URL, **options):
        """``options``: the call loop's (``stopping``, ``max_wait_secs``, ``backoff_*``, ``timeout``, ``clock``,
        ``sleep``), as ``TencentApi`` takes them."""
        super().__init__(base_url=base_url, **options)
        self.app_id, self.app_secret = app_id, app_secret
        self._forced: list[float] = []   # when force_refresh was asked, within the last 24 hours

    # ------------------------------------------------------------------ the access token

    def _fetch_token(self, stale: str | None) -> tuple[str, float]:
        """``stable_token``; when WeChat said ``stale`` is stale and the normal call gives it back, once more
        with ``force_refresh`` (within the worker's limits)."""
        token = self._stable_token()
        if stale is not None and token[0] == stale and self._may_force():  # still the token it refused
            token = self._stable_token(force=True)
        return token

    def _may_force(self) -> bool:
        """Whether a force_refresh is within the worker's limits now; if so, it is counted."""
        now = self._clock()
        self._forced = [at for at in self._forced if now - at < 86400]
        if len(self._forced) >= FORCE_PER_DAY or (self._forced and now - self._forced[-1] < FORCE_GAP_SECS):
            return False
        self._forced.append(now)
        return True

    def _stable_token(self, *, force: bool = False) -> tuple[str, float]:
        body = {"grant_type": "client_credential", "appid": self.app_id, "secret": self.app_secret}
        if force:
            body["force_refresh"] = True
        answer = self._json(self.client.post(f"{self.base_url}/cgi-bin/stable_token", json=body), "stable_token")
        return self._keep_token(answer, "stable_token", TOKEN_REFUSED | APP_REFUSED)

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
        response, answer = self._media(media_id)
        if answer.get("video_url"):
            response = self.client.get(str(answer["video_url"]), timeout=120, follow_redirects=True)
            if response.status_code != 200:
                raise WeixinError("media/get video_url", -1, f"HTTP {response.status_code}")
        return self.file_of(response)

    def _body(self, response: httpx.Response, where: str, binary: bool) -> dict | None:
        if response.status_code >= 500:
            return {"errcode": -1, "errmsg": f"HTTP {response.status_code}"}  # busy: waited out as -1 is
        if binary and response.status_code == 200 and not _is_json(response):
            return None
        return self._json(response, where)


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
