"""LINE's Messaging API, the few calls the worker makes, on httpx.

``LineApi.push`` sends one push request (at most five message objects) with its
``X-Line-Retry-Key``; LINE runs a request with a given key once and answers any later one with
409, which is taken as delivered. A 429 is waited out in place with a bounded backoff (LINE sends
no ``Retry-After``; one that is there is honoured), except the monthly message quota, which no
wait fixes. A 401 raises ``TokenRefused``: the channel access token is wrong or was revoked.
``LineApi.content`` waits (bounded) for LINE to prepare a large video or audio (202, polled on the
transcoding endpoint) and tries a 5xx or a network error again a few times.

Errors are LINE's JSON: ``{"message": "...", "details": [{"message": "...", "property": "..."}]}``.
"""
from __future__ import annotations

import hashlib
import json
import threading
import uuid
from typing import Callable

import httpx

DEFAULT_API_BASE_URL = "https://api.line.me"
DEFAULT_DATA_API_BASE_URL = "https://api-data.line.me"

#: The namespace of the retry keys: a delivery's push ``n`` always carries the same key.
RETRY_KEY_NAMESPACE = uuid.UUID("6f1c1f0e-5a57-4b8e-9d3e-4c494e450001")
#: LINE's answer to a 429 that is the month's quota, not the rate: waiting seconds does not help.
MONTHLY_LIMIT = "monthly limit"


class LineError(Exception):
    """LINE refused a call: ``status`` and LINE's ``message`` (with its details)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message


class TokenRefused(LineError):
    """401: the channel access token is wrong, expired or revoked."""


class RateLimited(LineError):
    """429 for longer than the worker waits in place (or the monthly quota)."""


class Stopped(Exception):
    """A wait was cut short because the worker is stopping."""


def messages_digest(messages: list[dict]) -> str:
    """SHA-256 of a push's message objects (canonical JSON): what the request carries."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def retry_key(delivery_id: str, push: int, messages: list[dict]) -> str:
    """The ``X-Line-Retry-Key`` of a delivery's ``push``-th request: the same after any restart.

    The digest of the push's messages is part of the UUIDv5's input: LINE requires a retried request to
    be identical to the first, so a push whose messages differ (another split of the answer) must never
    carry an old key, which LINE would answer 409 without sending it."""
    return str(uuid.uuid5(RETRY_KEY_NAMESPACE, f"{delivery_id}/{push}/{messages_digest(messages)}"))


