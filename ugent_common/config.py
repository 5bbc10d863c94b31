"""Loading ugent.toml: the callers, keys, issuers and per-caller defaults of [web.auth].

The file is read again when it changes (checked at most every UGENT_CONFIG_RECHECK_SECS), so a key,
an issuer or a default edited in it takes effect without a restart. [web.auth] is strict: a key it
does not know is an error naming the key (`web_auth_check`, run at start by the daemon, the web
processes and `manage.py check`), as is a file that does not parse or is empty (blank or comments
alone: a write caught half-way; `[web.auth]` alone says there is none). An edit that leaves it so while
running keeps the whole last good file (its [rules], [memory], [tools], … and [web.auth]); one that
breaks [web.auth] alone keeps the last good [web.auth]. Either is logged once, and again after a good
read. A key's value is read from the environment variable its `key_env` names, else from the vault
of a plugin's secret_env_refs (the lookups in settings.UGENT_KEY_ENV_LOOKUPS), each time it is needed
(the vault's answer is kept a few seconds): a rotated key works within seconds.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from django.conf import settings
from django.utils.module_loading import import_string
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ugent_common.logs import Repeats, warn_repeating
from ugent_common.validation import StrList, first_error, first_repeat

log = logging.getLogger("ugent.config")
ROLES = ("operator", "application")
DEFAULT_CALLER = "default"  # the caller of UGENT_WEB_API_KEY

#: Asymmetric algorithms a JWKS can serve. `none` and the HMAC family (HS*) are never allowed: a JWKS
#: publishes public keys, and a public key taken as an HMAC secret is the RS/HS confusion attack.
ASYMMETRIC_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
                         "EdDSA")
DEFAULT_ALGORITHMS = ("RS256", "ES256")
#: Actor keys of other kinds start so: an issuer's prefix may not, or its subjects could pose as them.
RESERVED_PREFIXES = ("web:", "web-user@", "operator@", "fed:", "fed#", "cron:")
MAX_LEEWAY_SECS = 300


class ConfigError(Exception):
    """ugent.toml's [web.auth] cannot be used as written; the message names the key."""


# --- the declared shape of [web.auth] ---------------------------------------------------------

_STRICT = ConfigDict(extra="forbid", strict=True)


class KeySpec(BaseModel):
    model_config = _STRICT
    name: str
    key_env: str
    role: str = "application"  # checked per key: a key with a wrong role is refused, not the file
    issuers: StrList = []
    # May the caller change things through POST /v1/ugent/commands? Left out: by role (Caller).
    allow_remote_control: Optional[bool] = None


class IssuerSpec(BaseModel):
    """One [[web.auth.issuers]] entry: an identity provider whose JWTs name users."""

    model_config = _STRICT
    issuer: str
    jwks_url: str
    audience: str
    actor_prefix: str
    algorithms: StrList = list(DEFAULT_ALGORITHMS)
    leeway_secs: int = 30

    @field_validator("issuer", "audience")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("jwks_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+", v):
            raise ValueError(f"{v!r} is not an http(s) URL")
        return v

    @field_validator("actor_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return actor_prefix_check(v)

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, v: list) -> list:
        return algorithms_check(v)

    @field_validator("leeway_secs")
    @classmethod
    def _leeway(cls, v: int) -> int:
        if not 0 <= v <= MAX_LEEWAY_SECS:
            raise ValueError(f"must be between 0 and {MAX_LEEWAY_SECS} seconds")
        return v


class CallerDefaultsSpec(BaseModel):
    """One [[web.auth.caller_defaults]] entry: what every turn that asserts `issuer` gets."""

    model_config = _STRICT
    issuer: str
    model: str = ""
    disable_memory_recall: bool = False
    disable_memory_write: bool = False
    disable_code_context: bool = False
    allowed_tools: Optional[StrList] = None  # only these tools (narrowed further by a request)
    denied_tools: StrList = []  # never these; ["*"]: none

    @field_validator("allowed_tools")
    @classmethod
    def _allowed_not_empty(cls, value):
        if value is not None and not value:
            raise ValueError('allowed_tools = [] would mean no restriction: leave it out, or set denied_tools = ["*"]')
        return value


class WebAuthSpec(BaseModel):
    model_config = _STRICT
    api_key_role: str = "operator"
    api_key_allow_remote_control: Optional[bool] = None  # allow_remote_control of UGENT_WEB_API_KEY's caller
    require_verified_identity: bool = False
    keys: list[KeySpec] = []
    issuers: list[IssuerSpec] = []
    caller_defaults: list[CallerDefaultsSpec] = []


