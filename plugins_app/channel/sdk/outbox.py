"""The worker's crash-recovery outbox: one SQLite file per worker.

What it guarantees, with the host's own deduplication, is that a worker killed
at any point neither loses nor doubles a message:

* **Inbound.** A channel message is written here before it is submitted and
  stays ``pending`` until the host answers ``inbound.submit``. After a crash the
  pending rows are submitted again; the host recognises a repeat by its
  idempotency key (conversation id + channel message id) and answers
  ``duplicate``. A message the host already acknowledged is not submitted again
  when the channel redelivers it.
* **Outbound.** A delivery is written as ``received`` before it is sent,
  ``sent`` (or ``failed``) once ``deliver()`` returns, and ``acked`` once the host
  answers ``outbound.ack``. After a crash the ``sent``/``failed`` rows' acks are
  sent again, and a delivery the host hands out again is acked from its row
  without a second send. Only a crash *inside* ``deliver()`` (row ``received``)
  leaves it unknown whether the channel got the message; the worker then asks
  ``already_delivered()`` and otherwise sends again (at least once).

Rows that reached a final state are kept for ``retention_secs`` (the window in
which a redelivery is still recognised) and then pruned.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .messages import InboundMessage, Delivery

STATE_DIR_ENV = "UGENT_WORKER_STATE_DIR"
DEFAULT_RETENTION_SECS = 7 * 24 * 3600

# Inbound states
PENDING = "pending"
ACKED = "acked"
REJECTED = "rejected"
# Outbound states
RECEIVED = "received"
SENT = "sent"
FAILED = "failed"
# (ACKED is shared)

# What to do with a delivery the host handed out.
DELIVER = "deliver"   # never tried (or a genuine retry): send it
RESUME = "resume"     # a crash interrupted deliver(): it may or may not have reached the channel
ACK = "ack"           # already sent or failed: only (re)send the recorded ack

_SCHEMA = """
CREATE TABLE IF NOT EXISTS inbound (
    key        TEXT PRIMARY KEY,
    message    TEXT NOT NULL,
    state      TEXT NOT NULL,
    result     TEXT,
    attempts   INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
-- replay reads the pending rows in arrival order
CREATE INDEX IF NOT EXISTS inbound_state ON inbound (state, created_at);
CREATE TABLE IF NOT EXISTS outbound (
    delivery_id        TEXT PRIMARY KEY,
    attempt            INTEGER NOT NULL,
    delivery           TEXT NOT NULL,
    state              TEXT NOT NULL,
    ack_status         TEXT,
    retryable          INTEGER,
    reason             TEXT,
    channel_message_id TEXT,
    created_at         REAL NOT NULL,
    updated_at         REAL NOT NULL
);
-- replay reads the rows whose ack is still owed
CREATE INDEX IF NOT EXISTS outbound_state ON outbound (state, updated_at);
"""


def default_state_dir() -> Path:
    """``$UGENT_WORKER_STATE_DIR``, else ``$XDG_STATE_HOME/ugent/workers`` (never a temp dir: it must survive)."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(xdg) / "ugent" / "workers"


def _safe(plugin_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", plugin_id) or "worker"


def outbox_path_for(plugin_id: str, state_dir: str | os.PathLike | None = None) -> Path:
    return Path(state_dir or default_state_dir()) / f"{_safe(plugin_id)}.outbox.sqlite3"


def refusal_path_for(plugin_id: str, state_dir: str | os.PathLike | None = None) -> Path:
    """Where a worker the platform refused (``ChannelRefused``) leaves the reason for the supervisor."""
    return Path(state_dir or default_state_dir()) / f"{_safe(plugin_id)}.refused"


@dataclass
class InboundRow:
    """One inbound message as the outbox holds it (``message`` is its wire dict)."""

    key: str
    message: dict
    state: str
    result: dict | None
    attempts: int


@dataclass
class PendingAck:
    """An ``outbound.ack`` the worker owes the host."""

    delivery_id: str
    status: str                 # delivered | failed
    retryable: bool = False
    reason: str | None = None
    channel_message_id: str | None = None
    claim: str | None = None    # the claim of the hand-out this ack answers (the newest one seen)

    def params(self) -> dict:
        p: dict[str, Any] = {"delivery_id": self.delivery_id, "status": self.status}
        if self.claim:
            p["claim"] = self.claim
        if self.status == "failed":
            p["retryable"] = self.retryable
            p["reason"] = self.reason or "delivery failed"
        if self.channel_message_id:
            p["channel_message_id"] = self.channel_message_id
        return p


@dataclass
class OutboundDecision:
    """What ``outbound_begin`` says to do with a delivery, and the ack to send when it is ACK."""

    action: str                 # DELIVER | RESUME | ACK
    ack: PendingAck | None = None


class Outbox:
    """The SQLite-backed record of inbound and outbound messages not yet settled with the host.

    Safe to share between the worker's threads (one connection behind a lock).
    Every write commits before the method returns, so a ``kill -9`` right after
    a call finds the row as the call left it.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, plugin_id: str | None = None,
                 state_dir: str | os.PathLike | None = None,
                 retention_secs: float = DEFAULT_RETENTION_SECS, clock=time.time):
        if path is None:
            if not plugin_id:
                raise ValueError("Outbox needs a path or a plugin_id")
            path = outbox_path_for(plugin_id, state_dir)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._clock = clock
        self.retention_secs = retention_secs
        self._lock = threading.RLock()
        # Autocommit; the read-modify-write steps open their own IMMEDIATE transactions.
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged write survives power loss too
            self._db.executescript(_SCHEMA)
        try:
            os.chmod(self.path, 0o600)  # message contents are private to the worker's user
        except OSError:
            pass
        self.prune()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- inbound ------------------------------------------------------------------

    def inbound_record(self, message: InboundMessage) -> InboundRow:
        """Write the message as pending unless its key is known; returns the row as it now stands."""
        now = self._clock()
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO inbound (key, message, state, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
                (message.key, json.dumps(message.to_dict()), PENDING, now, now))
            return self._inbound_row(message.key)

    def inbound_get(self, key: str) -> InboundRow | None:
        with self._lock:
            return self._inbound_row(key)

    def inbound_pending(self) -> list[InboundRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM inbound WHERE state = ? ORDER BY created_at, rowid", (PENDING,)).fetchall()
        return [self._to_inbound(r) for r in rows]

    def inbound_update_message(self, key: str, message: dict) -> None:
        """Store the message as it will be resent (e.g. with media ids filled in), so a replay reuses them."""
        with self._lock:
            self._db.execute("UPDATE inbound SET message = ?, updated_at = ? WHERE key = ?",
                             (json.dumps(message), self._clock(), key))

    def inbound_attempted(self, key: str) -> None:
        with self._lock:
            self._db.execute("UPDATE inbound SET attempts = attempts + 1, updated_at = ? WHERE key = ?",
                             (self._clock(), key))

    def inbound_attempt_undone(self, key: str) -> None:
        """The try counted before a call that the host never served (it was away): it does not count."""
        with self._lock:
            self._db.execute("UPDATE inbound SET attempts = max(attempts - 1, 0), updated_at = ? WHERE key = ?",
                             (self._clock(), key))

    def inbound_acked(self, key: str, result: dict) -> None:
        self._inbound_settle(key, ACKED, result)

    def inbound_rejected(self, key: str, reason: str) -> None:
        self._inbound_settle(key, REJECTED, {"reason": reason})

    def _inbound_settle(self, key: str, state: str, result: dict) -> None:
        with self._lock:
            self._db.execute("UPDATE inbound SET state = ?, result = ?, updated_at = ? WHERE key = ?",
                             (state, json.dumps(result), self._clock(), key))

    def _inbound_row(self, key: str) -> InboundRow | None:
        row = self._db.execute("SELECT * FROM inbound WHERE key = ?", (key,)).fetchone()
        return None if row is None else self._to_inbound(row)

    @staticmethod
    def _to_inbound(row: sqlite3.Row) -> InboundRow:
        return InboundRow(key=row["key"], message=json.loads(row["message"]), state=row["state"],
                          result=json.loads(row["result"]) if row["result"] else None, attempts=row["attempts"])

    # -- outbound -----------------------------------------------------------------

    def outbound_begin(self, delivery: Delivery) -> OutboundDecision:
        """Record a delivery the host handed out and say what to do with it.

        A new delivery, or a retry the host sent after a retryable failure (a
        higher ``attempt``), is recorded as ``received``: DELIVER. A row already
        ``sent``/``failed``/``acked`` for this attempt means the host is
        redelivering what this worker already handled: ACK with the recorded
        outcome, never a second send. A row left ``received`` by a crash: RESUME.
        """
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT * FROM outbound WHERE delivery_id = ?",
                                       (delivery.delivery_id,)).fetchone()
                if row is None:
                    self._db.execute(
                        "INSERT INTO outbound (delivery_id, attempt, delivery, state, created_at, updated_at)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (delivery.delivery_id, delivery.attempt, json.dumps(delivery.to_dict()), RECEIVED, now, now))
                    decision = OutboundDecision(DELIVER)
                elif row["state"] == RECEIVED:
                    self._db.execute("UPDATE outbound SET attempt = MAX(attempt, ?), delivery = ?, updated_at = ? "
                                     "WHERE delivery_id = ?",
                                     (delivery.attempt, json.dumps(delivery.to_dict()), now, delivery.delivery_id))
                    decision = OutboundDecision(RESUME)
                elif row["ack_status"] == "failed" and delivery.attempt > row["attempt"]:
                    # The host moved past the failed attempt (a retry, or an operator's requeue
                    # of a dead letter): a genuine new attempt. A delivered row is never resent.
                    self._db.execute(
                        "UPDATE outbound SET attempt = ?, delivery = ?, state = ?, ack_status = NULL, retryable = NULL,"
                        " reason = NULL, updated_at = ? WHERE delivery_id = ?",
                        (delivery.attempt, json.dumps(delivery.to_dict()), RECEIVED, now, delivery.delivery_id))
                    decision = OutboundDecision(DELIVER)
                else:
                    # Ack the recorded outcome under this hand-out's claim: this worker holds it now.
                    self._db.execute("UPDATE outbound SET delivery = ? WHERE delivery_id = ?",
                                     (json.dumps(dict(json.loads(row["delivery"]), claim=delivery.claim)),
                                      delivery.delivery_id))
                    decision = OutboundDecision(ACK, self._to_ack(row, claim=delivery.claim))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return decision

    def outbound_sent(self, delivery_id: str, channel_message_id: str | None = None) -> PendingAck:
        with self._lock:
            self._db.execute(
                "UPDATE outbound SET state = ?, ack_status = 'delivered', retryable = NULL, reason = NULL,"
                " channel_message_id = ?, updated_at = ? WHERE delivery_id = ?",
                (SENT, channel_message_id, self._clock(), delivery_id))
        return PendingAck(delivery_id, "delivered", channel_message_id=channel_message_id,
                          claim=self._claim(delivery_id))

    def outbound_failed(self, delivery_id: str, *, retryable: bool, reason: str) -> PendingAck:
        with self._lock:
            self._db.execute(
                "UPDATE outbound SET state = ?, ack_status = 'failed', retryable = ?, reason = ?, updated_at = ?"
                " WHERE delivery_id = ?", (FAILED, int(retryable), reason, self._clock(), delivery_id))
        return PendingAck(delivery_id, "failed", retryable=retryable, reason=reason, claim=self._claim(delivery_id))

    def _claim(self, delivery_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT delivery FROM outbound WHERE delivery_id = ?", (delivery_id,)).fetchone()
        return None if row is None else _stored_claim(row["delivery"])

    def outbound_acked(self, delivery_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE outbound SET state = ?, updated_at = ? WHERE delivery_id = ? AND state IN (?, ?)",
                             (ACKED, self._clock(), delivery_id, SENT, FAILED))

    def outbound_pending_acks(self) -> list[PendingAck]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM outbound WHERE state IN (?, ?) ORDER BY updated_at, rowid",
                                    (SENT, FAILED)).fetchall()
        return [self._to_ack(r) for r in rows]

    def outbound_state(self, delivery_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT state FROM outbound WHERE delivery_id = ?", (delivery_id,)).fetchone()
        return None if row is None else row["state"]

    @staticmethod
    def _to_ack(row: sqlite3.Row, *, claim: str | None = None) -> PendingAck:
        return PendingAck(delivery_id=row["delivery_id"], status=row["ack_status"] or "delivered",
                          retryable=bool(row["retryable"]), reason=row["reason"],
                          channel_message_id=row["channel_message_id"],
                          claim=claim if claim is not None else _stored_claim(row["delivery"]))

    # -- housekeeping ---------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Rows per table and state, e.g. ``{"inbound.pending": 1, "outbound.sent": 0}``."""
        out: dict[str, int] = {}
        with self._lock:
            for table in ("inbound", "outbound"):
                for row in self._db.execute(f"SELECT state, COUNT(*) AS n FROM {table} GROUP BY state"):
                    out[f"{table}.{row['state']}"] = row["n"]
        return out

    def prune(self) -> None:
        """Forget settled rows older than the retention window."""
        cutoff = self._clock() - self.retention_secs
        with self._lock:
            self._db.execute("DELETE FROM inbound WHERE state IN (?, ?) AND updated_at < ?", (ACKED, REJECTED, cutoff))
            self._db.execute("DELETE FROM outbound WHERE state = ? AND updated_at < ?", (ACKED, cutoff))


def _stored_claim(delivery_json: str | None) -> str | None:
    """The claim kept in a row's delivery (rows written before claims existed have none)."""
    try:
        claim = json.loads(delivery_json or "{}").get("claim")
    except (ValueError, AttributeError):
        return None
    return claim if isinstance(claim, str) and claim else None
