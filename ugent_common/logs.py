"""The daemon's log: plain or JSON lines, no secret in any of them, and no warning repeated every tick.

Settings wire these into LOGGING (ugent_site/settings.py): ``UGENT_LOG_FORMAT=json`` switches the
console handler to python-json-logger's formatter, whose lines carry each record's ``extra`` fields
(the request and turn lines pass theirs that way). Every handler gets two filters:

* :class:`RedactSecrets` rewrites any known secret (the operator key, the upstream key, configured
  keys, the secret key) and anything shaped like a key (``ugk_…``, ``sk-…``, a bearer token) as
  ``[redacted]``, in the message and in the extra fields.
* :class:`RepeatFilter` lets a warning through once, then at most once every
  ``REPEAT_WINDOW_SECONDS`` per distinct line, saying how often it repeated meanwhile.
  :func:`warn_repeating` does the same for one call site, whatever handler is listening.

The plain formatter (:class:`PlainFormatter`) writes one line per record: a control character a client
sent (a newline in a user id the request line names) is escaped, so it cannot forge a line.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from typing import Iterable

from ugent_common.loglevel import log_format_name, log_level_name

REPEAT_WINDOW_SECONDS = 300.0
REDACTED = "[redacted]"
#: Environment variables whose values are secrets wherever they appear.
SECRET_ENV = ("UGENT_WEB_API_KEY", "UGENT_LLM_API_KEY", "DJANGO_SECRET_KEY", "UGENT_SECRETS_KEY",
              "OPENAI_API_KEY")
_SHAPES = re.compile(r"(ugk_[A-Za-z0-9_\-]{6,}|sk-[A-Za-z0-9_\-]{12,}|(?i:bearer)\s+[A-Za-z0-9._~+/=\-]{8,})")
#: Attributes every LogRecord has: the rest are a call's ``extra`` fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}

_extra_secrets: set[str] = set()
_extra_lock = threading.Lock()


def secret_add(value: str) -> None:
    """A value to redact from every log line from now on (a configured key, a plugin secret)."""
    if value and len(value) >= 6:
        with _extra_lock:
            _extra_secrets.add(value)


def _known_secrets() -> Iterable[str]:
    for name in SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 6:
            yield value
    try:
        from django.conf import settings
        for name in ("UGENT_WEB_API_KEY", "UGENT_LLM_API_KEY", "SECRET_KEY", "UGENT_SECRETS_KEY"):
            value = getattr(settings, name, "") or ""
            if isinstance(value, str) and len(value) >= 6:
                yield value
    except Exception:  # settings not configured (a worker, a script): the environment is enough
        pass
    with _extra_lock:
        yield from list(_extra_secrets)


def _secrets_longest_first() -> list[str]:
    return sorted(set(_known_secrets()), key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every known secret and every key-shaped token replaced by ``[redacted]``.
    ``secrets``: the known secrets, longest first, when the caller redacts several texts at once."""
    if not text:
        return text
    for secret in _secrets_longest_first() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return _SHAPES.sub(lambda m: ("Bearer " if m.group(0)[:6].lower() == "bearer" else "") + REDACTED, text)


class RedactSecrets(logging.Filter):
    """Rewrites a record's message (args merged in) and its string extra fields without secrets."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        secrets = _secrets_longest_first()  # once a record, not once a field (the request line has seven)
        clean = redact(message, secrets)
        if clean != message or record.args:
            record.msg, record.args = clean, ()
        for key, value in list(vars(record).items()):
            if key not in _STANDARD and isinstance(value, str):
                setattr(record, key, redact(value, secrets))
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info), secrets)
        elif record.exc_text:
            record.exc_text = redact(record.exc_text, secrets)
        return True


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def controls_escaped(text: str) -> str:
    """``text`` with every C0 control character and DEL written as an escape (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: _ESCAPES.get(m.group(0), f"\\x{ord(m.group(0)):02x}"), text)


