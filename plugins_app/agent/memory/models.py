"""Durable memory's rows: the facts each user's memory holds, and the operator's memory settings."""
from django.db import models
from django.db.models import Q

from ugent_common.models import TimeStamped


class Tier(models.TextChoices):
    CORE = "core", "core"  # recalled on every turn while the budget lasts (pinned facts are core)
    CONTEXTUAL = "contextual", "contextual"  # recalled when the turn's text matches it
    ARCHIVAL = "archival", "archival"  # recalled only when it matches, after the other tiers
    EPHEMERAL = "ephemeral", "ephemeral"  # recalled when it matches, until it expires


class Source(models.TextChoices):
    CONVERSATION = "conversation", "conversation"  # extract_memory over the conversation's recent exchanges
    TURN = "turn", "turn"  # the after-turn extraction of one turn's message
    TOOL = "tool", "tool"  # the memory_control tool or the admin


class MemoryFact(TimeStamped):
    """One durable fact in one user's memory (scoped by the acting user's actor key)."""

    actor_key = models.CharField(max_length=300, help_text="The user whose memory holds this fact.")
    text = models.TextField()
    normalized = models.CharField(max_length=500, editable=False,
                                  help_text="The text as duplicates are recognised (lower case, single spaces).")
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.CONTEXTUAL)
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.TURN)
    source_ref = models.CharField(max_length=300, blank=True, default="",
                                  help_text="The conversation or turn the fact came from.")
    pinned = models.BooleanField(default=False, help_text="Pinned facts are recalled first and never forgotten by age.")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Ephemeral facts are not recalled after this.")
    last_seen_at = models.DateTimeField(null=True, blank=True,
                                        help_text="When the fact was last stated again (a merged duplicate).")
    seen_count = models.PositiveIntegerField(default=1)
    # float32 little-endian, for the lance_embedded backend; empty until that backend embeds the fact
    embedding = models.BinaryField(null=True, blank=True, editable=False)

    class Meta:
        constraints = [
            # duplicates are merged: one row per (user, normalized text)
            models.UniqueConstraint(fields=["actor_key", "normalized"], name="uniq_memory_fact_per_user"),
        ]
        indexes = [
            # recall's and the admin's per-user scans: WHERE actor_key = ? (ORDER BY updated_at)
            models.Index(fields=["actor_key", "updated_at"], name="memory_fact_actor_idx"),
            # recall's pinned and core facts, newest first: a seek, not a scan of the user's facts
            # (partial indexes: their condition is the query's own term, which SQLite then uses; a bare boolean
            # column in a composite index is not)
            models.Index(fields=["actor_key", "updated_at"], condition=models.Q(pinned=True),
                         name="memory_fact_pinned_idx"),
            models.Index(fields=["actor_key", "updated_at"], condition=models.Q(tier="core", pinned=False),
                         name="memory_fact_core_idx"),
            # lance_embedded's backfill: the facts without a vector, which a recall looks for every few minutes
            # (usually none: without it, a scan of every fact)
            models.Index(fields=["id"], condition=models.Q(embedding__isnull=True), name="memory_fact_no_vector_idx"),
            # the hourly prune of expired facts: a seek among the facts that expire (ephemeral), not a scan
            models.Index(fields=["expires_at"], condition=models.Q(expires_at__isnull=False),
                         name="memory_fact_expiry_idx"),
            # the admin's list, newest change first (the order below): without it each page sorted every fact
            models.Index(fields=["updated_at", "id"], name="memory_fact_updated_idx"),
        ]
        ordering = ["-updated_at"]

    def __str__(self):
        return self.text[:80]


class MemorySighting(models.Model):
    """One message a fact was stated in (`ref`: the turn that holds that message). A fact's seen_count
    counts each once: a redelivered extraction, or extract_memory reading again the exchanges an
    earlier extraction read, finds its sighting there and counts nothing."""

    fact = models.ForeignKey(MemoryFact, on_delete=models.CASCADE, related_name="sightings")
    ref = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["fact", "ref"], name="uniq_memory_sighting")]

    def __str__(self):
        return f"{self.fact_id} in {self.ref}"


BACKENDS = ("none", "sqlite_fts", "lance_embedded")
CADENCES = ("per_prompt", "every_call")


class MemorySettings(TimeStamped):
    """The operator's memory settings (one row, edited in the admin). A blank or zero field keeps what
    ugent.toml's [memory] says; a set one overrides it."""

    class Backend(models.TextChoices):
        FROM_CONFIG = "", "as ugent.toml says"
        NONE = "none", "none (conversation history only)"
        SQLITE_FTS = "sqlite_fts", "sqlite_fts (full-text search)"
        LANCE_EMBEDDED = "lance_embedded", "lance_embedded (embeddings)"

    class Cadence(models.TextChoices):
        FROM_CONFIG = "", "as ugent.toml says"
        PER_PROMPT = "per_prompt", "per_prompt (once per turn)"
        EVERY_CALL = "every_call", "every_call (before each engine call)"

    class Extractor(models.TextChoices):
        FROM_CONFIG = "", "as ugent.toml says"
        OFFLINE = "offline", "offline (rules over what the user said)"
        OPENAI_COMPATIBLE = "openai-compatible", "openai-compatible (a model; offline when it fails)"

    backend = models.CharField(max_length=20, choices=Backend.choices, blank=True, default="")
    recall_cadence = models.CharField(max_length=20, choices=Cadence.choices, blank=True, default="")
    max_hits = models.PositiveIntegerField(default=0, help_text="0: as ugent.toml says (default 12).")
    max_injected_tokens_est = models.PositiveIntegerField(default=0,
                                                          help_text="0: as ugent.toml says (default 1200).")
    extractor = models.CharField(
        max_length=20, choices=Extractor.choices, blank=True, default="",
        help_text="What finds the facts in what a user said. openai-compatible asks the turn's agent profile's "
                  "server (UGENT_LLM_* when the profile names none); the offline rules when it fails.")

    class Meta:
        verbose_name_plural = "memory settings"
        constraints = [models.CheckConstraint(condition=Q(id=1), name="one_memory_settings_row")]

    def __str__(self):
        return "memory settings"