def error_message(response: httpx.Response) -> str:
    """LINE's error body as one line: ``message`` and each detail's ``property: message``."""
    try:
        body = response.json()
    except ValueError:
        return (response.text or response.reason_phrase or "").strip()[:300]
    if not isinstance(body, dict):
        return str(body)[:300]
    text = str(body.get("message") or response.reason_phrase or "")
    details = [f"{d.get('property')}: {d.get('message')}" if d.get("property") else str(d.get("message"))
               for d in body.get("details") or [] if isinstance(d, dict)]
    return f"{text} ({'; '.join(details)})" if details else text


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class LineApi:
    def __init__(self, token: str, *, base_url: str = DEFAULT_API_BASE_URL,
                 data_base_url: str = DEFAULT_DATA_API_BASE_URL, stopping: threading.Event | None = None,
                 backoff_initial: float = 1.0, backoff_max: float = 30.0, max_wait_secs: float = 120.0,
                 timeout: float = 30.0, sleep: Callable[[float], bool] | None = None,
                 content_wait_secs: float = 60.0, content_poll_secs: float = 1.0, content_tries: int = 4,
                 content_backoff: float = 1.0):
        self.base_url = base_url.rstrip("/")
        self.data_base_url = data_base_url.rstrip("/")
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max, self.max_wait_secs = backoff_initial, backoff_max, max_wait_secs
        self._sleep = sleep or self.stopping.wait   # returns True when stopping
        # a content download: how long LINE may take to prepare a video or audio (202), how often its state
        # is polled, and how many times a 5xx or network error is tried in all (backing off, doubling)
        self.content_wait_secs, self.content_poll_secs = content_wait_secs, content_poll_secs
        self.content_tries, self.content_backoff = content_tries, content_backoff
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def bot_info(self) -> dict:
        """``GET /v2/bot/info``: who the token belongs to (raises TokenRefused for a bad token)."""
        response = self.client.get(f"{self.base_url}/v2/bot/info")
        if response.status_code != 200:
            raise self._error(response)
        return response.json()

    def push(self, to: str, messages: list[dict], key: str) -> tuple[list[dict], bool]:
        """``POST /v2/bot/message/push``; returns (LINE's ``sentMessages``, whether the key was already
        accepted, i.e. a 409). Waits out rate limits; raises LineError for any other refusal."""
        body = {"to": to, "messages": messages}
        waited, backoff = 0.0, self.backoff_initial
        while True:
            response = self.client.post(f"{self.base_url}/v2/bot/message/push", json=body,
                                        headers={"X-Line-Retry-Key": key})
            if response.status_code == 200:
                return list((response.json() or {}).get("sentMessages") or []), False
            if response.status_code == 409:
                # The key was accepted before (a push that went out before a crash or a lost answer).
                try:
                    sent = (response.json() or {}).get("sentMessages") or []
                except ValueError:
                    sent = []
                return list(sent), True
            if response.status_code != 429:
                raise self._error(response)
            message = error_message(response)
            if MONTHLY_LIMIT in message.lower():
                raise RateLimited(429, message)
            wait = retry_after(response)
            wait = backoff if wait is None else wait
            if waited + wait > self.max_wait_secs:
                raise RateLimited(429, f"{message} (still limited after {waited:.0f} s)")
            if self._sleep(wait):
                raise Stopped("stopping while rate limited")
            waited += wait
            backoff = min(backoff * 2, self.backoff_max)

    def content(self, message_id: str) -> tuple[bytes, str]:
        """``GET /v2/bot/message/{id}/content`` on the data API: the bytes and their type.

        A 202 means LINE is still preparing a large video or audio: its state is polled on
        ``GET /v2/bot/message/{id}/content/transcoding`` (``processing``, ``succeeded``, ``failed``) for up
        to ``content_wait_secs`` in all, then the content is asked again. A 5xx or a network error is
        tried again ``content_tries`` times in all, backing off from ``content_backoff`` seconds; a 401
        raises TokenRefused, any other refusal LineError at once."""
        url = f"{self.data_base_url}/v2/bot/message/{message_id}/content"
        failures, backoff, waited, prepared = 0, self.content_backoff, 0.0, False
        while True:
            try:
                response = self.client.get(url, timeout=120)
            except httpx.HTTPError:
                failures += 1
                if failures >= self.content_tries:
                    raise
            else:
                if response.status_code == 200:
                    return response.content, response.headers.get("Content-Type") or "application/octet-stream"
                if response.status_code == 202:
                    if prepared:  # LINE said succeeded, yet answers 202 again: waited for like processing
                        if waited >= self.content_wait_secs:
                            raise LineError(202, f"content of message {message_id} still not ready after "
                                                 f"{waited:.0f} s")
                        if self._sleep(self.content_poll_secs):
                            raise Stopped("stopping while the content was being prepared")
                        waited += self.content_poll_secs
                    waited, prepared = self._await_transcoding(message_id, waited), True
                    continue
                if response.status_code < 500:
                    raise self._error(response)
                failures += 1
                if failures >= self.content_tries:
                    raise self._error(response)
            if self._sleep(backoff):
                raise Stopped("stopping while the content download was retried")
            backoff = min(backoff * 2, self.backoff_max)

    def _await_transcoding(self, message_id: str, waited: float) -> float:
        """Poll LINE's preparation of a message's content until it says ``succeeded``; returns the seconds
        waited so far (the bound is over the whole download). Raises LineError when LINE says ``failed``
        or the content is still not ready after ``content_wait_secs``."""
        url = f"{self.data_base_url}/v2/bot/message/{message_id}/content/transcoding"
        while True:
            status = None
            try:
                response = self.client.get(url)
            except httpx.HTTPError:
                response = None  # not known now: asked again after the interval, within the bound
            if response is not None:
                if response.status_code == 401:
                    raise self._error(response)
                if response.status_code == 200:
                    try:
                        status = (response.json() or {}).get("status")
                    except ValueError:
                        status = None
            if status == "succeeded":
                return waited
            if status == "failed":
                raise LineError(422, f"LINE could not prepare the content of message {message_id} (transcoding "
                                     "failed)")
            if waited >= self.content_wait_secs:
                raise LineError(202, f"content of message {message_id} still not ready after {waited:.0f} s")
            if self._sleep(self.content_poll_secs):
                raise Stopped("stopping while the content was being prepared")
            waited += self.content_poll_secs

    @staticmethod
    def _error(response: httpx.Response) -> LineError:
        message = error_message(response)
        if response.status_code == 401:
            return TokenRefused(401, message)
        return LineError(response.status_code, message)
