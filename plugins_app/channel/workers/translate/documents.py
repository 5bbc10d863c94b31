"""channel-translate's documents: reading a file, cutting it into chunks, the instruction each chunk is
sent with, and putting the answers back together as the translated file.

Nothing here touches the disk or the bridge, so each part is tested alone (test_channel_translate_parts.py).

* Plain text and Markdown (``.txt``, ``.md``, ``.markdown``) are cut at blank lines (paragraphs); a
  Markdown code fence is one block whatever blank lines it holds. Paragraphs are packed into chunks of at
  most ``max_chars`` characters; a paragraph longer than that is cut at sentence ends, a sentence longer
  than that at white space, a word longer than that anywhere; a Markdown block is cut at line ends
  first, and a code fence is never cut. Each chunk remembers what followed it in the source (a blank
  line, a line break, a space, nothing), so the translation is joined the same way.
* Subtitles, SubRip (``.srt``) and WebVTT (``.vtt``), are cut at cues. The engine sees only the cues' text, each under its place
  in the file in brackets (``[12]``, the 12th cue, whatever its number); the numbers and timings are the worker's and are written back unchanged, so a
  model can never shift a timing. A cue the answer does not name keeps its source text (logged). A
  WebVTT file is read into units (units.py): its header, NOTE/STYLE/REGION blocks, cue identifiers,
  timings and settings are written back byte for byte.
* gettext catalogs (``.po``, ``.pot``) are po.py's; HTML pages (``.html``, ``.htm``) are markup.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .units import DocumentError, answer_cues, assemble_units, pack_units

__all__ = ["DocumentError", "answer_cues"]

#: The files the pipeline reads, by suffix (lower case), and how it cuts each.
FORMATS = {".txt": "text", ".md": "markdown", ".markdown": "markdown", ".srt": "srt", ".vtt": "vtt", ".po": "po",
           ".pot": "po", ".html": "html", ".htm": "html"}
#: The forms read into units (units.py): structure kept by the worker, only the marked text sent.
UNIT_FORMS = ("vtt", "po", "html")
#: Output suffixes that differ from the input's: a template (.pot) comes out as a catalog (.po).
OUTPUT_SUFFIX = {".pot": ".po"}
#: A BCP 47 tag as an operator types one: a language, then subtags (de, pt-BR, zh-Hant, sr-Latn-RS).
LANG_TAG = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})*$")
#: Names for the instruction, for the tags operators use most; any other tag is named by itself.
LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
    "es": "Spanish", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "nb": "Norwegian Bokmål",
    "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "pt-BR": "Brazilian Portuguese",
    "pt-PT": "European Portuguese", "ro": "Romanian", "ru": "Russian", "sv": "Swedish", "th": "Thai",
    "tr": "Turkish", "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese", "zh-Hans": "Simplified Chinese",
    "zh-Hant": "Traditional Chinese",
}

#: Where a sentence ends: after . ! ? … (and a closing quote or bracket) and white space, or after a CJK full stop.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?…])|(?<=[.!?…][\"'”’)\]]))\s+|(?<=[。！？])\s*")
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_SRT_TIMING = re.compile(r"^\s*\d{1,2}:\d{2}:\d{2}[,.]\d{1,3}\s*-->\s*\d{1,2}:\d{2}:\d{2}[,.]\d{1,3}.*$")
_VTT_HEADER = re.compile(r"^WEBVTT(?:[ \t].*)?$")
_VTT_TIME = r"(?:\d{2,}:)?\d{2}:\d{2}\.\d{3}"
_VTT_TIMING = re.compile(rf"^{_VTT_TIME}[ \t]+-->[ \t]+{_VTT_TIME}(?:[ \t].*)?$")
_VTT_OTHER = re.compile(r"^(?:NOTE|STYLE|REGION)(?:[ \t].*)?$")


@dataclass
class Cue:
    number: int
    timing: str
    text: str


@dataclass
class Chunk:
    """One piece of a document sent as one message: its source, and what joined it to the next piece."""

    text: str = ""
    joiner: str = ""
    cues: list[Cue] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)  # the [n] each cue is sent under: its place in the file
    units: list[dict] = field(default_factory=list)  # WebVTT, gettext, HTML: see units.py

    def to_dict(self) -> dict:
        d = {"text": self.text, "joiner": self.joiner,
             "cues": [[c.number, c.timing, c.text] for c in self.cues], "marks": list(self.marks)}
        if self.units:
            d["units"] = self.units
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Chunk":
        cues = [Cue(n, t, x) for n, t, x in d.get("cues", [])]
        # a plan recorded before marks were kept sent each cue under its own number
        return cls(d.get("text", ""), d.get("joiner", ""), cues, list(d.get("marks") or [c.number for c in cues]),
                   list(d.get("units") or []))


@dataclass
class Document:
    name: str
    suffix: str
    form: str
    chunks: list[Chunk]
    trailing_newline: bool = True


def format_of(name: str) -> str | None:
    for suffix, form in FORMATS.items():
        if name.lower().endswith(suffix):
            return form
    return None


def suffix_of(name: str) -> str:
    """The suffix the outputs keep, as the source spells it (``.MD`` stays ``.MD``)."""
    for suffix in FORMATS:
        if name.lower().endswith(suffix):
            return name[len(name) - len(suffix):]
    return ""


def output_suffix(name: str) -> str:
    """The suffix an output gets: the source's, except a template's (``.pot`` gives ``.po``)."""
    suffix = suffix_of(name)
    out = OUTPUT_SUFFIX.get(suffix.lower())
    return (out.upper() if suffix.isupper() else out) if out else suffix


def unsupported_reason(name: str) -> str:
    dot = name.rfind(".")
    kind = f"'{name[dot:]}'" if dot > 0 else "with no suffix"
    return (f"unsupported file type {kind}: this pipeline translates "
            f"{', '.join(sorted(FORMATS))} files")


def decode(data: bytes) -> str:
    """The file's text: UTF-8 (a byte-order mark is dropped), line ends made ``\\n``."""
    if not data.strip():
        raise DocumentError("the file is empty: there is nothing to translate")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                            "save the file as UTF-8 and drop it again") from None
    if "\x00" in text:
        raise DocumentError("the file holds NUL characters: it is not a text file")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_document(name: str, data: bytes, *, max_chars: int, langs: list[str] | None = None) -> Document:
    """A dropped file as chunks; raises DocumentError with the reason when it cannot be translated (into
    ``langs``, when given: a gettext catalog in another language is refused)."""
    form = format_of(name)
    if form is None:
        raise DocumentError(unsupported_reason(name))
    text = decode(data)
    if form == "srt":
        chunks = split_cues(parse_srt(text), max_chars)
    elif form in UNIT_FORMS:
        units, tail = read_units(form, text)
        if form == "po" and langs:
            from .po import language_problem
            problem = language_problem(units, langs)
            if problem:
                raise DocumentError(problem)
        chunks = pack_units(units, tail, max_chars, Chunk)
        if not chunks:
            raise DocumentError(NOTHING_TO_TRANSLATE[form])
    else:
        chunks = split_text(text, max_chars, markdown=form == "markdown")
    if not chunks:
        raise DocumentError("the file holds only white space: there is nothing to translate")
    return Document(name, suffix_of(name), form, chunks, trailing_newline=text.endswith("\n"))


