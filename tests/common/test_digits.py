"""ugent_common.digits: only 0-9 spell a number (str.isdigit() also takes "²", which int() refuses, and
"١٢", which int() reads as 12)."""
from __future__ import annotations

import pytest

from ugent_common.digits import ascii_int


@pytest.mark.parametrize("text, expected", [("0", 0), ("12", 12), ("007", 7), ("9" * 19, int("9" * 19))])
def test_ascii_digits_are_read(text, expected):
    assert ascii_int(text) == expected


@pytest.mark.parametrize("text", ["", "²", "⁵", "1²", "١٢", "１２", "-1", "+1", " 1", "1 ", "1.0", "0x1", "1_000",
                                  None, 12, b"12"])
def test_anything_else_is_none(text):
    assert ascii_int(text) is None


def test_more_digits_than_allowed_is_none():
    assert ascii_int("1" * 19, max_digits=19) == int("1" * 19)
    assert ascii_int("1" * 20, max_digits=19) is None
