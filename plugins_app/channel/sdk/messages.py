"""The bridge's message shapes: the normalised inbound message and the outbound delivery.

Both sides validate with these classes, so a field a worker gets wrong is
named in the error it receives (``message.attachments[0].kind: ...``). The
shapes are declared once, as pydantic models (``message_shapes.py``);
the dataclasses are what code handles. ``from_dict`` ignores members it does
not know, so a newer peer may add fields.
"""
from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from typing import Any

SOURCE_TYPES = ("user", "group", "room", "unknown")
ATTACHMENT_KINDS = ("image", "audio", "video", "document", "other")
ACK_STATUSES = ("delivered", "failed")

_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*(\s*;.*)?$")
MAX_ID_LENGTH = 512


class MessageValidationError(ValueError):
    """A message that breaks the protocol; ``field`` is the dotted path of what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def prefixed(self, prefix: str) -> "MessageValidationError":
        return MessageValidationError(f"{prefix}.{self.field}" if prefix else self.field, self.reason)


def check_timestamp(value: Any, where: str) -> str:
    """An RFC 3339 timestamp with a zone offset (``2024-05-01T12:00:00Z``)."""
    try:
        return _timestamp(value)
    except ValueError as exc:
        raise MessageValidationError(where, str(exc)) from None


def _timestamp(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be an RFC 3339 timestamp string")
    try:
        parsed = _dt.datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise ValueError("must be an RFC 3339 timestamp") from None
    if parsed.tzinfo is None:
        raise ValueError("must carry a zone offset (Z or +hh:mm)")
    return value


def _content_type(value: str) -> str:
    if not _CONTENT_TYPE.match(value):
        raise ValueError("must be a MIME type such as image/png")
    return value


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def utc_from_epoch(seconds) -> str:
    """A platform's epoch seconds (WeCom's and Weixin's ``CreateTime``) as the protocol's UTC timestamp; now when
    it is missing or no number."""
    try:
        moment = _dt.datetime.fromtimestamp(int(seconds), _dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        moment = _dt.datetime.now(_dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _validated(model_name: str, value: Any, path: str, default: str) -> Any:
    # The shapes (pydantic) load on the first message, not at import: a worker starts as fast as before.
    from . import message_shapes, shapes
    return shapes.validate_shape(getattr(message_shapes, model_name), value, root=path, default=default,
                                 error=MessageValidationError)


def _attachment(shape: Any) -> "Attachment":
    return Attachment(kind=shape.kind, content_type=shape.content_type, media_id=shape.media_id, url=shape.url,
                      filename=shape.filename, size=shape.size, channel_ref=shape.channel_ref)


# -- shapes ------------------------------------------------------------------------


@dataclass
class Attachment:
    """One file of a message: host media (``media_id`` from media.put) or a channel URL."""

    kind: str
    content_type: str
    media_id: str | None = None
    url: str | None = None
    filename: str | None = None
    size: int | None = None
    channel_ref: str | None = None  # the channel's own id for this file, once uploaded there

    def validate(self, path: str = "attachment") -> "Attachment":
        Attachment.from_dict(self.to_dict(), path)
        return self

    def to_dict(self) -> dict:
        return _drop_none({
            "kind": self.kind, "content_type": self.content_type, "media_id": self.media_id,
            "url": self.url, "filename": self.filename, "size": self.size, "channel_ref": self.channel_ref,
        })

    @classmethod
    def from_dict(cls, value: Any, path: str = "attachment") -> "Attachment":
        return _attachment(_validated("AttachmentShape", value, path, "attachment"))


@dataclass
class ReplyContext:
    """The message this one answers, as the channel names it."""

    message_id: str
    text: str | None = None
    sender_id: str | None = None

    def to_dict(self) -> dict:
        return _drop_none({"message_id": self.message_id, "text": self.text, "sender_id": self.sender_id})

    @classmethod
    def from_dict(cls, value: Any, path: str = "reply_to") -> "ReplyContext":
        shape = _validated("ReplyShape", value, path, "reply_to")
        return cls(message_id=shape.message_id, text=shape.text, sender_id=shape.sender_id)


@dataclass
class InboundMessage:
    """A channel message normalised for the host (``inbound.submit``).

    ``message_id`` is the channel's own id for the message and, with
    ``conversation_id``, the idempotency key: the host accepts a repeat as a
    duplicate and runs it once.
    """

    channel: str
    conversation_id: str
    message_id: str
    sender_id: str
    text: str = ""
    source_type: str = "unknown"
    sender_name: str | None = None
    attachments: list[Attachment] = field(default_factory=list)
    timestamp: str = field(default_factory=utc_now)
    reply_to: ReplyContext | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The idempotency key as one string (conversation and channel message id)."""
        return f"{self.conversation_id}\x1f{self.message_id}"

    def validate(self) -> "InboundMessage":
        InboundMessage.from_dict(self.to_dict())
        return self

    def to_dict(self) -> dict:
        d = {
            "channel": self.channel,
            "conversation_id": self.conversation_id,
            "message_id": self.message_id,
            "sender_id": self.sender_id,
            "sender_name": self.sender_name,
            "source_type": self.source_type,
            "text": self.text,
            "attachments": [a.to_dict() for a in self.attachments],
            "timestamp": self.timestamp,
            "reply_to": self.reply_to.to_dict() if self.reply_to else None,
            "metadata": dict(self.metadata),
        }
        return _drop_none(d)

    @classmethod
    def from_dict(cls, value: Any, path: str = "") -> "InboundMessage":
        m = _validated("InboundShape", value, path, "message")
        return cls(
            channel=m.channel, conversation_id=m.conversation_id, message_id=m.message_id,
            sender_id=m.sender_id, sender_name=m.sender_name, source_type=m.source_type, text=m.text or "",
            attachments=[_attachment(a) for a in m.attachments or []], timestamp=m.timestamp,
            reply_to=None if m.reply_to is None else ReplyContext(m.reply_to.message_id, m.reply_to.text,
                                                                  m.reply_to.sender_id),
            metadata=dict(m.metadata or {}),
        )


