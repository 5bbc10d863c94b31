"""WeCom's server API for an internal app: the access token, sending a message, uploading and downloading media.

Every answer is HTTP 200 with ``{"errcode": N, "errmsg": "..."}`` (0 is success), so the errcode,
not the status, says what happened:

* 40014 (invalid), 42001 (expired), 40001 (invalid credential) at a call: the access token is
  stale; it is fetched again at once and the call made once more;
* 45009 (the API's frequency limit), 45033 (too many concurrent calls): waited out in place, 1 s
  doubling to 30 s, up to ``max_wait_secs``; then ``RateLimited``;
* at ``gettoken``, 40001 (the secret is wrong), 40013 (the corp id), 40091 (the secret is not
  valid), 41004 (no secret), and anywhere 60020 (the server's IP is not in the app's trusted IPs):
  ``AppRefused``, which only the operator can fix;
* 81013 (the user, party and tag are all invalid), 60111 (no such user): ``UserUnreachable``.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

import httpx

DEFAULT_API_BASE_URL = "https://qyapi.weixin.qq.com"

#: The access token is stale: fetch a new one and make the call again (once).
TOKEN_STALE = {40001, 40014, 42001}
#: Too many calls: wait and make it again.
RATE_LIMITED = {45009, 45033}
#: Answers to gettoken (or any call) only the operator can fix: the corp id, the secret, the trusted IPs.
GETTOKEN_REFUSED = {40001, 40013, 40091, 41004, 60020}
APP_REFUSED = {40013, 40056, 40091, 60020}  # 40056: the agent id is not this app's
#: An upload WeCom refuses for the file itself (its type, its size, empty, missing, a voice too long):
#: uploading again cannot help. (The worker also takes any other errcode but a transient one, ``TRANSIENT``,
#: as the file refused, so that one file never holds back the rest of an answer.)
UPLOAD_REFUSED = {40004, 40005, 40006, 40009, 40010, 40011, 41005, 44001, 45001, 45007}
#: -1: the system is busy, or the call itself failed (an HTTP error, an answer that is not JSON).
SYSTEM_BUSY = -1
#: A template card's task_id already used: the card was sent before (task ids are per delivery).
TASK_ID_EXISTS = 42014
#: The user is not there for this app: sending again cannot help.
USER_UNREACHABLE = {81013, 60111}

#: Fetch a new token this long before the one in hand expires (WeCom gives 7,200 s).
REFRESH_MARGIN_SECS = 300.0
#: WeCom's limit for one text message, in bytes of UTF-8 (longer text is cut off by WeCom).
TEXT_LIMIT_BYTES = 2048
#: WeCom's duplicate check: the same content to the same user within this many seconds is not sent again.
DUPLICATE_CHECK_SECS = 1800


class WeComError(Exception):
    """WeCom answered a call with a non-zero errcode."""

    def __init__(self, where: str, errcode: int, errmsg: str):
        super().__init__(f"{where}: errcode {errcode}: {errmsg}")
        self.where, self.errcode, self.errmsg = where, errcode, errmsg


class AppRefused(WeComError):
    """The corp id, the secret or the server's IP is refused: the operator must fix the app's settings."""


class UserUnreachable(WeComError):
    """81013/60111: the user does not exist or is not in the app's visible range."""


