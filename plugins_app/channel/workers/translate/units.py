"""Documents kept as structure and marked text: the engine sees only the human text, each piece under a
``[n]`` line (its place in the document), and the structure is the worker's, written back byte for byte.

A structured document (WebVTT, a gettext catalog, an HTML page) is read into *units*, in file order. A
unit is a dict: ``before``, the file's text before it that is never sent (markup, timings, comments), its
``texts``, ``[[mark, text], ...]``, the pieces the engine translates, and what its format needs to write
it back. The text after the last unit is the last chunk's ``joiner``. Putting the document back is
``before`` + the unit written with the answers for its marks, unit after unit, then that tail; with no
answer for a mark (or the source text as the answer) a unit is written as it was read.

Units are packed into chunks like subtitle cues: never cut, as many as fit in ``max_chars``.
"""
from __future__ import annotations

import re

_MARK = re.compile(r"^\s*\[(\d+)\]\s*$")


class DocumentError(ValueError):
    """A file the pipeline cannot translate; the message is the reason written beside it in failed/."""


def answer_cues(answer: str) -> dict[int, str]:
    """The texts of an answer, by the ``[n]`` lines that head them."""
    found: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in answer.split("\n"):
        m = _MARK.match(line)
        if m:
            current = found.setdefault(int(m.group(1)), [])
            continue
        if current is not None:
            current.append(line)
    return {n: "\n".join(lines).strip("\n") for n, lines in found.items()}


def marked(mark: int, text: str) -> str:
    return f"[{mark}]\n{text}"


def unit_prompt(unit: dict) -> str:
    return "\n\n".join(marked(m, t) for m, t in unit["texts"])


def check_marks(units: list[dict]) -> None:
    """A text with a line that is only ``[n]`` would read as a piece's marker, in the prompt and in the
    answer (its piece cut in two, another piece's text taken for it): refused (DocumentError)."""
    for unit in units:
        for _mark, text in unit["texts"]:
            for line in text.split("\n"):
                if _MARK.match(line):
                    raise DocumentError(f"a text holds a line that is only {line.strip()!r}, which the pipeline "
                                        f"uses to mark its pieces (it would be read as one): {text[:60]!r}")


def pack_units(units: list[dict], tail: str, max_chars: int, chunk_cls) -> list:
    """Units packed into chunks whose text for the engine is within the limit (a unit is never cut; one
    longer than the limit goes alone). Units with nothing to send ride with the chunk they are in; the
    document's tail is the last chunk's joiner. No chunk when no unit has text to send."""
    if not any(u["texts"] for u in units):
        return []
    check_marks(units)
    chunks, current, size = [], [], 0
    for unit in units:
        block = len(unit_prompt(unit)) if unit["texts"] else 0
        if current and block and size and size + 2 + block > max_chars:
            chunks.append(current)
            current, size = [], 0
        current.append(unit)
        if block:
            size = size + 2 + block if size else block
    chunks.append(current)
    out = []
    for i, group in enumerate(chunks):
        text = "\n\n".join(unit_prompt(u) for u in group if u["texts"])
        out.append(chunk_cls(text=text, joiner=tail if i == len(chunks) - 1 else "", units=group))
    return out


def assemble_units(chunks: list, answers: list[str], render, *, lang: str | None,
                   missing: list[int] | None = None, notes: list[str] | None = None) -> str:
    """The document from its units and the answers: ``render(unit, texts, lang, notes)`` writes one unit,
    where ``texts`` maps each of its marks to the answer's text (a mark the answer left out is absent,
    and noted in ``missing``); ``notes`` collects what a format had to say (an answer it did not write)."""
    notes = [] if notes is None else notes
    out: list[str] = []
    for chunk, answer in zip(chunks, answers):
        found = answer_cues(answer) if answer is not None else {}
        for unit in chunk.units:
            texts = {}
            for mark, _source in unit["texts"]:
                text = found.get(mark)
                if text is None or not text.strip():
                    if missing is not None and answer is not None:
                        missing.append(mark)
                    continue
                texts[mark] = text
            out.append(unit["before"])
            out.append(render(unit, texts, lang, notes))
        out.append(chunk.joiner)
    return "".join(out)
