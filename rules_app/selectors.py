"""Reads of rule sets, rules and workspace trust."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from django.utils import timezone

from ugent_common import rows
from rules_app.models import Rule, RuleSet, RuleSource, WorkspaceTrust


def workspace_key(path) -> str:
    """How a workspace is recorded: its resolved absolute path."""
    return str(Path(path).expanduser().resolve())


def workspace_is_trusted(path) -> bool:
    """True when the operator approved this workspace and has not revoked it."""
    return WorkspaceTrust.objects.filter(path=workspace_key(path), revoked_at__isnull=True).exists()


def workspace_trust_get(path) -> Optional[WorkspaceTrust]:
    return WorkspaceTrust.objects.filter(path=workspace_key(path)).first()


def rule_set_versions() -> tuple[tuple[int, str, int], ...]:
    """(id, source, version) of every rule set: the one cheap query each message makes."""
    return tuple(rows.table(RuleSet).values_list(["id", "source", "version"], order_by=("id",)))


def admin_rules() -> list[Rule]:
    """Every admin-owned rule, in set order then file order."""
    return list(Rule.objects.filter(ruleset__source=RuleSource.ADMIN)
                .order_by("ruleset_id", "position", "id"))


def file_rule_set() -> Optional[RuleSet]:
    return RuleSet.objects.filter(source=RuleSource.FILE).first()


def rule_set_by_name(name: str) -> Optional[RuleSet]:
    return RuleSet.objects.filter(name=name).first()


def rule_set_rules(ruleset: RuleSet) -> list[Rule]:
    return list(ruleset.rules.order_by("position", "id"))


@dataclass(frozen=True)
class Heartbeat:
    """How recently the daemon enforcing the file's rules said they are in force."""

    pid: Optional[int]
    host: str
    age: Optional[float]  # seconds since its last heartbeat; None: no daemon ever recorded
    alive: bool  # a heartbeat within three intervals: a daemon enforces the recorded rules now


def daemon_heartbeat(row: Optional[RuleSet] = None) -> Heartbeat:
    """The file set's record as its daemon last confirmed it."""
    from rules_app import conf
    row = row if row is not None else file_rule_set()
    if row is None or row.heartbeat_at is None:
        return Heartbeat(getattr(row, "pid", None), getattr(row, "host", "") or "", None, False)
    age = max(0.0, (timezone.now() - row.heartbeat_at).total_seconds())
    return Heartbeat(row.pid, row.host, round(age, 1), age <= 3 * conf.rules_heartbeat_seconds())
