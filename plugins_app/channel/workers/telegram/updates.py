"""Bot API updates as the hub's inbound messages, and the conversation ids answers go back to."""
from __future__ import annotations

import re

from typing import Any

from plugins_app.channel.sdk import Attachment, InboundMessage, ReplyContext
from ugent_common.digits import ascii_int

SOURCE_TYPES = {"private": "user", "group": "group", "supergroup": "group", "channel": "room"}
FILE_URL_PREFIX = "tg-file:"

def _sender_name(user: dict | None) -> str | None:
    if not user:
        return None
    name = " ".join(p for p in (user.get("first_name"), user.get("last_name")) if p)
    return name or user.get("title") or user.get("username")


def conversation_of(chat_id: Any, thread_id: Any = None) -> str:
    """A chat, or a forum topic of a supergroup (``<chat_id>/<message_thread_id>``)."""
    return f"{chat_id}/{thread_id}" if thread_id else str(chat_id)


def parse_conversation(conversation_id: str) -> tuple[int | str, int | None]:
    chat, _, thread = conversation_id.partition("/")
    try:
        chat_id: int | str = int(chat)
    except ValueError:
        chat_id = chat  # a channel's @username
    return chat_id, ascii_int(thread)


def _attachments(msg: dict) -> list[Attachment]:
    out = []
    if msg.get("photo"):
        best = max(msg["photo"], key=lambda p: (p.get("file_size") or 0, p.get("width", 0) * p.get("height", 0)))
        out.append(Attachment("image", "image/jpeg", url=FILE_URL_PREFIX + best["file_id"],
                              size=best.get("file_size")))
    for key, kind, default_type in (("document", "document", "application/octet-stream"),
                                    ("video", "video", "video/mp4"), ("animation", "video", "video/mp4"),
                                    ("audio", "audio", "audio/mpeg"), ("voice", "audio", "audio/ogg"),
                                    ("video_note", "video", "video/mp4"), ("sticker", "image", "image/webp")):
        f = msg.get(key)
        if f and (key != "document" or "animation" not in msg):
            ctype = f.get("mime_type") or default_type
            if kind == "document" and ctype.startswith("image/"):
                kind = "image"
            out.append(Attachment(kind, ctype, url=FILE_URL_PREFIX + f["file_id"], filename=f.get("file_name"),
                                  size=f.get("file_size")))
    return out


def addressed_to(text: str, bot_username: str | None) -> str:
    """A command addressed to this bot in a group (``/model@this_bot gpt-x``) as the hub reads a command
    (``/model gpt-x``); one addressed to another bot keeps its ``@other_bot``, which the hub takes for no
    command of its own."""
    if not bot_username:
        return text
    return re.sub(rf"^(\s*/[^\s@/]+)@{re.escape(bot_username)}(?=\s|$)", r"\1", text, count=1, flags=re.IGNORECASE)


def normalise(update: dict, bot_username: str | None = None) -> InboundMessage | None:
    """One Bot API ``Update`` as the hub's message, or None for an update the bot does not answer.

    The message id is ``<update_id>:<message_id>``: the update id is Telegram's dedupe key (a
    redelivered update repeats it), and the chat's message id is what an answer replies to.
    """
    update_id = update.get("update_id")
    if update_id is None:
        return None
    if (cq := update.get("callback_query")) is not None:
        msg = cq.get("message") or {}
        chat = msg.get("chat") or {}
        if not chat or not cq.get("data"):
            return None
        user = cq.get("from") or {}
        return InboundMessage(
            channel="telegram", conversation_id=conversation_of(chat["id"], msg.get("message_thread_id")
                                                                if msg.get("is_topic_message") else None),
            message_id=f"{update_id}:cb", sender_id=str(user.get("id") or chat["id"]),
            sender_name=_sender_name(user), source_type=SOURCE_TYPES.get(chat.get("type"), "unknown"),
            text=cq["data"], reply_to=ReplyContext(str(msg["message_id"])) if msg.get("message_id") else None,
            metadata={"option": cq["data"],  # the pressed button's value: a question's reply token
                      "telegram": {"update_id": update_id, "callback_query_id": cq.get("id"),
                                   "option": cq["data"]}})
    msg = update.get("message") or update.get("channel_post")
    if not msg or not msg.get("chat"):
        return None
    chat = msg["chat"]
    user = msg.get("from") or msg.get("sender_chat") or chat
    text = addressed_to(msg.get("text") or msg.get("caption") or "", bot_username)
    attachments = _attachments(msg)
    if not text and not attachments:
        return None  # a service message (member joined, pinned, …): nothing to answer
    reply = msg.get("reply_to_message")
    return InboundMessage(
        channel="telegram",
        conversation_id=conversation_of(chat["id"], msg.get("message_thread_id") if msg.get("is_topic_message")
                                        else None),
        message_id=f"{update_id}:{msg['message_id']}", sender_id=str(user["id"]), sender_name=_sender_name(user),
        source_type=SOURCE_TYPES.get(chat.get("type"), "unknown"), text=text, attachments=attachments,
        reply_to=None if not reply else ReplyContext(
            str(reply["message_id"]), reply.get("text") or reply.get("caption"),
            str((reply.get("from") or {}).get("id")) if reply.get("from") else None),
        metadata={"telegram": {"update_id": update_id, "chat_type": chat.get("type"),
                               "username": user.get("username")}})


def reply_message_id(reply_to: str | None) -> int | None:
    """The Telegram message an answer replies to, from the hub's ``<update_id>:<message_id>``."""
    if not reply_to:
        return None
    tail = reply_to.rsplit(":", 1)[-1]
    return ascii_int(tail)
