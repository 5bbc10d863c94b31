"""Finding and instantiating chat engines through OPM's opm.agents.* entry points.

Engine instances are cached per profile version: engines are stateless (the
seed), so one instance serves every turn of a profile and keeps its
connection pool warm.
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
import time
from importlib.metadata import entry_points

from ovos_plugin_manager.utils import PluginTypes, find_plugins

_lock = threading.Lock()
_instances: dict[tuple, object] = {}
_extra: dict[str, type] = {}
# The installed engines, found once per process: the scan imports every engine of every group, which
# made the first turn after a start wait seconds (issue #12). plugins_app.agent.warm fills it at start.
_discovered: dict[str, type] | None = None
_discover_lock = threading.Lock()
_GROUPS = (PluginTypes.AGENT_CHAT, PluginTypes.AGENT_CHAT_MULTIMODAL)
# One build of an engine at a time per key, on a thread of its own under UGENT_PLUGIN_START_TIMEOUT:
# `_lock` only guards the dicts, so a constructor that never returns holds up only the callers of that
# engine, for at most the timeout, and never the other engines (_kept).
_building: dict[tuple, threading.Lock] = {}
_build_failed: dict[tuple, tuple[float, str]] = {}  # key -> (_clock() before which it is not tried again, why)
#: Seconds a build that did not finish in time is not tried again (its callers are refused at once meanwhile).
BUILD_RETRY_SECS = 30.0
_generation = 0  # reset() counts up: a build that ends after a reset is not kept


def register_engine(name: str, cls: type) -> None:
    """Register an engine class in-process (tests, embedding applications)."""
    _extra[name] = cls


def _env_engines() -> dict[str, type]:
    """UGENT_EXTRA_ENGINES="name=module:Class,..." for engines that are not installed packages."""
    return _env_classes("UGENT_EXTRA_ENGINES")


def _env_classes(variable: str) -> dict[str, type]:
    """{name: class} from an environment variable "name=module:Class,...", imported now."""
    out = {}
    for item in filter(None, os.environ.get(variable, "").split(",")):
        name, _, target = item.partition("=")
        module, _, attr = target.partition(":")
        out[name.strip()] = getattr(importlib.import_module(module.strip()), attr.strip())
    return out


def _installed(refresh: bool = False) -> dict[str, type]:
    global _discovered
    with _discover_lock:
        if _discovered is None or refresh:
            found = {}
            for group in _GROUPS:
                found.update(find_plugins(group))
            _discovered = found
        return _discovered


def chat_engines(refresh: bool = False) -> dict[str, type]:
    """Every installed chat engine by entry-point name (multimodal ones included); `refresh` scans again."""
    found = dict(_installed(refresh))
    found.update(_env_engines())
    found.update(_extra)
    return found


def _entry_point_class(provider: str) -> type | None:
    """One engine by its entry-point name, importing only that engine (the last group that has it wins,
    as in the full scan)."""
    found = None
    for group in _GROUPS:
        for ep in entry_points(group=str(getattr(group, "value", group)), name=provider):
            try:
                found = ep.load()
            except Exception:
                continue
    return found


def engine_class(provider: str) -> type:
    if provider in _extra:
        return _extra[provider]
    env = _env_engines()
    if provider in env:
        return env[provider]
    if _discovered is not None and provider in _discovered:
        return _discovered[provider]
    found = _entry_point_class(provider) if _discovered is None else None
    if found is None:
        found = chat_engines().get(provider)
    if found is None:
        raise LookupError(f"no chat engine named '{provider}' is installed")
    return found


def profile_hears_audio(profile) -> bool:
    """Whether the profile's engine takes audio itself (a MultimodalChatEngine: a voice message's recording
    reaches it as audio). Raises LookupError when its engine is not installed."""
    from ovos_plugin_manager.templates.agents import MultimodalChatEngine
    cls = engine_class(profile.provider)
    return isinstance(cls, type) and issubclass(cls, MultimodalChatEngine)  # (an entry point may be a factory)


def profile_follows_prompts(profile) -> bool:
    """Whether the profile's engine does what a prompt asks (rewrite this, translate that), rather than
    answer from somewhere else whatever it is asked: the offline notes engine quotes notes (its class says
    `follows_prompts = False`). Raises LookupError when its engine is not installed."""
    return bool(getattr(engine_class(profile.provider), "follows_prompts", True))


def engine_for_profile(profile) -> object:
    key = (profile.pk, profile.updated_at, profile.provider)

    def build():
        from ugent_common.secrets import secrets_opened
        config = secrets_opened(dict(profile.config or {}))  # the engine alone sees the plain secrets
        if profile.system_prompt and "system_prompt" not in config:
            config["system_prompt"] = profile.system_prompt
        _never_logged(config)
        return engine_class(profile.provider)(config)
    return _kept(key, build, what=f"chat engine '{profile.provider}'",
                 version=lambda k: k[1] if len(k) == 3 and k[0] == profile.pk else None)


def _kept(key: tuple, build, *, what: str, version=None) -> object:
    """The engine kept under `key`, built by `build()` on first use. `version(k)`: the profile version a
    key stands for when it is one of the same profile's (its `updated_at`), else None. Kept, an engine closes
    the older versions' ones; an older version's engine built once a newer one is kept (a turn that read
    the profile before an edit) is its caller's alone, never kept in the newer one's place or closing it.

    The build runs on a thread of its own (ugent_common.bounded) under UGENT_PLUGIN_START_TIMEOUT, one per
    key at a time, without the registry's lock: a constructor that never returns holds up only the callers
    of that engine, each for at most the timeout, and not other engines, turns of other profiles or the
    status page. A build past its time is refused at once (EngineError `engine_unavailable`) for
    BUILD_RETRY_SECS, then tried again; an engine such a build makes after all is kept (and ends the
    refusal). A constructor's own error is raised to its caller, as before."""
    with _lock:
        engine = _instances.get(key)
        if engine is not None:
            return engine
        _raise_if_failed_lately(key, what)
        one = _building.setdefault(key, threading.Lock())
        generation = _generation
    with one:
        with _lock:
            engine = _instances.get(key)
            if engine is not None:  # built by the caller this one waited for
                return engine
            _raise_if_failed_lately(key, what)
        from django.conf import settings

        from ugent_common import bounded
        timeout = float(settings.UGENT_PLUGIN_START_TIMEOUT)
        state: dict = {}  # (under _lock) "gave_up": its caller ran out of time; "spare": built, not to be kept

        def build_kept():
            """On the start's thread: the engine is kept when it is built, even past its caller's time (an
            engine slower to start than the timeout comes up at last, rather than being dropped and started
            from nothing at every try)."""
            engine, spare, old = build(), None, []
            with _lock:
                if generation == _generation and key in _instances:  # a later try's engine came first
                    spare, engine = engine, _instances[key]
                elif generation != _generation or _newer_kept(key, version):
                    # A reset meanwhile, or a stale version's engine (a newer one is kept): its caller's alone,
                    # closed if the caller gave up (by whichever of the two comes second)
                    if generation == _generation:
                        _build_failed.pop(key, None)
                    if state.get("gave_up"):
                        spare = engine
                    else:
                        state["spare"] = engine
                else:
                    _build_failed.pop(key, None)
                    _instances[key] = engine
                    old = [_instances.pop(k) for k in _other_versions(key, version)]
            for engine_old in ([spare] if spare is not None else []) + old:  # plugin code: outside the lock
                _close(engine_old)
            return engine

        done = bounded.call_bounded(build_kept, timeout=timeout, owner=f"start:{what}",
                                    limit=settings.UGENT_TURN_STUCK_MAX, name="ugent-engine-start")
        if done.error is not None:
            raise done.error
        if not (done.timed_out or done.refused):
            return done.value
        why = (f"the {what} did not start within {timeout:g} s (UGENT_PLUGIN_START_TIMEOUT)" if done.timed_out
               else f"the {what} has {done.refused} starts still running past their time limit")
        with _lock:
            state["gave_up"] = True
            engine, spare = _instances.get(key), state.pop("spare", None)
            if engine is None and generation == _generation:
                _build_failed[key] = (_clock() + BUILD_RETRY_SECS, why)
    if spare is not None:
        _close(spare)
    if engine is not None:  # built just as its time ran out
        return engine
    raise _unavailable(why)


