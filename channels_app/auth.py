"""API keys (x-api-key or Authorization: Bearer) -> the caller a request speaks for."""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from rest_framework import authentication, permissions

from channels_app import rows
from channels_app.errors import ApplicationError
from channels_app.models import ApiKey, Caller, Role, hash_key
from ugent_site import config


@dataclass
class Principal:
    """The authenticated caller; DRF puts it in request.user."""

    caller: Caller

    @property
    def is_operator(self) -> bool:
        return self.caller.role == Role.OPERATOR

    is_authenticated = True


def raw_key_from_headers(headers) -> str:
    key = headers.get("x-api-key", "")
    if not key:
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
    return key


def caller_for_key(raw: str) -> Caller | None:
    """Configured keys first (ugent.toml / environment), then keys created in the admin."""
    if not raw:
        return None
    digest = hash_key(raw)
    for ck in config.configured_keys():
        if hmac.compare_digest(_digest(ck.raw), digest):
            caller = rows.table(Caller).get(name=ck.caller)
            if caller is None:
                caller, _ = Caller.objects.get_or_create(
                    name=ck.caller, defaults={"role": ck.role, "issuers": list(ck.issuers), "from_config": True})
            if caller.role != ck.role or caller.issuers != list(ck.issuers):
                caller.role, caller.issuers = ck.role, list(ck.issuers)
                caller.save(update_fields=["role", "issuers", "updated_at"])
            return caller
    c, k = rows.table(Caller), rows.table(ApiKey)
    row = rows.fetchone(f"SELECT {c.select_list(c.attnames, 'c')} FROM {k.name} k JOIN {c.name} c "
                        f"ON c.id = k.{k.col('caller')} WHERE k.{k.col('key_hash')} = %s AND k.{k.col('active')} = %s",
                        [digest, True])
    return c.from_row(c.attnames, row) if row else None


_digests: dict[str, str] = {}


def _digest(raw: str) -> str:
    """A configured key's hash, computed once per key."""
    d = _digests.get(raw)
    if d is None:
        if len(_digests) > 1000:
            _digests.clear()
        d = _digests[raw] = hash_key(raw)
    return d


def authenticate_headers(headers) -> Principal:
    raw = raw_key_from_headers(headers)
    if not raw:
        raise ApplicationError("Missing API key: send it as x-api-key or Authorization: Bearer.",
                               status=401, code="missing_api_key")
    caller = caller_for_key(raw)
    if caller is None:
        raise ApplicationError("Invalid API key.", status=401, code="invalid_api_key")
    return Principal(caller)


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        return authenticate_headers(request.headers), None

    def authenticate_header(self, request):
        return "Bearer"


class HasCaller(permissions.BasePermission):
    def has_permission(self, request, view):
        return isinstance(request.user, Principal)


class IsOperator(permissions.BasePermission):
    message = "This endpoint answers operator keys only."

    def has_permission(self, request, view):
        return isinstance(request.user, Principal) and request.user.is_operator