def actor_prefix_check(v: str) -> str:
    """An issuer's actor prefix: not empty, not one of another actor kind's (shared by the admin)."""
    if not v or v != v.strip():
        raise ValueError("must be a non-empty prefix such as 'crm:' (no surrounding spaces)")
    for reserved in RESERVED_PREFIXES:
        if v.startswith(reserved) or reserved.startswith(v):
            raise ValueError(f"{v!r} would let a token's subject pose as a {reserved!r} actor")
    return v


def algorithms_check(v: list) -> list:
    """An issuer's algorithm allow-list: asymmetric algorithms only (shared by the admin)."""
    if not v:
        raise ValueError("must list at least one algorithm")
    for alg in v:
        if alg not in ASYMMETRIC_ALGORITHMS:
            raise ValueError(f"{alg!r} is not allowed: use {', '.join(ASYMMETRIC_ALGORITHMS)} "
                             "(never none or HS*, a JWKS holds public keys)")
    return list(v)


@dataclass(frozen=True)
class ConfiguredKey:
    caller: str
    role: str
    issuers: tuple = field(default_factory=tuple)
    raw: str = ""
    key_env: str = ""
    allow_remote_control: Optional[bool] = None  # None: unset, the role decides (Caller.remote_control_allowed)


# --- the file ---------------------------------------------------------------------------------

def ugent_home() -> Path:
    """The directory whose `.ugent/` holds an operator's own rules.toml, routing.toml and plugins.toml:
    UGENT_HOME, else the user's home. Read when used, so a changed setting moves all three."""
    value = getattr(settings, "UGENT_HOME", "")
    return Path(value).expanduser() if value else Path.home()


def config_path() -> Path | None:
    if settings.UGENT_CONFIG:
        return Path(settings.UGENT_CONFIG)
    candidate = Path(settings.UGENT_WORKSPACE) / "ugent.toml"
    return candidate if candidate.exists() else None


# --- a file with nothing in it ---------------------------------------------------------------

FILE_EMPTY = "the file is empty"


class EmptyFileError(ValueError):
    """A TOML file with nothing in it (blank, or comments alone), refused wherever rows follow a file: more
    likely a write caught half-way than a wish to remove every row, which a file saying `says` alone says.
    str() is the refusal of an import ("<source>: the file is empty; nothing was changed (to <remove>, import a
    file that says `<says>` alone)"; FILE_EMPTY alone without a source); `held` is its words where a running
    process keeps the last good rows and nobody asked for an import."""

    def __init__(self, source: str, *, remove: str, says: str, means: str = ""):
        self.source, self.remove, self.says, self.means = source, remove, says, means
        super().__init__(f"{source}: {FILE_EMPTY}; nothing was changed (to {remove}, import a file that says "
                         f"`{says}` alone)" if source else FILE_EMPTY)

    @property
    def held(self) -> str:
        return f"{self.source} is empty (blank or comments alone; `{self.says}` alone says {self.means})"


def toml_refuse_empty(data: dict, *, source: str, remove: str, says: str, means: str = "") -> dict:
    """`data`, a parsed TOML file, when it holds anything; EmptyFileError when it is blank or comments alone.
    The one home of that rule: cron.toml's import, `rules import`, `identity import` and ugent.toml's reads
    all call it, so the rows a file made are kept as they were."""
    if not data:
        raise EmptyFileError(source, remove=remove, says=says, means=means)
    return data


# --- ugent.toml, read ---------------------------------------------------------------------------

def _refuse_empty(data: dict, source: str) -> dict:
    return toml_refuse_empty(data, source=source, remove="remove the issuers and caller defaults it imported",
                             says="[web.auth]", means="there are no issuers or caller defaults")


def _read_why(path: Path | None) -> tuple[dict, str]:
    """The file's tables, and why it cannot stand for itself ("" when it can), naming the file: it cannot be
    read, does not parse (tomllib's line and column; a write caught half-way), or is blank or comments alone
    (the same, more likely than a wish to drop every table, which `[web.auth]` alone says). A missing file is
    no file: ({}, ""). The one read of the start-up check and the running process's; it logs nothing."""
    if not path or not path.exists():
        return {}, ""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        return {}, f"{path} does not parse: {exc}"
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"{path} could not be read: {exc}"
    try:
        return _refuse_empty(data, str(path)), ""
    except EmptyFileError as exc:
        return {}, exc.held


