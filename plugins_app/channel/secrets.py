"""The vault of secret_env_refs: values encrypted at rest with Fernet, never shown back.

The key is UGENT_SECRETS_KEY (a Fernet key, or any passphrase) or, without it,
derived from Django's SECRET_KEY; rotating either makes stored values unreadable
(they then count as missing, and the plugin's worker does not get them).
"""
from __future__ import annotations

import base64
import hashlib
import logging

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

from plugins_app.channel import conf

log = logging.getLogger("ugent.plugins")


def _fernet() -> Fernet:
    raw = conf.SECRETS_KEY
    if raw:
        try:
            return Fernet(raw.encode())
        except (ValueError, TypeError):
            pass  # a passphrase, not a Fernet key: derive one from it
    material = raw or f"ugent-plugin-secrets:{settings.SECRET_KEY}"
    return Fernet(base64.urlsafe_b64encode(hashlib.sha256(material.encode()).digest()))


def secret_encrypt(value: str) -> str:
    return _fernet().encrypt(value.encode()).decode("ascii")


def secret_decrypt(token: str) -> str | None:
    """The plain value, or None when it cannot be read (the key changed)."""
    try:
        return _fernet().decrypt(token.encode("ascii")).decode()
    except (InvalidToken, ValueError):
        return None


def secret_env_lookup(name: str) -> str | None:
    """A secret_env_refs value by its variable name, from the vault (settings.UGENT_KEY_ENV_LOOKUPS): a
    web key's `key_env` may name a secret a plugin holds, so the key sits in no file or environment."""
    from plugins_app.channel.models import PluginSecret
    for token in PluginSecret.objects.filter(name=name).order_by("id").values_list("ciphertext", flat=True):
        value = secret_decrypt(token)
        if value:
            return value
    return None
