"""Which agent profile a turn runs, and the defaults a fresh install starts with."""
from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError, transaction

from ugent_common import rows
from ugent_common.errors import ApplicationError
from plugins_app.agent.models import AgentProfile

DEFAULT_ALIAS = "ugent-default"


_defaults_seen = False


def profiles_ensure_defaults() -> None:
    """A fresh install answers out of the box: the offline notes engine, or the upstream the env names."""
    global _defaults_seen
    if _defaults_seen:
        return
    if AgentProfile.objects.exists():
        _defaults_seen = not settings.DATABASES["default"].get("TEST", {}).get("MIRROR") and _cacheable()
        return
    try:
        with transaction.atomic():
            if settings.UGENT_LLM_BASE_URL:
                AgentProfile.objects.create(name=settings.UGENT_LLM_MODEL or "default",
                                            provider="openai-compatible", is_default=True, config={})
                AgentProfile.objects.create(name="ugent-notes", provider="ugent-notes", config={})
            else:
                AgentProfile.objects.create(name="ugent-notes", provider="ugent-notes", is_default=True,
                                            config={})
    except IntegrityError:  # another process made them
        pass


def _cacheable() -> bool:
    # Tests empty the table between cases; a process serving requests never does.
    import sys
    return "pytest" not in sys.modules


def _by_name(name: str) -> AgentProfile | None:
    if "@" in name and ":" in name.split("@", 1)[0]:
        head, model = name.split("@", 1)
        provider, instance = head.split(":", 1)
        return rows.table(AgentProfile).get(provider=provider, instance=instance, name=model, allowed=True)
    return rows.table(AgentProfile).get(name=name, allowed=True)


MODEL_NOT_AVAILABLE = "The model '{name}' is not available here."


def model_not_available(name: str) -> ApplicationError:
    """The 400 of a model the operator does not allow (or that does not exist): chat and /model alike."""
    return ApplicationError(MODEL_NOT_AVAILABLE.format(name=name), status=400, code="model_not_found",
                            param="model")


def profile_named(name: str) -> AgentProfile | None:
    """The allowed profile a model name (or `<provider>:<instance>@<model>`) names, or None."""
    profiles_ensure_defaults()
    return _by_name(name)


def profile_choose(*, requested: str | None, actor=None, conversation=None, caller=None,
                   caller_default: str = "") -> tuple[AgentProfile, str]:
    """The turn's profile and where the choice came from, in the seed's order: the request's model
    (`request`, that turn only) → the user's stored /model choice (`user`) → the conversation's stored
    choice (`conversation`) → the caller's default: the per-caller defaults of the issuer the actor
    asserts (`caller_defaults`), then the caller's own (`caller`) → the global default (`global`, then
    `default_profile`). A stored or default name that is no longer allowed is passed over."""
    profiles_ensure_defaults()
    if requested and requested != DEFAULT_ALIAS:
        profile = _by_name(requested)
        if profile is None:
            raise model_not_available(requested)
        return profile, "request"
    for source, choice in (("user", getattr(actor, "model_choice", "")),
                           ("conversation", getattr(conversation, "model_choice", "")),
                           ("caller_defaults", caller_default),
                           ("caller", getattr(caller, "default_model", "")),
                           ("global", settings.UGENT_DEFAULT_MODEL)):
        if choice:
            profile = _by_name(choice)
            if profile is not None:
                return profile, source
    profile = (rows.table(AgentProfile).get(is_default=True, allowed=True)
               or rows.table(AgentProfile).get(allowed=True))
    if profile is None:
        raise ApplicationError("No model is available here.", status=400, code="model_not_found",
                               param="model")
    return profile, "default_profile"


def profile_resolve(*, requested: str | None, actor=None, conversation=None, caller=None,
                    caller_default: str = "") -> AgentProfile:
    """The request's model for this turn; else the stored /model choice, the caller's default, the global one."""
    return profile_choose(requested=requested, actor=actor, conversation=conversation, caller=caller,
                          caller_default=caller_default)[0]


def model_get(name: str) -> dict | None:
    """The model object models_list() holds under this id (a name, or <provider>:<instance>@<model>); None
    when the list has none: GET /v1/models/{model} answers exactly what GET /v1/models lists."""
    return next((m for m in models_list() if m["id"] == name), None)


def models_list() -> list[dict]:
    """The models callers may name; `<provider>:<instance>@<model>` too where two copies share a name. First,
    while any model is allowed, `ugent-default` (DEFAULT_ALIAS), which a request may name as well: the sender's
    stored /model choice, then the caller's default, then the global default (created: the global default's)."""
    profiles_ensure_defaults()
    profiles = list(AgentProfile.objects.filter(allowed=True).order_by("name", "id"))
    counts: dict[str, int] = {}
    for p in profiles:
        counts[p.name] = counts.get(p.name, 0) + 1
    out, seen = [], {DEFAULT_ALIAS}  # (a profile of that name could never be picked by it)
    if profiles:
        default, _source = profile_choose(requested=None)
        out.append({"id": DEFAULT_ALIAS, "object": "model", "created": int(default.created_at.timestamp()),
                    "owned_by": "ugent"})
    for p in profiles:
        created = int(p.created_at.timestamp())
        if p.name not in seen:
            seen.add(p.name)
            out.append({"id": p.name, "object": "model", "created": created, "owned_by": p.provider})
        if counts[p.name] > 1:
            out.append({"id": p.qualified_name, "object": "model", "created": created, "owned_by": p.provider})
    return out
