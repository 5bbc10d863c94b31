"""Markdown, as models write it, in WhatsApp's formatting; an answer split at WhatsApp's 4,096 characters.

WhatsApp marks ``*bold*``, ``_italic_``, ``~strikethrough~``, ``` ```monospace``` ``` and
``inline code`` with backticks, ``> `` quotes and ``- `` / ``1. `` lists, and has no escape
character. So the conversion is deliberately small: the Markdown forms that differ are rewritten
(``**b**``/``__b__`` → ``*b*``, ``*i*`` → ``_i_``, ``~~s~~`` → ``~s~``, ``# Heading`` → ``*Heading*``,
``[text](url)`` → ``text (url)``, ``* item``/``+ item`` → ``- item``, a fence's language dropped),
code and bare URLs are left exactly as written, and everything else is the model's text unchanged.
"""
from __future__ import annotations

import re

from plugins_app.channel.sdk.text import split_text

#: WhatsApp's limit on a text message's body, in characters.
TEXT_LIMIT = 4096

_INLINE = re.compile(
    r"(?P<code>(?P<ticks>`+)(?P<code_body>.+?)(?P=ticks))"
    r"|(?P<image>!\[(?P<image_text>[^\]\n]*)\]\((?P<image_url>[^)\s]+)\))"
    r"|(?P<link>\[(?P<link_text>[^\]\n]+)\]\((?P<link_url>[^)\s]+)\))"
    r"|(?P<url>\b(?:https?|ftp)://[^\s<>]+)"   # a bare URL: its "__init__" or "*foo*" are not emphasis
    r"|(?P<both>\*\*\*(?P<both_body>[^*\n]+?)\*\*\*)"
    r"|(?P<bold>\*\*(?P<bold_body>.+?)\*\*|(?<!\w)__(?P<bold2_body>.+?)__(?!\w))"
    r"|(?P<strike>~~(?P<strike_body>.+?)~~)"
    r"|(?P<em>(?<![\w*])\*(?![\s*])(?P<em_body>.+?)(?<![\s*])\*(?![\w*])"
    r"|(?<![\w_])_(?![\s_])(?P<em2_body>.+?)(?<![\s_])_(?![\w_]))")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_FENCE_LINE = re.compile(r"^\s{0,3}```\s*([\w+#.-]*)\s*$")


def _inline(text: str, inside: frozenset = frozenset()) -> str:
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(text[pos:m.start()])
        if m.group("code") or m.group("url"):
            out.append(m.group(0))
        elif m.group("image"):
            label = m.group("image_text")
            out.append(f"{label} ({m.group('image_url')})" if label else m.group("image_url"))
        elif m.group("both"):
            body = _inline(m.group("both_body"), inside | {"bold", "em"})
            out.append(body if {"bold", "em"} <= inside else f"*_{body}_*")
        elif m.group("link"):
            label, url = _inline(m.group("link_text"), inside), m.group("link_url")
            out.append(url if label == url else f"{label} ({url})")
        else:
            kind, marker, body = (("bold", "*", m.group("bold_body") or m.group("bold2_body")) if m.group("bold")
                                  else ("strike", "~", m.group("strike_body")) if m.group("strike")
                                  else ("em", "_", m.group("em_body") or m.group("em2_body")))
            # a marker inside the same kind would close it early: the inner span keeps its text only
            out.append(_inline(body, inside) if kind in inside else f"{marker}{_inline(body, inside | {kind})}{marker}")
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def to_whatsapp(markdown: str) -> str:
    """Common Markdown as WhatsApp formatting (see the module docstring)."""
    out: list[str] = []
    fence: list[str] | None = None
    opening = ""
    for line in markdown.split("\n"):
        m = _FENCE_LINE.match(line)
        if fence is not None:
            if m and not m.group(1):
                if "".join(fence).strip():  # an empty block would show as six backticks
                    out.append("```" + "\n".join(fence) + "```")
                fence = None
            else:
                fence.append(line)
            continue
        if m:
            fence, opening = [], line
            continue
        if (h := _HEADING.match(line)):
            out.append(f"*{_inline(h.group(1), frozenset({'bold'}))}*")
        elif _RULE.match(line):
            out.append("\u2014" * min(8, len(line.strip())))  # never longer than the rule written
        elif (b := _BULLET.match(line)):
            out.append(f"{b.group(1)}- {_inline(b.group(2))}")
        else:
            out.append(_inline(line))
    if fence is not None and "".join(fence).strip():  # an unclosed fence: closed, as a Markdown renderer would,
        block = "```" + "\n".join(fence) + "```"       # unless that is longer than the lines as written
        source = "\n".join([opening, *fence])
        out.append(block if len(block) <= len(source) else source)
    return "\n".join(out)


def message_parts(markdown: str, limit: int = TEXT_LIMIT) -> list[str]:
    """An answer as the bodies of the text messages that carry it, each within ``limit`` characters.

    The Markdown is split first (``split_text`` closes and reopens a code fence cut in two), each
    part converted; conversion never makes a part longer than its Markdown, and should a converted
    part still measure over the limit, its Markdown is split again with a smaller limit and each
    piece converted: converted text is never split (``split_text`` would read WhatsApp's
    `````first line`` as a fence with a language)."""
    parts: list[str] = []
    for piece in split_text(markdown, limit) if markdown.strip() else []:
        parts.extend(_converted(piece, limit))
    return [p for p in parts if p.strip()]


def _converted(piece: str, limit: int) -> list[str]:
    converted = to_whatsapp(piece)
    over = len(converted) - limit
    if over <= 0 or len(piece) <= 16:
        return [converted]
    smaller = max(16, min(limit, len(piece)) - over)
    return [c for sub in split_text(piece, smaller) for c in _converted(sub, limit)]