@dataclass
class Delivery:
    """A message the host asks the worker to send to the channel (``outbound.poll``).

    ``delivery_id`` is the host's idempotency key; ``attempt`` starts at 1 and
    grows by one with each retry after a retryable failure, so a worker can tell
    a retry from a redelivery of the same attempt.
    """

    delivery_id: str
    conversation_id: str
    text: str = ""
    channel: str = ""
    attachments: list[Attachment] = field(default_factory=list)
    reply_to_message_id: str | None = None
    attempt: int = 1
    created_at: str | None = None
    metadata: dict = field(default_factory=dict)
    #: The host's mark of the hand-out this copy came from; the worker sends it back with its ack,
    #: so an ack is matched to the claim that holds the delivery (a replaced session's late one is not).
    claim: str | None = field(default=None, compare=False)

    def validate(self) -> "Delivery":
        Delivery.from_dict(self.to_dict())
        return self

    def to_dict(self) -> dict:
        return _drop_none({
            "delivery_id": self.delivery_id,
            "conversation_id": self.conversation_id,
            "channel": self.channel,
            "text": self.text,
            "attachments": [a.to_dict() for a in self.attachments],
            "reply_to_message_id": self.reply_to_message_id,
            "attempt": self.attempt,
            "created_at": self.created_at,
            "metadata": dict(self.metadata),
            "claim": self.claim,
        })

    @classmethod
    def from_dict(cls, value: Any, path: str = "") -> "Delivery":
        d = _validated("DeliveryShape", value, path, "delivery")
        return cls(
            delivery_id=d.delivery_id, conversation_id=d.conversation_id, channel=d.channel or "",
            text=d.text or "", attachments=[_attachment(a) for a in d.attachments or []],
            reply_to_message_id=d.reply_to_message_id, attempt=d.attempt, created_at=d.created_at,
            metadata=dict(d.metadata or {}), claim=d.claim,
        )


@dataclass
class Media:
    """Bytes of one attachment with their type, as media.get returns and media.put takes."""

    data: bytes
    content_type: str
    filename: str | None = None

    @property
    def size(self) -> int:
        return len(self.data)
