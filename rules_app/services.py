"""Writes of the rules room: load records, admin rules, import/export, workspace trust,
and the two native actions a rule can run on a conversation."""
from __future__ import annotations

import json
import logging
import re
import tomllib
from dataclasses import dataclass, field
from datetime import date, datetime, time
from typing import Any, Optional

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from rules_app import engine
from rules_app.models import DecisionKind, LoadStatus, Rule, RuleSet, RuleSource, WorkspaceTrust
from rules_app.selectors import workspace_key
from ugent_common.config import EmptyFileError, toml_refuse_empty

log = logging.getLogger("ugent.rules")

FILE_SET_NAME = "rules.toml"
ADMIN_SET_NAME = "admin"


class RulesError(Exception):
    """A rules operation refused, with a message for the operator."""


def json_safe(value: Any) -> Any:
    """TOML values as JSON: dates and times become ISO strings."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    return value


def _decision_fields(raw: Any) -> tuple[str, dict]:
    """(kind, params) of a parsed rules.toml decision (already validated by the engine)."""
    if isinstance(raw, str):
        return raw, {}
    kind = next(k for k in engine.DECISION_KINDS if k in raw)
    body = raw[kind] if isinstance(raw[kind], dict) else {}
    keep = ("workflow", "inject_context") if kind == DecisionKind.START_WORKFLOW else ("action", "params")
    return kind, {k: json_safe(body[k]) for k in keep if k in body}


# --- the file's rule set -------------------------------------------------------------------

@dataclass
class LoadRecord:
    """What one process saw when it (re)loaded the rules file."""

    status: str
    path: str = ""
    rule_count: int = 0
    dropped: list = field(default_factory=list)  # [{"rule", "reason"}]
    last_error: str = ""
    warnings: list = field(default_factory=list)
    on_error: str = "open"
    raw_rules: Optional[list] = None  # the file's [[rules]] tables; None keeps the mirrored rules
    pid: Optional[int] = None  # the enforcing process that saw it (not part of the digest)
    host: str = ""

    def digest(self) -> str:
        import hashlib
        payload = json.dumps([self.status, self.path, self.rule_count, self.dropped, self.last_error,
                              self.warnings, self.on_error, json_safe(self.raw_rules)],
                             sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()


def rule_set_record_load(*, record: LoadRecord) -> bool:
    """Record a load of the rules file in the file's RuleSet row and mirror its rules.

    Only a process that enforces the rules records (rules_app.runtime.enforce_here):
    each enforcing process records its own loads; a load identical to the one recorded
    (same digest) writes only the heartbeat, so N processes seeing one edit write once.
    Returns True when the row changed. Processes starting together may both find
    no row yet: the one whose insert loses records again over the winner's row.
    """
    try:
        return _record_load(record)
    except IntegrityError:
        return _record_load(record)


@transaction.atomic
def _record_load(record: LoadRecord) -> bool:
    digest = record.digest()
    rs = RuleSet.objects.select_for_update().filter(source=RuleSource.FILE).first()
    if rs is not None and rs.digest == digest:
        if record.pid is not None:
            rule_set_heartbeat(pid=record.pid, host=record.host)
        return False
    if rs is None:
        rs = RuleSet(source=RuleSource.FILE, name=FILE_SET_NAME)
        if RuleSet.objects.filter(name=FILE_SET_NAME).exists():  # an admin set took the name
            rs.name = f"{FILE_SET_NAME} (file)"
    rs.path = record.path
    rs.status = record.status
    rs.rule_count = record.rule_count
    rs.dropped = record.dropped
    rs.last_error = record.last_error
    rs.warnings = record.warnings
    rs.on_error = record.on_error
    rs.loaded_at = timezone.now()
    rs.digest = digest
    rs.pid, rs.host, rs.heartbeat_at = record.pid, record.host, rs.loaded_at
    rs.save()
    if record.raw_rules is not None:
        rs.rules.all().delete()
        reasons = {d["rule"]: d["reason"] for d in record.dropped}
        rows = []
        for i, raw in enumerate(record.raw_rules):
            kind, params = _decision_fields(raw["decision"])
            rows.append(Rule(ruleset=rs, name=raw["name"], priority=raw.get("priority", 0),
                             condition=json_safe(raw["match"]), decision=kind, params=params, position=i,
                             dropped_reason=reasons.get(raw["name"], "")))
        Rule.objects.bulk_create(rows)
    return True


def rule_set_heartbeat(*, pid: int, host: str) -> bool:
    """An enforcing process says the file's rules it recorded are still in force (no other column moves)."""
    now = timezone.now()
    return RuleSet.objects.filter(source=RuleSource.FILE).update(pid=pid, host=host, heartbeat_at=now) == 1


