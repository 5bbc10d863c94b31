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

import httpx

from plugins_app.channel.sdk.tencent import (ApiError, AppRefused, RateLimited, Stopped, TencentApi,
                                             UserUnreachable, errcode_of)
from ugent_common.digits import ascii_int

__all__ = ["DEFAULT_API_BASE_URL", "RATE_LIMITED", "SYSTEM_BUSY", "TASK_ID_EXISTS",
           "TEXT_LIMIT_BYTES", "TOKEN_STALE", "AppRefused", "RateLimited", "Stopped", "UserUnreachable", "WeComApi",
           "WeComError", "errcode_of"]

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

#: WeCom's limit for one text message, in bytes of UTF-8 (longer text is cut off by WeCom).
TEXT_LIMIT_BYTES = 2048
#: WeCom's duplicate check: the same content to the same user within this many seconds is not sent again.
DUPLICATE_CHECK_SECS = 1800


#: WeCom's errors are the SDK's (``sdk/tencent.py``): AppRefused (the corp id, the secret or the server's IP),
#: UserUnreachable (81013/60111: no such user, or not in the app's visible range), RateLimited (45009/45033
#: for longer than the call waits in place).
WeComError = ApiError


class WeComApi(TencentApi):
    token_stale = frozenset(TOKEN_STALE)
    rate_limited = frozenset(RATE_LIMITED)
    app_refused = frozenset(APP_REFUSED)
    user_unreachable = frozenset(USER_UNREACHABLE)
    still_limited = "still limited after {waited:.0f} s"
    stopped_waiting = "stopping while rate limited"

    def __init__(self, corp_id: str, secret: str, agent_id: str, *, base_url: str = DEFAULT_API_BASE_URL, **options):
        """``options``: the call loop's (``stopping``, ``max_wait_secs``, ``backoff_*``, ``timeout``, ``clock``,
        ``sleep``), as ``TencentApi`` takes them."""
        super().__init__(base_url=base_url, **options)
        self.corp_id, self.secret, self.agent_id = corp_id, secret, agent_id

    def _fetch_token(self, stale: str | None) -> tuple[str, float]:
        """``GET /cgi-bin/gettoken`` with the corp id and the app's secret."""
        response = self.client.get(f"{self.base_url}/cgi-bin/gettoken",
                                   params={"corpid": self.corp_id, "corpsecret": self.secret})
        return self._keep_token(self._json(response, "gettoken"), "gettoken", GETTOKEN_REFUSED)

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
        body = {"touser": user, "msgtype": msgtype, "agentid": self._agentid(), msgtype: content,
                "enable_duplicate_check": 1, "duplicate_check_interval": DUPLICATE_CHECK_SECS}
        answer = self._call("message/send", lambda token: self.client.post(
            f"{self.base_url}/cgi-bin/message/send", params={"access_token": token}, json=body))
        invalid = {u.lower() for u in str(answer.get("invaliduser") or "").split("|") if u}
        if user.lower() in invalid:
            raise UserUnreachable("message/send", 81013, f"invaliduser: {answer.get('invaliduser')}")
        return answer

    def update_card_button(self, user: str, response_code: str, replace_name: str) -> dict:
        """``POST /cgi-bin/message/update_template_card``: the buttons of the card ``user`` pressed become one
        that cannot be pressed, saying ``replace_name``. ``response_code`` is the press's (its callback's
        ``ResponseCode``): WeCom takes each one once, within 72 hours."""
        body = {"userids": [user], "agentid": self._agentid(), "response_code": response_code,
                "button": {"replace_name": replace_name}}
        answer = self._call("message/update_template_card", lambda token: self.client.post(
            f"{self.base_url}/cgi-bin/message/update_template_card", params={"access_token": token}, json=body))
        invalid = answer.get("invaliduser") or []
        invalid = invalid.split("|") if isinstance(invalid, str) else invalid
        if user.lower() in {str(u).lower() for u in invalid}:
            raise UserUnreachable("message/update_template_card", 81013, f"invaliduser: {invalid}")
        return answer

    def _agentid(self):
        number = ascii_int(str(self.agent_id))
        return self.agent_id if number is None else number

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
        response, _ = self._media(media_id)
        return self.file_of(response)

    def _body(self, response: httpx.Response, where: str, binary: bool) -> dict | None:
        if binary and response.status_code == 200 and (response.headers.get("Content-Disposition")
                                                       or not _is_json(response)):
            return None  # the file (WeCom sends a file with its name; a .txt or .json is text/plain or JSON too)
        return self._json(response, where)


def _is_json(response: httpx.Response) -> bool:
    ctype = (response.headers.get("Content-Type") or "").lower()
    return ctype.startswith("application/json") or ctype.startswith("text/plain")