class PlainFormatter(logging.Formatter):
    """The plain lines: one record, one line. A value a client sent (a user id in the request line's
    fields) that holds a newline would otherwise write a second line that reads as the daemon's own, so
    control characters in the line are escaped; a traceback below it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return controls_escaped(super().formatMessage(record))


class Repeats:
    """Counts repeats of a key: ``seen(key)`` says whether to log now and how many were held back."""

    def __init__(self, window: float = REPEAT_WINDOW_SECONDS):
        self.window = window
        self._lock = threading.Lock()
        self._state: dict = {}  # key -> [last logged (monotonic), repeats since]

    def seen(self, key, now: float | None = None) -> tuple[bool, int]:
        now = time.monotonic() if now is None else now
        with self._lock:
            state = self._state.get(key)
            if state is None:
                if len(self._state) > 10_000:
                    self._state.clear()
                self._state[key] = [now, 0]
                return True, 0
            if now - state[0] >= self.window:
                repeats, state[0], state[1] = state[1], now, 0
                return True, repeats
            state[1] += 1
            return False, state[1]

    def clear(self) -> None:
        with self._lock:
            self._state.clear()


def repeat_suffix(repeats: int, window: float = REPEAT_WINDOW_SECONDS) -> str:
    if not repeats:
        return ""
    minutes = round(window / 60)
    return f" (repeated {repeats} time{'s' if repeats != 1 else ''} in the last {minutes} minutes)"


class RepeatFilter(logging.Filter):
    """A warning (or worse) with the same logger, level and text passes once per window, with its count."""

    def __init__(self, name: str = "", window: float = REPEAT_WINDOW_SECONDS):
        super().__init__(name)
        self.repeats = Repeats(window)
        _filters.add(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "repeats", None) is not None:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        emit, repeats = self.repeats.seen((record.name, record.levelno, message))
        if emit and repeats:
            record.msg, record.args = message + repeat_suffix(repeats, self.repeats.window), ()
            record.repeats = repeats
        return emit


_call_sites = Repeats()
_filters: "weakref.WeakSet[RepeatFilter]" = weakref.WeakSet()


def repeats_forget() -> None:
    """Every count of repeats in this process dropped: the next line of each kind is written as new
    (the tests start each from here, so a line one test logged does not come back to another with a
    count, once a run has gone on longer than the window)."""
    _call_sites.clear()
    for f in list(_filters):
        f.repeats.clear()


def warn_repeating(logger: logging.Logger, message: str, *args, key=None, level: int = logging.WARNING,
                   repeats: Repeats | None = None) -> bool:
    """Log ``message % args`` once, then at most once every five minutes with the number of repeats.

    ``key`` tells one repeating line from another (default: the logger, message and args).
    Returns True when a line was written."""
    book = repeats or _call_sites
    emit, count = book.seen((logger.name, message, args) if key is None else (logger.name, key))
    if emit:
        logger.log(level, message + repeat_suffix(count, book.window), *args, extra={"repeats": count})
    return emit


def logging_config(*, fmt: str, level: str, loggers: dict) -> dict:
    """The LOGGING dict: one console handler, plain or JSON, with the two filters. `fmt` and `level` are
    read by :func:`log_format_name` and :func:`log_level_name` (any case, empty means the default); another
    value raises ImproperlyConfigured naming the setting and the values it takes, rather than a dictConfig
    ValueError (level) or plain lines (format)."""
    from django.core.exceptions import ImproperlyConfigured
    try:
        fmt, level = log_format_name(fmt), log_level_name(level)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    formatters = {
        "plain": {"()": "ugent_common.logs.PlainFormatter", "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "pythonjsonlogger.json.JsonFormatter",
                 "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
                 "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"}},
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"secrets": {"()": "ugent_common.logs.RedactSecrets"},
                    "repeats": {"()": "ugent_common.logs.RepeatFilter"}},
        "formatters": formatters,
        "handlers": {"console": {"class": "logging.StreamHandler",
                                 "formatter": fmt,
                                 "filters": ["repeats", "secrets"]}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": loggers,
    }
