"""What each process counts for GET /metrics (prometheus_client), and nothing else.

Counters and histograms live here, so every room may count without importing the site. They
are process-local; in servers mode (several web processes, workers, the supervisor) set
``PROMETHEUS_MULTIPROC_DIR`` to one empty directory for all of them before they start, and the
scrape (ugent_site/metrics.py) sums every process's files (prometheus_client's multiprocess
mode). Figures read from the database at scrape time (queue depth, deliveries by state) are
collected there, once, not here. No label holds user data: endpoints are URL patterns, rule
labels are the operator's rule names.
"""
from __future__ import annotations

import logging

from prometheus_client import Counter, Histogram

log = logging.getLogger("ugent.metrics")

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)

REQUESTS = Counter("ugent_requests", "API requests answered, by endpoint, method and status.",
                   ["endpoint", "method", "status"])
REQUEST_SECONDS = Histogram("ugent_request_duration_seconds", "Time to answer an API request (streams: to "
                            "their end).", ["endpoint"], buckets=_SECONDS)
TURNS_ENDED = Counter("ugent_turns_ended", "Turns ended, by end state.", ["state"])
TURN_SECONDS = Histogram("ugent_turn_duration_seconds", "Turn duration, from its start to its end.",
                         buckets=_SECONDS)
TTFT_SECONDS = Histogram("ugent_turn_time_to_first_token_seconds", "From a turn's start to its first answer token.",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
TOKENS = Counter("ugent_tokens", "Tokens used by turns, by kind (prompt, completion).", ["kind"])
PLUGIN_RESTARTS = Counter("ugent_plugin_restarts", "Channel plugin workers started again after the first start.",
                          ["plugin"])
RULE_DECISIONS = Counter("ugent_rule_decisions", "Messages a rule decided, by rule and decision.",
                         ["rule", "decision"])


def _safely(fn):
    def wrapper(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception:  # a metric must never break what it measures
            log.warning("could not count %s", fn.__name__, exc_info=True)
    return wrapper


@_safely
def request_answered(*, endpoint: str, method: str, status: int, seconds: float) -> None:
    REQUESTS.labels(endpoint, method, str(status)).inc()
    REQUEST_SECONDS.labels(endpoint).observe(seconds)


@_safely
def turn_ended(*, state: str, seconds: float | None, ttft_seconds: float | None,
               prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
    TURNS_ENDED.labels(state).inc()
    if seconds is not None:
        TURN_SECONDS.observe(seconds)
    if ttft_seconds is not None:
        TTFT_SECONDS.observe(ttft_seconds)
    if prompt_tokens:
        TOKENS.labels("prompt").inc(prompt_tokens)
    if completion_tokens:
        TOKENS.labels("completion").inc(completion_tokens)


@_safely
def plugin_restarted(plugin_id: str) -> None:
    PLUGIN_RESTARTS.labels(plugin_id).inc()


@_safely
def rule_decided(*, rule: str, decision: str) -> None:
    RULE_DECISIONS.labels(rule, decision).inc()
