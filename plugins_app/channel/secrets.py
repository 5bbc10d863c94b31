"""The vault of secret_env_refs: values encrypted at rest with Fernet, never shown back.

The vault itself is ugent_common.secrets, shared with agent profiles' secret config keys.
"""
from ugent_common.secrets import secret_decrypt, secret_encrypt  # noqa: F401