def web_auth_parse(data: dict) -> WebAuthSpec:
    """[web.auth] of a parsed ugent.toml, validated; ConfigError naming the key otherwise."""
    web = data.get("web", {})
    raw = web.get("auth", {}) if isinstance(web, dict) else {}
    if not isinstance(raw, dict):
        raise ConfigError("ugent.toml: web.auth: expected a table")
    try:
        spec = WebAuthSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("ugent.toml: " + first_error(exc, root="web.auth", data=raw,
                                                        labels={"keys": "name", "issuers": "issuer",
                                                                "caller_defaults": "issuer"}))
    for what, values in (("issuers", [i.issuer for i in spec.issuers]),
                         ("caller_defaults", [d.issuer for d in spec.caller_defaults])):
        rep = first_repeat(values)
        if rep is not None:
            raise ConfigError(f"ugent.toml: web.auth.{what}[{rep[1]}]: issuer {values[rep[1]]!r} "
                              f"repeats web.auth.{what}[{rep[0]}]")
    prefixes = [i.actor_prefix for i in spec.issuers]
    for i, a in enumerate(prefixes):
        for j, b in enumerate(prefixes):
            if i != j and b.startswith(a):
                raise ConfigError(f"ugent.toml: web.auth.issuers[{j}].actor_prefix: {b!r} starts with "
                                  f"web.auth.issuers[{i}]'s {a!r}, so their actors could collide")
    return spec