class RateLimited(WeComError):
    """45009/45033 for longer than the call waits in place."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


def errcode_of(body) -> int:
    try:
        return int((body or {}).get("errcode", 0))
    except (TypeError, ValueError, AttributeError):
        return -1


class WeComApi:
    def __init__(self, corp_id: str, secret: str, agent_id: str, *, base_url: str = DEFAULT_API_BASE_URL,
                 stopping: threading.Event | None = None, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 max_wait_secs: float = 120.0, timeout: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], bool] | None = None):
        self.corp_id, self.secret, self.agent_id = corp_id, secret, agent_id
        self.base_url = base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        self._clock = clock
        self._sleep = sleep or self.stopping.wait   # returns True when stopping
        self.client = httpx.Client(timeout=timeout)
        self._lock = threading.Lock()
        self._token: str | None = None
        self._refresh_at = 0.0

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ the access token

    def token(self, *, fresh: bool = False, stale: str | None = None) -> str:
        """The access token, fetched with ``gettoken`` when there is none, it is near its expiry, or
        ``fresh`` (WeCom said ``stale`` is no longer valid: a token another thread already replaced is kept)."""
        with self._lock:
            if fresh and (stale is None or stale == self._token):
                self._token = None
            if self._token is None or self._clock() >= self._refresh_at:
                self._fetch_token()
            return self._token

    def _fetch_token(self) -> None:
        response = self.client.get(f"{self.base_url}/cgi-bin/gettoken",
                                   params={"corpid": self.corp_id, "corpsecret": self.secret})
        body = self._json(response, "gettoken")
        code = errcode_of(body)
        if code in GETTOKEN_REFUSED:
            raise AppRefused("gettoken", code, str(body.get("errmsg")))
        if code != 0 or not body.get("access_token"):
            raise WeComError("gettoken", code, str(body.get("errmsg") or "no access_token"))
        expires_in = float(body.get("expires_in") or 7200)
        self._token = str(body["access_token"])
        self._refresh_at = self._clock() + max(expires_in / 2, expires_in - REFRESH_MARGIN_SECS)

    # ------------------------------------------------------------------ calls

    def send_text(self, user: str, content: str) -> dict:
        """``POST /cgi-bin/message/send``: ``content`` to ``user`` as a text message, with WeCom's duplicate
        check on (the same content to the same user within 30 minutes is not sent twice). Returns WeCom's
        answer (``msgid``)."""
        return self.send(user, "text", {"content": content})

    def send(self, user: str, msgtype: str, content: dict) -> dict:
        """``POST /cgi-bin/message/send``: one message of ``msgtype`` (text, image, voice, video, file,
        template_card) whose object is ``content``, to ``user``, with WeCom's duplicate check on. Returns
        WeCom's answer (``msgid``; a button card's ``response_code`` too)."""
        body = {"touser": user, "msgtype": msgtype, "agentid": int(self.agent_id) if str(self.agent_id).isdigit()
                else self.agent_id, msgtype: content, "enable_duplicate_check": 1,
                "duplicate_check_interval": DUPLICATE_CHECK_SECS}
        answer = self._call("message/send", lambda token: self.client.post(
            f"{self.base_url}/cgi-bin/message/send", params={"access_token": token}, json=body))
        invalid = {u.lower() for u in str(answer.get("invaliduser") or "").split("|") if u}
        if user.lower() in invalid:
            raise UserUnreachable("message/send", 81013, f"invaliduser: {answer.get('invaliduser')}")
        return answer

    def upload(self, data: bytes, media_type: str, filename: str, content_type: str) -> dict:
        """``POST /cgi-bin/media/upload?type=``: a temporary media file (multipart, field ``media``); returns
        WeCom's answer (``type``, ``media_id``, ``created_at``). The file name is the one a file message shows."""
        def post(token):
            return self.client.post(f"{self.base_url}/cgi-bin/media/upload",
                                    params={"access_token": token, "type": media_type},
                                    files={"media": (filename, data, content_type)}, timeout=120)
        answer = self._call("media/upload", post)
        if not answer.get("media_id"):
            raise WeComError("media/upload", -1, "the answer has no media_id")
        return answer

    def media(self, media_id: str) -> tuple[bytes, str, str | None]:
        """``GET /cgi-bin/media/get``: a media file's bytes, type and file name (temporary media, 3 days)."""
        holder: dict = {}

        def get(token):
            response = self.client.get(f"{self.base_url}/cgi-bin/media/get",
                                       params={"access_token": token, "media_id": media_id}, timeout=120)
            holder["response"] = response
            return response
        self._call("media/get", get, binary=True)
        response = holder["response"]
        ctype = (response.headers.get("Content-Type") or "application/octet-stream").split(";")[0].strip()
        found = re.search(r'filename="?([^";]+)"?', response.headers.get("Content-Disposition") or "")
        return response.content, ctype, found.group(1) if found else None

    def _call(self, where: str, request: Callable[[str], httpx.Response], *, binary: bool = False) -> dict:
        refreshed = False
        waited, backoff = 0.0, self.backoff_initial
        token = self.token()
        while True:
            response = request(token)
            if binary and response.status_code == 200 and (response.headers.get("Content-Disposition")
                                                           or not _is_json(response)):
                return {}  # the file (WeCom sends a file with its name; a .txt or .json is text/plain or JSON too)
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
                    raise RateLimited(where, code, f"{errmsg} (still limited after {waited:.0f} s)")
                if self._sleep(backoff):
                    raise Stopped("stopping while rate limited")
                waited += backoff
                backoff = min(backoff * 2, self.backoff_max)
                continue
            if code in APP_REFUSED:
                raise AppRefused(where, code, errmsg)
            if code in USER_UNREACHABLE:
                raise UserUnreachable(where, code, errmsg)
            raise WeComError(where, code, errmsg)

    @staticmethod
    def _json(response: httpx.Response, where: str) -> dict:
        if response.status_code != 200:
            raise WeComError(where, -1, f"HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise WeComError(where, -1, "the answer is not JSON") from None
        if not isinstance(body, dict):
            raise WeComError(where, -1, "the answer is not a JSON object")
        return body


def _is_json(response: httpx.Response) -> bool:
    ctype = (response.headers.get("Content-Type") or "").lower()
    return ctype.startswith("application/json") or ctype.startswith("text/plain")
