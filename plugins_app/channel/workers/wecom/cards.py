"""A question's options as a WeCom ``template_card`` of type ``button_interaction``.

A question's delivery carries ``metadata["options"]`` = ``[{id, label, value}]`` and, as its text, the
prompt and the options numbered (``channels_app.questions.question_channel_text``). The card shows the
prompt as its title and one button per option: ``text`` the label, ``key`` the value (the reply token a
press sends back, as the callback's ``EventKey``). WeCom's limits (message/send, template_card):

* ``button_list``: at most 6 buttons; a button's ``key`` at most 1,024 bytes, unique in the card; its
  ``text`` "best not over 10 characters";
* ``main_title.title`` "best not over 36 characters"; ``sub_title_text`` "best not over 160";
* ``task_id``: unique for the app, letters, digits and ``_-@``, at most 128 bytes.

A label longer than a button takes is cut (…) and the card's second line lists the options in full; a
prompt longer than the title likewise goes whole in that line. A question the card cannot carry whole
(more than 6 options, a key too long, a prompt and list over 160 characters) gets no card: its numbered
text goes out as before, and typed replies answer it.
"""
from __future__ import annotations

import hashlib
import re

CARD_TYPE = "button_interaction"
MAX_BUTTONS = 6
MAX_KEY_BYTES = 1024
MAX_BUTTON_TEXT = 10
MAX_TITLE = 36
MAX_SUB_TITLE = 160
MAX_TASK_ID_BYTES = 128
#: Every task id this worker makes starts so: a press of a card of another sender's is not a question's.
TASK_ID_PREFIX = "ugent-"
BUTTON_STYLE = 1
_TASK_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_@-]")
CONFIRM_SUFFIX = " (yes or no)"
#: A pressed card's button when the chosen option's label is not known (a card sent before the state file).
ANSWERED_MARK = "✓"


def task_id_of(delivery_id: str) -> str:
    """The card's task id: the delivery's id where WeCom's alphabet and length allow it, else its safe
    characters and a hash of the whole (still one per delivery, and the same at every resend)."""
    safe = _TASK_ID_UNSAFE.sub("_", delivery_id)
    if safe == delivery_id and len(TASK_ID_PREFIX + safe) <= MAX_TASK_ID_BYTES:
        return TASK_ID_PREFIX + safe
    digest = hashlib.sha256(delivery_id.encode("utf-8")).hexdigest()[:24]
    return f"{TASK_ID_PREFIX}{safe[:MAX_TASK_ID_BYTES - len(TASK_ID_PREFIX) - 25]}-{digest}"


def valid_options(metadata) -> list[dict] | None:
    """A delivery's options as [{label, value}] when a card can carry every one, else None."""
    options = metadata.get("options") if isinstance(metadata, dict) else None
    if not isinstance(options, list) or not 1 <= len(options) <= MAX_BUTTONS:
        return None
    out = []
    for opt in options:
        if not isinstance(opt, dict):
            return None
        label, value = opt.get("label"), opt.get("value")
        if not (isinstance(label, str) and label.strip() and isinstance(value, str) and value):
            return None
        if len(value.encode("utf-8")) > MAX_KEY_BYTES:
            return None
        out.append({"label": label.strip(), "value": value})
    if len({o["value"] for o in out}) != len(out):
        return None  # WeCom refuses two buttons with one key
    return out


def prompt_of(text: str, options: list[dict]) -> str:
    """The question's prompt: its text without the numbered options (and a confirm's "(yes or no)")."""
    lines = (text or "").rstrip().split("\n")
    numbered = {f"{n}. {o['label']}" for n, o in enumerate(options, 1)}
    while lines and lines[-1].strip() in numbered:
        lines.pop()
    prompt = "\n".join(lines).strip()
    return prompt[: -len(CONFIRM_SUFFIX)].rstrip() if prompt.endswith(CONFIRM_SUFFIX) else prompt


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def question_card(delivery_id: str, text: str, metadata) -> dict | None:
    """The ``template_card`` object of a question's delivery, or None when it has no options a card takes."""
    options = valid_options(metadata)
    if options is None:
        return None
    prompt = prompt_of(text, options) or "Choose one"
    title = cut(prompt.split("\n")[0], MAX_TITLE)
    detail = []
    if title != prompt:
        detail.append(prompt)
    if any(len(o["label"]) > MAX_BUTTON_TEXT for o in options):
        detail += [f"{n}. {o['label']}" for n, o in enumerate(options, 1)]
    card = {"card_type": CARD_TYPE, "main_title": {"title": title}, "task_id": task_id_of(delivery_id),
            "button_list": [{"text": cut(o["label"], MAX_BUTTON_TEXT), "style": BUTTON_STYLE, "key": o["value"]}
                            for o in options]}
    if detail:
        sub = "\n".join(detail)
        if len(sub) > MAX_SUB_TITLE:
            return None  # the card cannot show the question whole: the numbered text can
        card["sub_title_text"] = sub
    return card


def answered_button(label: str | None) -> str:
    """What the pressed card's buttons become (``update_template_card``'s ``button.replace_name``): the chosen
    option's label, cut as a button's text is; a check mark when the card's options are not known here."""
    return cut(label.strip(), MAX_BUTTON_TEXT) if label and label.strip() else ANSWERED_MARK


def option_label(options: list[dict], key: str) -> str | None:
    """The label of the option whose value is ``key``, among a card's options."""
    for opt in options:
        if isinstance(opt, dict) and opt.get("value") == key and isinstance(opt.get("label"), str):
            return opt["label"]
    return None
