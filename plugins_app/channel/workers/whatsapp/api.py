"""A thin client of Meta's Graph API for the WhatsApp Business Cloud API, on httpx.

Meta publishes no Python SDK for the Cloud API; the calls the worker makes are three:
``POST /{phone-number-id}/messages`` (send), ``GET /{media-id}`` (a media's download URL) and the
download itself, plus ``GET /{phone-number-id}`` to check the token at start.

Every refusal is a ``GraphError`` carrying Graph's error object
(``{"error": {"message", "type", "code", "error_subcode", "fbtrace_id"}}``) and the HTTP status;
``classify`` says what it means for the worker: the token is dead (``auth``), the business account
or number cannot send until the operator acts in WhatsApp Manager (``account``), wait and try again
(``rate``), trying again cannot help (``permanent``), or anything else (``retry``, left to the
host's retries). ``GraphApi.send`` waits out rate limits in place (a ``Retry-After`` when Meta
gives one, else a bounded doubling backoff) and raises once the wait would exceed its bound.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

DEFAULT_BASE_URL = "https://graph.facebook.com/v21.0"

#: The token is invalid, expired or revoked (190; 102 an old-style session), or lacks the permission
#: (10, 200-299 and 131005): only the operator can fix these.
AUTH_CODES = frozenset({190, 102, 10, 131005})
#: The account or number cannot send at all until the operator acts (each answer would fail the same):
ACCOUNT_CODES = {
    133010: "register the number for the Cloud API (POST /{phone-number-id}/register, with its PIN)",
    3: "the app lacks the capability or permission for this call: check its WhatsApp product and the "
       "system user's assets",
    368: "the account is blocked for a policy violation: see Account quality in WhatsApp Manager",
    131031: "the business account is locked: see Account quality in WhatsApp Manager",
}
#: Throttling: 4 (app), 80007 (WhatsApp Business Account), 130429 (Cloud API throughput),
#: 131056 (too many messages to one recipient in a short time).
RATE_CODES = frozenset({4, 80007, 130429, 131056})
#: Sending the same request again cannot succeed.
PERMANENT_CODES = frozenset({
    100,      # invalid parameter
    131008,   # a required parameter is missing
    131009,   # a parameter value is not valid
    131021,   # the recipient is the sender
    131026,   # the message is undeliverable (not a WhatsApp user, old app, terms not accepted)
    131030,   # the recipient is not on the test number's allowed list
    131047,   # re-engagement: the 24-hour customer service window has closed, only templates may go
    131051,   # unsupported message type
    131052,   # the media could not be downloaded
    131053,   # the media could not be uploaded
    470,      # the 24-hour window, as older API versions said it
})
REENGAGEMENT = 131047
UNDELIVERABLE = 131026
#: Hosts the access token may be sent to when downloading media, besides the API base URL's own.
MEDIA_HOSTS = ("fbsbx.com", "facebook.com", "whatsapp.net", "fbcdn.net")


@dataclass
class GraphError(Exception):
    status: int
    code: int | None = None
    subcode: int | None = None
    message: str = ""
    kind: str = ""
    fbtrace_id: str | None = None
    retry_after: float | None = None

    def __str__(self) -> str:
        code = f"{self.code}" + (f"/{self.subcode}" if self.subcode else "") if self.code is not None else "-"
        return f"HTTP {self.status}, code {code}: {self.message or 'no message'}"


class RateLimited(Exception):
    """Still rate limited once the longest wait allowed was spent."""


class Stopped(Exception):
    """A wait for a rate limit was cut short because the worker is stopping."""


def classify(err: GraphError) -> str:
    """``auth``, ``account``, ``rate``, ``permanent`` or ``retry``."""
    if err.status == 401 or err.code in AUTH_CODES or (err.code is not None and 200 <= err.code <= 299):
        return "auth"
    if err.code in ACCOUNT_CODES:
        return "account"
    if err.status == 429 or err.code in RATE_CODES:
        return "rate"
    if err.code in PERMANENT_CODES:
        return "permanent"
    return "retry"


def parse_error(response: httpx.Response) -> GraphError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    retry_after = None
    header = response.headers.get("Retry-After")
    if header:
        try:
            retry_after = max(0.0, float(header))
        except ValueError:
            retry_after = None

    def _int(value: Any) -> int | None:
        try:
            return int(value)
        except (TypeError, ValueError):
            return None
    details = (error.get("error_data") or {}).get("details") if isinstance(error.get("error_data"), dict) else None
    message = str(error.get("message") or error.get("error_user_msg") or response.reason_phrase or "")
    if details and details not in message:
        message = f"{message} ({details})"
    return GraphError(status=response.status_code, code=_int(error.get("code")), subcode=_int(error.get("error_subcode")),
                      message=message, kind=str(error.get("type") or ""), fbtrace_id=error.get("fbtrace_id"),
                      retry_after=retry_after)


class GraphApi:
    """One access token's calls to one phone number's Cloud API."""

    def __init__(self, token: str, phone_number_id: str, *, base_url: str = DEFAULT_BASE_URL,
                 stopping: threading.Event | None = None, timeout: float = 30.0, max_wait_secs: float = 60.0,
                 backoff: tuple[float, float] = (1.0, 30.0), client: httpx.Client | None = None):
        self.token = token
        self.phone_number_id = phone_number_id
        self.base_url = base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.max_wait_secs = max_wait_secs
        self.backoff = backoff
        self.client = client or httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {token}"})
        self.waits: list[float] = []   # each rate-limit wait taken, for the logs and the tests

    def close(self) -> None:
        self.client.close()

    def _check(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            raise parse_error(response)
        try:
            body = response.json()
        except ValueError:
            return {}
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            raise parse_error(response)  # an error object in a 200: Graph does that for some batch calls
        return body if isinstance(body, dict) else {}

    def phone_number(self) -> dict:
        """``GET /{phone-number-id}``: the number's display form and verified name; refuses a bad token."""
        return self._check(self.client.get(f"{self.base_url}/{self.phone_number_id}",
                                           params={"fields": "display_phone_number,verified_name"}))

    def send(self, body: dict, *, on_wait=None) -> dict:
        """``POST /{phone-number-id}/messages``, waiting out rate limits; raises ``GraphError`` otherwise."""
        return self._post(f"{self.base_url}/{self.phone_number_id}/messages", on_wait=on_wait, json=body)

    def upload(self, data: bytes, content_type: str, filename: str, *, on_wait=None) -> str:
        """``POST /{phone-number-id}/media`` (multipart): the media id a message may then send."""
        answer = self._post(f"{self.base_url}/{self.phone_number_id}/media", on_wait=on_wait,
                            data={"messaging_product": "whatsapp", "type": content_type},
                            files={"file": (filename, data, content_type)})
        if not answer.get("id"):
            raise GraphError(status=200, message=f"the media upload answered no id: {answer!r}")
        return str(answer["id"])

    def _post(self, url: str, *, on_wait=None, **kwargs) -> dict:
        waited, delay = 0.0, self.backoff[0]
        while True:
            try:
                return self._check(self.client.post(url, **kwargs))
            except GraphError as err:
                if classify(err) != "rate":
                    raise
                if err.retry_after is not None:
                    wait = err.retry_after
                else:
                    wait, delay = delay, min(delay * 2, self.backoff[1])
                if waited + wait > self.max_wait_secs:
                    raise RateLimited(f"rate limited for longer than {self.max_wait_secs:.0f} s ({err})") from err
                if on_wait is not None:
                    on_wait(err, wait)
                self.waits.append(wait)
                if self.stopping.wait(wait):
                    raise Stopped(f"stopping while rate limited ({err})") from err
                waited += wait

    def media_info(self, media_id: str) -> dict:
        """``GET /{media-id}``: ``{"url", "mime_type", "sha256", "file_size", "id"}``; the URL lasts 5 minutes."""
        return self._check(self.client.get(f"{self.base_url}/{media_id}",
                                           params={"phone_number_id": self.phone_number_id}))

    def media_host_allowed(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        api_host = (urlsplit(self.base_url).hostname or "").lower()
        return host == api_host or any(host == h or host.endswith("." + h) for h in MEDIA_HOSTS)

    def download(self, media_id: str) -> tuple[bytes, str]:
        """A media's bytes and content type: its URL from ``GET /{media-id}``, then that URL with the token."""
        info = self.media_info(media_id)
        url = str(info.get("url") or "")
        if not url or not self.media_host_allowed(url):
            raise ValueError(f"media {media_id}: Meta gave a download URL on a host that is not Meta's: {url!r}")
        response = self.client.get(url, follow_redirects=False)  # a redirect could lead the token elsewhere
        if response.is_redirect:
            raise ValueError(f"media {media_id}: the download redirected to {response.headers.get('location')!r}")
        if response.status_code >= 400:
            raise parse_error(response)
        return response.content, str(info.get("mime_type") or response.headers.get("content-type") or
                                     "application/octet-stream")
