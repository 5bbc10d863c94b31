"""Numbers read from text: ASCII digits only.

``str.isdigit()`` is true for more than 0-9: superscripts (``"²"``) and other digits that ``int()``
refuses (a ValueError where a guard was meant to prevent one), and the digits of other scripts
(``"١٢"``, Arabic-Indic) that ``int()`` reads as 12. Where a number comes from outside (a cursor, an
item's number typed in chat, a header, a message id), only ``0``-``9`` spell one: every such read goes
through :func:`ascii_int`.
"""
from __future__ import annotations

import re

_DIGITS = re.compile(r"[0-9]+")


def ascii_int(text, *, max_digits: int | None = None) -> int | None:
    """The non-negative integer ``text`` spells in ASCII digits, or None: for anything else (another
    script's digits, a sign, spaces, not a string) and for more than ``max_digits`` digits."""
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        return None
    if max_digits is not None and len(text) > max_digits:
        return None
    return int(text)
