"""gettext catalogs (``.po``, and ``.pot`` templates, whose translations come out as ``.po``) as units.

A small parser of its own (no dependency): entries are runs of comment lines (``#``), then keywords
(``msgctxt``, ``msgid``, ``msgid_plural``, ``msgstr``, ``msgstr[n]``), each with a quoted string and its
continuation lines. What it cannot read for sure is refused (DocumentError, with the line): the pipeline
never writes a catalog it half understood.

* Sent: the ``msgid`` (and ``msgid_plural``) of each entry whose ``msgstr`` is empty or that is
  ``fuzzy``. An entry already translated, an obsolete entry (``#~``), a comment block and the text
  between entries are written back byte for byte.
* Written: a translated entry keeps its comments, references, flags (``fuzzy`` dropped, with the
  ``#|`` previous-msgid lines that go with it), ``msgctxt`` and ``msgid`` as they were; only its
  ``msgstr`` lines are new. The header entry keeps everything but ``Language:`` (the target, as
  gettext spells it: ``pt_BR``), ``Plural-Forms:`` (set when PLURAL_FORMS knows the target, added when
  the catalog has plurals and no such line) and a template's ``charset=CHARSET`` (UTF-8, what the
  pipeline writes). A catalog with no header entry gets a minimal one first.
* Refused (language_problem): a catalog whose header's ``Language:`` is set and is not the target: its
  translations and plural forms are another language's.
* Placeholders: the answer for a text must hold the same printf (``%s``, ``%d``, ``%(name)s``,
  ``%1$s``, ``%%``) and brace (``{name}``, ``{0}``, ``{}``) placeholders as the text, as many of each,
  the plain ones (``%s``, ``{}``: each takes the next argument) in their order; numbered and named ones
  may move. If not, the entry is left as it was and marked ``fuzzy``.
* Plurals: the target's number of forms comes from PLURAL_FORMS. One form: ``msgstr[0]`` is the
  plural's translation; two: the singular's, then the plural's. A language with more forms, or one
  not in the table (written with two forms), gets the singular's translation in ``msgstr[0]``, the
  plural's in the others, and the entry is marked ``fuzzy``: a translator must check those forms. For
  a target not in the table the number of forms is the header's ``nplurals``, or, when the header has
  no rule (a template's ``nplurals=INTEGER``), two, with GUESSED_PLURAL_FORMS in the header (gettext
  refuses plural entries with no rule).
"""
from __future__ import annotations

import re

from .units import DocumentError

#: gettext's Plural-Forms for the targets the pipeline knows (the gettext manual's table); a target
#: not here gets two forms and its plural entries are marked fuzzy.
PLURAL_FORMS = {
    "ja": "nplurals=1; plural=0;", "ko": "nplurals=1; plural=0;", "zh": "nplurals=1; plural=0;",
    "vi": "nplurals=1; plural=0;", "th": "nplurals=1; plural=0;", "id": "nplurals=1; plural=0;",
    "en": "nplurals=2; plural=(n != 1);", "de": "nplurals=2; plural=(n != 1);", "nl": "nplurals=2; plural=(n != 1);",
    "sv": "nplurals=2; plural=(n != 1);", "da": "nplurals=2; plural=(n != 1);", "nb": "nplurals=2; plural=(n != 1);",
    "fi": "nplurals=2; plural=(n != 1);", "el": "nplurals=2; plural=(n != 1);", "es": "nplurals=2; plural=(n != 1);",
    "it": "nplurals=2; plural=(n != 1);", "pt-PT": "nplurals=2; plural=(n != 1);",
    "fr": "nplurals=2; plural=(n > 1);", "pt-BR": "nplurals=2; plural=(n > 1);",
    "ru": "nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
    "uk": "nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
    "pl": "nplurals=3; plural=(n==1 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
    "cs": "nplurals=3; plural=(n==1) ? 0 : (n>=2 && n<=4) ? 1 : 2;",
    "ro": "nplurals=3; plural=(n==1 ? 0 : (n==0 || (n%100 > 0 && n%100 < 20)) ? 1 : 2);",
    "ar": "nplurals=6; plural=(n==0 ? 0 : n==1 ? 1 : n==2 ? 2 : n%100>=3 && n%100<=10 ? 3 : n%100>=11 ? 4 : 5);",
}
#: The Plural-Forms written for a target not in the table into a catalog whose header has no rule.
GUESSED_PLURAL_FORMS = "nplurals=2; plural=(n != 1);"
#: Languages whose plural rule depends on the region: never looked up by the language alone.
_BY_REGION_ONLY = ("pt",)

