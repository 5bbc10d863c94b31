"""The fields every API request shares, declared once: whom it speaks for and which conversation.

Each has the length its column holds (a longer value is a 400, not PostgreSQL's "value too long" as a
500) and none may hold a control character: an id the answer sends back in a header
(x-ugent-conversation-id) cannot carry a newline, and a user or client id is written into the request
log line, where a newline would forge a second line. Every input serializer of the API (the DRF views,
the chat and stream views, the live call's query) takes them from here.
"""
from __future__ import annotations

from rest_framework import serializers

from channels_app.json_input import JsonInput

CONTROL_CHARACTERS = "must not contain control characters (a newline, a tab, ...)"


def no_control_characters(value: str) -> None:
    """Refuses a value with a C0 control character or DEL, before anything is accepted."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise serializers.ValidationError(CONTROL_CHARACTERS)


def conversation_id_field(**kwargs) -> serializers.CharField:
    return serializers.CharField(max_length=255, validators=[no_control_characters], **kwargs)


def client_id_field(**kwargs) -> serializers.CharField:
    options = {"required": False, "default": "", "allow_blank": True, **kwargs}
    return serializers.CharField(max_length=200, validators=[no_control_characters], **options)


def channel_field() -> serializers.CharField:
    return serializers.CharField(required=False, default="web", max_length=50)


class IdentityFields(JsonInput):
    """Whom a request speaks for (Keys and callers)."""

    user = serializers.CharField(required=False, max_length=255, validators=[no_control_characters],
                                 help_text="The end user (Keys and callers).")
    federation_issuer = serializers.CharField(required=False, max_length=200, validators=[no_control_characters],
                                              help_text="With federation_subject: a federated end user.")
    federation_subject = serializers.CharField(required=False, max_length=255, validators=[no_control_characters],
                                               help_text="With federation_issuer: a federated end user.")


class ConversationFields(IdentityFields):
    """Whom a request speaks for and the conversation it names."""

    conversation_id = conversation_id_field()
    client_id = client_id_field()
    channel = channel_field()