# ---------------------------------------------------------------------------- plain text and Markdown

def blocks_of(text: str, *, markdown: bool = False) -> list[str]:
    """The paragraphs of a text: runs of lines between blank lines; a Markdown code fence is one block."""
    blocks, current, fenced = [], [], None
    for line in text.split("\n"):
        if markdown:
            m = _FENCE.match(line)
            if m and fenced is None:
                fenced = m.group(1)
            elif m and line.strip().startswith(fenced):
                fenced = None
                current.append(line)
                continue
        if fenced is None and not line.strip():
            if current:
                blocks.append("\n".join(current))
                current = []
            continue
        current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


def _cut_long(text: str, max_chars: int) -> list[tuple[str, str]]:
    """A block longer than the limit as pieces within it, each with the white space that followed it in
    the source (the last: ""), so joining them gives the block back: at sentence ends, else at white
    space, else anywhere."""
    sentences: list[tuple[str, str]] = []
    pos = 0
    for m in _SENTENCE_END.finditer(text):
        if m.start() == pos:  # nothing before this break (a run of stops): its white space joins the last
            if sentences and m.group():
                sentences[-1] = (sentences[-1][0], sentences[-1][1] + m.group())
            pos = m.end()
            continue
        sentences.append((text[pos:m.start()], m.group()))
        pos = m.end()
    if pos < len(text):
        sentences.append((text[pos:], ""))
    out: list[tuple[str, str]] = []
    for sentence, sep in sentences:
        if len(sentence) <= max_chars:
            out.append((sentence, sep))
            continue
        parts = re.split(r"(\s+)", sentence)
        words = [(parts[i], parts[i + 1] if i + 1 < len(parts) else sep) for i in range(0, len(parts), 2)]
        for word, follows in words:
            if not word:
                if out and follows:
                    out[-1] = (out[-1][0], out[-1][1] + follows)
                continue
            while len(word) > max_chars:  # a "word" longer than the limit (a URL, a script with no spaces)
                out.append((word[:max_chars], ""))
                word = word[max_chars:]
            out.append((word, follows))
    return out


