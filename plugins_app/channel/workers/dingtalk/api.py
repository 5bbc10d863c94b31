"""DingTalk's OpenAPI (``api.dingtalk.com``) for an internal app's robot: the access token, sending, downloads.

Every call but the token carries ``x-acs-dingtalk-access-token``. Errors are an HTTP status with DingTalk's
JSON ``{"code": "...", "message": "...", "requestid": "..."}``:

* at ``POST /v1.0/oauth2/accessToken``, a 4xx other than a throttle (``invalidClientIdOrSecret``, ...):
  ``AppRefused``: the app key or secret is wrong, which only the operator can fix;
* ``InvalidAuthentication`` at a call (the token stale or revoked; api.dingtalk.com answers it HTTP 400
  ``{"code": "InvalidAuthentication", "message": "不合法的access_token"}``), or any 401: a new token is
  fetched at once and the call made once more; a second one in a row is ``AppRefused``;
* 403 ``Forbidden.AccessDenied.AccessTokenPermissionDenied`` (the app lacks the robot permission) and any
  code naming the robot code (``invalidParameter.robotCode.*``): ``AppRefused``; except at
  ``groupMessages/send``, where ``robotCode.notExsit``, ``robotCode.empty`` and ``robotCode.coolApp`` are
  about that one group (DingTalk: "机器人不存在 / 请检查机器人是否在群内", the robot is not, or no longer,
  in it): ``RobotNotInGroup``, a failure of that message only;
* any other ``Forbidden.AccessDenied.*`` that is not a throttle (``…IpNotInWhiteList``: the app's IP
  whitelist leaves this host out; ``…AccessTokenPermissionDenied``...), at any status: ``AppRefused``;
* throttling, HTTP 429 or a code naming it (``Throttling...``, ``...QpsLimit...``), and any 5xx: waited out
  in place, 1 s doubling to 30 s, up to ``max_wait_secs``; then ``RateLimited``/``Unavailable``;
* any other 4xx: ``DingTalkError`` (a per-message error: sending again cannot help).

``batchSend`` answers 200 even for a user it did not reach: ``invalidStaffIdList`` names a user id that
is no one the robot can write to (``UserUnreachable``), ``flowControlledStaffIdList`` one the flow control
held back (waited out like a throttle).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable

import httpx

from plugins_app.channel.sdk.token import TokenCache
from ugent_common.digits import ascii_int

DEFAULT_API_BASE_URL = "https://api.dingtalk.com"
#: Where a message's ``sessionWebhook`` points: the worker posts to no other host with it.
DEFAULT_OAPI_BASE_URL = "https://oapi.dingtalk.com"
#: A session webhook's errcode for sending too fast (the robot's 20 messages a minute): waited out.
SESSION_THROTTLED = {130101}
#: DingTalk's global errcode -1, 系统繁忙 (the system is busy: "try again"): waited out like a 5xx.
SESSION_BUSY = {-1}
#: The old OAPI's errcodes (oapi.dingtalk.com, answered HTTP 200) of a token it does not take: fetched again once.
OAPI_TOKEN_STALE = {40014, 42001}
#: The old OAPI's throttles (the app's or the organisation's calls a second): waited out.
OAPI_THROTTLED = {90002, 90018, 130101}
#: The old OAPI's refusal of the app, not of the file: this host not in the IP whitelist (60020), which stops
#: every call; the operator must fix it. (60011, no permission for media/upload, or an HTTP 403, refuses files
#: only: text still goes out, so each file becomes a note naming the permission.)
OAPI_APP_REFUSED = {60020}
TOKEN_HEADER = "x-acs-dingtalk-access-token"

#: The largest received file a download reads: past it the download is given up (``TooLarge``), never held whole.
MAX_DOWNLOAD_BYTES = 20 * 1024 * 1024
#: DingTalk's code for a token it does not take (stale, revoked), answered HTTP 400 by api.dingtalk.com.
INVALID_TOKEN_CODE = "InvalidAuthentication"
#: Codes DingTalk uses for a throttled call (besides HTTP 429), matched case-insensitively as substrings.
THROTTLE_MARKS = ("throttling", "qpslimit", "flowcontrol", "ratelimit")
GROUP_SEND_PATH = "/v1.0/robot/groupMessages/send"
#: Robot-code errors of a group send that are about that group, not the app: the robot is not in it (removed,
#: the group disbanded...). DingTalk's table for groupMessages/send: "机器人robotCode无效，请检查机器人是否在群内".
GROUP_ROBOT_CODES = frozenset({"invalidparameter.robotcode.notexsit", "invalidparameter.robotcode.empty",
                               "invalidparameter.robotcode.coolapp"})
#: A refusal of the app's settings (its IP whitelist, its permissions), whatever the call; checked after throttling,
#: so ``Forbidden.AccessDenied.QpsLimitForApi`` stays a throttle.
ACCESS_DENIED_PREFIX = "forbidden.accessdenied"
#: A 403 that is the app's permissions, not the message.
PERMISSION_DENIED_MARKS = ("accesstokenpermissiondenied", "permissiondenied")


class DingTalkError(Exception):
    """DingTalk refused a call: ``status`` (HTTP), ``code`` and ``message`` (DingTalk's)."""

    def __init__(self, where: str, status: int, code: str, message: str):
        super().__init__(f"{where}: HTTP {status} {code}: {message}")
        self.where, self.status, self.code, self.message = where, status, code, message


class AppRefused(DingTalkError):
    """The app key or secret, the robot code or the app's permissions are refused: the operator must fix them."""


class UserUnreachable(DingTalkError):
    """``invalidStaffIdList`` named the user: no one the robot can write to."""


class RobotNotInGroup(DingTalkError):
    """A group send refused with a robot-code error that names the group: the robot is not (or no longer) in it."""


class TooLarge(DingTalkError):
    """A received file over the download's bound: not read past it."""


class UploadRefused(DingTalkError):
    """``media/upload`` refused the file itself (its type, its size...): an ``errcode`` that is no token, throttle
    or permission matter. Sending it again cannot help."""


class RateLimited(DingTalkError):
    """Throttled for longer than a call waits in place."""


class Unavailable(DingTalkError):
    """5xx for longer than a call waits in place."""


class SessionRefused(DingTalkError):
    """A session webhook answered a non-zero errcode (expired, or the message refused): not worth sending again."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


def error_of(response: httpx.Response) -> tuple[str, str]:
    """(code, message) of DingTalk's error body; the status's phrase when there is none."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return str(body.get("code") or ""), str(body.get("message") or "")
    return "", response.reason_phrase or ""


def throttled(status: int, code: str) -> bool:
    lowered = code.lower()
    return status == 429 or any(mark in lowered for mark in THROTTLE_MARKS)


class DingTalkApi:
    def __init__(self, app_key: str, app_secret: str, robot_code: str, *, base_url: str = DEFAULT_API_BASE_URL,
                 oapi_base_url: str = DEFAULT_OAPI_BASE_URL, stopping: threading.Event | None = None, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 max_wait_secs: float = 120.0, timeout: float = 30.0, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], bool] | None = None):
        self.app_key, self.app_secret, self.robot_code = app_key, app_secret, robot_code
        self.base_url = base_url.rstrip("/")
        self.oapi_base_url = oapi_base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        #: Wall-clock: the token's lifetime runs on DingTalk's side while this host is suspended, which a
        #: monotonic clock does not count.
        self._clock = clock or time.time
        self._sleep = sleep or self.stopping.wait   # returns True when stopping
        self.client = httpx.Client(timeout=timeout)
        self._tokens = TokenCache(self._fetch_token, clock=self._clock)

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ the access token

    def token(self, *, fresh: bool = False, stale: str | None = None) -> str:
        """The app's access token, fetched when there is none, it is near its expiry, or ``fresh`` (DingTalk
        refused ``stale``: a token another thread already replaced is kept)."""
        return self._tokens.get(fresh=fresh, stale=stale)

    def _fetch_token(self, stale: str | None) -> tuple[str, float]:
        where = "POST /v1.0/oauth2/accessToken"
        waited, backoff = 0.0, self.backoff_initial
        while True:
            response = self.client.post(f"{self.base_url}/v1.0/oauth2/accessToken",
                                        json={"appKey": self.app_key, "appSecret": self.app_secret})
            if response.status_code == 200:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                if not isinstance(body, dict) or not body.get("accessToken"):
                    raise DingTalkError(where, 200, "", "the answer carries no accessToken")
                return str(body["accessToken"]), float(body.get("expireIn") or 7200)
            code, message = error_of(response)
            if throttled(response.status_code, code) or response.status_code >= 500:
                waited, backoff = self._wait(where, response.status_code, code, message, waited, backoff)
                continue
            if 400 <= response.status_code < 500:
                raise AppRefused(where, response.status_code, code, message)
            raise DingTalkError(where, response.status_code, code, message)

    # ------------------------------------------------------------------ calls

    def send_to_user(self, user_id: str, msg_key: str, msg_param: dict) -> str:
        """``POST /v1.0/robot/oToMessages/batchSend`` to one user; returns the ``processQueryKey``."""
        where = "POST /v1.0/robot/oToMessages/batchSend"
        body = {"robotCode": self.robot_code, "userIds": [user_id], "msgKey": msg_key,
                "msgParam": json.dumps(msg_param, ensure_ascii=False)}
        waited, backoff = 0.0, self.backoff_initial
        while True:
            answer = self._call(where, "/v1.0/robot/oToMessages/batchSend", body)
            if user_id in (answer.get("invalidStaffIdList") or []):
                raise UserUnreachable(where, 200, "invalidStaffIdList", f"{user_id} is in invalidStaffIdList")
            if user_id in (answer.get("flowControlledStaffIdList") or []):
                waited, backoff = self._wait(where, 200, "flowControlledStaffIdList", f"{user_id} is flow "
                                             "controlled", waited, backoff)
                continue
            return str(answer.get("processQueryKey") or "")

    def send_to_group(self, open_conversation_id: str, msg_key: str, msg_param: dict) -> str:
        """``POST /v1.0/robot/groupMessages/send``; returns the ``processQueryKey``."""
        body = {"robotCode": self.robot_code, "openConversationId": open_conversation_id, "msgKey": msg_key,
                "msgParam": json.dumps(msg_param, ensure_ascii=False)}
        answer = self._call(f"POST {GROUP_SEND_PATH}", GROUP_SEND_PATH, body)
        return str(answer.get("processQueryKey") or "")

    def send_by_session(self, url: str, param: dict) -> None:
        """POST a markdown message (``{"title", "text"}``) to a message's ``sessionWebhook``: no token, answered
        ``{"errcode": 0, "errmsg": "ok"}``, and only that JSON body is a message sent. Throttling (429, errcode
        130101), errcode -1 (系统繁忙) and 5xx are waited out; another errcode (the session expired, the message
        refused) raises ``SessionRefused``; an answer that is not DingTalk's JSON (a proxy's page...) raises
        ``DingTalkError`` with its status: nothing says the message went out."""
        where = "POST sessionWebhook"
        waited, backoff = 0.0, self.backoff_initial
        while True:
            response = self.client.post(url, json={"msgtype": "markdown", "markdown": param})
            status = response.status_code
            if status == 429 or status >= 500:
                code, message = error_of(response)
                waited, backoff = self._wait(where, status, code, message, waited, backoff)
                continue
            try:
                answer = response.json()
            except ValueError:
                answer = None
            errcode = answer.get("errcode") if isinstance(answer, dict) else None
            try:
                errcode = None if isinstance(errcode, bool) else int(errcode)
            except (TypeError, ValueError):
                errcode = None
            if errcode is None:
                raise DingTalkError(where, status, "", "the answer carries no errcode (not DingTalk's JSON): "
                                    f"{response.text[:60]!r}")
            errmsg = str(answer.get("errmsg") or answer.get("message") or response.reason_phrase or "")
            if status == 200 and errcode == 0:
                return
            if errcode in SESSION_THROTTLED:
                waited, backoff = self._wait(where, 429, str(errcode), errmsg, waited, backoff)
                continue
            if errcode in SESSION_BUSY:
                waited, backoff = self._wait(where, 503, str(errcode), errmsg, waited, backoff)
                continue
            raise SessionRefused(where, status, str(errcode), errmsg)

    def upload(self, data: bytes, media_type: str, filename: str, content_type: str) -> str:
        """``POST {oapi}/media/upload?access_token=…&type=image|voice|video|file``, the file as the multipart
        field ``media``; returns its ``media_id``, which the robot's ``sampleImageMsg`` (``photoURL``),
        ``sampleFile`` and ``sampleAudio`` (``mediaId``) take. The old OAPI answers HTTP 200 with ``errcode``:
        a stale token (40014, 42001) is fetched again once; -1 (busy), a throttle and 5xx are waited out; 60020
        (this host not in the IP whitelist) is the app's refusal (``AppRefused``); any other errcode, 60011 (no
        permission to upload) and an HTTP 403 included, is the file refused (``UploadRefused``: a note)."""
        where = "POST /media/upload"
        refreshed = False
        waited, backoff = 0.0, self.backoff_initial
        token = self.token()
        while True:
            response = self.client.post(f"{self.oapi_base_url}/media/upload",
                                        params={"access_token": token, "type": media_type},
                                        files={"media": (filename, data, content_type)}, timeout=120)
            status = response.status_code
            if status == 429 or status >= 500:
                code, message = error_of(response)
                waited, backoff = self._wait(where, status, code, message, waited, backoff)
                continue
            try:
                answer = response.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise DingTalkError(where, status, "", f"the answer is not DingTalk's JSON: {response.text[:60]!r}")
            try:
                errcode = int(answer.get("errcode") or 0)
            except (TypeError, ValueError):
                errcode = -2
            errmsg = str(answer.get("errmsg") or "")
            if status == 200 and errcode == 0:
                if not answer.get("media_id"):
                    raise DingTalkError(where, status, "", "the answer carries no media_id")
                return str(answer["media_id"])
            if errcode in OAPI_TOKEN_STALE or status == 401:
                if not refreshed:
                    refreshed = True
                    token = self.token(fresh=True, stale=token)
                    continue
                raise AppRefused(where, status, str(errcode), errmsg)
            if errcode in OAPI_THROTTLED:
                waited, backoff = self._wait(where, 429, str(errcode), errmsg, waited, backoff)
                continue
            if errcode in SESSION_BUSY:
                waited, backoff = self._wait(where, 503, str(errcode), errmsg, waited, backoff)
                continue
            if errcode in OAPI_APP_REFUSED:
                raise AppRefused(where, status, str(errcode), errmsg)
            if errcode == 60011 or status == 403:
                raise UploadRefused(where, status, str(errcode), f"{errmsg}: the app may not upload files (grant "
                                    "it the media upload permission in the developer console)")
            raise UploadRefused(where, status, str(errcode), errmsg)

    def download_url(self, download_code: str) -> str:
        """``POST /v1.0/robot/messageFiles/download``: where a received file can be fetched (for a while)."""
        answer = self._call("POST /v1.0/robot/messageFiles/download", "/v1.0/robot/messageFiles/download",
                            {"downloadCode": download_code, "robotCode": self.robot_code})
        url = answer.get("downloadUrl")
        if not url:
            raise DingTalkError("POST /v1.0/robot/messageFiles/download", 200, "", "the answer has no downloadUrl")
        return str(url)

    def download(self, download_code: str, max_bytes: int = MAX_DOWNLOAD_BYTES) -> tuple[bytes, str]:
        """A received file's bytes and type: its download URL asked for, then fetched (no token: the URL is
        signed), streamed and given up past ``max_bytes`` (``TooLarge``: by its Content-Length, or as it is
        read). A 5xx of the file's host is tried again within the wait bound."""
        url = self.download_url(download_code)
        where = f"GET {url.split('?')[0]}"  # the signature in the query is not for logs
        waited, backoff = 0.0, self.backoff_initial
        while True:
            with self.client.stream("GET", url, timeout=120) as response:
                status, reason = response.status_code, response.reason_phrase
                if status == 200:
                    ctype = (response.headers.get("Content-Type") or "application/octet-stream").split(";")[0].strip()
                    declared = ascii_int(response.headers.get("Content-Length"))
                    if declared is not None and declared > max_bytes:
                        raise TooLarge(where, status, "", f"the file is {declared} bytes, over {max_bytes}")
                    chunks, size = [], 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > max_bytes:
                            raise TooLarge(where, status, "", f"the file is over {max_bytes} bytes")
                        chunks.append(chunk)
                    return b"".join(chunks), ctype
            if status < 500:
                raise DingTalkError(where, status, "", reason)
            waited, backoff = self._wait("GET downloadUrl", status, "", reason, waited, backoff)

    def _call(self, where: str, path: str, body: dict) -> dict:
        refreshed = False
        waited, backoff = 0.0, self.backoff_initial
        token = self.token()
        while True:
            response = self.client.post(f"{self.base_url}{path}", json=body, headers={TOKEN_HEADER: token})
            status = response.status_code
            if status == 200:
                try:
                    answer = response.json()
                except ValueError:
                    answer = None
                return answer if isinstance(answer, dict) else {}
            code, message = error_of(response)
            if throttled(status, code) or status >= 500:
                waited, backoff = self._wait(where, status, code, message, waited, backoff)
                continue
            if status == 401 or code == INVALID_TOKEN_CODE:
                if not refreshed:
                    refreshed = True
                    token = self.token(fresh=True, stale=token)
                    continue
                raise AppRefused(where, status, code, message)
            lowered = code.lower()
            if path == GROUP_SEND_PATH and lowered in GROUP_ROBOT_CODES:
                raise RobotNotInGroup(where, status, code, message)
            if ((status == 403 and any(mark in lowered for mark in PERMISSION_DENIED_MARKS))
                    or lowered.startswith(ACCESS_DENIED_PREFIX) or "robotcode" in lowered):
                raise AppRefused(where, status, code, message)
            raise DingTalkError(where, status, code, message)

    def _wait(self, where: str, status: int, code: str, message: str, waited: float,
              backoff: float) -> tuple[float, float]:
        """Sleep ``backoff`` unless that passes the bound (then raise); returns (waited, next backoff)."""
        if waited + backoff > self.max_wait_secs:
            kind = Unavailable if status >= 500 else RateLimited
            raise kind(where, status, code, f"{message} (still refused after {waited:.0f} s)")
        if self._sleep(backoff):
            raise Stopped("stopping while waiting out a throttle or an outage")
        return waited + backoff, min(backoff * 2, self.backoff_max)
