"""Agent plugins' rows: the agent profiles that compose an engine into a model callers name."""
from django.db import models
from django.db.models import Q

from ugent_common.models import TimeStamped
from ugent_common.secrets import SecretJSONField


class AgentProfile(TimeStamped):
    """A model a caller may name: which OPM engines compose the agent, and their config."""

    name = models.CharField(max_length=200, help_text="The model name clients send.")
    provider = models.CharField(max_length=100, default="openai-compatible",
                                help_text="The opm.agents.chat entry point of the chat engine.")
    instance = models.SlugField(max_length=100, default="default",
                                help_text="Names this copy where two profiles offer one model name.")
    config = SecretJSONField(default=dict, blank=True, help_text=(
        "The chat engine's config. Keys named like a secret (api_key, *_token, *password*, …) are stored "
        "encrypted and never shown back."))
    memory_engine = models.CharField(max_length=100, blank=True, default="",
                                     help_text=("An opm.agents.memory entry point (an AgentContextManager, "
                                                "optional): it builds the context each model call sees from "
                                                "the turn's history; its config is this profile's config under "
                                                "the engine's name."))
    summarizer_engine = models.CharField(max_length=100, blank=True, default="",
                                         help_text=("The opm.agents.summarizer.chat entry point that writes compaction "
                                                    "summaries: ugent-extractive (offline, the default when "
                                                    "empty), ugent-openai-compatible (this profile's config), "
                                                    "or any installed one."))
    system_prompt = models.TextField(blank=True, default="")
    allowed = models.BooleanField(default=True, help_text="Callers may name this model.")
    is_default = models.BooleanField(default=False, help_text="The global default model.")
    history_turns = models.PositiveIntegerField(default=20, help_text="Past messages sent to the engine.")
    context_tokens = models.PositiveIntegerField(default=8192, help_text=(
        "The engine's context budget, in (estimated) tokens: a turn whose history would pass "
        "UGENT_COMPACT_THRESHOLD of it is compacted first. 0: never compacted automatically."))

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["provider", "instance", "name"], name="uniq_profile_copy"),
            models.UniqueConstraint(fields=["is_default"], condition=Q(is_default=True),
                                    name="one_default_profile"),
        ]
        ordering = ["name", "provider", "instance"]

    def __str__(self):
        return self.qualified_name

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}:{self.instance}@{self.name}"


# --- channel plugins ---------------------------------------------------------------------------