# --- admin-owned rules ---------------------------------------------------------------------

def rule_set_admin_ensure(*, name: str = ADMIN_SET_NAME) -> RuleSet:
    """The admin-owned rule set called ``name``, created empty if missing."""
    rs, _ = RuleSet.objects.get_or_create(name=name, defaults={"source": RuleSource.ADMIN,
                                                              "status": LoadStatus.LOADED})
    if rs.source != RuleSource.ADMIN:
        raise RulesError(f"rule set '{name}' comes from the rules file and is read-only")
    return rs


def rule_set_touch(*, ruleset_id: int) -> None:
    """An admin set changed: recount it and bump its version so every process recompiles."""
    from rules_app.workflows import workflow_check
    kept, dropped = 0, []
    for i, rule in enumerate(Rule.objects.filter(ruleset_id=ruleset_id).order_by("position", "id")):
        try:
            compiled, problem = rule.compile(i)
        except engine.RuleSetError as exc:
            problem = str(exc)
        else:
            if problem is None and isinstance(compiled.decision, engine.StartWorkflow):
                problem = workflow_check(compiled.decision.workflow)
        if problem:
            dropped.append({"rule": rule.name, "reason": problem})
        else:
            kept += 1
    now = timezone.now()
    RuleSet.objects.filter(pk=ruleset_id).update(version=F("version") + 1, rule_count=kept, dropped=dropped,
                                                 status=LoadStatus.LOADED, last_error="", loaded_at=now,
                                                 updated_at=now)


@transaction.atomic
def rule_save(*, rule: Rule) -> Rule:
    """Validate (condition compiled by the engine) and save an admin-owned rule; in force on commit."""
    ruleset = RuleSet.objects.select_for_update().get(pk=rule.ruleset_id)
    if ruleset.source != RuleSource.ADMIN:
        raise ValidationError({"ruleset": "Rules of the rules file are edited in the file, not here."})
    rule.full_clean()
    rule.save()
    rule_set_touch(ruleset_id=ruleset.pk)
    return rule


@transaction.atomic
def rule_delete(*, rule: Rule) -> None:
    """Delete an admin-owned rule; the file's rules are deleted by editing the file."""
    ruleset = RuleSet.objects.select_for_update().get(pk=rule.ruleset_id)
    if ruleset.source != RuleSource.ADMIN:
        raise ValidationError("Rules of the rules file are edited in the file, not here.")
    rule.delete()
    rule_set_touch(ruleset_id=ruleset.pk)


@dataclass
class ImportResult:
    ruleset: RuleSet
    imported: int
    skipped: list  # [{"rule", "reason"}]: rules the engine would drop (an unknown action, params)


@transaction.atomic
def rules_import(*, text: str, source: str = "<rules>", set_name: str = ADMIN_SET_NAME) -> ImportResult:
    """Replace the admin-owned set ``set_name`` with the rules of a rules.toml document.

    A document the engine would refuse as a whole raises :class:`RulesError`
    and changes nothing, and so does one with nothing in it (blank, or comments
    alone: more likely a write caught half-way than a wish to empty the set,
    which `rules = []` says). A rule the engine would drop as it loads (unknown
    native action, an action given params) is skipped and reported.
    """
    try:
        engine.parse_rules(text, source=source, check=False, log=False)
    except engine.RuleSetError as exc:
        raise RulesError(str(exc)) from None
    try:
        doc = toml_refuse_empty(tomllib.loads(text), source=source, remove="empty the set", says="rules = []")
    except EmptyFileError as exc:
        raise RulesError(str(exc)) from None
    raw_rules = doc.get("rules", [])
    rs = rule_set_admin_ensure(name=set_name)
    rs.rules.all().delete()
    skipped, imported = [], 0
    for i, raw in enumerate(raw_rules):
        kind, params = _decision_fields(raw["decision"])
        rule = Rule(ruleset=rs, name=raw["name"], priority=raw.get("priority", 0),
                    condition=json_safe(raw["match"]), decision=kind, params=params, position=i)
        try:
            rule.full_clean()
        except ValidationError as exc:
            skipped.append({"rule": rule.name, "reason": "; ".join(exc.messages)})
            continue
        rule.save()
        imported += 1
    rule_set_touch(ruleset_id=rs.pk)
    rs.refresh_from_db()
    return ImportResult(rs, imported, skipped)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007F")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if value is None:
        raise RulesError("a null value cannot be written as TOML")
    return _toml_value(str(value))


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_value(key)


