"""The delivery policy: one state machine for outbound deliveries, kept by both hubs.

Pure Python, no Django: the Django hub (``plugins_app.channel.services``, rows moved by
conditional updates) and ``InMemoryHub`` (the SDK's test host) both ask this
module what a hand-out may take and what an ack does, so their semantics cannot
drift apart. docs/plugin-protocol.md ("Delivery semantics") is the contract:

* **In-flight limit.** A plugin never holds more than ``max_in_flight``
  unacknowledged deliveries: a poll takes at most ``room()``.
* **Claims.** Each hand-out marks what it took with a fresh claim token
  (``new_claim()``) that travels with the delivery to the worker and back with
  its ack. A requeue clears it.
* **Acks.** ``delivered`` is final whenever it comes (the message did go out).
  A failure counts only from the holder of the current claim: one for a
  delivery nobody holds now, or under another claim (a replaced session's late
  ack), is answered ``duplicate`` and changes nothing, so it cannot requeue
  what a new session is sending.
* **Retries, backoff, dead letters.** A retryable failure comes back with
  ``attempt + 1`` after ``backoff(attempt)`` (doubling, capped), until the
  attempt that used the last of ``max_retries`` retries fails; then, and at
  once for a permanent failure, the delivery is dead-lettered with the reason.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

PENDING = "pending"
IN_FLIGHT = "in_flight"
DELIVERED = "delivered"
DEAD_LETTER = "dead_letter"
SETTLED = (DELIVERED, DEAD_LETTER)

ACK_DELIVERED = "delivered"
ACK_FAILED = "failed"


def new_claim() -> str:
    """A fresh claim token for one hand-out (32 hex characters)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class AckOutcome:
    """What an ack does to a delivery. ``changed`` False: nothing is written (a duplicate or a stale ack)."""

    state: str
    attempt: int
    duplicate: bool
    changed: bool
    failure: str | None = None        # the reason to append to the delivery's failures
    backoff_secs: float | None = None  # a retry waits this long before it is handed out again
    dead_letter_reason: str | None = None
    permanent: bool = False

    def result(self) -> dict:
        """The ``outbound.ack`` result (without ``delivery_id``, which the bridge adds)."""
        return {"state": self.state, "attempt": self.attempt, "duplicate": self.duplicate}


@dataclass(frozen=True)
class DeliveryPolicy:
    """One plugin's limits (``[plugins.limits]``) and the retry backoff of the host."""

    max_in_flight: int = 64
    max_retries: int = 5
    backoff_secs: float = 2.0
    backoff_max_secs: float = 300.0

    def room(self, *, in_flight: int, max_items: int) -> int:
        """How many deliveries a poll may take now (0: the plugin holds its limit)."""
        return max(0, min(max_items, self.max_in_flight - in_flight))

    def backoff(self, failed_attempt: int) -> float:
        """The wait before handing out attempt ``failed_attempt + 1``: base * 2**(attempt - 1), capped."""
        return min(self.backoff_secs * (2 ** (failed_attempt - 1)), self.backoff_max_secs)

    def ack(self, *, state: str, attempt: int, held_claim: str | None, status: str, retryable: bool,
            reason: str | None, claim: str | None) -> AckOutcome:
        """Decide what an ack does to a delivery in ``state`` at ``attempt`` held under ``held_claim``.

        ``claim`` is the claim the ack names: ``None`` when the caller cannot say
        (a direct call that trusts itself), a string otherwise (``""``: the acking
        session holds no claim on it).
        """
        if state in SETTLED:
            return AckOutcome(state, attempt, duplicate=True, changed=False)
        if status == ACK_DELIVERED:
            return AckOutcome(DELIVERED, attempt, duplicate=False, changed=True)
        stale = claim is not None and claim != (held_claim or "")
        if state != IN_FLIGHT or stale:
            # Nobody holds it now, or someone else does: this failure is about a hand-out
            # that is over, and must neither spend an attempt nor requeue the new holder's copy.
            return AckOutcome(state, attempt, duplicate=True, changed=False)
        failure = reason or ""
        if not retryable:
            return AckOutcome(DEAD_LETTER, attempt, duplicate=False, changed=True, failure=failure,
                              dead_letter_reason=f"permanent failure: {reason}", permanent=True)
        if attempt > self.max_retries:
            return AckOutcome(DEAD_LETTER, attempt, duplicate=False, changed=True, failure=failure,
                              dead_letter_reason=f"max_retries ({self.max_retries}) exceeded: {reason}")
        return AckOutcome(PENDING, attempt + 1, duplicate=False, changed=True, failure=failure,
                          backoff_secs=self.backoff(attempt))