def _other_versions(key: tuple, version) -> list[tuple]:
    """(_lock held) The kept keys of the same profile's other versions."""
    return [] if version is None else [k for k in _instances if k != key and version(k) is not None]


def _newer_kept(key: tuple, version) -> bool:
    """(_lock held) A newer version of the same profile than `key`'s has its engine kept."""
    mine = None if version is None else version(key)
    for k in _other_versions(key, version):
        try:
            if mine is not None and version(k) > mine:
                return True
        except TypeError:  # versions that do not compare: the newest kept is the one built last, as before
            pass
    return False


def _raise_if_failed_lately(key: tuple, what: str) -> None:
    """(_lock held) A build of this engine ran out of time less than BUILD_RETRY_SECS ago: refused at once."""
    failed = _build_failed.get(key)
    if failed is not None and _clock() < failed[0]:
        raise _unavailable(f"{failed[1]}; it is tried again {BUILD_RETRY_SECS:g} s after that attempt")


def _unavailable(why: str):
    from plugins_app.agent.engines.base import EngineError
    return EngineError(why[:1].upper() + why[1:] + ".", code="engine_unavailable")


def _never_logged(config: dict) -> None:
    """A profile's secret-named config values (api_key, token, …) are redacted from every log line."""
    from ugent_common.logs import secret_add
    for name, value in config.items():
        if isinstance(value, str) and any(w in name.lower() for w in ("key", "token", "secret", "password")):
            secret_add(value)