def rules_export(*, ruleset: RuleSet) -> str:
    """The rules of ``ruleset`` as a rules.toml document (inline tables; parses back to the same rules).
    An empty set says ``rules = []``: a comment alone would be refused by rules_import as a file
    caught half-way through a write."""
    lines = [f"# rule set '{ruleset.name}' ({ruleset.get_source_display()}), exported by UGENT", ""]
    rules = list(ruleset.rules.order_by("position", "id"))
    if not rules:
        lines += ["rules = []", ""]
    for rule in rules:
        if rule.dropped_reason:
            lines.append(f"# dropped as it loaded: {rule.dropped_reason}")
        lines += ["[[rules]]", f"name = {_toml_value(rule.name)}", f"priority = {rule.priority}",
                  f"decision = {_toml_value(rule.raw_decision())}",
                  f"match = {_toml_value(rule.condition)}", ""]
    return "\n".join(lines)


# --- workspace trust -----------------------------------------------------------------------

def workspace_trust_approve(*, path, approved_by: str = "") -> WorkspaceTrust:
    """Trust ``path``: a rules.toml/routing.toml inside it may load (picked up within seconds)."""
    trust, _ = WorkspaceTrust.objects.update_or_create(
        path=workspace_key(path), defaults={"approved_by": approved_by, "revoked_at": None})
    return trust


def workspace_trust_revoke(*, path) -> bool:
    """Withdraw trust; running processes drop the workspace's rules file at their next look."""
    return WorkspaceTrust.objects.filter(path=workspace_key(path), revoked_at__isnull=True).update(
        revoked_at=timezone.now(), updated_at=timezone.now()) == 1


# --- native actions ------------------------------------------------------------------------


def sender_identified(actor) -> bool:
    """False for an application's anonymous web user and for a sender with no id."""
    from plugins_app.agent.memory.hooks import actor_identified
    return actor_identified(actor)


def memory_extract(*, turn, first_message: bool = False) -> str:
    """extract_memory for the turn that runs it: save durable facts from the conversation's latest
    exchanges before it (UGENT_MEMORY_EXCHANGES, six) and from the message itself (the turn's text)
    into the sender's memory, or say why not (the spec's order). Run again, it saves nothing twice:
    memory merges a fact it already holds (one row per user and normalized text)."""
    from django.conf import settings

    from channels_app.models import Message, Turn
    from plugins_app.agent.memory import services as memory
    from plugins_app.agent.memory.hooks import voice_keeps_out_of_memory
    conversation, text = turn.conversation, (turn.context or {}).get("text", "")
    # a spoken message (voice, live) keeps what the rule starts out of memory, as StartWorkflow's run
    if (turn.disable_memory_write or turn.is_spoken
            or (voice_keeps_out_of_memory()
                and Turn.objects.spoken().filter(conversation_id=turn.conversation_id).exists())):
        return engine.MEMORY_WRITES_OFF
    if not sender_identified(turn.actor):
        return engine.MEMORY_SENDER_UNKNOWN
    said: list[tuple[str, str]] = []
    if not first_message:
        # an exchange is a user message and its answer: the user's side states the facts about them;
        # the turn's own message is the one below, not one of the exchanges before it. Each is named by
        # its turn, so a fact an earlier extraction counted from it is not counted again.
        said = [(content, ref or "") for content, ref in
                Message.objects.filter(conversation_id=turn.conversation_id, role=Message.Role.USER,
                                       actor_id=turn.actor_id)  # the sender's own: not a group's others
                .exclude(turn_id=turn.pk).order_by("-id")
                .values_list("content", "turn__turn_id")[:settings.UGENT_MEMORY_EXCHANGES]][::-1]
    said.append((text, turn.turn_id))
    try:
        saved = memory.facts_extract_save(actor_key=turn.actor.key, texts=[t for t, _ in said],
                                          seen_in=[ref for _, ref in said], source="conversation",
                                          source_ref=conversation.external_id or "", profile_id=turn.profile_id)
    except memory.MemoryUnavailable:
        return engine.MEMORY_BACKEND_NEEDED
    return engine.memory_saved_answer(saved)
