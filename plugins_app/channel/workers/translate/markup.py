"""HTML pages (``.html``, ``.htm``) as units, read with the standard library's html.parser.

(lxml is installed too, but it writes a page back as it understands it, not as it was: html.parser
reports where each tag and text starts, so the page is cut at those places and written back exactly.)

* Sent: each text node with a letter in it (outside its entities), in the page's order, its leading and trailing white space
  kept apart (written back as it was), and the quoted value of an ``alt`` or ``title`` attribute (what
  a reader hears or sees in a tooltip). Entities go as written (``&amp;``), and the answer is written
  as it comes but for a ``<`` that would open a tag (written ``&lt;``) and, in an attribute, its quote
  (``&quot;`` or ``&#39;``).
* Never sent: tags, other attributes, an unquoted ``alt``/``title`` value, comments,
  the doctype, the contents of ``script``, ``style``, ``code``, ``pre``, ``kbd``, ``samp``, ``var``,
  ``textarea``, ``template``, ``svg`` and ``math``, and the ``head`` but for its ``title``. The head
  ends at ``</head>``, ``<body>``, any other start tag a head cannot hold (HEAD_ELEMENTS), or text with
  words in it, as a browser has it: both tags are optional.
* Refused (DocumentError): a file with no tag at all, a file that ends inside a tag or a comment, and
  one of the elements above never closed (its end would be guessed, and code could be sent as text).
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

from .units import DocumentError

#: Elements whose content is never sent.
SKIPPED = frozenset({"script", "style", "code", "pre", "kbd", "samp", "var", "textarea", "template", "svg", "math"})
#: The elements a head can hold: any other start tag ends it, as in a browser.
HEAD_ELEMENTS = frozenset({"head", "title", "meta", "link", "base", "style", "script", "noscript", "template"})
_OPENS_MARKUP = re.compile(r"<(?=[A-Za-z/!?])")
_TEXT = ("data", "entityref", "charref")
_ENTITY = re.compile(r"&#?[A-Za-z0-9]+;")


def _has_words(text: str) -> bool:
    """A letter outside entities: ``&nbsp;`` or ``&copy; 2024`` alone is nothing to translate."""
    return any(c.isalpha() for c in _ENTITY.sub("", text))

#: The attributes whose (quoted) values are sent.
TRANSLATED_ATTRIBUTES = ("alt", "title")
# a start tag's name, then its attributes one after another, as html.parser reads them
_TAG_NAME = re.compile(r"<[a-zA-Z][^\t\n\r\f />\x00]*(?:\s|/(?!>))*")
_ATTRIBUTE = re.compile(r"((?<=['\"\s/])[^\s/>][^\s/=>]*)(\s*=+\s*('[^']*'|\"[^\"]*\"|(?!['\"])[^>\s]*))?(?:\s|/(?!>))*")


class _Events(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.events: list[tuple[tuple[int, int], str, str]] = []
        self.tags: dict[int, str] = {}  # event index -> the start tag as written

    def _add(self, kind: str, value: str = "") -> None:
        self.events.append((self.getpos(), kind, value))

    def handle_starttag(self, tag, attrs):
        self._add("start", tag)
        self.tags[len(self.events) - 1] = self.get_starttag_text()

    def handle_startendtag(self, tag, attrs):
        self._add("startend", tag)
        self.tags[len(self.events) - 1] = self.get_starttag_text()

    def handle_endtag(self, tag):
        self._add("end", tag)

    def handle_data(self, data):
        self._add("data", data)

    def handle_entityref(self, name):
        self._add("entityref", name)

    def handle_charref(self, name):
        self._add("charref", name)

    def handle_comment(self, data):
        self._add("comment")

    def handle_decl(self, decl):
        self._add("decl")

    def handle_pi(self, data):
        self._add("pi")

    def unknown_decl(self, data):
        self._add("decl")


def _attribute_values(tag: str) -> list[tuple[int, int, str]]:
    """(start, end, quote) of the quoted alt/title values in a start tag as written, offsets in it."""
    m = _TAG_NAME.match(tag)
    if not m:
        return []
    out, k = [], m.end()
    while k < len(tag):
        a = _ATTRIBUTE.match(tag, k)
        if not a or a.end() == k:
            break
        value = a.group(3)
        if (a.group(1).lower() in TRANSLATED_ATTRIBUTES and value and value[0] in "'\""
                and _has_words(value)):
            start = a.start(3) + 1
            core = value[1:-1]
            start += len(core) - len(core.lstrip())
            out.append((start, start + len(core.strip()), value[0]))
        k = a.end()
    return out


def parse_html(text: str) -> tuple[list[dict], str]:
    parser = _Events()
    parser.feed(text)
    parser.close()
    starts, pos = [], 0
    for line in text.split("\n"):
        starts.append(pos)
        pos += len(line) + 1

    def offset(p: tuple[int, int]) -> int:
        return starts[p[0] - 1] + p[1]

    if parser.rawdata:
        line = text.count("\n", 0, len(text) - len(parser.rawdata)) + 1
        raise DocumentError(f"not a well-formed HTML file: the element whose content starts at line {line} "
                            f"(a script or a style) is never closed: {parser.rawdata[:60]!r}")
    events = [(offset(p), kind, value) for p, kind, value in parser.events]
    if not any(kind in ("start", "startend", "decl") for _, kind, _ in events):
        raise DocumentError("not an HTML file: it holds no tag")
    units: list[dict] = []
    done = 0
    open_skipped: list[tuple[str, int]] = []  # (tag, line) of the skipped elements open
    in_head = in_title = False
    i = 0
    while i < len(events):
        at, kind, value = events[i]
        if kind == "data" and value == "<" and _OPENS_MARKUP.match(text, at):
            line = text.count("\n", 0, at) + 1
            raise DocumentError(f"not a well-formed HTML file: line {line}: the file ends inside a tag or a comment "
                                f"that is never closed: {text[at:at + 60]!r}")
        if kind in _TEXT:
            j = i
            while j < len(events) and events[j][1] in _TEXT and not (
                    events[j][2] == "<" and _OPENS_MARKUP.match(text, events[j][0])):
                j += 1
            end = events[j][0] if j < len(events) else len(text)
            node = text[at:end]
            core = node.strip()
            if core and in_head and not in_title and not open_skipped and _has_words(core):
                in_head = False  # text with words cannot be in a head: the body began (its tag is optional)
            if core and not open_skipped and (in_title or not in_head) and _has_words(core):
                core_start = at + (len(node) - len(node.lstrip()))
                units.append({"before": text[done:core_start], "texts": [[len(units) + 1, core]]})
                done = core_start + len(core)
            i = j
            continue
        if kind in ("start", "startend") and in_head and not open_skipped and value not in HEAD_ELEMENTS:
            in_head = False  # a tag that cannot be in a head: the body began (</head> and <body> are optional)
        if kind in ("start", "startend") and not open_skipped and not in_head:
            for start, end, quote in _attribute_values(parser.tags[i]):
                units.append({"before": text[done:at + start], "texts": [[len(units) + 1, text[at + start:at + end]]],
                              "quote": quote})
                done = at + end
        if kind == "start":
            if value in SKIPPED:
                open_skipped.append((value, text.count("\n", 0, at) + 1))
            elif value == "head":
                in_head = True
            elif value == "title":
                in_title = True
            elif value == "body":
                in_head = False
        elif kind == "end":
            if value in SKIPPED and any(t == value for t, _ in open_skipped):
                while open_skipped and open_skipped.pop()[0] != value:
                    pass
            elif value == "head":
                in_head = False
            elif value == "title":
                in_title = False
        i += 1
    if open_skipped:
        tag, line = open_skipped[-1]
        raise DocumentError(f"not a well-formed HTML file: the <{tag}> opened at line {line} is never closed "
                            f"(its content is never translated, and where it ends cannot be told)")
    return units, text[done:]


def render_html(unit: dict, texts: dict[int, str], lang: str | None, notes: list[str]) -> str:
    [[mark, source]] = unit["texts"]
    answer = texts.get(mark)
    if answer is None:
        return source
    answer = _OPENS_MARKUP.sub("&lt;", answer.strip())
    quote = unit.get("quote")
    if quote:
        answer = answer.replace(quote, "&quot;" if quote == '"' else "&#39;")
    return answer