_KEYWORD = re.compile(r'^(msgctxt|msgid_plural|msgid|msgstr(?:\[(\d+)\])?)[ \t]+(".*)$')
_STRING = re.compile(r'^"((?:[^"\\]|\\.)*)"[ \t]*$')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "v": "\v",
            "'": "'", "?": "?"}
_PRINTF = re.compile(r"%(?:\d+\$)?(?:\([A-Za-z_][\w.-]*\))?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?"
                     r"(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGcrsa%]")
_BRACE = re.compile(r"\{\{|\}\}|\{[A-Za-z_0-9]*(?:[.\[][^{}:!]*)?(?:![rsa])?(?::[^{}]*)?\}")


def same_language(header: str, target: str) -> bool:
    """Whether a catalog's ``Language:`` (gettext's ``pt_BR``) names the target (BCP 47's ``pt-BR``)."""
    return header.replace("_", "-").lower() == target.replace("_", "-").lower()


def language_problem(units: list[dict], langs: list[str]) -> str | None:
    """Why a catalog cannot go into these languages: its header names another language (its msgstrs are
    translations into that one, its plural forms that one's), or None."""
    header = next((u.get("language") or "" for u in units if "header" in u), "")
    other = [lang for lang in langs if not same_language(header, lang)] if header else []
    if not other:
        return None
    return (f"the catalog is in {header} (its header's Language:), not {', '.join(other)}: its translations "
            f"and plural forms are {header}'s; drop its template (.pot), or a catalog whose Language: is empty "
            "or the target")


def plural_forms(lang: str | None) -> str | None:
    if not lang:
        return None
    base = lang.split("-")[0]
    return PLURAL_FORMS.get(lang) or (None if base in _BY_REGION_ONLY else PLURAL_FORMS.get(base))


def nplurals(lang: str | None) -> int | None:
    forms = plural_forms(lang)
    return int(re.search(r"nplurals=(\d+)", forms).group(1)) if forms else None


def placeholders(text: str) -> list[str]:
    """The printf and brace placeholders of a text, sorted (as many of each as it holds)."""
    return sorted(_PRINTF.findall(text) + _BRACE.findall(text))


def _movable(p: str) -> bool:
    """A placeholder a translation may move: numbered (``%1$s``, ``{0}``), named (``%(name)s``, ``{name}``),
    or one that takes no argument (``%%``, ``{{``, ``}}``). A plain one (``%s``, ``{}``) takes the next
    argument: moving it hands it another one."""
    if p.startswith("%"):
        return p == "%%" or bool(re.match(r"%(?:\d+\$|\()", p))
    return p in ("{{", "}}") or bool(re.match(r"\{[A-Za-z_0-9]", p))


def placeholder_signature(text: str) -> tuple[list[str], list[str]]:
    """What an answer must keep of a text's placeholders: its plain ones in their order, and its
    numbered and named ones in any order."""
    found = sorted([(m.start(), m.group()) for m in _PRINTF.finditer(text)]
                   + [(m.start(), m.group()) for m in _BRACE.finditer(text)])
    return ([p for _, p in found if not _movable(p)], sorted(p for _, p in found if _movable(p)))


def _unescape(body: str, line: int) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt in "01234567":
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            out.append(chr(int(m.group(), 8)))
            i += 1 + len(m.group())
        elif nxt == "x" and re.match(r"[0-9A-Fa-f]{1,2}", body[i + 2:]):
            m = re.match(r"[0-9A-Fa-f]{1,2}", body[i + 2:])
            out.append(chr(int(m.group(), 16)))
            i += 2 + len(m.group())
        else:
            raise DocumentError(f"not a gettext catalog (.po): line {line}: unknown escape '\\{nxt}' in a string")
    return "".join(out)


