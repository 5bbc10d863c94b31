"""API keys (x-api-key or Authorization: Bearer) -> the caller a request speaks for."""
from __future__ import annotations

import copy
import hmac
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from rest_framework import authentication, permissions

from channels_app import federation, statements

from ugent_common import rows
from channels_app.errors import ApplicationError
from channels_app.models import ApiKey, Caller, Role, hash_key
from ugent_common import config

log = logging.getLogger("ugent.hub")


@dataclass
class Principal:
    """The caller whose key authenticated; DRF puts it in request.user. It says which key spoke, not
    whom the request acts for: that is a channels_app.access.Viewer (services.viewer_resolve), which
    every data check takes."""

    caller: Caller
    identity: "federation.VerifiedIdentity | None" = None  # a verified identity token's user
    key_id: int | None = None  # the admin-issued ApiKey that spoke; None for a configured key

    @property
    def has_operator_key(self) -> bool:
        """An operator key, whomever it names: enough for the operator-only host endpoints, never for data."""
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
    return caller_and_key_for_key(raw)[0]


def caller_and_key_for_key(raw: str) -> tuple[Caller | None, int | None]:
    """The caller of a key and the admin-issued key's id (None for a configured key)."""
    if not raw:
        return None, None
    digest = hash_key(raw)
    federation.config_sync()
    for ck in config.configured_keys():
        if hmac.compare_digest(_digest(ck.raw), digest):
            return configured_caller(ck), None
    found = statements.caller_for_key_hash(digest)
    if found is None:
        return None, None
    key_id, caller = found
    key_used(key_id)
    return caller, key_id


# --- the callers of configured keys, kept per process ----------------------------
# ugent.toml declares them and the file wins for their role, issuers and allow_remote_control; their row
# holds the rest (its id, the admin's default_model). A process reads the row again once
# UGENT_CALLER_RECHECK_SECS have passed, when ugent.toml was read anew, or when this process saved or
# deleted a caller (the admin, caller_rows_changed), instead of on every request: a round trip each in
# servers mode. A change made in another process counts here within the recheck interval.

_callers: dict[str, tuple[float, int, Caller]] = {}  # name -> (monotonic read time, config generation, row)
_callers_changed = [0]  # goes up with each save or delete of a caller in this process
_clock = time.monotonic


def _copy(caller: Caller) -> Caller:
    """A caller of its own for one request: the kept row never changes under another request."""
    out = copy.copy(caller)
    out.issuers = list(caller.issuers or [])
    return out


def _follows_file(caller: Caller, ck) -> bool:
    return (caller.role == ck.role and caller.issuers == list(ck.issuers)
            and caller.allow_remote_control == ck.allow_remote_control)


def configured_caller(ck) -> Caller:
    """The Caller row of a configured key (created at its first use, brought in line with the file): a
    copy of this process's, read again when it is older than UGENT_CALLER_RECHECK_SECS."""
    now, gen, changed = _clock(), config.generation(), _callers_changed[0]
    held = _callers.get(ck.caller)
    if (held is not None and held[1] == gen and now - held[0] < settings.UGENT_CALLER_RECHECK_SECS
            and _follows_file(held[2], ck)):
        return _copy(held[2])
    caller = rows.table(Caller).get(name=ck.caller)
    written = False  # by this call: then what it holds is the row as it now stands
    if caller is None:
        caller, written = Caller.objects.get_or_create(
            name=ck.caller, defaults={"role": ck.role, "issuers": list(ck.issuers), "from_config": True,
                                      "allow_remote_control": ck.allow_remote_control})
    # The file wins for the callers it declares: role, issuers and allow_remote_control follow it.
    if not _follows_file(caller, ck):
        # Written past the models' signals: the file is each process's own word for these fields, so a
        # process whose file differs (a rolling deploy) brings the row back at its next read, and a
        # credentials wake-up from each would set the other off again, without end. A stream opened with
        # this key is checked against this process's file anyway.
        caller.role, caller.issuers = ck.role, list(ck.issuers)
        caller.allow_remote_control = ck.allow_remote_control
        caller.updated_at = timezone.now()
        Caller.objects.filter(pk=caller.pk).update(role=caller.role, issuers=caller.issuers, updated_at=caller.updated_at,
                                                   allow_remote_control=caller.allow_remote_control)
        caller_rows_changed()
        written = True
    if written or _callers_changed[0] == changed:  # else a save or delete came meanwhile: not kept
        if len(_callers) > 1000:
            _callers.clear()
        _callers[ck.caller] = (now, gen, _copy(caller))
    return caller


def caller_rows_changed(**kwargs) -> None:
    """post_save / post_delete of a Caller (connected in channels_app.apps): this process reads the rows
    of configured callers again at their next use. The signal comes inside the writer's transaction, so
    a request on another thread may read and keep the old row before it commits: the kept rows are
    forgotten again once it has."""
    _callers_forget()
    from django.db import transaction
    if transaction.get_connection(kwargs.get("using")).in_atomic_block:
        transaction.on_commit(_callers_forget, using=kwargs.get("using"))


def _callers_forget() -> None:
    _callers_changed[0] += 1
    _callers.clear()


