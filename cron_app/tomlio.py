"""cron.toml ⇄ plain data: parse and check a file, render one back out.

`parse_cron_toml` returns a dict shaped like the file with every default filled
in, or raises CronConfigError naming the job and the field. It writes nothing;
`services.cron_config_import` applies it.
"""
from __future__ import annotations

import re
import tomllib

import tomli_w

from cron_app.schedule import ScheduleError, parse_schedule, parse_timezone

OVERLAPS = ("skip", "queue", "allow")
CATCH_UPS = ("once", "none")
ID_RE = re.compile(r"^[-a-zA-Z0-9_]+$")
JOB_KEYS = {"id", "enabled", "rule_trigger", "schedule", "timezone", "overlap", "max_concurrent_runs",
            "catch_up", "tasks", "destinations"}
TASK_KEYS = {"id", "prompt", "model"}
DEST_KEYS = {"channel", "conversation"}


class CronConfigError(ValueError):
    pass


def _expect(value, kind, where: str):
    if kind is bool and not isinstance(value, bool):
        raise CronConfigError(f"{where}: expected a boolean")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise CronConfigError(f"{where}: expected an integer")
    if kind is str and not isinstance(value, str):
        raise CronConfigError(f"{where}: expected a string")
    return value


def _unknown(table: dict, known: set, where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise CronConfigError(f"{where}: unknown key '{extra[0]}'")


def parse_cron_toml(text: str) -> dict:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CronConfigError(f"cron.toml does not parse: {exc}") from None
    return check_config(raw)


def check_config(raw: dict) -> dict:
    _unknown(raw, {"enabled", "jobs"}, "cron.toml")
    out = {"enabled": _expect(raw.get("enabled", True), bool, "enabled"), "jobs": []}
    jobs = raw.get("jobs", [])
    if not isinstance(jobs, list):
        raise CronConfigError("jobs: expected [[jobs]] tables")
    seen = set()
    for i, job in enumerate(jobs):
        where = f"jobs[{i}]"
        if not isinstance(job, dict):
            raise CronConfigError(f"{where}: expected a table")
        if "id" not in job:
            raise CronConfigError(f"{where}: missing field 'id'")
        jid = _expect(job["id"], str, f"{where}.id")
        if not ID_RE.match(jid) or len(jid) > 100:
            raise CronConfigError(f"{where}.id: '{jid}' may hold only letters, digits, '-' and '_'")
        where = f"job '{jid}'"
        if jid in seen:
            raise CronConfigError(f"{where}: id is used twice")
        seen.add(jid)
        _unknown(job, JOB_KEYS, where)
        schedule = _expect(job.get("schedule", ""), str, f"{where}.schedule").strip()
        tz = _expect(job.get("timezone", ""), str, f"{where}.timezone")
        try:
            if schedule:
                parse_schedule(schedule)
            parse_timezone(tz)
        except ScheduleError as exc:
            raise CronConfigError(f"{where}: {exc}") from None
        overlap = _expect(job.get("overlap", "skip"), str, f"{where}.overlap")
        if overlap not in OVERLAPS:
            raise CronConfigError(f"{where}.overlap: '{overlap}' is not one of skip, queue, allow")
        catch_up = _expect(job.get("catch_up", "once"), str, f"{where}.catch_up")
        if catch_up not in CATCH_UPS:
            raise CronConfigError(f"{where}.catch_up: '{catch_up}' is not one of once, none")
        mcr = _expect(job.get("max_concurrent_runs", 1), int, f"{where}.max_concurrent_runs")
        if mcr < 1:
            raise CronConfigError(f"{where}.max_concurrent_runs: must be at least 1")
        entry = {"id": jid, "enabled": _expect(job.get("enabled", True), bool, f"{where}.enabled"),
                 "rule_trigger": _expect(job.get("rule_trigger", False), bool, f"{where}.rule_trigger"),
                 "schedule": schedule, "timezone": tz, "overlap": overlap, "max_concurrent_runs": mcr,
                 "catch_up": catch_up, "tasks": [], "destinations": []}
        task_ids = set()
        for t, task in enumerate(job.get("tasks", []) or []):
            tw = f"{where}.tasks[{t}]"
            if not isinstance(task, dict):
                raise CronConfigError(f"{tw}: expected a table")
            _unknown(task, TASK_KEYS, tw)
            for key in ("id", "prompt"):
                if key not in task:
                    raise CronConfigError(f"{tw}: missing field '{key}'")
            tid = _expect(task["id"], str, f"{tw}.id")
            if not ID_RE.match(tid):
                raise CronConfigError(f"{tw}.id: '{tid}' may hold only letters, digits, '-' and '_'")
            if tid in task_ids:
                raise CronConfigError(f"{where}: task id '{tid}' is used twice")
            task_ids.add(tid)
            prompt = _expect(task["prompt"], str, f"{tw}.prompt")
            if not prompt.strip():
                raise CronConfigError(f"{tw}.prompt: must not be empty")
            entry["tasks"].append({"id": tid, "prompt": prompt,
                                   "model": _expect(task.get("model", ""), str, f"{tw}.model")})
        for d, dest in enumerate(job.get("destinations", []) or []):
            dw = f"{where}.destinations[{d}]"
            if not isinstance(dest, dict):
                raise CronConfigError(f"{dw}: expected a table")
            _unknown(dest, DEST_KEYS, dw)
            for key in ("channel", "conversation"):
                if key not in dest or not _expect(dest[key], str, f"{dw}.{key}").strip():
                    raise CronConfigError(f"{dw}: missing field '{key}'")
            entry["destinations"].append({"channel": dest["channel"].strip(),
                                          "conversation": dest["conversation"].strip()})
        out["jobs"].append(entry)
    return out


def render_cron_toml(config: dict) -> str:
    """The file for `config` (shaped as parse_cron_toml returns), leaving out defaults."""
    doc = {"enabled": config["enabled"], "jobs": []}
    for job in config["jobs"]:
        j = {"id": job["id"], "enabled": job["enabled"], "rule_trigger": job["rule_trigger"]}
        if job["schedule"]:
            j["schedule"] = job["schedule"]
        if job["timezone"]:
            j["timezone"] = job["timezone"]
        j["overlap"] = job["overlap"]
        j["max_concurrent_runs"] = job["max_concurrent_runs"]
        j["catch_up"] = job["catch_up"]
        j["tasks"] = [{k: v for k, v in t.items() if v or k != "model"} for t in job["tasks"]]
        if job["destinations"]:
            j["destinations"] = list(job["destinations"])
        doc["jobs"].append(j)
    if not doc["jobs"]:
        del doc["jobs"]
    return "# cron.toml — exported by `manage.py cron export`\n" + tomli_w.dumps(doc)