def _string(text: str, line: int) -> str:
    m = _STRING.match(text.strip())
    if not m:
        raise DocumentError(f"not a gettext catalog (.po): line {line}: expected a quoted string, got "
                            f"{text.strip()[:60]!r}")
    return _unescape(m.group(1), line)


def _escape(value: str) -> str:
    return (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r"))


def po_lines(keyword: str, value: str) -> list[str]:
    """A keyword and its string as gettext writes them: one line, or, for a text with line breaks
    inside, an empty first string and a line per text line."""
    if "\n" not in value[:-1]:
        return [f'{keyword} "{_escape(value)}"']
    return [f'{keyword} ""'] + [f'"{_escape(part)}"' for part in value.splitlines(keepends=True)]


class _Entry:
    def __init__(self, first: int):
        self.first = first          # index of its first line
        self.end = first            # index past its last line
        self.comments: list[str] = []
        self.key_start: int | None = None  # index of its first keyword line
        self.str_start: int | None = None  # index of its first msgstr line
        self.fields: dict[str, str] = {}   # msgctxt, msgid, msgid_plural, msgstr, msgstr[n]
        self.current: str | None = None


def _entries(lines: list[str]) -> list[_Entry]:
    entries: list[_Entry] = []
    entry: _Entry | None = None

    def close():
        nonlocal entry
        if entry is not None:
            _check(entry)
            entries.append(entry)
        entry = None

    for i, raw in enumerate(lines):
        line = raw.strip()
        n = i + 1
        if not line:
            close()
            continue
        if line.startswith("#"):
            if entry is not None and entry.key_start is not None:
                if entry.str_start is None:
                    raise DocumentError(f"not a gettext catalog (.po): line {n}: a comment inside an entry "
                                        "(between its msgid and its msgstr)")
                close()  # the next entry, with no blank line between
            if entry is None:
                entry = _Entry(i)
            entry.comments.append(raw)
            entry.end = i + 1
            continue
        if line.startswith('"'):
            if entry is None or entry.current is None:
                raise DocumentError(f"not a gettext catalog (.po): line {n}: a string that continues nothing")
            entry.fields[entry.current] += _string(line, n)
            entry.end = i + 1
            continue
        m = _KEYWORD.match(line)
        if not m:
            raise DocumentError(f"not a gettext catalog (.po): line {n}: expected a comment, a keyword (msgid, "
                                f"msgstr, ...) or a string, got {line[:60]!r}")
        key = m.group(1)
        if key in ("msgctxt", "msgid") and entry is not None and entry.str_start is not None:
            close()  # the next entry, with no blank line between
        if entry is None:
            entry = _Entry(i)
        if key in entry.fields:
            raise DocumentError(f"not a gettext catalog (.po): line {n}: a second {key} in one entry")
        if key.startswith("msgstr"):
            if "msgid" not in entry.fields:
                raise DocumentError(f"not a gettext catalog (.po): line {n}: {key} with no msgid before it")
            if entry.str_start is None:
                entry.str_start = i
        elif entry.str_start is not None:
            raise DocumentError(f"not a gettext catalog (.po): line {n}: {key} after the entry's msgstr")
        if entry.key_start is None:
            entry.key_start = i
        entry.fields[key] = _string(m.group(3), n)
        entry.current = key
        entry.end = i + 1
    close()
    return entries


def _check(entry: _Entry) -> None:
    if entry.key_start is None:
        return  # comments only (an obsolete entry is comments too)
    n = entry.first + 1
    f = entry.fields
    if "msgid" not in f:
        raise DocumentError(f"not a gettext catalog (.po): the entry at line {n} has no msgid")
    plural_strs = sorted(k for k in f if k.startswith("msgstr["))
    if "msgid_plural" in f:
        if "msgstr" in f or not plural_strs:
            raise DocumentError(f"not a gettext catalog (.po): the entry at line {n} has a msgid_plural: its "
                                "translations must be msgstr[0], msgstr[1], ...")
    elif plural_strs:
        raise DocumentError(f"not a gettext catalog (.po): the entry at line {n} has msgstr[n] but no msgid_plural")
    elif "msgstr" not in f:
        raise DocumentError(f"not a gettext catalog (.po): the entry at line {n} needs one msgstr")


def _flags(comments: list[str]) -> list[str]:
    out = []
    for c in comments:
        if c.startswith("#,"):
            out.extend(f.strip() for f in c[2:].split(",") if f.strip())
    return out


def parse_po(text: str) -> tuple[list[dict], str]:
    lines = text.split("\n")
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    entries = _entries(lines)
    if not any(e.key_start is not None for e in entries):
        raise DocumentError("not a gettext catalog (.po): it holds no entry (msgid ... msgstr ...)")
    units: list[dict] = []
    done, mark = 0, 0
    header_forms = next((e.fields.get("msgstr", "") for e in entries if e.key_start is not None
                         and e.fields["msgid"] == "" and "msgctxt" not in e.fields), "")
    found = re.search(r"^Plural-Forms:.*\bnplurals\s*=\s*(\d+)", header_forms, re.M | re.I)
    header_count = int(found.group(1)) if found and int(found.group(1)) > 0 else None
    has_plurals = any("msgid_plural" in e.fields for e in entries)
    if not any(e.key_start is not None and e.fields["msgid"] == "" and "msgctxt" not in e.fields for e in entries):
        # no header entry: one is written first (Language:, and Plural-Forms: for plural entries)
        units.append({"before": "", "entry": "", "comments": [], "keys": [], "fuzzy": False, "texts": [],
                      "header": "", "plurals": has_plurals, "added": True, "language": ""})
    for e in entries:
        if e.key_start is None:
            continue
        f = e.fields
        header = f["msgid"] == "" and "msgctxt" not in f
        fuzzy = "fuzzy" in _flags(e.comments)
        translations = [v for k, v in f.items() if k.startswith("msgstr")]
        wanted = not header and (fuzzy or not any(translations)) and f["msgid"].strip() != ""
        if not header and not wanted:
            continue
        start, end = offsets[e.first], offsets[e.end - 1] + len(lines[e.end - 1])
        unit = {"before": text[done:start], "entry": text[start:end], "comments": e.comments,
                "keys": lines[e.key_start:e.str_start], "fuzzy": fuzzy, "texts": []}
        if header:
            unit["header"] = f.get("msgstr", "")
            unit["plurals"] = has_plurals
            found = re.search(r"^Language:[ \t]*(\S*)", unit["header"], re.M | re.I)
            unit["language"] = found.group(1) if found else ""
        else:
            mark += 1
            unit["texts"].append([mark, f["msgid"]])
            if "msgid_plural" in f:
                mark += 1
                unit["texts"].append([mark, f["msgid_plural"]])
                unit["header_count"] = header_count
        units.append(unit)
        done = end
    return units, text[done:]


def _keep_newlines(source: str, answer: str) -> str:
    """The answer with the source's leading and trailing line breaks (gettext checks they agree)."""
    lead = source[:len(source) - len(source.lstrip("\n"))]
    trail = source[len(source.rstrip("\n")):]
    return lead + answer.strip("\n") + trail


def _comments(comments: list[str], *, fuzzy: bool) -> list[str]:
    """The entry's comments with the fuzzy flag set or dropped (and, dropped, the #| previous-msgid lines)."""
    out, flagged = [], False
    for c in comments:
        if c.startswith("#|") and not fuzzy:
            continue
        if c.startswith("#,"):
            flags = [f.strip() for f in c[2:].split(",") if f.strip() and f.strip() != "fuzzy"]
            if fuzzy:
                flags.insert(0, "fuzzy")
                flagged = True
            if flags:
                out.append("#, " + ", ".join(flags))
            continue
        out.append(c)
    if fuzzy and not flagged:
        at = next((i for i, c in enumerate(out) if c.startswith("#|")), len(out))
        out.insert(at, "#, fuzzy")
    return out


def _header(value: str, lang: str, plurals: bool) -> str:
    lines = value.split("\n")
    forms = plural_forms(lang)
    if forms is None and plurals and not re.search(r"^Plural-Forms:.*\bnplurals\s*=\s*[1-9]", value, re.M | re.I):
        # a target the table does not know, and a header with no rule (a template's INTEGER): gettext
        # refuses plural entries with no rule, so the two-form rule stands in (the entries are fuzzy)
        forms = GUESSED_PLURAL_FORMS
    language = f"Language: {lang.replace('-', '_')}"
    seen = seen_forms = False
    for i, line in enumerate(lines):
        key = line.split(":", 1)[0].strip().lower()
        if key == "language":
            lines[i], seen = language, True
        elif key == "plural-forms":
            seen_forms = True
            if forms:
                lines[i] = f"Plural-Forms: {forms}"
        elif key == "content-type" and "charset=CHARSET" in line:
            lines[i] = line.replace("charset=CHARSET", "charset=UTF-8")
    at = len(lines) - 1 if lines[-1] == "" else len(lines)
    if not seen:
        lines.insert(at, language)
        at += 1
    if plurals and forms and not seen_forms:
        # gettext refuses plural entries in a catalog whose header has no rule
        lines.insert(at, f"Plural-Forms: {forms}")
    return "\n".join(lines)


def render_po(unit: dict, texts: dict[int, str], lang: str | None, notes: list[str]) -> str:
    if "header" in unit:
        if lang is None:
            return unit["entry"]
        if unit.get("added"):
            # a catalog with no header entry: a minimal one, what msgfmt needs to read the catalog
            value = _header("Content-Type: text/plain; charset=UTF-8\n", lang, unit.get("plurals", False))
            return "\n".join(['msgid ""'] + po_lines("msgstr", value)) + "\n\n"
        value = _header(unit["header"], lang, unit.get("plurals", False))
        if value == unit["header"]:
            return unit["entry"]
        return "\n".join(unit["comments"] + unit["keys"] + po_lines("msgstr", value))
    marks = [m for m, _ in unit["texts"]]
    sources = dict(unit["texts"])
    plural = len(marks) == 2
    known = nplurals(lang) if plural else None
    # a target not in the table: as many forms as the catalog's header says, else two (fuzzy either way)
    count = known or unit.get("header_count") or 2
    needed = [marks[-1]] if plural and count == 1 else marks
    if any(m not in texts for m in needed):
        return unit["entry"]  # no answer: left as it was
    answers = {m: _keep_newlines(sources[m], texts[m]) for m in needed}
    bad = next((m for m in needed if placeholder_signature(answers[m]) != placeholder_signature(sources[m])), None)
    if bad is not None:
        key = "msgid_plural" if plural and bad == marks[1] else "msgid"
        notes.append(f"{key} {sources[bad][:60]!r}: the answer {answers[bad][:60]!r} does not hold its placeholders "
                     f"({' '.join(placeholders(sources[bad])) or 'none'}); left untranslated, marked fuzzy")
        if unit["fuzzy"]:
            return unit["entry"]
        # a translation that lost or changed a placeholder would crash the program: not written
        lines = unit["entry"].split("\n")
        head = len(unit["comments"])
        return "\n".join(_comments(unit["comments"], fuzzy=True) + lines[head:])
    if not plural:
        strs = po_lines("msgstr", answers[marks[0]])
        fuzzy = False
    else:
        forms = [answers[marks[-1]]] if count == 1 else [answers[marks[0]]] + [answers[marks[1]]] * (count - 1)
        strs = [line for i, form in enumerate(forms) for line in po_lines(f"msgstr[{i}]", form)]
        fuzzy = known is None or count > 2
    return "\n".join(_comments(unit["comments"], fuzzy=fuzzy) + unit["keys"] + strs)
