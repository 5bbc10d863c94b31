"""split_text: each part fits the platform's limit, and the parts read as the whole."""
import pytest
from hypothesis import given, settings, strategies as st

from plugins_app.channel.sdk.text import split_text, utf16_len

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers


def test_a_short_text_is_one_part():
    assert split_text("hello", 4096) == ["hello"]


def test_it_cuts_at_a_paragraph_break_before_a_line_or_a_word():
    text = "a" * 30 + "\n\n" + "b" * 30 + "\n" + "c" * 30
    assert split_text(text, 70) == ["a" * 30, "b" * 30 + "\n" + "c" * 30]


def test_a_code_block_cut_in_two_is_closed_and_reopened_with_its_language():
    text = "intro\n```python\n" + "\n".join(f"x = {i}" for i in range(40)) + "\n```\nafter"
    parts = split_text(text, 120)
    assert len(parts) > 2
    for part in parts[:-1]:
        assert part.count("```") % 2 == 0, part
    assert all(p.startswith("```python\n") for p in parts[1:-1])
    assert all(len(p) <= 120 for p in parts)


def test_telegram_counts_utf16_units_so_emoji_take_two():
    text = "😀" * 3000
    parts = split_text(text, 4096, measure=utf16_len)
    assert all(utf16_len(p) <= 4096 for p in parts)
    assert "".join(parts) == text


@settings(max_examples=200)
@given(st.text(alphabet=st.sampled_from(list("ab \n😀é")), max_size=600), st.integers(16, 200))
def test_every_part_fits_and_no_word_is_lost(text, limit):
    parts = split_text(text, limit, measure=utf16_len)
    assert all(utf16_len(p) <= limit for p in parts)
    assert "".join(text.split()) == "".join("".join(parts).split())
