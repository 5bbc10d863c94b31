"""Outbound text for platforms with a length limit: split an answer into messages that fit.

``split_text`` cuts at the last paragraph break that fits, else the last line
break, else the last space, else hard; a fenced code block cut in two is closed
at the end of one part and reopened (with its language) at the start of the next,
so each message renders on its own. ``measure`` says how the platform counts:
``len`` for code points (Discord, Slack), ``utf16_len`` for Telegram. ``shorten`` fits a button's label;
``unsent_note`` is the line an answer carries in place of a file the platform will not take.
"""
from __future__ import annotations

import re
from typing import Callable

_FENCE = re.compile(r"^```(\S*)", re.MULTILINE)


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, as Telegram counts message length and entity offsets."""
    return len(text.encode("utf-16-le")) // 2


def _fit(text: str, limit: int, measure: Callable[[str], int]) -> int:
    """The longest prefix length (in code points) of ``text`` that measures within ``limit``."""
    if measure(text) <= limit:
        return len(text)
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if measure(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _open_fence(text: str) -> str | None:
    """The language tag of a code fence ``text`` leaves open ('' for none), or None when all are closed."""
    fences = _FENCE.findall(text)
    return fences[-1] if len(fences) % 2 else None


def split_text(text: str, limit: int, *, measure: Callable[[str], int] = len) -> list[str]:
    """``text`` as parts that each measure at most ``limit``; joined, they read as the original."""
    if limit < 16:
        raise ValueError("limit must leave room for a code fence")
    parts: list[str] = []
    reopen = ""
    rest = text
    while rest:
        budget = limit - measure(reopen) - 4  # room to close a fence ("\n```")
        piece = reopen + rest
        if measure(piece) <= limit:
            parts.append(piece)
            break
        n = _fit(rest, budget, measure)
        head = rest[:n]
        cut = next((i for i in (head.rfind("\n\n"), head.rfind("\n"), head.rfind(" ")) if i > n // 4), n)
        head, rest = rest[:cut], rest[cut:].lstrip("\n ") if cut < n else rest[cut:]
        piece = reopen + head
        lang = _open_fence(piece)
        if lang is not None:
            piece = piece.rstrip("\n") + "\n```"
            reopen = f"```{lang}\n"
        else:
            reopen = ""
        parts.append(piece)
    return [p for p in parts if p.strip()]


def shorten(label: str, limit: int, *, measure: Callable[[str], int] = len) -> str:
    """``label`` on one line within ``limit`` (as ``measure`` counts: ``utf16_len`` for LINE): whole when it
    fits, else cut (at a space when one is in the second half of what fits) and ended with an ellipsis. For a
    button's label, where the platform refuses a longer one."""
    label = " ".join(label.split())
    if measure(label) <= limit:
        return label
    cut = label[:_fit(label, limit - 1, measure)]
    space = cut.rfind(" ")
    if space >= len(cut) // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.-") + "\u2026"


def unsent_note(attachment, why: str) -> str:
    """The line sent in place of a file the platform will not take (``attachment``: an ``Attachment``), so the
    user knows it exists: ``[report.pdf was not sent: <why>]``."""
    kind = attachment.kind or "file"
    name = attachment.filename or ("an " if kind[:1] in "aeiou" else "a ") + kind
    return f"[{name} was not sent: {why}]"