def _markdown_segments(block: str) -> list[str]:
    """A Markdown block's lines, a fenced code block in it kept as one segment."""
    segments: list[str] = []
    fence: list[str] | None = None
    for line in block.split("\n"):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = [line]
            else:
                segments.append(line)
        else:
            fence.append(line)
            if m and line.strip().startswith(fence[0].strip()[:3]):
                segments.append("\n".join(fence))
                fence = None
    if fence is not None:
        segments.append("\n".join(fence))
    return segments


def _units_of_block(block: str, max_chars: int, markdown: bool) -> list[tuple[str, str]]:
    """A block as pieces within the limit, each with what followed it (the last: "")."""
    if len(block) <= max_chars:
        return [(block, "")]
    if not markdown:
        return _cut_long(block, max_chars)
    # Markdown: at line ends first (a list, a table, a quote keep their lines); a fenced code block is
    # never cut (it goes whole, over the limit if need be: a fence cut in two is no longer code)
    units: list[tuple[str, str]] = []
    for seg in _markdown_segments(block):
        if len(seg) <= max_chars or _FENCE.match(seg):
            units.append((seg, "\n"))
        else:
            pieces = _cut_long(seg, max_chars)
            units.extend(pieces[:-1])
            units.append((pieces[-1][0], "\n"))
    units[-1] = (units[-1][0], "")
    return units


def split_text(text: str, max_chars: int, *, markdown: bool = False) -> list[Chunk]:
    """Paragraphs packed into chunks of at most ``max_chars`` characters, in order (a Markdown code
    fence longer than that is one chunk of its own)."""
    if max_chars < 1:
        raise ValueError("max_chars must be at least 1")
    # (piece, what follows it): a blank line between paragraphs; within a paragraph cut in pieces, the
    # white space that was there (a space, a line break)
    units: list[tuple[str, str]] = []
    for block in blocks_of(text, markdown=markdown):
        pieces = _units_of_block(block, max_chars, markdown)
        units.extend(pieces[:-1])
        units.append((pieces[-1][0], "\n\n"))
    chunks: list[Chunk] = []
    current, joiner = "", ""
    for piece, follows in units:
        if current and len(current) + len(joiner) + len(piece) > max_chars:
            chunks.append(Chunk(current, joiner))
            current = ""
        current = current + joiner + piece if current else piece
        joiner = follows
    if current:
        chunks.append(Chunk(current, ""))
    return chunks


# ---------------------------------------------------------------------------- SubRip

def parse_srt(text: str) -> list[Cue]:
    """The cues of a SubRip file: a number, a timing line, the text lines, a blank line."""
    cues: list[Cue] = []
    blocks = [b for b in re.split(r"\n[ \t]*\n", text.strip("\n")) if b.strip()]
    for n, block in enumerate(blocks, 1):
        lines = block.strip("\n").split("\n")
        if lines and lines[0].strip().isdigit():
            number, lines = int(lines[0].strip()), lines[1:]
        else:
            number = (cues[-1].number + 1) if cues else 1
        if not lines or not _SRT_TIMING.match(lines[0]):
            raise DocumentError(f"not a SubRip (.srt) file: block {n} has no timing line "
                                f"('00:00:01,000 --> 00:00:02,000'): {block[:60]!r}")
        cues.append(Cue(number, lines[0].strip(), "\n".join(lines[1:])))
    return cues


def cue_block(cue: Cue, mark: int | None = None) -> str:
    return f"[{cue.number if mark is None else mark}]\n{cue.text}"


def split_cues(cues: list[Cue], max_chars: int) -> list[Chunk]:
    """Cues packed into chunks whose text for the engine (``[n]`` then the cue's text) is within the limit;
    a cue is never cut. ``n`` is the cue's place in the file (1, 2, ...), not its number: a file whose
    numbering restarts or repeats still names each cue once."""
    chunks: list[Chunk] = []
    current: list[tuple[int, Cue]] = []
    size = 0

    def flush():
        chunks.append(Chunk("\n\n".join(cue_block(c, m) for m, c in current), "", [c for _, c in current],
                            [m for m, _ in current]))

    for mark, cue in enumerate(cues, 1):
        block = len(cue_block(cue, mark))
        if current and size + 2 + block > max_chars:
            flush()
            current, size = [], 0
        size = size + 2 + block if current else block
        current.append((mark, cue))
    if current:
        flush()
    return chunks