# --- credentials changed: open streams ask theirs again --------------------------
# An open event stream checks the key or token that opened it at each keep-alive (channels_app.fanout), and
# at once when its caller's credentials change, here or in another process: a wake-up on its caller's topic.
# What counts (CREDENTIAL_FIELDS): a key's activity, hash or caller, a caller's name, role, issuers or remote
# control, an identity issuer's verification (for the callers that list it), and any of them deleted. A
# label or a default model saved wakes nobody. A change written past the models' signals and these services
# (a raw UPDATE, a key taken out of ugent.toml) waits for the keep-alive.

CREDENTIALS_TOPIC = "credentials"
CREDENTIAL_FIELDS = {
    "ApiKey": ("active", "key_hash", "caller_id"),
    "Caller": ("name", "role", "issuers", "allow_remote_control"),
    "Issuer": ("issuer", "jwks_url", "audience", "actor_prefix", "algorithms", "leeway_secs"),
}


def credentials_topic(caller_pk: int) -> str:
    return f"{CREDENTIALS_TOPIC}:{caller_pk}"


def credentials_snapshot(sender, instance, update_fields=None, **kwargs) -> None:
    """pre_save of ApiKey, Caller and Issuer (channels_app.apps): what the row held of the fields that
    authenticate, to tell at post_save whether any changed (None: none of them is being saved)."""
    fields = CREDENTIAL_FIELDS[sender.__name__]
    instance._credentials_was = None
    if instance.pk is None:
        return
    if update_fields is not None and not {sender._meta.get_field(f).attname for f in update_fields} & set(fields):
        return
    instance._credentials_was = sender.objects.filter(pk=instance.pk).values(*fields).first()


def credentials_changed(sender, instance, created=False, **kwargs) -> None:
    """post_save / post_delete of ApiKey, Caller and Issuer (channels_app.apps): when a field that
    authenticates changed (or the row went), wake the checks of the streams of the callers concerned."""
    if created:
        return
    if "update_fields" in kwargs:  # a save (post_delete has no such argument)
        was = getattr(instance, "_credentials_was", None)
        if was is None or all(getattr(instance, f) == v for f, v in was.items()):
            return
    if sender.__name__ == "ApiKey":
        callers = [instance.caller_id]
    elif sender.__name__ == "Caller":
        callers = [instance.pk]
    else:  # an issuer: the callers that accept its tokens
        callers = [pk for pk, issuers in Caller.objects.values_list("pk", "issuers") if instance.issuer in (issuers or ())]
    credentials_changed_for(*callers, using=kwargs.get("using"))


def credentials_changed_for(*caller_pks: int, using=None) -> None:
    """Wake the credentials checks of these callers' open streams, in every process, once the change has
    committed (a check before it would still pass)."""
    if not caller_pks:
        return
    from django.db import transaction

    from channels_app import notify
    topics = [credentials_topic(pk) for pk in caller_pks]
    transaction.on_commit(lambda: notify.publish(*topics), using=using)


# --- ApiKey.last_used_at -----------------------------------------------------
# Written at most once a minute per key, and never by the request: the request thread only checks an
# in-process clock per key; the UPDATE runs on one background thread, conditional on the stored value
# being a minute old, so several processes sharing a database also write it about once a minute.

KEY_USE_EVERY_SECS = 60
_key_marked: dict[int, float] = {}  # key id -> time.monotonic() of this process's last write
_key_writer: ThreadPoolExecutor | None = None
_key_writer_lock = threading.Lock()
_key_pending: list[Future] = []


def key_used(key_id: int) -> None:
    """Note that a key authenticated a request; writes `last_used_at` off the hot path when due."""
    now = time.monotonic()
    last = _key_marked.get(key_id)
    if last is not None and now - last < KEY_USE_EVERY_SECS:
        return
    _key_marked[key_id] = now
    global _key_writer
    with _key_writer_lock:
        if _key_writer is None:
            _key_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ugent-key-use")
        _key_pending[:] = [f for f in _key_pending if not f.done()]
        _key_pending.append(_key_writer.submit(_key_used_write, key_id, timezone.now()))


def _key_used_write(key_id: int, at) -> int:
    from django.db import close_old_connections, connection
    close_old_connections()
    try:
        return (ApiKey.objects.filter(pk=key_id)
                .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=at - timedelta(seconds=KEY_USE_EVERY_SECS)))
                .update(last_used_at=at))
    except Exception:  # a bookkeeping write: a locked or gone database must not surface anywhere
        log.warning("could not record the use of API key %s", key_id, exc_info=True)
        return 0
    finally:
        connection.close()


def key_use_flush() -> None:
    """Wait for the pending `last_used_at` writes (tests, and a process that stops)."""
    with _key_writer_lock:
        pending = list(_key_pending)
    for f in pending:
        f.result()


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
    """The caller of the request's key, and the user its identity token names (verified, or a 403)."""
    raw = raw_key_from_headers(headers)
    if not raw:
        raise ApplicationError("Missing API key: send it as x-api-key or Authorization: Bearer.",
                               status=401, code="missing_api_key")
    caller, key_id = caller_and_key_for_key(raw)
    if caller is None:
        raise ApplicationError("Invalid API key.", status=401, code="invalid_api_key")
    token = federation.token_from_headers(headers, raw)
    if not token:
        return Principal(caller, key_id=key_id)
    return Principal(caller, federation.token_verify(token), key_id=key_id)


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
        return isinstance(request.user, Principal) and request.user.has_operator_key
