"""Writes to memory: save (duplicates merged), forget, pin. Every write is scoped to one actor key."""
from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from plugins_app.agent.memory import conf
from plugins_app.agent.memory.backends import backend_named, facts_forgotten
from plugins_app.agent.memory.extract import Candidate, extract_facts, normalize
from plugins_app.agent.memory.model_extract import (ModelExtractionError, extraction_server, model_facts,
                                                     no_server_told)
from plugins_app.agent.memory.models import MemoryFact, MemorySettings, MemorySighting, Source, Tier

log = logging.getLogger("ugent.memory")


class MemoryUnavailable(Exception):
    """Memory uses the default backend (none): nothing durable can be saved."""


def _expiry(tier: str):
    if tier != Tier.EPHEMERAL:
        return None
    return timezone.now() + timedelta(seconds=settings.UGENT_MEMORY_EPHEMERAL_TTL_SECS)


def fact_save(*, actor_key: str, text: str, tier: str = Tier.CONTEXTUAL, source: str = Source.TURN,
              source_ref: str = "", backend: str | None = None, seen_in: str = "") -> tuple[MemoryFact, bool]:
    """Save one fact in `actor_key`'s memory; (fact, created). A fact already there is merged: it is
    seen once more, and a core tier it is given again sticks.

    `seen_in`: the turn whose message states the fact. A fact is seen once per such turn: saved again
    from a turn it was already seen in (a redelivered extraction, extract_memory reading again an
    exchange an earlier extraction read), its seen_count and last_seen_at stay as they are. Without
    it, every save counts."""
    if not actor_key:
        raise ValueError("memory is scoped to a user: actor_key is required")
    text = " ".join((text or "").split())
    key = normalize(text)
    if not key:
        raise ValueError("a fact needs text")
    seen_in = (seen_in or "")[:100]
    now = timezone.now()
    for _ in range(3):
        try:
            with transaction.atomic():
                fact = MemoryFact.objects.create(actor_key=actor_key, text=text, normalized=key, tier=tier,
                                                 source=source, source_ref=source_ref[:300],
                                                 expires_at=_expiry(tier))
                if seen_in:
                    MemorySighting.objects.create(fact=fact, ref=seen_in)
            created = True
            break
        except IntegrityError:  # the same fact, saved before (or just now by another worker): merge
            pass
        try:
            fact, created = _merge(actor_key, key, tier, seen_in, now), False
            break
        except (MemoryFact.DoesNotExist, IntegrityError):
            # the fact it merges into was deleted meanwhile (forgotten, pruned once expired, the admin): the
            # statement is saved anew, as it would have been a moment later
            continue
    else:
        raise RuntimeError(f"memory: the fact {key[:60]!r} was deleted three times while being saved")
    if created or not fact.embedding:
        backend_named(backend or conf.memory_conf().backend).indexed(fact)
    return fact, created


def _merge(actor_key: str, key: str, tier: str, seen_in: str, now) -> MemoryFact:
    """The user's fact with normalised text `key`, stated once more (see fact_save); ``DoesNotExist`` or
    ``IntegrityError`` (its sighting's fact gone, at commit) when it was deleted meanwhile. On PostgreSQL the
    row is locked until the commit, so a delete waits for the merge."""
    with transaction.atomic():  # the sighting and its count commit together: a crash between them would
        fact = MemoryFact.objects.select_for_update().get(actor_key=actor_key, normalized=key)
        changes = {}            # leave a sighting whose statement was never counted
        if _sighted(fact, seen_in):
            changes = {"seen_count": F("seen_count") + 1, "last_seen_at": now, "updated_at": now}
        if tier == Tier.CORE and fact.tier != Tier.CORE:
            changes.update(tier=Tier.CORE, expires_at=None, updated_at=now)
        elif fact.tier == Tier.EPHEMERAL and changes:
            changes["expires_at"] = _expiry(Tier.EPHEMERAL)
        if changes:
            if not MemoryFact.objects.filter(pk=fact.pk).update(**changes):
                raise MemoryFact.DoesNotExist(f"memory fact {fact.pk} was deleted")
            fact.refresh_from_db()
    return fact


def _sighted(fact: MemoryFact, seen_in: str) -> bool:
    """Record that `fact` was stated in `seen_in`'s message; False when that was recorded before (the
    statement was counted already). Without a turn to name, every statement counts."""
    if not seen_in:
        return True
    try:
        with transaction.atomic():
            MemorySighting.objects.create(fact=fact, ref=seen_in)
    except IntegrityError:  # seen in that turn before, or just now by another worker
        return False
    return True


def facts_said(texts: list[str], *, extractor: str, profile_id: int | None = None) -> list[list[Candidate]]:
    """The facts each text states: the model's reading with `extractor` "openai-compatible", else the
    offline rules'. A model that fails or answers out of shape is logged, and the offline rules read
    the texts instead."""
    if extractor == "openai-compatible":
        server = extraction_server(profile_id)
        if not no_server_told(server):
            try:
                return model_facts(texts, server)
            except ModelExtractionError as exc:  # every failure of the model's: the engine, the server, the reply
                log.warning("memory: the model extractor failed; the offline extractor read the messages "
                            "instead (%s)", exc)
    return [extract_facts(text) for text in texts]


