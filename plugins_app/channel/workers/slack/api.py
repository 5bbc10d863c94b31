"""Slack's Web API through slack-sdk's ``WebClient``, with Slack's rate limits honoured.

Every call goes through ``SlackApi.call``: a 429 answer's ``Retry-After`` blocks that method
(for ``chat.postMessage``: that channel, as Slack limits posting per channel) and the call is
tried again once the wait is over; a token bucket per channel (about one message a second, with
a burst) and one for the workspace keep the worker under the posting limits before Slack has to
say so. A wait is cut short when the worker stops.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

DEFAULT_BASE_URL = "https://slack.com/api/"

#: Errors that mean the token itself is no good: only the operator can fix them.
AUTH_ERRORS = frozenset({"invalid_auth", "not_authed", "token_revoked", "token_expired", "account_inactive",
                         "no_permission", "missing_scope", "not_allowed_token_type", "invalid_token",
                         "team_access_not_granted", "ekm_access_denied", "app_missing_action_url"})
#: Errors that sending the same message again cannot fix.
PERMANENT_ERRORS = frozenset({"channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "no_text",
                              "too_many_attachments", "restricted_action", "restricted_action_read_only_channel",
                              "restricted_action_thread_only_channel", "restricted_action_non_threadable_channel",
                              "cannot_reply_to_message", "invalid_blocks", "invalid_metadata_format",
                              "invalid_metadata_schema", "message_limit_exceeded", "duplicate_channel_not_found",
                              "file_not_found", "invalid_arguments", "user_not_in_channel", "channel_is_archived"})


class RateLimited(Exception):
    """The worker stopped while a rate limit was still in force."""


class Stopped(Exception):
    """A wait for a rate limit was cut short because the worker is stopping."""


class Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.stamp = burst, clock()

    def delay(self) -> float:
        """Take a token; returns how long to wait before using it (0 when one was there)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class RateGate:
    """When the next call of a method (and, for posting, to a channel) may go out."""

    def __init__(self, *, per_channel_rate: float = 1.0, per_channel_burst: float = 6,
                 global_rate: float = 5.0, global_burst: float = 60, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._not_before: dict[tuple[str, str], float] = {}
        self._buckets: dict[str, Bucket] = {}
        self._per_channel = (per_channel_rate, per_channel_burst)
        self._global = Bucket(global_rate, global_burst, clock)

    def block(self, method: str, key: str, secs: float) -> None:
        """Slack said wait ``secs`` (a 429's Retry-After) before calling ``method`` for ``key`` again."""
        with self._lock:
            until = self.clock() + max(0.0, secs)
            self._not_before[(method, key)] = max(until, self._not_before.get((method, key), 0.0))

    def delay(self, method: str, key: str, *, post: bool = False) -> float:
        """How long to wait before this call may go out (takes the buckets' tokens when posting)."""
        with self._lock:
            wait = max(0.0, self._not_before.get((method, key), 0.0) - self.clock(),
                       self._not_before.get((method, ""), 0.0) - self.clock())
            if post:
                bucket = self._buckets.get(key)
                if bucket is None:
                    bucket = self._buckets[key] = Bucket(*self._per_channel, clock=self.clock)
                wait = max(wait, bucket.delay(), self._global.delay())
            return wait


def retry_after(exc: SlackApiError, default: float = 1.0) -> float:
    headers = getattr(exc.response, "headers", {}) or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else default
    except (TypeError, ValueError):
        return default


def error_code(exc: SlackApiError) -> str:
    try:
        return str(exc.response.get("error") or "unknown_error")
    except Exception:  # noqa: BLE001 - a response that is not JSON
        return f"http_{getattr(exc.response, 'status_code', '?')}"


class SlackApi:
    """One token's Web API client (the bot token, or the app-level token for Socket Mode)."""

    def __init__(self, token: str, *, base_url: str = DEFAULT_BASE_URL, gate: RateGate | None = None,
                 stopping: threading.Event | None = None, timeout: int = 30, max_wait_secs: float = 900.0):
        base = base_url if base_url.endswith("/") else base_url + "/"
        self.base_url = base
        self.client = WebClient(token=token, base_url=base, timeout=timeout)
        self.gate = gate or RateGate()
        self.stopping = stopping or threading.Event()
        self.max_wait_secs = max_wait_secs

    def call(self, method: str, *, key: str = "", post: bool = False, json: dict | None = None,
             params: dict | None = None, http_verb: str = "POST") -> dict[str, Any]:
        """Call ``method``; waits out rate limits, raises ``SlackApiError`` for any other refusal."""
        waited = 0.0
        while True:
            wait = self.gate.delay(method, key, post=post)
            if wait > 0:
                if waited + wait > self.max_wait_secs:
                    raise RateLimited(f"{method}: rate limited for longer than {self.max_wait_secs:.0f} s")
                if self.stopping.wait(wait):
                    raise Stopped(f"{method}: stopping while rate limited")
                waited += wait
            try:
                response = self.client.api_call(method, http_verb=http_verb, json=json, params=params)
                return dict(response.data) if isinstance(response.data, dict) else {"ok": True}
            except SlackApiError as exc:
                if getattr(exc.response, "status_code", None) == 429 or error_code(exc) == "ratelimited":
                    # chat.postMessage is limited per channel; everything else per method and workspace
                    self.gate.block(method, key if post else "", retry_after(exc))
                    post = False  # the tokens of this call are spent; only Slack's wait applies now
                    continue
                raise
