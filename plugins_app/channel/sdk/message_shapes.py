"""The wire shapes of the SDK's messages, declared as pydantic models (see ``shapes.py`` for the error style).

``messages.py`` validates through these and hands out its dataclasses; it imports
this module on the first message, so importing the SDK does not load pydantic.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, Field, model_validator

from .messages import ATTACHMENT_KINDS, MAX_ID_LENGTH, SOURCE_TYPES, _content_type, _timestamp
from .shapes import Shape, field_error

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
Name = Annotated[str, Field(min_length=1)]
Timestamp = Annotated[Any, AfterValidator(_timestamp)]
ContentType = Annotated[Name, AfterValidator(_content_type)]


class AttachmentShape(Shape):
    kind: Literal[ATTACHMENT_KINDS]
    content_type: ContentType
    media_id: Optional[Id] = None
    url: Optional[Name] = None
    filename: Optional[Name] = None
    size: Optional[Annotated[int, Field(ge=0)]] = None
    channel_ref: Optional[Name] = None

    @model_validator(mode="after")
    def _has_bytes(self):
        if self.media_id is None and self.url is None:
            raise field_error("media_id", "an attachment needs a media_id or a url")
        return self


class ReplyShape(Shape):
    message_id: Id
    text: Optional[str] = None
    sender_id: Optional[Name] = None


class InboundShape(Shape):
    channel: Annotated[str, Field(min_length=1, max_length=64)]
    conversation_id: Id
    message_id: Id
    sender_id: Id
    sender_name: Optional[str] = None
    source_type: Literal[SOURCE_TYPES] = "unknown"
    text: Optional[str] = None
    attachments: Optional[list[AttachmentShape]] = None
    timestamp: Timestamp
    reply_to: Optional[ReplyShape] = None
    metadata: Optional[dict] = None

    @model_validator(mode="after")
    def _has_content(self):
        if not self.text and not self.attachments:
            raise field_error("text", "a message needs text or attachments")
        return self


class DeliveryShape(Shape):
    delivery_id: Id
    conversation_id: Id
    channel: Optional[str] = None
    text: Optional[str] = None
    attachments: Optional[list[AttachmentShape]] = None
    reply_to_message_id: Optional[Id] = None
    attempt: Annotated[int, Field(ge=1)] = 1
    created_at: Optional[Timestamp] = None
    metadata: Optional[dict] = None
    claim: Optional[Id] = None