def cue_text(answer: str | None) -> str | None:
    """A subtitle cue's text from an answer, as a subtitle file can hold it: a blank line would end the
    cue early, and (WebVTT) an arrow would read as a timing, so the answer's blank lines are dropped and
    ``-->`` is written ``->``. None when nothing is left (the cue keeps its source text)."""
    if answer is None:
        return None
    text = "\n".join(line for line in answer.split("\n") if line.strip()).replace("-->", "->")
    return text or None


# ---------------------------------------------------------------------------- WebVTT

def parse_vtt(text: str) -> tuple[list[dict], str]:
    """A WebVTT file as units: the header, NOTE, STYLE and REGION blocks, cue identifiers, timings and
    cue settings are ``before`` (never sent); each cue's text is one unit's text, sent under its place
    among the cues. Blocks are runs of lines between empty lines, as the WebVTT spec has them."""
    lines = text.split("\n")
    if not lines or not _VTT_HEADER.match(lines[0]):
        raise DocumentError("not a WebVTT (.vtt) file: the first line must be 'WEBVTT' (then, optionally, a space "
                            f"and a title): {lines[0][:60]!r}")
    units: list[dict] = []
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    done = 0  # the offset up to which the text is in a unit already
    i, block = 0, 0
    while i < len(lines):
        if lines[i] == "":
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i] != "":
            i += 1
        block += 1
        other = (_VTT_OTHER.match(lines[start]) and "-->" not in lines[start]
                 and not (start + 1 < i and _VTT_TIMING.match(lines[start + 1])))  # not a cue named "NOTE"
        if start == 0 or other:
            continue  # the header, a NOTE, a STYLE or a REGION block: kept as it is
        timing = start if "-->" in lines[start] else start + 1
        if timing >= i or not _VTT_TIMING.match(lines[timing]):
            raise DocumentError(f"not a WebVTT (.vtt) file: block {block} (line {start + 1}) is not a cue: it has "
                                f"no timing line ('00:00:01.000 --> 00:00:02.000'): {lines[start][:60]!r}")
        if timing + 1 >= i:
            continue  # a cue with no text
        payload_start = offsets[timing + 1]
        payload_end = offsets[i - 1] + len(lines[i - 1])
        units.append({"before": text[done:payload_start],
                      "texts": [[len(units) + 1, text[payload_start:payload_end]]]})
        done = payload_end
    return units, text[done:]


def render_vtt(unit: dict, texts: dict[int, str], lang: str | None, notes: list[str]) -> str:
    [[mark, source]] = unit["texts"]
    return cue_text(texts.get(mark)) or source


# ---------------------------------------------------------------------------- the forms read into units

NOTHING_TO_TRANSLATE = {
    "vtt": "the WebVTT file has no cue with text: there is nothing to translate",
    "po": "every entry of the catalog is translated already (and none is fuzzy): there is nothing to translate",
    "html": "the HTML file has no text outside markup, scripts, styles and code: there is nothing to translate",
}


def read_units(form: str, text: str) -> tuple[list[dict], str]:
    if form == "vtt":
        return parse_vtt(text)
    if form == "po":
        from .po import parse_po
        return parse_po(text)
    from .markup import parse_html
    return parse_html(text)


def renderer(form: str):
    if form == "vtt":
        return render_vtt
    if form == "po":
        from .po import render_po
        return render_po
    from .markup import render_html
    return render_html


# ---------------------------------------------------------------------------- the instruction

def language_name(tag: str) -> str:
    name = LANGUAGE_NAMES.get(tag) or LANGUAGE_NAMES.get(tag.split("-")[0])
    return f"{name} ({tag})" if name else f"the language with the BCP 47 tag {tag}"


def parse_glossary(text: str) -> dict[str, dict[str, str]]:
    """A glossary file: ``term = translation`` lines; a ``[de]`` line starts terms for that language only
    (before any such line, for every language); ``#`` starts a comment. Returns {language or "*": terms}."""
    out: dict[str, dict[str, str]] = {}
    section = "*"
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"\[\s*([A-Za-z0-9-]+)\s*\]", line)
        if m:
            section = m.group(1)
            continue
        term, eq, target = line.partition("=")
        if not eq or not term.strip() or not target.strip():
            raise ValueError(f"glossary line {n}: expected 'term = translation', got {raw!r}")
        out.setdefault(section, {})[term.strip()] = target.strip()
    return out


