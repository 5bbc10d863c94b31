"""Salesforce's REST side, the few calls the worker makes, on httpx: the OAuth 2.0 client credentials flow
and the sObject create that publishes a platform event.

* **Token.** ``POST {login}/services/oauth2/token`` (form: ``grant_type=client_credentials``, ``client_id``,
  ``client_secret``) answers ``{"access_token", "instance_url", "token_type": "Bearer", ...}``. The login URL
  is the org's My Domain (the client credentials flow is refused on login.salesforce.com). An answer of
  ``400 {"error": "invalid_client" | "invalid_grant" | "unauthorized_client", "error_description"}`` raises
  ``ClientRefused``: only the operator can fix the connected app; any other failure (``unknown_error``, a
  login rate limit, a 5xx, the network) raises ``TokenError``, which waiting can fix. A token is kept until a
  call answers ``401 [{"errorCode": "INVALID_SESSION_ID"}]``, then fetched again once and the call made again.
* **Publish.** ``POST {instance_url}/services/data/v{version}/sobjects/{Event__e}/`` with the event's fields
  answers ``201 {"id", "success": true, "errors": [{"statusCode": "OPERATION_ENQUEUED", "message":
  <EventUuid>}]}``: the EventUuid is what ``publish`` returns. Salesforce's errors are a list,
  ``[{"message", "errorCode", "fields"}]``: 503 ``SERVER_UNAVAILABLE``, ``UNABLE_TO_LOCK_ROW``,
  ``PLATFORM_EVENT_PUBLISHING_UNAVAILABLE`` (or any 5xx, or a network error) are waited out in place (1 s
  doubling to 30 s, a ``Retry-After`` honoured) up to ``max_wait_secs``, then ``RateLimited``; anything else
  is ``SalesforceError`` with the status, so the caller tells a field or validation error (400: sending again
  cannot help) from the rest, and ``LIMIT_EXCEEDED``/``REQUEST_LIMIT_EXCEEDED`` (the hourly publishing
  allocation, the org's daily API requests: worth the hub's retries, not a wait in place) from both. A 2xx answer with
  ``success: false`` is read by its error codes the same way (a busy code waited out, any other a 400).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import httpx

DEFAULT_LOGIN_URL = "https://login.salesforce.com"
DEFAULT_API_VERSION = "62.0"

#: The token endpoint's errors that name the connected app or its run-as user: waiting cannot fix them.
CLIENT_ERRORS = ("invalid_client", "invalid_client_id", "invalid_grant", "unauthorized_client",
                 "unsupported_grant_type", "inactive_user", "inactive_org")
#: REST error codes that are Salesforce saying "later", not "no".
BUSY_CODES = ("SERVER_UNAVAILABLE", "UNABLE_TO_LOCK_ROW", "PLATFORM_EVENT_PUBLISHING_UNAVAILABLE")
#: REST error codes worth the hub's retries but not a wait in place: the hourly publishing allocation and the
#: org's API requests over 24 hours (TotalRequests), which a wait of two minutes does not bring back.
LATER_CODES = ("LIMIT_EXCEEDED", "REQUEST_LIMIT_EXCEEDED")


class SalesforceError(Exception):
    """Salesforce refused a call: the HTTP ``status``, the first ``errorCode`` and the messages."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}" if code else f"{status} {message}")
        self.status, self.code, self.message = status, code, message


class ClientRefused(SalesforceError):
    """The token endpoint refused the connected app (its consumer key or secret, its run-as user, the flow)."""


class TokenError(SalesforceError):
    """The token endpoint failed for any other reason (``unknown_error`` "retry your request", a login rate
    limit, a 5xx, the network, an answer without a token): waiting can fix it, so it is retryable."""


class RateLimited(SalesforceError):
    """Still busy or unavailable after the longest wait in place."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


@dataclass
class Token:
    access_token: str
    instance_url: str


def rest_errors(response: httpx.Response) -> tuple[str, str]:
    """(first errorCode, the messages as one line) of Salesforce's REST error list."""
    try:
        body = response.json()
    except ValueError:
        return "", (response.text or response.reason_phrase or "").strip()[:300]
    if isinstance(body, dict):  # a publish answered 201 with success false, or an odd proxy
        body = body.get("errors") or [body]
    items = [e for e in body if isinstance(e, dict)] if isinstance(body, list) else []
    if not items:
        return "", str(body)[:300]
    code = str(items[0].get("errorCode") or items[0].get("statusCode") or "")
    parts = []
    for e in items:
        text = str(e.get("message") or "")
        fields = e.get("fields") or []
        parts.append(f"{text} ({', '.join(map(str, fields))})" if fields else text)
    return code, "; ".join(parts)[:500]


