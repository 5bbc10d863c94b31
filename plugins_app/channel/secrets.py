"""The vault of secret_env_refs: values encrypted at rest with Fernet, never shown back.

The vault itself is ugent_common.secrets, shared with agent profiles' secret config keys.
"""
from __future__ import annotations

from ugent_common.secrets import secret_decrypt, secret_encrypt  # noqa: F401


def secret_env_lookup(name: str) -> str | None:
    """A secret_env_refs value by its variable name, from the vault (settings.UGENT_KEY_ENV_LOOKUPS): a
    web key's `key_env` may name a secret a plugin holds, so the key sits in no file or environment."""
    from plugins_app.channel.models import PluginSecret
    for token in PluginSecret.objects.filter(name=name).order_by("id").values_list("ciphertext", flat=True):
        value = secret_decrypt(token)
        if value:
            return value
    return None
