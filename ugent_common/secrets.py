"""The secrets vault every room uses: values encrypted at rest with Fernet, never shown back.

The key is UGENT_SECRETS_KEY (a Fernet key, or any passphrase) or, without it, derived from Django's
SECRET_KEY; rotating either makes stored values unreadable (they then count as missing). Channel
plugins' secret_env_refs and agent profiles' secret config keys (api_key, *_token, *password*, …)
are kept here. `SecretJSONField` seals a JSON config's secret-named values on every write.
"""
from __future__ import annotations

import base64
import hashlib
import re

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.db import models

SEALED = "$ugent_secret"
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_SECRET_LAST_WORDS = {"key", "apikey", "secret", "token", "password", "passwd", "credential", "credentials",
                      "authorization"}


def _fernet() -> Fernet:
    raw = getattr(settings, "UGENT_SECRETS_KEY", "")
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


def is_secret_name(name: str) -> bool:
    """A config key named like a secret: its last word is key, token, secret, password, … (max_tokens is not)."""
    words = [w.lower() for w in _WORDS.findall(str(name))]
    return bool(words) and words[-1] in _SECRET_LAST_WORDS


def is_sealed(value) -> bool:
    return isinstance(value, dict) and set(value) == {SEALED}


def secrets_sealed(config):
    """The config with every secret-named, non-empty value encrypted ({"$ugent_secret": token}); nested too."""
    if not isinstance(config, dict):
        return config
    out = {}
    for k, v in config.items():
        if is_sealed(v):
            out[k] = v
        elif is_secret_name(k) and v not in (None, ""):
            out[k] = {SEALED: secret_encrypt(v if isinstance(v, str) else str(v))}
        else:
            out[k] = secrets_sealed(v)
    return out


def secrets_opened(config):
    """The config with sealed values decrypted, for the engine only; an unreadable one is left out."""
    if not isinstance(config, dict):
        return config
    out = {}
    for k, v in config.items():
        if is_sealed(v):
            plain = secret_decrypt(v[SEALED])
            if plain is not None:
                out[k] = plain
        else:
            out[k] = secrets_opened(v)
    return out


def secrets_hidden(config):
    """The config without its secrets (what a page may show), and the secret paths it held."""
    if not isinstance(config, dict):
        return config, []
    out, paths = {}, []
    for k, v in config.items():
        if is_sealed(v) or (is_secret_name(k) and v not in (None, "")):
            paths.append(k)
        else:
            inner, sub = secrets_hidden(v)
            out[k] = inner
            paths.extend(f"{k}/{p}" for p in sub)
    return out, paths


class SecretJSONField(models.JSONField):
    """A JSON config whose secret-named values are stored encrypted, whichever way the row is written."""

    def pre_save(self, model_instance, add):
        value = secrets_sealed(getattr(model_instance, self.attname))
        setattr(model_instance, self.attname, value)
        return value

    def get_prep_value(self, value):
        return super().get_prep_value(secrets_sealed(value))
