"""The Streaming API's CometD (Bayeux 1.0, long polling: JSON arrays POSTed to ``{instance}/cometd/{version}``)
subscription to one platform event channel, resumed durably by replay id.

* ``/meta/handshake`` (``ext.replay: true``) gives a ``clientId``; ``/meta/subscribe`` names the channel
  (``/event/<Name>__e``) with ``ext.replay: {channel: <replay id>}``: the last one recorded, or -1 (only new
  events) / -2 (every event Salesforce still keeps, 72 hours) the first time; then ``/meta/connect`` in a loop,
  each answer carrying the events (``data.event.replayId``, ``data.event.EventUuid``, ``data.payload``) and
  the connect's own reply with its ``advice``. Events in a handshake's or a subscribe's answer (a server may
  flush its queue with any reply) are taken the same way.
* An event is handed to ``on_event`` (the worker records it in its outbox) and only then is its replay id
  written to the ``ReplayStore`` (a SQLite file beside the outbox, synchronous=FULL): a worker killed between
  the two is given the event again after the restart, and the outbox, keyed by the message id, runs it once.
* A first subscription ("new only", -1) records its moment before it goes out; until an event's replay id is
  recorded, a later subscribe asks for -2; from then on every subscription passes over events created more
  than ``CLOCK_SKEW_SECS`` before that moment (also once a replay id is recorded: a -2 catch-up cut short
  resumes among the old events), so a crash before the first event neither loses what came meanwhile nor
  takes older events.
* ``403::Unknown client`` or ``advice.reconnect: handshake`` starts over with a handshake (a successful
  connect advising it does so after the backoff or the advised interval, whichever is longer) (the server
  forgets a client that did not reconnect within its timeout; a new handshake removes the subscriptions,
  so the channel is subscribed again, from the replay id recorded). ``401::Authentication invalid`` (on
  connect, or nested in a handshake's ``ext.sfdc.failureReason``) or an HTTP 401 fetches a new token first.
  A fresh client refused at once again backs off (1 s doubling to 30 s), as any network or server error does.
* A stored replay id Salesforce no longer keeps is refused on subscribe (``400::The replayId {N} you
  provided was invalid...``): logged as an error (events between may be lost) and subscribed again with -2.
* A channel that does not exist (``400::The channel you requested to subscribe to does not exist``, or
  ``doesn’t exist``) raises ``ChannelMissing``: the operator must define the platform event. A handshake
  denied for anything but the token or a limit, or ``400 Unsupported API version``, raises ``StreamRefused``.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import logging
import re
import sqlite3
import threading
import time
from typing import Callable

import httpx

from .api import SalesforceApi, Token

log = logging.getLogger("ugent.worker.salesforce.cometd")

REPLAY_NEW = -1
REPLAY_ALL = -2
#: How far Salesforce's clock may be behind ours: a resumed first subscription takes events this much older too.
CLOCK_SKEW_SECS = 120.0
#: Seconds the server holds a /meta/connect (Salesforce advises 110 s) plus a margin for the answer.
CONNECT_TIMEOUT_SECS = 130.0


class CometdError(Exception):
    """A Bayeux reply with ``successful: false`` (or no reply) for a meta channel."""


class ChannelMissing(CometdError):
    """The platform event channel does not exist in the org (or the integration user may not read it)."""


class StreamRefused(CometdError):
    """The Streaming API refuses this worker for a reason only the operator can fix: a handshake denied for
    anything but the token or a limit (the user's or the org's API/streaming permission), an API version the
    Streaming API does not serve."""


class ReplayStore:
    """The last replay id taken from each channel, durable (one row a channel), and when the channel was first
    subscribed to: a worker that took no event yet resumes from that moment, not from "new only" again."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replay (channel TEXT PRIMARY KEY, replay_id INTEGER, at REAL, "
                         "since REAL)")

    def get(self, channel: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT replay_id FROM replay WHERE channel = ?", (channel,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def since(self, channel: str) -> float | None:
        """When the channel was first subscribed to (kept once events are taken), or None."""
        with self._lock:
            row = self._db.execute("SELECT since FROM replay WHERE channel = ?", (channel,)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def started(self, channel: str, at: float) -> None:
        """Record the first subscription's moment (kept if one is recorded already)."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO replay VALUES (?, NULL, ?, ?)", (channel, time.time(), at))

    def put(self, channel: str, replay_id: int) -> None:
        with self._lock:
            self._db.execute("INSERT INTO replay VALUES (?, ?, ?, NULL) ON CONFLICT (channel) DO UPDATE SET "
                             "replay_id = excluded.replay_id, at = excluded.at", (channel, int(replay_id), time.time()))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def parse_time(value) -> _dt.datetime | None:
    """A Salesforce datetime (``2024-05-01T12:00:00.000Z``, or ``...+0000`` as the SOAP side writes it) with its
    zone; None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    text = re.sub(r"([+-][0-9]{2})([0-9]{2})$", r"\1:\2", value.strip())
    try:
        moment = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def created_at(message: dict) -> float | None:
    """The event's ``CreatedDate`` as a Unix time, or None."""
    moment = parse_time(((message.get("data") or {}).get("payload") or {}).get("CreatedDate"))
    return None if moment is None else moment.timestamp()


def replay_id_of(message: dict) -> int | None:
    event = (message.get("data") or {}).get("event") or {}
    try:
        return int(event["replayId"])
    except (KeyError, TypeError, ValueError):
        return None


def invalid_replay(error: str) -> bool:
    """Whether a subscribe's error is Salesforce refusing the replay id (outside the retention window)."""
    return "replayid" in error.lower() and "invalid" in error.lower()


def missing_channel(error: str) -> bool:
    """Whether a subscribe's error says the channel does not exist (Salesforce writes it with a straight or a
    curly apostrophe too)."""
    text = error.lower()
    return any(words in text for words in ("does not exist", "doesn't exist", "doesn\u2019t exist"))


def permanent_denial(reply: dict) -> bool:
    """A handshake denied (``403::Handshake denied``) for neither the token (``401::``, fetched again) nor a
    limit (``403::Organization total events daily limit exceeded``, concurrent clients: waited out)."""
    reason = str(((reply.get("ext") or {}).get("sfdc") or {}).get("failureReason") or "")
    return (str(reply.get("error") or "").startswith("403::") and not auth_failure(reply)
            and "limit" not in reason.lower())


def auth_failure(reply: dict) -> bool:
    """A reply saying the token is no longer valid: ``401::...`` as the error or the handshake's nested reason."""
    reason = str(((reply.get("ext") or {}).get("sfdc") or {}).get("failureReason") or "")
    return str(reply.get("error") or "").startswith("401::") or reason.startswith("401::")


class Subscription:
    """One channel's subscription, run by ``run()`` until ``stopping`` is set (in the listener's thread)."""

    def __init__(self, api: SalesforceApi, channel: str, store: ReplayStore, on_event: Callable[[dict], None], *,
                 first_replay: int = REPLAY_NEW, stopping: threading.Event | None = None,
                 backoff_initial: float = 1.0, backoff_max: float = 30.0):
        self.api, self.channel, self.store, self.on_event = api, channel, store, on_event
        self.first_replay = first_replay
        self.stopping = stopping or threading.Event()
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.http = httpx.Client(timeout=httpx.Timeout(CONNECT_TIMEOUT_SECS, connect=30.0))
        self.client_id: str | None = None
        self.token: Token | None = None
        self._ids = itertools.count(1)
        self.subscribed_from: int | None = None   # the replay id of the last subscribe (for the log and tests)
        self.skip_before: float | None = None     # a resumed "new only" start: events created before it are old

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ the wire

    def url(self) -> str:
        assert self.token is not None
        return f"{self.token.instance_url}/cometd/{self.api.api_version}"

    def send(self, message: dict) -> list[dict]:
        """POST one Bayeux message; returns every message of the answer. An HTTP 401 fetches a new token
        and sends once more (a new token needs a new handshake, which the caller's reply check does)."""
        message = {**message, "id": str(next(self._ids))}
        for attempt in (0, 1):
            self.token = self.token or self.api.token()
            response = self.http.post(self.url(), json=[message],
                                      headers={"Authorization": f"Bearer {self.token.access_token}"})
            if response.status_code == 401 and attempt == 0:
                self.token = self.api.token(stale=self.token.access_token)
                continue
            if response.status_code == 400 and "unsupported api version" in response.text.lower():
                raise StreamRefused(f"POST /cometd/{self.api.api_version}: HTTP 400 {response.text[:200]}")
            if response.status_code != 200:
                raise CometdError(f"{message['channel']}: HTTP {response.status_code} {response.text[:200]}")
            body = response.json()
            return [m for m in (body if isinstance(body, list) else [body]) if isinstance(m, dict)]
        raise CometdError(f"{message['channel']}: HTTP 401 with a new token")

    @staticmethod
    def reply(messages: list[dict], channel: str) -> dict:
        for m in messages:
            if m.get("channel") == channel:
                return m
        raise CometdError(f"no {channel} reply in the answer")

    # ------------------------------------------------------------------ the steps

    def handshake(self) -> None:
        self.http.cookies.clear()  # BAYEUX_BROWSER belongs to the old client
        for attempt in (0, 1):
            messages = self.send({"channel": "/meta/handshake", "version": "1.0", "minimumVersion": "1.0",
                                  "supportedConnectionTypes": ["long-polling"], "ext": {"replay": True}})
            self._take_events(messages)
            reply = self.reply(messages, "/meta/handshake")
            if reply.get("successful"):
                self.client_id = str(reply["clientId"])
                return
            if auth_failure(reply) and attempt == 0 and self.token is not None:
                self.token = self.api.token(stale=self.token.access_token)
                continue
            if permanent_denial(reply):
                reason = ((reply.get("ext") or {}).get("sfdc") or {}).get("failureReason")
                raise StreamRefused(f"handshake: {reply.get('error')}" + (f" ({reason})" if reason else ""))
            raise CometdError(f"handshake: {reply.get('error')} {reply.get('ext') or ''}".strip())

    def subscribe(self) -> int:
        """Subscribe from the replay id recorded (or the first start's); returns the replay id used."""
        stored = self.store.get(self.channel)
        replay = self.first_replay if stored is None else stored
        since = self.store.since(self.channel) if self.first_replay == REPLAY_NEW else None
        # "New only": what was published before the first start stays out, also once a replay id is recorded
        # (a -2 catch-up cut short by a crash resumes from the middle of the old events).
        self.skip_before = None if since is None else since - CLOCK_SKEW_SECS
        if since is not None and replay == REPLAY_NEW:
            # Subscribed before, "new only", but no event was recorded since (a crash may have taken one the
            # worker never wrote down): everything kept, less what was published before that first start.
            replay = REPLAY_ALL
        if stored is None:
            # written before the subscribe goes out: a crash just after Salesforce took it still resumes from here
            self.store.started(self.channel, time.time())
        reply = self._subscribe(replay)
        if not reply.get("successful"):
            error = str(reply.get("error") or "")
            if invalid_replay(error) and replay >= 0:
                log.error("salesforce: %s: the replay id %s recorded is no longer kept by Salesforce (%s): "
                          "subscribing with -2, every event it still keeps; events published between may be "
                          "lost", self.channel, replay, error)
                replay = REPLAY_ALL
                reply = self._subscribe(replay)
        if not reply.get("successful"):
            error = str(reply.get("error") or "")
            if missing_channel(error):
                raise ChannelMissing(f"subscribe to {self.channel}: {error}")
            raise CometdError(f"subscribe to {self.channel}: {error}")
        self.subscribed_from = replay
        log.info("salesforce: subscribed to %s from replay id %s", self.channel, replay)
        return replay

    def _subscribe(self, replay: int) -> dict:
        messages = self.send({"channel": "/meta/subscribe", "clientId": self.client_id,
                              "subscription": self.channel, "ext": {"replay": {self.channel: replay}}})
        self._take_events(messages)  # a server may flush the backlog with the subscribe's reply
        return self.reply(messages, "/meta/subscribe")

    def connect_once(self) -> dict:
        """One /meta/connect: each event of the answer handed on (then its replay id recorded); returns the
        connect's reply."""
        messages = self.send({"channel": "/meta/connect", "clientId": self.client_id,
                              "connectionType": "long-polling"})
        self._take_events(messages)
        return self.reply(messages, "/meta/connect")

    def _take_events(self, messages: list[dict]) -> None:
        """Each event of an answer handed on, then its replay id recorded. Bayeux lets a server put data
        messages in any answer (a handshake's, a subscribe's), not only a connect's: none is passed over."""
        for m in messages:
            if m.get("channel") != self.channel or "data" not in m:
                continue
            replay_id = replay_id_of(m)
            created = created_at(m)
            if self.skip_before is None or created is None or created >= self.skip_before:
                self.on_event(m)                   # recorded in the outbox (raises if it could not be)
            if replay_id is not None:
                self.store.put(self.channel, replay_id)   # only now: a crash before this replays the event

    def run(self) -> None:
        """Handshake, subscribe, connect until stopping; a failure backs off and starts over. Raises
        ChannelMissing, StreamRefused and the api's ClientRefused (what only the operator can fix)."""
        from .api import ClientRefused
        backoff = self.backoff_initial
        while not self.stopping.is_set():
            try:
                self.handshake()
                self.subscribe()
                refused_in_a_row = 0
                while not self.stopping.is_set():
                    reply = self.connect_once()
                    advice = reply.get("advice") or {}
                    if not reply.get("successful"):
                        error = str(reply.get("error") or "")
                        if auth_failure(reply) and self.token is not None:
                            self.token = self.api.token(stale=self.token.access_token)
                        refused_in_a_row += 1
                        if refused_in_a_row > 1:  # a fresh client refused at once again: back off, not spin
                            raise CometdError(f"connect refused again: {error} (advice {advice})")
                        log.info("salesforce: connect refused (%s, advice %s): handshaking again", error, advice)
                        self.handshake()
                        self.subscribe()
                        continue
                    interval = float(advice.get("interval") or 0) / 1000.0
                    if advice.get("reconnect") in ("handshake", "none"):
                        # a server that keeps saying so is not hammered with handshakes: the backoff (or the
                        # advised interval) first, and no reset of it
                        wait = max(backoff, interval)
                        log.info("salesforce: the server advises reconnect %s: handshaking again in %.0f s",
                                 advice.get("reconnect"), wait)
                        if self.stopping.wait(wait):
                            return
                        backoff = min(backoff * 2, self.backoff_max)
                        break
                    refused_in_a_row, backoff = 0, self.backoff_initial
                    if interval and self.stopping.wait(interval):
                        return
            except (ClientRefused, ChannelMissing, StreamRefused):
                raise
            except Exception as exc:  # noqa: BLE001 - the network, the server, an event not recorded: start over
                if self.stopping.is_set():
                    return
                log.warning("salesforce: streaming %s: %s: %s; again in %.0f s", self.channel, type(exc).__name__,
                            exc, backoff)
                if self.stopping.wait(backoff):
                    return
                backoff = min(backoff * 2, self.backoff_max)