class _Loaded:
    """The last good file, re-read when its mtime or size changes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.checked_at = -1e18
        self.stamp: tuple | None = None
        self.data: dict = {}
        self.auth: WebAuthSpec = WebAuthSpec()
        self.generation = 0
        # why the file as it stands is not the [web.auth] in use ("" when it is): it is empty, does not
        # parse or is invalid; the rows it defines then stay too (config_sync), as `identity import` refuses it
        self.error = ""
        # why no table of the file as it stands is in use ("" when they are): it is empty, or cannot be read
        # or parsed; load_config() gives the last good file's ([rules], [memory], …), and [web.auth] its too
        self.held = ""
        self.used = self.auth_used = False  # a read's tables, its [web.auth], are in use (else none are)
        self.failures = Repeats()  # the failures logged since the file was last read well


_loaded = _Loaded()


def _stamp(path: Path | None) -> tuple:
    if not path:
        return (None,)
    try:
        st = path.stat()
    except OSError:
        return (str(path), None)
    return (str(path), st.st_mtime_ns, st.st_size)


def _refresh() -> _Loaded:
    now = time.monotonic()
    recheck = float(getattr(settings, "UGENT_CONFIG_RECHECK_SECS", 2.0))
    if now - _loaded.checked_at < recheck:
        return _loaded
    with _loaded.lock:
        if now - _loaded.checked_at < recheck:
            return _loaded
        path = config_path()
        stamp = _stamp(path)
        if stamp != _loaded.stamp:
            _read_anew(path, stamp)
        _loaded.checked_at = now
    return _loaded


def _read_anew(path: Path | None, stamp: tuple) -> None:
    """The file changed: take it, or keep what is in use and say why. A failure is logged once, and again
    after a good read (whatever the log's repeat filter saw before): `failures` is cleared by each good one."""
    data, why = _read_why(path)
    if why:  # empty, or cannot be read or parsed (a write caught half-way): none of it is used, as at start
        _loaded.held = _loaded.error = why
        _fail(f"{why}; the last good file is kept" if _loaded.used else f"{why}; none of it is used")
    else:
        try:
            _loaded.auth, _loaded.auth_used = web_auth_parse(data), True
            _loaded.error = ""
            _loaded.failures.clear()
        except ConfigError as exc:  # its other tables are used; [web.auth] the last good one, or none
            _loaded.error = str(exc)
            _fail(f"{exc}; the last good [web.auth] is kept" if _loaded.auth_used else f"{exc}; [web.auth] is not used")
        _loaded.data, _loaded.used, _loaded.held = data, True, ""
    _loaded.stamp = stamp
    _loaded.generation += 1


def _fail(message: str) -> None:
    warn_repeating(log, "%s", message, level=logging.ERROR, repeats=_loaded.failures)


def load_config() -> dict:
    """ugent.toml as a dict; {} when there is none. A file that is empty, or cannot be read or parsed, is
    logged, not fatal: the last good file's tables are given (config_held() says why), {} with none."""
    return _refresh().data


def web_auth() -> WebAuthSpec:
    """[web.auth] as last read well."""
    return _refresh().auth


def generation() -> int:
    """Goes up each time the file is read anew (a changed file): callers resync what they derive."""
    return _refresh().generation


def web_auth_rows_held() -> str:
    """Why the issuer and caller-defaults rows ugent.toml made must stay as they are, though the file changed
    ("" when they may follow it): the file is empty, does not parse, or is invalid (web_auth_error's words)."""
    return _refresh().error


def web_auth_error() -> str:
    """Why the running [web.auth] is not the file as it stands now ("" when it is): the status shows it."""
    return _refresh().error


def config_held() -> str:
    """Why none of ugent.toml as it stands is in use ("" when it is): it is empty, or cannot be read or parsed,
    and load_config() and web_auth() give the last good file's tables (none, when no read was good)."""
    return _refresh().held


def web_auth_check() -> None:
    """At start: ugent.toml as written now, or ConfigError naming what is wrong: the file, when it cannot be
    read, does not parse (tomllib's line and column) or is empty (blank or comments alone: a write caught
    half-way, as the running process takes it; `[web.auth]` alone, or no file, is no [web.auth]), else
    [web.auth]'s first bad key."""
    path = config_path()
    stamp = _stamp(path)  # (before the read: a change after it is read anew at the next refresh)
    data, why = _read_why(path)
    if why:
        raise ConfigError(why)
    auth = web_auth_parse(data)
    # The file the check passed is this process's first good version: if it is emptied or broken before
    # the first real read, that read keeps this one rather than running with no [web.auth] at all.
    with _loaded.lock:
        if not _loaded.used:
            _loaded.data, _loaded.auth, _loaded.used, _loaded.auth_used = data, auth, True, True
            _loaded.stamp, _loaded.error, _loaded.held = stamp, "", ""
            _loaded.checked_at = time.monotonic()
            _loaded.generation += 1


# --- keys -------------------------------------------------------------------------------------

_vault: dict[str, tuple[float, str]] = {}
VAULT_CACHE_SECS = 2.0


def key_env_value(name: str) -> str:
    """The value of a key_env variable: the environment, else the vault (kept VAULT_CACHE_SECS)."""
    if not name:
        return ""
    raw = os.environ.get(name, "")
    if raw:
        return raw
    now = time.monotonic()
    hit = _vault.get(name)
    if hit is not None and now - hit[0] < VAULT_CACHE_SECS:
        return hit[1]
    value = ""
    for dotted in getattr(settings, "UGENT_KEY_ENV_LOOKUPS", ()):
        try:
            value = import_string(dotted)(name) or ""
        except Exception:  # a broken vault must not take every key down with it
            log.warning("key_env lookup %s failed for %s", dotted, name, exc_info=True)
            value = ""
        if value:
            break
    _vault[name] = (now, value)
    return value


def configured_keys() -> list[ConfiguredKey]:
    """UGENT_WEB_API_KEY and each [[web.auth.keys]] entry whose variable (or vault entry) is set."""
    auth = web_auth()
    keys = []
    if settings.UGENT_WEB_API_KEY:
        role = auth.api_key_role
        if role in ROLES:
            keys.append(ConfiguredKey(DEFAULT_CALLER, role, (), settings.UGENT_WEB_API_KEY, "UGENT_WEB_API_KEY",
                                      auth.api_key_allow_remote_control))
        else:
            log.error("UGENT_WEB_API_KEY refused (api_key_role=%r; the roles are operator and application)", role)
    for entry in auth.keys:
        raw = key_env_value(entry.key_env)
        name, role = entry.name, entry.role
        if not raw or not name:
            continue
        if role not in ROLES or name == DEFAULT_CALLER:
            log.error("key refused (name=%s, reason=%s)", name,
                      f"role {role!r} is not operator or application" if role not in ROLES
                      else f"the name {DEFAULT_CALLER!r} belongs to UGENT_WEB_API_KEY")
            continue
        keys.append(ConfiguredKey(name, role, tuple(entry.issuers), raw, entry.key_env, entry.allow_remote_control))
    return keys


def key_env_of(caller_name: str) -> Optional[str]:
    """The variable a configured caller's key is read from (the admin shows it, never the key)."""
    if caller_name == DEFAULT_CALLER:
        return "UGENT_WEB_API_KEY"
    for entry in web_auth().keys:
        if entry.name == caller_name:
            return entry.key_env
    return None


def config_recheck() -> None:
    """Look at ugent.toml again at its next use, whatever the recheck interval (a watcher saw it change).
    Unlike reset_caches() this forgets nothing: a broken file still keeps the last good one."""
    with _loaded.lock:
        _loaded.checked_at = -1e18
        if _loaded.stamp is not None:  # read it again even if path, mtime and size match (a file replaced
            _loaded.stamp = ("recheck",)  # with `cp -p`): its watcher saw a change (the inode) they miss


def reset_caches() -> None:
    """Forget everything read (tests, and a settings change): the next read starts with no last good file."""
    with _loaded.lock:
        _loaded.checked_at = -1e18
        _loaded.stamp = None
        _loaded.data, _loaded.auth, _loaded.error, _loaded.held = {}, WebAuthSpec(), "", ""
        _loaded.used = _loaded.auth_used = False
        _loaded.failures.clear()
        _loaded.generation += 1
    _vault.clear()
