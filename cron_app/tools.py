"""The `scheduled_jobs` toolbox: a turn may list and start the cron jobs that opt in to being started
from a message (`rule_trigger = true` in cron.toml), for its own user, as a rule's StartWorkflow does.

A job runs later, as its own turns, so it is offered only to a turn whose tools are not narrowed:
seed 000 says a turn restricted by routing's tool restriction or `ugent_allowed_tools` /
`ugent_denied_tools` "is not offered scheduled jobs, which would run without them". The two tools
are in the hub's SCHEDULING_TOOLS, which narrowing removes, and the factory offers nothing to a
narrowed turn or task. Enabled with `[tools] enabled = [..., "scheduled_jobs"]` (docs/tools.md).
"""
from __future__ import annotations

from types import SimpleNamespace

from channels_app import tools as hub_tools

TOOLBOX = "scheduled_jobs"
LIST_TOOL = "list_scheduled_jobs"
START_TOOL = "start_scheduled_job"


def jobs_startable() -> list[dict]:
    """The enabled jobs a message (a rule, this tool) may start: name, schedule (None: only on demand)."""
    from cron_app.models import CronJob
    return [{"name": j["name"], "schedule": j["schedule"] or None}
            for j in CronJob.objects.filter(enabled=True, rule_trigger=True).order_by("name")
            .values("name", "schedule")]


def job_start(ctx: hub_tools.ToolContext, job: str, text: str) -> str:
    """Start `job` for the turn's user with `text` as its input; the answer text a rule's start gives."""
    from cron_app.models import RunTrigger
    from cron_app.services import workflow_start
    turn, conv = ctx.turn, ctx.conversation
    sender = SimpleNamespace(
        actor=ctx.actor, conversation=conv, channel=getattr(conv, "channel", "") or "",
        conversation_id=getattr(conv, "external_id", "") or "", user_id=getattr(ctx.actor, "user_id", "") or "",
        text=text, limits={"disable_memory_recall": turn.disable_memory_recall,
                           "disable_code_context": turn.disable_code_context,
                           "disable_memory_write": turn.disable_memory_write,
                           "allowed_tools": ctx.allowed, "denied_tools": list(ctx.denied or [])})
    return workflow_start(workflow=job, inject_context=False, ctx=sender, trigger=RunTrigger.TOOL)


def _box_class():
    from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput
    from pydantic import Field

    class NoArgs(ToolArguments):
        pass

    class JobsOutput(ToolOutput):
        jobs: list

    class StartArgs(ToolArguments):
        job: str = Field(min_length=1, description="The job's name, as list_scheduled_jobs gives it.")
        input: str = Field(default="", description="What the job should work on (its message).")

    class StartOutput(ToolOutput):
        result: str

    class ScheduledJobsToolBox(ToolBox):
        def __init__(self, ctx: hub_tools.ToolContext):
            self.ctx = ctx
            super().__init__(toolbox_id=TOOLBOX)

        def list_jobs(self, args: NoArgs) -> dict:
            return {"jobs": jobs_startable()}

        def start(self, args: StartArgs) -> dict:
            return {"result": job_start(self.ctx, args.job, args.input)}

        def discover_tools(self):
            return [AgentTool(name=LIST_TOOL, description="List the scheduled jobs you may start for the user.",
                              argument_schema=NoArgs, output_schema=JobsOutput, tool_call=self.list_jobs),
                    AgentTool(name=START_TOOL,
                              description="Start a scheduled job now for the user; its result follows later.",
                              argument_schema=StartArgs, output_schema=StartOutput, tool_call=self.start)]

    return ScheduledJobsToolBox


_BOX = None


def scheduled_jobs_factory(ctx: hub_tools.ToolContext):
    """The toolbox for an unrestricted turn; None for a narrowed turn or task, and for an anonymous user."""
    global _BOX
    if hub_tools.is_narrowed(ctx.allowed, list(ctx.denied or [])) or ctx.actor is None:
        return None
    if _BOX is None:
        _BOX = _box_class()
    return _BOX(ctx)


def register() -> None:
    hub_tools.SCHEDULING_TOOLS.update({LIST_TOOL, START_TOOL})
    hub_tools.hub_toolbox_register(TOOLBOX, scheduled_jobs_factory)