def glossary_for(glossary: dict[str, dict[str, str]], lang: str, text: str) -> dict[str, str]:
    """The glossary's terms for ``lang`` that occur in ``text`` (case-insensitive)."""
    terms = dict(glossary.get("*", {}))
    terms.update(glossary.get(lang.split("-")[0], {}))
    terms.update(glossary.get(lang, {}))
    lowered = text.lower()
    return {k: v for k, v in terms.items() if k.lower() in lowered}


def instruction(chunk: Chunk, *, form: str, lang: str, source_lang: str | None, name: str, index: int,
                total: int, glossary: dict[str, str] | None = None) -> str:
    """The message one chunk is sent with: what to do, then the text itself after a line of its own."""
    source = f"from {language_name(source_lang)} " if source_lang else ""
    lines = [f"Translate the text below {source}into {language_name(lang)}."]
    if form in ("srt", "vtt"):
        lines.append("It is a part of a subtitle file. Each subtitle starts with its number in brackets on a "
                     "line of its own, such as [12]: keep every such line exactly as it is, in the same order, "
                     "and translate only the text under it, keeping its line breaks.")
    elif form == "po":
        lines.append("It is a part of a software's user-interface messages. Each message starts with its number "
                     "in brackets on a line of its own, such as [12]: keep every such line exactly as it is, in the "
                     "same order, and translate only the text under it, keeping its line breaks. Keep placeholders "
                     "exactly as they are, such as %s, %d, %(name)s, {name} and {0}, and keep markup and "
                     "keyboard accelerators such as & and _ in place.")
    elif form == "html":
        lines.append("It is the text of a web page, piece by piece: the markup is kept apart. Each piece starts "
                     "with its number in brackets on a line of its own, such as [12]: keep every such line exactly "
                     "as it is, in the same order, and translate only the text under it. Pieces that follow each "
                     "other may be parts of one sentence split by formatting (a link, emphasis): translate each "
                     "piece in place so that together they read well. Add no markup; keep entities such as &amp;.")
    elif form == "markdown":
        lines.append("It is Markdown: keep the markup exactly (headings, lists, emphasis, links and their "
                     "URLs, tables, line breaks); do not translate code, inline code or URLs.")
    else:
        lines.append("Keep its layout: the same paragraphs and line breaks.")
    lines.append("Answer with the translation only: no introduction, no notes, no quotation marks around it.")
    if glossary:
        lines.append("Use these translations for these terms:")
        lines.extend(f"- {term} => {target}" for term, target in sorted(glossary.items()))
    if total > 1:
        lines.append(f"This is part {index + 1} of {total} of the document {name}; the parts before it "
                     "are earlier in this conversation.")
    return "\n".join(lines) + "\n\n" + chunk.text


# ---------------------------------------------------------------------------- putting it back together

def clean_answer(answer: str) -> str:
    return answer.strip("\n").rstrip()


def assemble(doc_form: str, chunks: list[Chunk], answers: list[str], *, trailing_newline: bool = True,
             missing: list[int] | None = None, lang: str | None = None, notes: list[str] | None = None) -> str:
    """The translated file from each chunk's answer, in chunk order. For subtitles, the cue numbers
    and timings come from the source; ``missing`` collects the numbers of cues the answers left out
    (they keep their source text). WebVTT, gettext and HTML are written from their units (units.py);
    ``lang`` is the target (a catalog's header names it), None to write the source's structure as is;
    ``notes`` collects what a format had to say (a catalog entry whose answer broke a placeholder)."""
    if len(chunks) != len(answers):
        raise ValueError("one answer per chunk")
    if doc_form in UNIT_FORMS:
        return assemble_units(chunks, answers, renderer(doc_form), lang=lang, missing=missing, notes=notes)
    if doc_form == "srt":
        out = []
        for chunk, answer in zip(chunks, answers):
            texts = answer_cues(answer)
            for cue, mark in zip(chunk.cues, chunk.marks or [c.number for c in chunk.cues]):
                text = cue_text(texts.get(mark))
                if not text:
                    if missing is not None:
                        missing.append(cue.number)
                    text = cue.text
                out.append(f"{cue.number}\n{cue.timing}\n{text}".rstrip("\n") + "\n")
        return "\n".join(out)
    text = ""
    for chunk, answer in zip(chunks, answers):
        text += clean_answer(answer) + chunk.joiner
    return text + ("\n" if trailing_newline else "")
