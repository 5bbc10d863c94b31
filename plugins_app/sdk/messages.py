"""The bridge's message shapes: the normalised inbound message and the outbound delivery.

Both sides validate with these classes, so a field a worker gets wrong is
named in the error it receives (``message.attachments[0].kind: ...``).
``from_dict`` ignores members it does not know, so a newer peer may add fields.
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


# -- small field checks ----------------------------------------------------------


def _obj(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise MessageValidationError(path, "must be an object")
    return value


def _str(d: dict, key: str, path: str, *, required: bool = True, allow_empty: bool = False,
         max_length: int | None = None) -> str | None:
    value = d.get(key)
    where = f"{path}.{key}" if path else key
    if value is None:
        if required:
            raise MessageValidationError(where, "is required")
        return None
    if not isinstance(value, str):
        raise MessageValidationError(where, "must be a string")
    if not allow_empty and not value:
        raise MessageValidationError(where, "must not be empty")
    if max_length is not None and len(value) > max_length:
        raise MessageValidationError(where, f"must be at most {max_length} characters")
    return value


def _choice(d: dict, key: str, path: str, choices: tuple[str, ...], default: str | None = None) -> str:
    value = d.get(key, default)
    where = f"{path}.{key}" if path else key
    if value is None:
        raise MessageValidationError(where, "is required")
    if value not in choices:
        raise MessageValidationError(where, f"must be one of {', '.join(choices)}")
    return value


def _int(d: dict, key: str, path: str, *, default: int | None = None, minimum: int = 0) -> int | None:
    value = d.get(key, default)
    where = f"{path}.{key}" if path else key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageValidationError(where, "must be an integer")
    if value < minimum:
        raise MessageValidationError(where, f"must be at least {minimum}")
    return value


def _metadata(d: dict, path: str) -> dict:
    value = d.get("metadata")
    if value is None:
        return {}
    return dict(_obj(value, f"{path}.metadata" if path else "metadata"))


def check_timestamp(value: Any, where: str) -> str:
    """An RFC 3339 timestamp with a zone offset (``2024-05-01T12:00:00Z``)."""
    if not isinstance(value, str) or not value:
        raise MessageValidationError(where, "must be an RFC 3339 timestamp string")
    try:
        parsed = _dt.datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise MessageValidationError(where, "must be an RFC 3339 timestamp") from None
    if parsed.tzinfo is None:
        raise MessageValidationError(where, "must carry a zone offset (Z or +hh:mm)")
    return value


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


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
        d = _obj(value, path)
        kind = _choice(d, "kind", path, ATTACHMENT_KINDS)
        content_type = _str(d, "content_type", path)
        if not _CONTENT_TYPE.match(content_type):
            raise MessageValidationError(f"{path}.content_type", "must be a MIME type such as image/png")
        att = cls(
            kind=kind,
            content_type=content_type,
            media_id=_str(d, "media_id", path, required=False, max_length=MAX_ID_LENGTH),
            url=_str(d, "url", path, required=False),
            filename=_str(d, "filename", path, required=False),
            size=_int(d, "size", path),
            channel_ref=_str(d, "channel_ref", path, required=False),
        )
        if att.media_id is None and att.url is None:
            raise MessageValidationError(f"{path}.media_id", "an attachment needs a media_id or a url")
        return att


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
        d = _obj(value, path)
        return cls(
            message_id=_str(d, "message_id", path, max_length=MAX_ID_LENGTH),
            text=_str(d, "text", path, required=False, allow_empty=True),
            sender_id=_str(d, "sender_id", path, required=False),
        )


def _attachments(d: dict, path: str) -> list[Attachment]:
    value = d.get("attachments")
    if value is None:
        return []
    where = f"{path}.attachments" if path else "attachments"
    if not isinstance(value, list):
        raise MessageValidationError(where, "must be an array")
    return [Attachment.from_dict(a, f"{where}[{i}]") for i, a in enumerate(value)]


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
        d = _obj(value, path or "message")
        p = path
        text = _str(d, "text", p, required=False, allow_empty=True) or ""
        attachments = _attachments(d, p)
        if not text and not attachments:
            raise MessageValidationError(f"{p}.text" if p else "text", "a message needs text or attachments")
        reply = d.get("reply_to")
        return cls(
            channel=_str(d, "channel", p, max_length=64),
            conversation_id=_str(d, "conversation_id", p, max_length=MAX_ID_LENGTH),
            message_id=_str(d, "message_id", p, max_length=MAX_ID_LENGTH),
            sender_id=_str(d, "sender_id", p, max_length=MAX_ID_LENGTH),
            sender_name=_str(d, "sender_name", p, required=False, allow_empty=True),
            source_type=_choice(d, "source_type", p, SOURCE_TYPES, default="unknown"),
            text=text,
            attachments=attachments,
            timestamp=check_timestamp(d.get("timestamp"), f"{p}.timestamp" if p else "timestamp"),
            reply_to=None if reply is None else ReplyContext.from_dict(reply, f"{p}.reply_to" if p else "reply_to"),
            metadata=_metadata(d, p),
        )


@dataclass
class OutboundDelivery:
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

    def validate(self) -> "OutboundDelivery":
        OutboundDelivery.from_dict(self.to_dict())
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
    def from_dict(cls, value: Any, path: str = "") -> "OutboundDelivery":
        d = _obj(value, path or "delivery")
        p = path
        created = d.get("created_at")
        return cls(
            delivery_id=_str(d, "delivery_id", p, max_length=MAX_ID_LENGTH),
            conversation_id=_str(d, "conversation_id", p, max_length=MAX_ID_LENGTH),
            channel=_str(d, "channel", p, required=False, allow_empty=True) or "",
            text=_str(d, "text", p, required=False, allow_empty=True) or "",
            attachments=_attachments(d, p),
            reply_to_message_id=_str(d, "reply_to_message_id", p, required=False, max_length=MAX_ID_LENGTH),
            attempt=_int(d, "attempt", p, default=1, minimum=1),
            created_at=None if created is None else check_timestamp(created, f"{p}.created_at" if p else "created_at"),
            metadata=_metadata(d, p),
            claim=_str(d, "claim", p, required=False, max_length=MAX_ID_LENGTH),
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