def facts_extract_save(*, actor_key: str, texts: list[str], source: str, source_ref: str = "",
                       seen_in: list[str] | None = None, profile_id: int | None = None) -> int:
    """Extract facts from what the user said (`texts`, oldest first) and save them; how many were new.
    `seen_in`, beside `texts`: the turn each text was said in (fact_save's; "" where none is known).
    `profile_id`: the turn's agent profile, whose server the model extractor asks (facts_said).

    Raises MemoryUnavailable with the default backend; extraction errors propagate (the caller says
    "Saving to memory failed" and logs why)."""
    settings_now = conf.memory_conf()
    backend = settings_now.backend
    if backend == "none":
        raise MemoryUnavailable()
    refs = list(seen_in) if seen_in is not None else [""] * len(texts)
    if len(refs) != len(texts):
        raise ValueError("seen_in names one turn for each text")
    seen: set[tuple[str, str]] = set()
    candidates: list[tuple[Candidate, str]] = []
    for found, ref in zip(facts_said(texts, extractor=settings_now.extractor, profile_id=profile_id), refs):
        for c in found:
            if (normalize(c.text), ref) not in seen:
                seen.add((normalize(c.text), ref))
                candidates.append((c, ref))
    new = 0
    for c, ref in candidates:
        _, created = fact_save(actor_key=actor_key, text=c.text, tier=c.tier, source=source,
                               source_ref=source_ref, backend=backend, seen_in=ref)
        new += created
    if candidates:
        log.info("memory saved (actor=%s, source=%s, found=%d, new=%d)", actor_key, source,
                 len({normalize(c.text) for c, _ in candidates}), new)
    return new


def fact_forget(*, actor_key: str, fact_id: int) -> bool:
    """Delete one of the user's facts; False when the user has no such fact."""
    deleted, _ = MemoryFact.objects.filter(actor_key=actor_key, pk=fact_id).delete()
    if deleted:
        facts_forgotten([fact_id])
    return bool(deleted)


def facts_delete(*, fact_ids: list[int]) -> int:
    """The operator deletes facts (the admin), whoever's they are; how many were deleted."""
    ids = list(MemoryFact.objects.filter(pk__in=fact_ids).values_list("id", flat=True))
    deleted, _ = MemoryFact.objects.filter(pk__in=ids).delete()
    facts_forgotten(ids)
    return deleted


def facts_expired_prune(*, batch: int = 500) -> int:
    """Retention (plugins_app.tasks.prune_memory): delete the facts whose expiry (ephemeral facts) passed more
    than UGENT_MEMORY_EXPIRED_KEEP_SECS ago; until then the admin still shows them (recall never does). Pinned
    facts are never deleted by age. They leave the LanceDB table too. A negative setting keeps them for
    ever. How many were deleted."""
    keep = settings.UGENT_MEMORY_EXPIRED_KEEP_SECS
    if keep < 0:
        return 0
    total = 0
    while True:
        cutoff = timezone.now() - timedelta(seconds=keep)
        expired = MemoryFact.objects.filter(expires_at__lt=cutoff, pinned=False)
        ids = list(expired.order_by("expires_at").values_list("id", flat=True)[:batch])
        if not ids:
            return total
        # (a fact stated again meanwhile has a new expiry: the condition is checked again as it is deleted)
        deleted, _ = expired.filter(pk__in=ids).delete()
        gone = sorted(set(ids) - set(MemoryFact.objects.filter(pk__in=ids).values_list("id", flat=True)))
        facts_forgotten(gone)
        total += len(gone)
        log.info("memory: deleted %d facts expired before %s", len(gone), cutoff.isoformat(timespec="seconds"))
        if len(ids) < batch:
            return total


def fact_edited(*, fact: MemoryFact, changed: list[str]) -> None:
    """After the operator saved a fact (the admin): the backend's index follows its text and its user. Under
    a backend that keeps no vectors, a vector the row kept from lance_embedded no longer fits it: it is
    dropped (and left the LanceDB table), so a later switch back embeds the fact anew (the backfill)."""
    if "text" in changed or "actor_key" in changed:
        backend = conf.memory_conf().backend
        if backend != "lance_embedded" and MemoryFact.objects.filter(pk=fact.pk, embedding__isnull=False) \
                .update(embedding=None):
            facts_forgotten([fact.pk])
        backend_named(backend).indexed(fact)


def fact_pin(*, actor_key: str, fact_id: int, pinned: bool = True) -> bool:
    """Pin (core tier, recalled first) or unpin one of the user's facts; False when there is none."""
    changes = {"pinned": pinned, "updated_at": timezone.now()}
    if pinned:
        changes.update(tier=Tier.CORE, expires_at=None)
    return MemoryFact.objects.filter(actor_key=actor_key, pk=fact_id).update(**changes) == 1


def vector_index_refresh() -> str:
    """lance_embedded's vector index built or refreshed (plugins_app.tasks.memory_vector_index); what was done."""
    from plugins_app.agent.memory.backends import EmbeddedBackend
    done = EmbeddedBackend.store().vector_index_refresh()
    log.info("memory: LanceDB vector index: %s", done)
    return done


def vector_backfill() -> int:
    """lance_embedded: facts without a vector embedded (plugins_app.tasks.memory_vector_backfill); how many.
    Nothing while another backend is in force: a switch to lance_embedded asks again."""
    from plugins_app.agent.memory.backends import EmbeddedBackend
    if conf.memory_conf().backend != "lance_embedded":
        return 0
    return EmbeddedBackend.store().backfill()


def memory_settings_save(*, row: MemorySettings) -> MemorySettings:
    """The admin's memory settings: saved as the one row, read again at once by this process."""
    fields = {f: getattr(row, f) for f in conf.ADMIN_FIELDS}
    saved, _ = MemorySettings.objects.update_or_create(pk=1, defaults=fields)
    conf.reset()
    return saved
