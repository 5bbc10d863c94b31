"""A delivery's options (a question's buttons) as a WhatsApp ``interactive`` message, and a press read back.

Up to 3 options: reply buttons (``type: button``; each ``{"type": "reply", "reply": {"id", "title"}}``,
an id of at most 256 characters, a title of at most 20, titles unique in the message). 4 to 10: a
list (``type: list``; one section of rows ``{"id", "title", "description"?}``, an id of at most 200
characters, a title of at most 24, a description of at most 72; the button that opens it at most
20). The body is the delivery's text, at most 1,024 characters (Meta's limit for reply buttons;
the list page names 4,096, older references 1,024: the safe side for both). More than 10 options, a
longer text, or an option no button can carry: None, and the delivery goes as plain text, whose
numbered options a typed reply answers.

A press comes back as a message of type ``interactive`` whose ``button_reply`` or ``list_reply``
carries the ``id`` (the option's value) and the ``title`` shown.
"""
from __future__ import annotations

from plugins_app.channel.sdk.text import shorten

BUTTONS_MAX = 3
ROWS_MAX = 10
BODY_LIMIT = 1024
BUTTON_ID_LIMIT = 256
BUTTON_TITLE_LIMIT = 20
ROW_ID_LIMIT = 200
ROW_TITLE_LIMIT = 24
ROW_DESCRIPTION_LIMIT = 72
SECTION_TITLE = "Options"
LIST_BUTTON = "Choose"


def _options(metadata) -> list[tuple[str, str]] | None:
    """(label, value) of each option; None when there are none or one has no label or no value."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not options:
        return None
    out = []
    for opt in options:
        if isinstance(opt, dict):
            label, value = str(opt.get("label") or opt.get("value") or ""), str(opt.get("value") or "")
        else:
            label = value = str(opt)
        if not label.strip() or not value.strip() or value != value.strip():
            return None  # Meta refuses an id with leading or trailing spaces
        out.append((label, value))
    return out


def _titles(labels: list[str], limit: int) -> list[str]:
    """The labels shortened to ``limit``; numbered ("2. …") when shortening made two the same, since a
    button's title must be unique in its message and the user must tell them apart."""
    titles = [shorten(label, limit) for label in labels]
    if len({t.casefold() for t in titles}) == len(titles):
        return titles
    return [shorten(f"{n}. {label}", limit) for n, label in enumerate(labels, 1)]


def interactive_message(body: str, metadata) -> dict | None:
    """The ``interactive`` object of a message showing ``body`` with the delivery's options to press;
    None when WhatsApp cannot show them (see the module docstring)."""
    options = _options(metadata)
    if not options or not body.strip() or len(body) > BODY_LIMIT:
        return None
    labels, values = [label for label, _ in options], [value for _, value in options]
    if len(set(values)) != len(values):
        return None
    if len(options) <= BUTTONS_MAX:
        if any(len(v) > BUTTON_ID_LIMIT for v in values):
            return None
        buttons = [{"type": "reply", "reply": {"id": value, "title": title}}
                   for value, title in zip(values, _titles(labels, BUTTON_TITLE_LIMIT))]
        return {"type": "button", "body": {"text": body}, "action": {"buttons": buttons}}
    if len(options) > ROWS_MAX or any(len(v) > ROW_ID_LIMIT for v in values):
        return None
    rows = []
    for value, title, label in zip(values, _titles(labels, ROW_TITLE_LIMIT), labels):
        row = {"id": value, "title": title}
        if title != " ".join(label.split()):  # shortened: the whole label (as far as it fits) below it
            row["description"] = shorten(label, ROW_DESCRIPTION_LIMIT)
        rows.append(row)
    return {"type": "list", "body": {"text": body},
            "action": {"button": LIST_BUTTON, "sections": [{"title": SECTION_TITLE, "rows": rows}]}}


def pressed(message: dict) -> tuple[str, str] | None:
    """(id, title) of an ``interactive`` message's ``button_reply`` or ``list_reply``; None otherwise."""
    inter = message.get("interactive") if isinstance(message, dict) else None
    if not isinstance(inter, dict):
        return None
    reply = inter.get("button_reply") or inter.get("list_reply")
    if not isinstance(reply, dict) or not reply.get("id"):
        return None
    return str(reply["id"]), str(reply.get("title") or reply["id"])
