"""cron.toml ⇄ plain data: parse and check a file, render one back out.

`parse_cron_toml` returns a dict shaped like the file with every default filled
in, or raises CronConfigError in the one style of ugent_common.validation,
`<where>: <what>`, naming the job and the field (`jobs[0] (nightly).overlap:
'sometimes' is not one of skip, queue, allow`). The file's shape is declared once,
as the pydantic specs below: strict (an unknown key or `enabled = "yes"` is refused).
It writes nothing; `services.cron_config_import` applies it.
"""
from __future__ import annotations

import re
import tomllib
from typing import Annotated, Any

import tomli_w
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from cron_app.schedule import ScheduleError, parse_schedule, parse_timezone
from ugent_common.config import toml_refuse_empty
from ugent_common.validation import first_error, first_repeat, one_of

OVERLAPS = ("skip", "queue", "allow")
CATCH_UPS = ("once", "none")
ID_RE = re.compile(r"^[-a-zA-Z0-9_]+$")
_SPEC = ConfigDict(strict=True, extra="forbid")
_LABELS = {"jobs": "id", "tasks": "id"}


class CronConfigError(ValueError):
    pass


def _error(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("cron", message, ctx)


def _id(value: str) -> str:
    if not ID_RE.match(value) or len(value) > 100:
        raise _error("'{value}' may hold only letters, digits, '-' and '_'", value=value)
    return value


def _filled(value: str) -> str:
    if not value.strip():
        raise _error("must not be empty")
    return value


def _strip(value: str) -> str:
    return value.strip()


def _schedule_reason(exc: ScheduleError, field: str) -> str:
    # ScheduleError names its field ("schedule '* * *' is not ..."); the location already does.
    text = str(exc)
    return text[len(field) + 1:] if text.startswith(field + " ") else text


JobId = Annotated[str, AfterValidator(_id)]
Filled = Annotated[str, AfterValidator(_filled)]


class TaskSpec(BaseModel):
    """`[[jobs.tasks]]`."""

    model_config = _SPEC
    id: JobId
    prompt: Filled
    model: str = ""


class DestinationSpec(BaseModel):
    """`[[jobs.destinations]]`: where a run's result goes."""

    model_config = _SPEC
    channel: Annotated[Filled, AfterValidator(_strip)]
    conversation: Annotated[Filled, AfterValidator(_strip)]


class JobSpec(BaseModel):
    """`[[jobs]]`."""

    model_config = _SPEC
    id: JobId
    enabled: bool = True
    rule_trigger: bool = False
    schedule: Annotated[str, AfterValidator(_strip)] = ""
    timezone: str = ""
    overlap: one_of(*OVERLAPS) = "skip"
    max_concurrent_runs: int = 1
    catch_up: one_of(*CATCH_UPS) = "once"
    tasks: list[TaskSpec] = []
    destinations: list[DestinationSpec] = []

    @field_validator("schedule")
    @classmethod
    def _crontab(cls, value: str) -> str:
        if value:
            try:
                parse_schedule(value)
            except ScheduleError as exc:
                raise _error(_schedule_reason(exc, "schedule")) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            parse_timezone(value)
        except ScheduleError as exc:
            raise _error(_schedule_reason(exc, "timezone")) from None
        return value

    @field_validator("max_concurrent_runs")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise _error("must be at least 1")
        return value

    @field_validator("tasks")
    @classmethod
    def _task_ids_once(cls, value: list[TaskSpec]) -> list[TaskSpec]:
        seen = set()
        for task in value:
            if task.id in seen:
                raise _error("task id '{id}' is used twice", id=task.id)
            seen.add(task.id)
        return value


class CronFileSpec(BaseModel):
    """A cron.toml document."""

    model_config = _SPEC
    enabled: bool = True
    jobs: list[JobSpec] = []


def parse_cron_toml(text: str, *, source: str = "") -> dict:
    """The checked config of a cron.toml's text; raises CronConfigError, or EmptyFileError (ugent_common.config)
    for a text with nothing in it (blank, or comments alone), whoever imports it: more likely a write caught
    half-way than a wish to delete every job, which `enabled = true` alone says. `source` names the file in
    that refusal (without it the refusal is config.FILE_EMPTY alone)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CronConfigError(f"cron.toml does not parse: {exc}") from None
    return check_config(toml_refuse_empty(raw, source=source, remove="remove every job", says="enabled = true"))


def check_config(raw: dict) -> dict:
    """The checked config (every default filled in) for a parsed cron.toml; raises CronConfigError."""
    try:
        spec = CronFileSpec.model_validate(raw)
    except ValidationError as exc:
        raise CronConfigError(first_error(exc, data=raw, labels=_LABELS)) from None
    repeat = first_repeat(job.id for job in spec.jobs)
    if repeat:
        first, i = repeat
        job_id = spec.jobs[i].id
        raise CronConfigError(f"jobs[{i}] ({job_id}).id: '{job_id}' is used twice (jobs[{first}] and jobs[{i}])")
    return spec.model_dump()


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
