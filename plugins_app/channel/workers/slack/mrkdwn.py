"""Markdown (what the agent writes) to Slack's mrkdwn, and Slack's message text back to plain text.

Slack's markup differs from Markdown: ``*bold*``, ``_italic_``, ``~strike~``, ``<url|label>`` links,
no headings, and ``&``, ``<``, ``>`` must be escaped as ``&amp;``, ``&lt;``, ``&gt;`` (Slack's
"Formatting text for app surfaces"). Escaping everything but a line's leading ``>`` (a quote)
also means an answer can never ping ``<!channel>`` or a user by accident: mentions stay text.
"""
from __future__ import annotations

import html
import re

_FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:\n)?```", re.DOTALL)
_INLINE = re.compile(r"`([^`\n]+)`")
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_AUTOLINK = re.compile(r"&lt;(https?://[^\s&]+|mailto:[^\s&]+)&gt;")
_BOLD = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_ITALIC_STAR = re.compile(r"(?<![\w*\x01])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_QUOTE = re.compile(r"^ {0,3}>\s?")
_RULE = re.compile(r"^ {0,3}([-*_])(\s*\1){2,}\s*$")

_HOLD = "\x00{}\x00"
_HELD = re.compile(r"\x00(\d+)\x00")


def escape(text: str) -> str:
    """Slack's three control characters as entities (nothing else is HTML-escaped)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_mrkdwn(markdown: str) -> str:
    """Markdown as Slack mrkdwn: emphasis, links, headings, lists, quotes, code kept verbatim."""
    held: list[str] = []

    def hold(value: str) -> str:
        held.append(value)
        return _HOLD.format(len(held) - 1)

    # Code first: nothing inside is converted, only escaped. Slack shows a fence's language as text.
    text = _FENCED.sub(lambda m: hold("```\n" + escape(m.group(1)) + "\n```"), markdown)
    text = _INLINE.sub(lambda m: hold("`" + escape(m.group(1)) + "`"), text)
    lines = []
    for line in text.split("\n"):
        quote = ""
        m = _QUOTE.match(line)
        if m:
            quote, line = ">", line[m.end():]
        if _RULE.match(line):
            line = "―――"
        else:
            h = _HEADING.match(line)
            if h:
                line = "**" + h.group(1) + "**"
            line = _BULLET.sub(lambda b: b.group(1) + "• ", line)
        lines.append(quote + (" " if quote and line else "") + line if quote else line)
    text = "\n".join(lines)
    # Escape, keeping the quote markers that start lines.
    text = "\n".join(_escape_line(line) for line in text.split("\n"))
    text = _IMAGE.sub(lambda m: hold(f"<{m.group(2)}|{m.group(1) or m.group(2)}>"), text)
    text = _LINK.sub(lambda m: hold(f"<{m.group(2)}|{m.group(1)}>"), text)
    text = _AUTOLINK.sub(lambda m: hold(f"<{m.group(1)}>"), text)
    text = _BOLD.sub(lambda m: "\x01" + m.group(2) + "\x01", text)
    text = _ITALIC_STAR.sub(lambda m: "_" + m.group(1) + "_", text)
    text = _STRIKE.sub(lambda m: "~" + m.group(1) + "~", text)
    text = text.replace("\x01", "*")
    while _HELD.search(text):
        text = _HELD.sub(lambda m: held[int(m.group(1))], text)
    return text


def _escape_line(line: str) -> str:
    if line.startswith(">"):
        return ">" + escape(line[1:])
    return escape(line)


# -- inbound: Slack's message text as the agent should read it ---------------------------

_ANGLE = re.compile(r"<([^<>]+)>")


def to_plain(text: str, *, bot_user_id: str | None = None) -> str:
    """Slack message text as plain text: ``<@U1>`` → ``@U1``, ``<#C1|general>`` → ``#general``,
    ``<https://x|label>`` → ``label (https://x)``, entities unescaped; a leading mention of the bot
    itself is dropped, so ``@bot /ask x`` reads ``/ask x`` to the rules."""
    if bot_user_id:
        text = re.sub(rf"^\s*<@{re.escape(bot_user_id)}(\|[^>]*)?>[\s:,]*", "", text)

    def one(m: re.Match) -> str:
        inner = m.group(1)
        target, _, label = inner.partition("|")
        if target.startswith("@"):
            return "@" + (label or target[1:])
        if target.startswith("#"):
            return "#" + (label or target[1:])
        if target.startswith("!"):
            name = target[1:].split("^")[0]
            return label or ("@" + name if name in ("here", "channel", "everyone") else name)
        if label and label != target:
            return f"{label} ({target})"
        return target.removeprefix("mailto:") if target.startswith("mailto:") and not label else target

    return html.unescape(_ANGLE.sub(one, text)) if "&" in text else _ANGLE.sub(one, text)