def _close(engine) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            pass


def reset() -> None:
    global _generation
    with _lock:
        _generation += 1
        engines = list(_instances.values())
        _instances.clear()
        _build_failed.clear()
    for engine in engines:
        _close(engine)


# --- the engines that read a free-text reply to a question (channels_app.questions) ---------------

#: The project's offline defaults, used when the configured name is one of these or is not installed.
BUILTIN_OPTION_MATCHER = "ugent-option-matcher"
BUILTIN_YESNO = "ugent-yesno"
_OPTION_MATCHER_GROUP = "opm.agents.option_matcher"
_YESNO_GROUP = "opm.agents.yesno"


def _helper_engine(setting: str, group: str, builtin_name: str, builtin: str) -> object:
    from django.conf import settings
    name = getattr(settings, setting, "") or builtin_name
    key = ("helper", group, name)

    def build():
        cls = _extra.get(name)
        if cls is None and name != builtin_name:
            for ep in entry_points(group=group, name=name):
                try:
                    cls = ep.load()
                except Exception:
                    cls = None
        if cls is None:
            module, _, attr = builtin.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        return cls({})
    return _kept(key, build, what=f"engine '{name}'")


def option_matcher() -> object:
    """The OptionMatcherEngine (opm.agents.option_matcher) named by UGENT_OPTION_MATCHER_ENGINE."""
    return _helper_engine("UGENT_OPTION_MATCHER_ENGINE", _OPTION_MATCHER_GROUP, BUILTIN_OPTION_MATCHER,
                          "plugins_app.agent.engines.matchers:OrdinalFuzzyOptionMatcher")


def yesno_engine() -> object:
    """The YesNoEngine (opm.agents.yesno) named by UGENT_YESNO_ENGINE."""
    return _helper_engine("UGENT_YESNO_ENGINE", _YESNO_GROUP, BUILTIN_YESNO,
                          "plugins_app.agent.engines.matchers:KeywordYesNoEngine")


# --- the NaturalLanguageInferenceEngine that checks citations (channels_app.citations) -----------

BUILTIN_NLI = "ugent-lexical-nli"
_NLI_GROUP = "opm.agents.nli"
_BUILTIN_NLI_CLASS = "plugins_app.agent.engines.nli:LexicalOverlapNLI"


def nli_engine(name: str, config: dict | None = None) -> object:
    """The NaturalLanguageInferenceEngine (opm.agents.nli) by entry-point name, built with `config` and
    kept per (name, config). The project's baseline is found by its module too, so it works before the
    package's entry points are installed again. LookupError when no such engine is installed."""
    import json
    config = dict(config or {})
    key = ("nli", name, json.dumps(config, sort_keys=True, default=str))

    def build():
        cls = _extra.get(name)
        if cls is None:
            for ep in entry_points(group=_NLI_GROUP, name=name):
                try:
                    cls = ep.load()
                except Exception:
                    cls = None
        if cls is None and name == BUILTIN_NLI:
            module, _, attr = _BUILTIN_NLI_CLASS.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        if cls is None:
            raise LookupError(f"no NLI engine named '{name}' is installed (entry-point group {_NLI_GROUP})")
        return cls(config)
    return _kept(key, build, what=f"NLI engine '{name}'")


# --- the chat summarisers compaction uses (channels_app.compaction) -------------------------------

SUMMARIZER_GROUP = "opm.agents.summarizer.chat"
#: The offline default, used when a profile names no summariser.
BUILTIN_SUMMARIZER = "ugent-extractive"
# The project's own, importable even where its packaging's entry points are not installed yet.
_BUILTIN_SUMMARIZERS = {
    BUILTIN_SUMMARIZER: "plugins_app.agent.engines.summarizers:ExtractiveChatSummarizer",
    "ugent-openai-compatible": "plugins_app.agent.engines.summarizers:OpenAICompatibleChatSummarizer",
}
_extra_summarizers: dict[str, type] = {}


