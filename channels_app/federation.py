"""Federated identity: a JWT from a listed issuer, verified against the issuer's JWKS, names the end user.

A request carries the token as `Authorization: Bearer <jwt>` beside its `x-api-key`, or in the
`x-ugent-identity` header (docs/identity.md). The issuers are `Issuer` rows (`[[web.auth.issuers]]`
imports into them). A token is verified with PyJWT against its issuer's JWKS, fetched with httpx:

- the JWKS is kept for as long as its `Cache-Control: max-age` says (UGENT_JWKS_DEFAULT_TTL_SECS
  without one), and fetched again when a token names a `kid` it does not hold, at most once per
  UGENT_JWKS_MIN_REFRESH_SECS per issuer, so a stream of made-up kids cannot hammer the provider;
- a fetch that fails keeps the keys already held, and is not tried again within the same interval;
  only a request that carries a token ever waits on a fetch (UGENT_JWKS_TIMEOUT_SECS at most);
- enforced: the signature, `iss`, `aud`, `exp` (required) and `nbf` with the issuer's leeway, `sub`
  (required), and the issuer's algorithm allow-list. `none` and HS* are never accepted, and the key
  must be of the algorithm's type (an RSA key never verifies an ES256 or HS256 token).

Every refusal is an ApplicationError 403 (`identity_token_invalid`) whose message names the rule.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import jwt
from django.conf import settings
from django.db import transaction

from channels_app.errors import ApplicationError
from channels_app.models import CallerDefaults, Issuer
from ugent_common import config

log = logging.getLogger("ugent.identity")

IDENTITY_HEADER = "x-ugent-identity"
CODE = "identity_token_invalid"
#: The key types an algorithm family verifies with.
KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


@dataclass(frozen=True)
class VerifiedIdentity:
    """The end user a verified token names."""

    issuer: str
    subject: str
    actor_key: str  # <actor_prefix><sub>
    expires_at: float | None = None  # Unix time past which it is refused: its exp plus the issuer's leeway


def _expiry(exp, leeway) -> float:
    """exp plus leeway as Unix time; an exp too large for a float (PyJWT takes any integer) never comes."""
    try:
        return float(exp) + float(leeway)
    except OverflowError:
        return math.inf


def refuse(why: str) -> ApplicationError:
    return ApplicationError(f"The identity token was refused: {why}", status=403, code=CODE)


# --- the JWKS cache ----------------------------------------------------------------------------

@dataclass
class _Jwks:
    keys: dict = field(default_factory=dict)  # kid -> jwt.PyJWK
    expires_at: float = 0.0                    # time.monotonic() past which the set is stale
    fetched_at: float = -1e18                  # the last attempt, good or not
    failed: str = ""                           # why the last attempt failed ("" when it did not)
    lock: threading.Lock = field(default_factory=threading.Lock)


_cache: dict[str, _Jwks] = {}
_cache_lock = threading.Lock()
_MAX_AGE = re.compile(r"(?:^|,)\s*(?:s-)?max-age\s*=\s*\"?(\d+)", re.I)


def _entry(url: str) -> _Jwks:
    with _cache_lock:
        found = _cache.get(url)
        if found is None:
            found = _cache[url] = _Jwks()
        return found


def jwks_reset() -> None:
    """Forget every fetched JWKS (tests)."""
    with _cache_lock:
        _cache.clear()


def jwks_forget(*, urls: list[str]) -> int:
    """Forget the fetched JWKS of these URLs in this process: the next token of each fetches it again."""
    with _cache_lock:
        return sum(1 for url in set(urls) if _cache.pop(url, None) is not None)


def _ttl(cache_control: str) -> float:
    low = float(settings.UGENT_JWKS_MIN_REFRESH_SECS)
    if re.search(r"\b(no-store|no-cache)\b", cache_control or "", re.I):
        return low
    m = _MAX_AGE.search(cache_control or "")
    ttl = float(m.group(1)) if m else float(settings.UGENT_JWKS_DEFAULT_TTL_SECS)
    return min(max(ttl, low), float(settings.UGENT_JWKS_MAX_TTL_SECS))


def _fetch(url: str, entry: _Jwks) -> None:
    """One fetch of a JWKS into `entry` (its lock held). A failure keeps the keys held."""
    entry.fetched_at = time.monotonic()
    try:
        resp = httpx.get(url, timeout=float(settings.UGENT_JWKS_TIMEOUT_SECS), follow_redirects=False,
                         headers={"accept": "application/json"})
        resp.raise_for_status()
        doc = resp.json()
        keys = {}
        for raw in doc.get("keys", []) if isinstance(doc, dict) else []:
            if not isinstance(raw, dict) or raw.get("use", "sig") != "sig":
                continue
            try:
                key = jwt.PyJWK(raw)
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
                log.warning("JWKS %s: a key was skipped (kid=%s): not a usable public key", url, raw.get("kid"))
                continue
            keys[raw.get("kid") or ""] = key
        if not isinstance(doc, dict) or "keys" not in doc:
            raise ValueError("the document holds no `keys`")
    except (httpx.HTTPError, ValueError, json.JSONDecodeError) as exc:
        entry.failed = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("JWKS could not be fetched (url=%s, error=%s)", url, entry.failed)
        return
    entry.keys, entry.failed = keys, ""
    entry.expires_at = entry.fetched_at + _ttl(resp.headers.get("cache-control", ""))


def jwks_key(issuer: Issuer, kid: str):
    """The issuer's public key `kid`, fetching the JWKS when it is stale or lacks that kid (at most
    once per interval). Refuses when the key cannot be had."""
    entry = _entry(issuer.jwks_url)
    interval = float(settings.UGENT_JWKS_MIN_REFRESH_SECS)
    with entry.lock:
        now = time.monotonic()
        due = now - entry.fetched_at >= interval
        if due and (now >= entry.expires_at or kid not in entry.keys):
            _fetch(issuer.jwks_url, entry)
        key = entry.keys.get(kid)
        if key is None and not kid and len(entry.keys) == 1:
            key = next(iter(entry.keys.values()))  # a token without kid, a JWKS of one key
        failed = entry.failed
    if key is not None:
        return key
    if failed and not entry.keys:
        raise refuse(f"the JWKS of issuer {issuer.issuer!r} could not be fetched, so no token of it can be "
                     "verified now.")
    raise refuse(f"it is signed by a key (kid {kid!r}) that the JWKS of issuer {issuer.issuer!r} does not hold.")


def identity_status() -> dict:
    """The `identity` section of GET /v1/ugent/status: the rules in force, each issuer's JWKS as this
    process holds it, and a [web.auth] edit that was refused (the last good one runs meanwhile)."""
    issuers = []
    for issuer in Issuer.objects.order_by("issuer"):
        with _cache_lock:
            entry = _cache.get(issuer.jwks_url)
        issuers.append({"issuer": issuer.issuer, "actor_prefix": issuer.actor_prefix,
                        "algorithms": _algorithms(issuer), "from_config": issuer.from_config,
                        "jwks_keys": len(entry.keys) if entry else None,
                        "jwks_error": (entry.failed or None) if entry else None})
    return {"require_verified_identity": config.web_auth().require_verified_identity,
            "config_error": config.web_auth_error() or None, "issuers": issuers}


# --- verification ------------------------------------------------------------------------------

def token_from_headers(headers, api_key: str) -> str:
    """The identity token a request carries, or "": `Authorization: Bearer` when an `x-api-key` is
    there too (and is not the same string), else the x-ugent-identity header."""
    token = (headers.get(IDENTITY_HEADER) or "").strip()
    if token:
        return token
    if headers.get("x-api-key"):
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            bearer = auth[7:].strip()
            if bearer and bearer != api_key:
                return bearer
    return ""


def _algorithms(issuer: Issuer) -> list[str]:
    return list(issuer.algorithms or config.DEFAULT_ALGORITHMS)


def token_verify(token: str) -> VerifiedIdentity:
    """The end user a token names, or a 403 refusal saying which rule refused it."""
    try:
        header = jwt.get_unverified_header(token)
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise refuse("it is not a JWT (three base64url parts: header, claims, signature).")
    alg = header.get("alg")
    if not isinstance(alg, str) or alg.lower() == "none":
        raise refuse("its algorithm is none: an unsigned token is never accepted.")
    iss = claims.get("iss")
    if not isinstance(iss, str) or not iss:
        raise refuse("it names no issuer (iss).")
    issuer = Issuer.objects.filter(issuer=iss).first()
    if issuer is None:
        raise refuse(f"its issuer {iss!r} is not listed in [[web.auth.issuers]].")
    allowed = _algorithms(issuer)
    if alg not in allowed or alg not in config.ASYMMETRIC_ALGORITHMS:
        raise refuse(f"its algorithm {alg} is not allowed for issuer {iss!r} (allowed: {', '.join(allowed)}).")
    kid = header.get("kid") or ""
    if not isinstance(kid, str):
        raise refuse("its key id (kid) is not a string.")
    key = jwks_key(issuer, kid)
    kty = key.key_type
    if KEY_TYPES.get(alg[:2]) != kty:
        raise refuse(f"its algorithm {alg} does not match the {kty} key (kid {kid!r}) it names.")
    try:
        verified = jwt.decode(token, key=key.key, algorithms=[alg], audience=issuer.audience, issuer=iss,
                              leeway=issuer.leeway_secs,
                              options={"require": ["exp", "iss", "aud", "sub"], "verify_signature": True})
    except jwt.ExpiredSignatureError:
        raise refuse("it has expired (exp).")
    except jwt.ImmatureSignatureError:
        raise refuse("it is not valid yet (nbf or iat in the future).")
    except jwt.InvalidAudienceError:
        raise refuse(f"its audience (aud) is not {issuer.audience!r}.")
    except jwt.InvalidIssuerError:
        raise refuse(f"its issuer (iss) is not {iss!r}.")
    except jwt.MissingRequiredClaimError as exc:
        raise refuse(f"it lacks the {exc.claim} claim.")
    except jwt.InvalidSignatureError:
        raise refuse("its signature does not verify against the issuer's key.")
    except jwt.PyJWTError as exc:
        raise refuse(f"it is not valid ({exc}).")
    sub = verified.get("sub")
    # the subject is kept as it is (Actor.user_id, federation_subject: 255 characters) and behind the prefix
    # (Actor.key: 300); a longer one was a 500 on PostgreSQL where its row is first saved, past the check
    if not isinstance(sub, str) or not sub or len(sub) > 255 or len(issuer.actor_prefix) + len(sub) > 300:
        raise refuse("its subject (sub) is empty or too long.")
    return VerifiedIdentity(issuer=iss, subject=sub, actor_key=f"{issuer.actor_prefix}{sub}",
                            expires_at=_expiry(verified["exp"], issuer.leeway_secs))


# --- [[web.auth.issuers]] and [[web.auth.caller_defaults]] ⇄ rows -------------------------------
# These writes live here rather than in services.py because auth (a part, below services) runs the
# sync on the request path when ugent.toml changed.

ISSUER_FIELDS = ("jwks_url", "audience", "actor_prefix", "algorithms", "leeway_secs")
DEFAULTS_FIELDS = ("model", "disable_memory_recall", "disable_memory_write", "disable_code_context",
                   "allowed_tools", "denied_tools")


@transaction.atomic
def identity_config_import(*, auth: config.WebAuthSpec) -> dict:
    """[[web.auth.issuers]] and [[web.auth.caller_defaults]] into their rows. The file wins for the
    rows it defines (from_config); a row it no longer lists and that came from it is removed; rows
    made in the admin stay. Returns counts."""
    counts = {"issuers": 0, "caller_defaults": 0, "removed": 0}
    names = [i.issuer for i in auth.issuers]
    # a prefix moves between issuers in one edit: free the old rows' prefixes first
    Issuer.objects.filter(from_config=True).exclude(issuer__in=names).delete()
    for spec in auth.issuers:
        values = {"jwks_url": spec.jwks_url, "audience": spec.audience, "actor_prefix": spec.actor_prefix,
                  "algorithms": list(spec.algorithms), "leeway_secs": spec.leeway_secs, "from_config": True}
        Issuer.objects.filter(actor_prefix=spec.actor_prefix).exclude(issuer=spec.issuer).delete()
        Issuer.objects.update_or_create(issuer=spec.issuer, defaults=values)
        counts["issuers"] += 1
    gone = CallerDefaults.objects.filter(from_config=True).exclude(
        issuer__in=[d.issuer for d in auth.caller_defaults]).delete()[0]
    counts["removed"] += gone
    for spec in auth.caller_defaults:
        CallerDefaults.objects.update_or_create(issuer=spec.issuer, defaults={
            **{f: (list(getattr(spec, f)) if isinstance(getattr(spec, f), (list, tuple)) else getattr(spec, f))
               for f in DEFAULTS_FIELDS}, "from_config": True})
        counts["caller_defaults"] += 1
    return counts


def identity_config_export() -> dict:
    """The [web.auth] tables of every Issuer and CallerDefaults row, as ugent.toml holds them."""
    issuers = [{"issuer": i.issuer, "jwks_url": i.jwks_url, "audience": i.audience,
                "actor_prefix": i.actor_prefix, "algorithms": list(i.algorithms or config.DEFAULT_ALGORITHMS),
                "leeway_secs": i.leeway_secs} for i in Issuer.objects.order_by("issuer")]
    defaults = []
    for d in CallerDefaults.objects.order_by("issuer"):
        entry = {"issuer": d.issuer}
        if d.model:
            entry["model"] = d.model
        entry.update({f: getattr(d, f) for f in DEFAULTS_FIELDS[1:] if getattr(d, f)})
        defaults.append(entry)
    return {"issuers": issuers, "caller_defaults": defaults}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a TOML basic string


def identity_toml_render(exported: dict) -> str:
    """identity_config_export() as TOML, to paste under [web.auth] of ugent.toml. With no rows, a
    `[web.auth]` table alone, which `identity import` reads as "none" (it refuses a blank file)."""
    if not any(exported.get(table) for table in ("issuers", "caller_defaults")):
        return "# no issuers and no caller defaults\n[web.auth]\n"
    out = []
    for table in ("issuers", "caller_defaults"):
        for entry in exported.get(table, []):
            out.append(f"[[web.auth.{table}]]")
            out.extend(f"{k} = {_toml_value(v)}" for k, v in entry.items())
            out.append("")
    return "\n".join(out)

_synced = {"generation": None}
_sync_lock = threading.Lock()


def config_sync() -> None:
    """Bring the rows that ugent.toml defines up to date when the file was read anew (cheap otherwise)."""
    gen = config.generation()
    if _synced["generation"] == gen:
        return
    with _sync_lock:
        if _synced["generation"] == gen:
            return
        held = config.web_auth_rows_held()
        if held:  # empty, unparseable or invalid: the rows keep their last good state, as `identity import` does
            log.error("[web.auth] issuers and caller defaults in the database are kept as they were: %s", held)
            _synced["generation"] = gen
            return
        try:
            identity_config_import(auth=config.web_auth())
        except Exception:  # the rows keep their last state; the next change tries again
            log.exception("[web.auth] issuers and caller defaults could not be imported")
        _synced["generation"] = gen
