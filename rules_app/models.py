"""Rule sets, their rules, and the workspace trust the rules file needs.

A rule set comes from the rules file (``source = file``: one row, a read-only
mirror of the file with its load status) or from the admin (``source = admin``:
edited in the admin, in force on save). See docs/rules.md.
"""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from ugent_common.models import TimeStamped
from rules_app import engine


class RuleSource(models.TextChoices):
    FILE = "file", "rules file"
    ADMIN = "admin", "admin"


class LoadStatus(models.TextChoices):
    LOADED = "loaded", "loaded: rules in force"
    RETAINED = "retained", "last edit failed: previous rules retained"
    FAILED = "failed", "failed to load: no rules in force (fail-open)"
    CLOSED = "closed", "failed to load: refusing every message (on_error = closed)"
    SKIPPED = "skipped", "skipped: the workspace is not trusted"
    MISSING = "missing", "no rules file: no rule engine"


class RuleSet(TimeStamped):
    """Where a group of rules comes from, and how its last load went."""

    name = models.CharField(max_length=100, unique=True)
    source = models.CharField(max_length=10, choices=RuleSource.choices, default=RuleSource.ADMIN)
    path = models.CharField(max_length=1000, blank=True, default="",
                            help_text="The rules file (file sets only).")
    status = models.CharField(max_length=10, choices=LoadStatus.choices, default=LoadStatus.LOADED)
    on_error = models.CharField(max_length=10, blank=True, default="open")
    rule_count = models.PositiveIntegerField(default=0, help_text="Rules in force from this set.")
    dropped = models.JSONField(default=list, blank=True,
                               help_text="Rules refused as they loaded: [{rule, reason}].")
    warnings = models.JSONField(default=list, blank=True)
    last_error = models.TextField(blank=True, default="")
    loaded_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=0, help_text="Bumped on every admin edit; "
                                          "each process recompiles when it changes.")
    digest = models.CharField(max_length=64, blank=True, default="", editable=False,
                              help_text="What the last recorded load saw (skips identical re-records).")
    # Who wrote the file set's record: only a process that enforces the rules (rules_app.runtime).
    pid = models.PositiveIntegerField(null=True, blank=True, editable=False,
                                      help_text="The enforcing daemon process that last recorded or confirmed it.")
    host = models.CharField(max_length=255, blank=True, default="", editable=False)
    heartbeat_at = models.DateTimeField(null=True, blank=True, editable=False,
                                        help_text="When that daemon last said these rules are still in force.")

    class Meta:
        constraints = [
            # the one rules file a deployment runs with
            models.UniqueConstraint(fields=["source"], condition=Q(source="file"), name="one_file_rule_set"),
        ]

    def __str__(self):
        return f"{self.name} ({self.get_source_display()})"

    @property
    def read_only(self) -> bool:
        return self.source == RuleSource.FILE


class DecisionKind(models.TextChoices):
    PASS = "PassToDefaultAgent"
    IGNORE = "Ignore"
    START_WORKFLOW = "StartWorkflow"
    RUN_NATIVE_ACTION = "RunNativeAction"


class Rule(TimeStamped):
    """One rule: a condition (the rules.toml ``match`` table as JSON) and a decision with its params."""

    ruleset = models.ForeignKey(RuleSet, on_delete=models.CASCADE, related_name="rules")
    name = models.CharField(max_length=200)
    priority = models.IntegerField(default=0, help_text="Higher runs first; ties in file order.")
    condition = models.JSONField(
        help_text='One condition, as in rules.toml: {"field": "text", "contains_any": ["a"]}, '
                  '{"all_of": [...]}, {"any_of": [...]}, {"not": {...}}, {"always": true}.')
    decision = models.CharField(max_length=30, choices=DecisionKind.choices, default=DecisionKind.PASS)
    params = models.JSONField(
        default=dict, blank=True,
        help_text='StartWorkflow: {"workflow": "digest", "inject_context": false}; '
                  'RunNativeAction: {"action": "compact_conversation" or "extract_memory"}; else {}.')
    position = models.PositiveIntegerField(default=0, help_text="Order in the file (breaks priority ties).")
    dropped_reason = models.TextField(blank=True, default="",
                                      help_text="Why the file's rule was refused as it loaded (file sets).")

    class Meta:
        ordering = ["ruleset_id", "position", "id"]
        constraints = [
            models.UniqueConstraint(fields=["ruleset", "name"], name="uniq_rule_name_in_set"),
        ]

    def __str__(self):
        return self.name

    # -- the engine's view -----------------------------------------------------

    def raw_decision(self):
        """The decision as rules.toml writes it: a string, or {Kind: params}."""
        if self.decision in (DecisionKind.PASS, DecisionKind.IGNORE):
            return str(self.decision)
        return {str(self.decision): dict(self.params or {})}

    def compile(self, index: int) -> tuple[engine.CompiledRule, str | None]:
        """The engine rule and its load-time problem (a drop reason) or None; raises RuleSetError."""
        where = f"rule '{self.name}'"
        condition = engine.compile_condition(self.condition, where=f"{where}.match")
        decision, problem = engine.parse_decision(self.raw_decision(), f"{where}.decision")
        return engine.CompiledRule(self.name, self.priority, condition, decision, index), problem

    def clean(self):
        errors = {}
        if self.decision in (DecisionKind.PASS, DecisionKind.IGNORE) and self.params:
            errors["params"] = f"{self.decision} takes no params: leave it {{}}."
        try:
            engine.compile_condition(self.condition, where="match")
        except engine.RuleSetError as exc:
            errors["condition"] = str(exc)
        if "params" not in errors:
            try:
                _decision, problem = engine.parse_decision(self.raw_decision(), "decision")
            except engine.RuleSetError as exc:
                errors["params"] = str(exc)
            else:
                if problem:
                    errors["params"] = problem
        if errors:
            raise ValidationError(errors)


class WorkspaceTrust(TimeStamped):
    """A workspace the operator approved: a rules/routing file inside it may load."""

    path = models.CharField(max_length=1000, unique=True, help_text="The workspace, resolved.")
    approved_by = models.CharField(max_length=200, blank=True, default="")
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return self.path

    @property
    def trusted(self) -> bool:
        return self.revoked_at is None