def register_summarizer(name: str, cls: type) -> None:
    """Register a ChatSummarizerEngine class in-process (tests, embedding applications)."""
    _extra_summarizers[name] = cls


def summarizer_class(name: str) -> type:
    """The ChatSummarizerEngine an opm.agents.summarizer.chat entry point names; LookupError if none."""
    name = name or BUILTIN_SUMMARIZER
    if name in _extra_summarizers:
        return _extra_summarizers[name]
    if name and f"{name}=" in os.environ.get("UGENT_EXTRA_SUMMARIZERS", ""):
        # as UGENT_EXTRA_ENGINES: summarisers that are not installed packages (a daemon's tests use one)
        found = _env_classes("UGENT_EXTRA_SUMMARIZERS").get(name)
        if found is not None:
            return found
    if name in _BUILTIN_SUMMARIZERS:
        module, _, attr = _BUILTIN_SUMMARIZERS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    return _plugin_class(SUMMARIZER_GROUP, name, "chat summariser")


def _plugin_class(group: str, name: str, what: str) -> type:
    """The class the entry point `name` of `group` loads; LookupError (naming `what`) if none loads."""
    for ep in entry_points(group=group, name=name):
        try:
            return ep.load()
        except Exception as exc:
            raise LookupError(f"the {what} '{name}' failed to load: {type(exc).__name__}: {exc}")
    raise LookupError(f"no {what} named '{name}' is installed")


MEMORY_GROUP = "opm.agents.memory"
_extra_memory: dict[str, type] = {}


def register_memory_engine(name: str, cls: type) -> None:
    """Register an AgentContextManager class in-process (tests, embedding applications)."""
    _extra_memory[name] = cls


#: How long a memory engine that failed to load stays failed in a process before the entry points are
#: scanned for it again (a package installed meanwhile is found then, without a restart).
MISSING_RECHECK_SECS = 30.0
_memory_missing: dict[str, tuple[float, str]] = {}  # name -> (_clock() of the failed scan, why)
_clock = time.monotonic


def memory_engine_class(name: str) -> type:
    """The AgentContextManager an opm.agents.memory entry point names; LookupError if none loads."""
    if name in _extra_memory:
        return _extra_memory[name]
    missing = _memory_missing.get(name)
    if missing is not None and _clock() - missing[0] < MISSING_RECHECK_SECS:
        raise LookupError(missing[1])
    try:
        found = _memory_entry_point(name)
    except LookupError as exc:
        # a turn asks at every model call: a profile naming an engine that is not installed must not
        # scan every installed package's entry points each time (tens of milliseconds)
        if len(_memory_missing) > 100:
            _memory_missing.clear()
        _memory_missing[name] = (_clock(), str(exc))
        raise
    _memory_missing.pop(name, None)
    return found


@functools.cache
def _memory_entry_point(name: str) -> type:
    # one scan of the entry points per name and process (a turn asks at every model call)
    return _plugin_class(MEMORY_GROUP, name, "memory engine")


def memory_engine_for_profile(profile) -> object | None:
    """A new instance of the profile's AgentContextManager (AgentProfile.memory_engine), None when it
    names none. Its config is the profile's config under the engine's name (as ovos-persona passes a
    memory module its block), with the profile's system prompt. A new one each turn: the hub hands it
    the conversation's history, so nothing piles up in it from turn to turn."""
    name = getattr(profile, "memory_engine", "") if profile is not None else ""
    if not name:
        return None
    from ugent_common.secrets import secrets_opened
    config = secrets_opened(dict((profile.config or {}).get(name) or {}))
    if profile.system_prompt and "system_prompt" not in config:
        config["system_prompt"] = profile.system_prompt
    return memory_engine_class(name)(config)


def summarizer_for_profile(profile) -> object:
    """The profile's ChatSummarizerEngine (AgentProfile.summarizer_engine, else ugent-extractive), built
    from the profile's config without its system prompt; one instance per profile version."""
    name = (getattr(profile, "summarizer_engine", "") if profile is not None else "") or BUILTIN_SUMMARIZER
    key = ("summarizer", getattr(profile, "pk", None), getattr(profile, "updated_at", None), name)

    def build():
        from ugent_common.secrets import secrets_opened
        config = secrets_opened(dict(profile.config or {})) if profile is not None else {}
        config.pop("system_prompt", None)
        _never_logged(config)
        return summarizer_class(name)(config)
    return _kept(key, build, what=f"chat summariser '{name}'",
                 version=lambda k: k[2] if k[0] == "summarizer" and k[1] == key[1] and key[1] is not None else None)