def published_id(body) -> str:
    """What names a published event: its ``EventUuid``, which Salesforce gives in the create's answer as an
    ``OPERATION_ENQUEUED`` "error" (``{"statusCode": "OPERATION_ENQUEUED", "message": <EventUuid>}``) and
    which subscribers see in ``data.event``; else the answer's ``id``."""
    if not isinstance(body, dict):
        return ""
    for e in body.get("errors") or []:
        if isinstance(e, dict) and e.get("statusCode") == "OPERATION_ENQUEUED" and e.get("message"):
            return str(e["message"])
    return str(body.get("id") or "")


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class SalesforceApi:
    """The token (shared by the listener's CometD client and the sender) and the publish call."""

    def __init__(self, client_id: str, client_secret: str, *, login_url: str = DEFAULT_LOGIN_URL,
                 api_version: str = DEFAULT_API_VERSION, stopping: threading.Event | None = None,
                 backoff_initial: float = 1.0, backoff_max: float = 30.0, max_wait_secs: float = 120.0,
                 timeout: float = 30.0, sleep: Callable[[float], bool] | None = None):
        self.client_id, self.client_secret = client_id, client_secret
        self.login_url = login_url.rstrip("/")
        self.api_version = api_version
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        self._sleep = sleep or self.stopping.wait  # returns True when stopping
        self.client = httpx.Client(timeout=timeout)
        self._lock = threading.Lock()
        self._token: Token | None = None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ the token

    def token(self, *, stale: str | None = None) -> Token:
        """The access token, fetched when there is none or when ``stale`` (the token a call was refused
        with) is still the one kept; another thread that already fetched a new one is not repeated."""
        with self._lock:
            if self._token is None or (stale is not None and self._token.access_token == stale):
                self._token = self._fetch_token()
            return self._token

    def _fetch_token(self) -> Token:
        """A new token; raises ClientRefused (only the operator can help) or TokenError (anything else)."""
        try:
            response = self.client.post(f"{self.login_url}/services/oauth2/token", data={
                "grant_type": "client_credentials", "client_id": self.client_id, "client_secret": self.client_secret})
        except httpx.TransportError as exc:
            raise TokenError(0, "", f"{type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code == 200:
            if isinstance(body, dict) and body.get("access_token") and body.get("instance_url"):
                return Token(str(body["access_token"]), str(body["instance_url"]).rstrip("/"))
            raise TokenError(200, "", "the token answer has no access_token or instance_url")
        error = str((body or {}).get("error") or "") if isinstance(body, dict) else ""
        description = str((body or {}).get("error_description") or "") if isinstance(body, dict) else ""
        if response.status_code in (400, 401) and error in CLIENT_ERRORS:
            raise ClientRefused(response.status_code, error, description)
        raise TokenError(response.status_code, error, description or response.text[:300])

    # ------------------------------------------------------------------ REST

    def sobjects_url(self, token: Token, sobject: str) -> str:
        return f"{token.instance_url}/services/data/v{self.api_version}/sobjects/{sobject}/"

    def publish(self, event: str, fields: dict) -> str:
        """Publish one platform event (``POST .../sobjects/<event>/``); returns its EventUuid (else its id). A
        stale token is fetched again once; busy answers are waited out; raises SalesforceError for any other
        refusal."""
        waited, backoff, refreshed = 0.0, self.backoff_initial, False
        token = self.token()
        while True:
            try:
                response = self.client.post(self.sobjects_url(token, event), json=fields,
                                            headers={"Authorization": f"Bearer {token.access_token}"})
            except httpx.TransportError as exc:
                response, code, message = None, "", f"{type(exc).__name__}: {exc}"
            else:
                code, message = rest_errors(response)
                if response.status_code in (200, 201):
                    body = response.json()
                    if not isinstance(body, dict) or body.get("success") is not False:
                        return published_id(body)
                    # taken, but not published: its error codes say "later" or "no" as an error status's would
                    if code not in BUSY_CODES:
                        raise SalesforceError(400, code, message)
                elif response.status_code == 401 and not refreshed:
                    refreshed = True
                    token = self.token(stale=token.access_token)
                    continue
                elif not (response.status_code >= 500 or code in BUSY_CODES or response.status_code == 429):
                    raise SalesforceError(response.status_code, code, message)
            wait = retry_after(response) if response is not None else None
            wait = backoff if wait is None else wait
            if waited + wait > self.max_wait_secs:
                status = response.status_code if response is not None else 0
                raise RateLimited(status, code, f"{message} (still refused after {waited:.0f} s)")
            if self._sleep(wait):
                raise Stopped("stopping while Salesforce was busy")
            waited += wait
            backoff = min(backoff * 2, self.backoff_max)
