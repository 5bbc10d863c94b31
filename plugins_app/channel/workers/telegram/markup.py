"""Markdown, as models write it, in Telegram's MarkdownV2; a delivery's options as an inline keyboard."""
from __future__ import annotations

import re

_V2_SPECIAL = re.compile(r"([_*\[\]()~`>#+\-=|{}.!\\])")
_INLINE = re.compile(
    r"(?P<code>(?P<ticks>`+)(?P<code_body>.+?)(?P=ticks))"
    r"|(?P<link>\[(?P<link_text>[^\]\n]+)\]\((?P<link_url>[^)\s]+)\))"
    r"|(?P<bold>\*\*(?P<bold_body>.+?)\*\*|(?<!\w)__(?P<bold2_body>.+?)__(?!\w))"
    r"|(?P<strike>~~(?P<strike_body>.+?)~~)"
    r"|(?P<em>(?<![\w*])\*(?![\s*])(?P<em_body>.+?)(?<![\s*])\*(?![\w*])"
    r"|(?<![\w_])_(?![\s_])(?P<em2_body>.+?)(?<![\s_])_(?![\w_]))")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_ORDERED = re.compile(r"^(\s*)(\d{1,9})[.)]\s+(.*)$")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_FENCE_LINE = re.compile(r"^\s{0,3}```\s*([\w+#.-]*)\s*$")


def escape_v2(text: str) -> str:
    """Plain text for MarkdownV2: every reserved character escaped."""
    return _V2_SPECIAL.sub(r"\\\1", text)


def _escape_code(text: str) -> str:
    return text.replace("\\", "\\\\").replace("`", "\\`")


def _inline(text: str, inside: frozenset = frozenset()) -> str:
    """One line's inline markup. `inside`: the entities around it. MarkdownV2 has no italic within italic
    (`_` + `_a_` reads as `__`, underline) nor the like for bold and strikethrough, so an entity already
    open keeps its text and drops its own markers."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(escape_v2(text[pos:m.start()]))
        if m.group("code"):
            out.append(f"`{_escape_code(m.group('code_body').strip() or m.group('code_body'))}`")
        elif m.group("link"):
            url = m.group("link_url").replace("\\", "\\\\").replace(")", "\\)")
            out.append(f"[{_inline(m.group('link_text'), inside)}]({url})")
        else:
            kind, marker, body = (("bold", "*", m.group("bold_body") or m.group("bold2_body")) if m.group("bold")
                                  else ("strike", "~", m.group("strike_body")) if m.group("strike")
                                  else ("em", "_", m.group("em_body") or m.group("em2_body")))
            if kind in inside:
                out.append(_inline(body, inside))
            else:
                out.append(f"{marker}{_inline(body, inside | {kind})}{marker}")
        pos = m.end()
    out.append(escape_v2(text[pos:]))
    return "".join(out)


def markdown_to_v2(text: str) -> str:
    """Common Markdown (what models write) as Telegram MarkdownV2.

    Bold, italic, strikethrough, inline code, fenced code (with its language), links, headings
    (bold), quotes, lists and rules; everything else is text with every reserved character escaped.
    """
    lines, out = text.split("\n"), []
    fence: list[str] | None = None
    lang = ""
    for line in lines:
        m = _FENCE_LINE.match(line)
        if fence is not None:
            if m and not m.group(1):
                out.append(f"```{lang}\n" + "\n".join(_escape_code(x) for x in fence) + "\n```")
                fence = None
            else:
                fence.append(line)
            continue
        if m:
            fence, lang = [], m.group(1)
            continue
        if (h := _HEADING.match(line)):
            out.append(f"*{_inline(h.group(1))}*")
        elif _RULE.match(line):
            out.append("\u2014" * 8)
        elif (q := _QUOTE.match(line)):
            out.append(">" + _inline(q.group(1)))
        elif (b := _BULLET.match(line)):
            out.append(f"{b.group(1)}\u2022 {_inline(b.group(2))}")
        elif (o := _ORDERED.match(line)):
            out.append(f"{o.group(1)}{o.group(2)}\\. {_inline(o.group(3))}")
        else:
            out.append(_inline(line))
    if fence is not None:  # an unclosed fence: close it, as the renderer of the web page would
        out.append(f"```{lang}\n" + "\n".join(_escape_code(x) for x in fence) + "\n```")
    return "\n".join(out)


def keyboard_of(metadata: dict) -> dict | None:
    """A delivery's ``options`` (strings, or ``{"label", "value"}``) as an inline keyboard, one button a row."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not options:
        return None
    rows = []
    for opt in options[:100]:
        if isinstance(opt, dict):
            label, value = str(opt.get("label") or opt.get("value") or ""), str(opt.get("value") or opt.get("label"))
        else:
            label = value = str(opt)
        if label:
            # callback_data is at most 64 bytes: a longer value is cut (the label still shows it whole)
            rows.append([{"text": label[:128], "callback_data": value.encode()[:64].decode(errors="ignore")}])
    return {"inline_keyboard": rows} if rows else None
