"""OneBot 12 message events as the hub's inbound messages, and who in a group the worker answers.

A message event (https://12.onebot.dev, "消息事件") is ``type: message``, ``detail_type`` ``private`` (``user_id``)
or ``group`` (``group_id``, ``user_id``: who wrote), with ``message_id``, ``message`` (a list of segments
``{"type", "data"}``), ``alt_message`` (a plain rendering) and ``self: {"platform", "user_id"}`` (the account the
bridge is logged in as). The segments read: ``text`` (``text``), ``mention`` (``user_id``), ``mention_all``,
``image``/``voice``/``audio``/``video``/``file`` (``file_id``, fetched with ``get_file``), ``location``
(``latitude``, ``longitude``, ``title``, ``content``) and ``reply`` (``message_id``, ``user_id``). An
implementation's own segments (ComWeChatBotClient's ``wx.emoji``, ``wx.link``, ``wx.app``...) are not read:
a message of nothing else is taken as its ``alt_message``.
"""
from __future__ import annotations

from plugins_app.channel.sdk import Attachment, InboundMessage, ReplyContext
from plugins_app.channel.sdk.messages import utc_from_epoch

CHANNEL = "wechat"
GROUP_PREFIX = "group:"
#: The URL an attachment carries until its bytes are on the host: the SDK fetches what has a URL, and this one
#: names the bridge's ``file_id`` (the host never sees it: the message goes on with the bytes, or a note).
FILE_URL_PREFIX = "onebot-file:"
#: Group messages the worker answers: those that mention the account (or reply to one of its messages), all of
#: them, or none.
GROUP_POLICIES = ("mention", "all", "off")

_FILES = {"image": ("image", "image/jpeg", "image"), "voice": ("audio", "audio/silk", "voice message"),
          "audio": ("audio", "audio/mpeg", "audio"), "video": ("video", "video/mp4", "video"),
          "file": ("document", "application/octet-stream", "file")}


def conversation_of(event: dict) -> str:
    """A private chat is the peer's user id; a group ``group:<group_id>`` (user and group ids may share a form on
    a bridge of another platform, and the answer needs to know which it is)."""
    if event.get("detail_type") == "group":
        return GROUP_PREFIX + str(event.get("group_id") or "")
    return str(event.get("user_id") or "")


def target_of(conversation_id: str) -> dict:
    """``send_message``'s ``detail_type`` and whom to send to, for a conversation id of ``conversation_of``."""
    if conversation_id.startswith(GROUP_PREFIX):
        return {"detail_type": "group", "group_id": conversation_id.removeprefix(GROUP_PREFIX)}
    return {"detail_type": "private", "user_id": conversation_id}


def file_id_of(url: str | None) -> str | None:
    return url.removeprefix(FILE_URL_PREFIX) if url and url.startswith(FILE_URL_PREFIX) else None


def _segments(event: dict) -> list[tuple[str, dict]]:
    out = []
    for seg in event.get("message") if isinstance(event.get("message"), list) else []:
        if isinstance(seg, dict) and isinstance(seg.get("type"), str):
            out.append((seg["type"], seg.get("data") if isinstance(seg.get("data"), dict) else {}))
    return out


def addressed(event: dict, self_id: str | None) -> bool:
    """A group message is for the account: a ``mention`` of it, or a ``reply`` to one of its messages."""
    if not self_id:
        return False
    return any((kind == "mention" and str(data.get("user_id")) == self_id)
               or (kind == "reply" and str(data.get("user_id")) == self_id) for kind, data in _segments(event))


def self_id_of(event: dict) -> str | None:
    me = event.get("self") if isinstance(event.get("self"), dict) else {}
    return str(me["user_id"]) if me.get("user_id") not in (None, "") else None


def normalise(event: dict, *, groups: str = "mention", self_id: str | None = None) -> InboundMessage | None:
    """A message event as the hub's ``InboundMessage``; None for what is not submitted: not a message, the
    account's own, a group message the policy passes over, nothing to read."""
    if event.get("type") != "message" or event.get("detail_type") not in ("private", "group"):
        return None
    me = self_id_of(event) or self_id
    sender = str(event.get("user_id") or "")
    if not sender or (me and sender == me):
        return None  # the account's own messages (sent from its phone, or the worker's answers) would loop
    group = event.get("detail_type") == "group"
    if group and (groups == "off" or not event.get("group_id") or (groups == "mention" and not addressed(event, me))):
        return None
    texts: list[str] = []
    attachments: list[Attachment] = []
    reply_to = None
    for kind, data in _segments(event):
        if kind == "text":
            texts.append(str(data.get("text") or ""))
        elif kind == "mention":
            if str(data.get("user_id")) != me:  # the account's own mention is how it was called, not content
                texts.append(f"@{data.get('user_id')} ")
        elif kind == "mention_all":
            texts.append("@all ")
        elif kind in _FILES and data.get("file_id"):
            att_kind, ctype, _ = _FILES[kind]
            attachments.append(Attachment(kind=att_kind, content_type=ctype,
                                          url=FILE_URL_PREFIX + str(data["file_id"]), channel_ref=str(data["file_id"])))
        elif kind == "location":
            where = " ".join(str(data.get(k)) for k in ("title", "content") if data.get(k))
            texts.append(f"[location] {where} ({data.get('latitude')}, {data.get('longitude')})".replace("  ", " "))
        elif kind == "reply" and data.get("message_id") and reply_to is None:
            # ComWeChatBotClient puts the chatroom's id where a quote in a group names its sender: no sender then
            quoted = str(data["user_id"]) if data.get("user_id") else None
            reply_to = ReplyContext(message_id=str(data["message_id"]),
                                    sender_id=None if group and quoted == str(event.get("group_id")) else quoted)
    text = "".join(texts).strip()
    if not text and not attachments:
        text = str(event.get("alt_message") or "").strip()  # an implementation's own segment (a link, a sticker)
        if not text:
            return None
    platform = event["self"].get("platform") if isinstance(event.get("self"), dict) else None
    metadata = {k: v for k, v in {"self_id": me, "platform": platform,
                                  "group_id": event.get("group_id") if group else None,
                                  "event_id": event.get("id")}.items() if v}
    return InboundMessage(
        channel=CHANNEL, conversation_id=conversation_of(event),
        message_id=str(event.get("message_id") or event.get("id") or ""), sender_id=sender,
        source_type="group" if group else "user", text=text, attachments=attachments, reply_to=reply_to,
        timestamp=utc_from_epoch(event.get("time")), metadata=metadata)
