"""The hub's side of tools: which toolboxes a turn gets, narrowing, and running one call.

A turn's tools are assembled by `turn_tools(ctx)` from the toolboxes enabled in ugent.toml
`[tools]` (or the agent profile's `config["tools"]`): the built-in `workspace` (plugins_app.agent),
the hub's own toolboxes (`HUB_TOOLBOXES`: `delegation`, and whatever `hub_toolbox_register` adds,
e.g. `ask_user` at merge), `opm.agents.toolbox` plugins (`[tools.plugins.<entry point>]`) and MCP
servers (`[[tools.mcp]]`). The names the engine is offered are then narrowed by the turn's
allowed/denied lists (routing ∩ request ∩ caller defaults; never widened, see `limits_merge`).

A hub toolbox is built per turn from a `ToolContext` (turn, actor, conversation, should_stop,
emit). `tool_call_run` runs one call on its own thread under the per-tool timeout, records it as a
`ToolCall` row and as two `turn.delta` events of segment "tool" (start and end), and gives back the
TOOL message content the engine is shown. See docs/tools.md.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from django.conf import settings
from django.db import transaction

from channels_app.events import _lock_log as log_lock
from channels_app.events import events_append
from channels_app.models import ToolCall, ToolCallState, Turn, TurnState
from channels_app.sandbox import conversation_workspace
from ugent_common import bounded, rows

log = logging.getLogger("ugent.tools")

DEFAULT_ENABLED = ("workspace", "delegation", "ask_user", "memory")
ALL = "*"
STEP_LIMIT_ERROR = "the tool step limit ({limit}) was reached: answer with what you have"
TIMEOUT_ERROR = "the tool did not answer within {seconds:g} s"
OVERRUN_ERROR = ("{count} earlier calls of this toolbox are still running past their time limit: it is not "
                 "called again until they end (UGENT_TOOL_OVERRUN_MAX)")
UNKNOWN_ERROR = "no tool named {name!r} is offered to this turn"
STOPPED_ERROR = "the turn was stopped while the tool ran"
BAD_ARGUMENTS_ERROR = "the arguments are not a JSON object"
TOO_LARGE_ERROR = ("the tool's result is {size} bytes, over the {limit} a result may be "
                   "(UGENT_TOOL_RESULT_MAX_BYTES): ask for less of it")
#: The tools a scheduled job would offer (cron). Cron registers none today; a narrowed turn is
#: offered none of them, since a job runs later without the turn's limits (seed 000).
SCHEDULING_TOOLS: set[str] = set()


# --- narrowing --------------------------------------------------------------------------------

def is_narrowed(allowed: Optional[list], denied: Optional[list]) -> bool:
    """Whether a turn's tools are restricted at all (then it is not offered scheduled jobs)."""
    return allowed is not None or bool(denied)


def limits_merge(*, allowed: Optional[list], denied: Optional[list], more_allowed: Optional[list] = None,
                 more_denied: Optional[list] = None) -> tuple[Optional[list], list]:
    """Two sets of limits as one, never wider than either: allowed lists intersect (None: no
    restriction), denied lists add up (["*"] stays ["*"])."""
    if allowed is None:
        out_allowed = None if more_allowed is None else list(more_allowed)
    elif more_allowed is None:
        out_allowed = list(allowed)
    else:
        keep = set(more_allowed)
        out_allowed = [t for t in allowed if t in keep]
    out_denied: list = []
    for name in list(denied or []) + list(more_denied or []):
        if name not in out_denied:
            out_denied.append(name)
    if ALL in out_denied:
        out_denied = [ALL]
    return out_allowed, out_denied


def tools_narrow(names: list[str], *, allowed: Optional[list], denied: Optional[list]) -> list[str]:
    """`names` filtered by the turn's limits, order kept, never extended."""
    denied = set(denied or [])
    if ALL in denied:
        return []
    keep = None if allowed is None else set(allowed)
    out = [n for n in names if n not in denied and (keep is None or n in keep)]
    if is_narrowed(allowed, list(denied)):
        out = [n for n in out if n not in SCHEDULING_TOOLS]
    return out


# --- the per-turn context and the hub's toolboxes ----------------------------------------------

@dataclass
class ToolContext:
    """What a hub toolbox is built from, once per turn (and once per delegated task)."""

    turn: Turn
    actor: Any
    conversation: Any
    should_stop: Callable[[], bool]
    emit: Callable[[list], None]  # write [(type, data, audience)] items to the turn's events
    allowed: Optional[list] = None  # the turn's effective limits: a delegated task inherits them
    denied: list = field(default_factory=list)
    depth: int = 0  # 0: the turn; 1+: a task it delegated
    profile: Any = None
    messages: list = field(default_factory=list)  # what the engine saw, for a toolbox that needs it


HubToolboxFactory = Callable[[ToolContext], Any]
HUB_TOOLBOXES: dict[str, HubToolboxFactory] = {}


def hub_toolbox_register(name: str, factory: HubToolboxFactory) -> None:
    """Add a hub toolbox by name: `factory(ctx)` returns a ToolBox (or None: not for this turn).
    A toolbox is offered to turns whose `[tools] enabled` (or profile) names it."""
    HUB_TOOLBOXES[name] = factory


def _delegation_factory(ctx: ToolContext):
    if ctx.depth >= settings.UGENT_TOOL_DELEGATION_DEPTH:
        return None  # a delegated task does not delegate again past the depth limit
    return DelegationToolBox(ctx)


hub_toolbox_register("delegation", _delegation_factory)


def _ask_user_factory(ctx: ToolContext):
    """ask_user: a question to the turn's user, waited for (channels_app.questions, docs/questions.md)."""
    from channels_app.questions import AskUserToolBox
    return AskUserToolBox(ctx)


def _memory_factory(ctx: ToolContext):
    """memory_control (forget, pin, list): only to a turn that may write the user's memory (memory's one
    rule for it: not kept out of memory, not spoken, an identified sender), with a durable backend
    configured (plugins_app.agent.memory, docs/memory.md)."""
    if ctx.actor is None:
        return None
    from plugins_app.agent.memory.hooks import turn_may_write
    if not turn_may_write(ctx.turn):
        return None
    from plugins_app.agent.memory.tools import MemoryToolBox
    return MemoryToolBox({"actor_key": ctx.actor.key, "disable_memory_write": False})


hub_toolbox_register("ask_user", _ask_user_factory)
hub_toolbox_register("memory", _memory_factory)


# --- configuration ----------------------------------------------------------------------------

def tools_config() -> dict:
    """ugent.toml's [tools] (a dict; {} when absent)."""
    from ugent_common.config import load_config
    section = load_config().get("tools") or {}
    return section if isinstance(section, dict) else {}


def enabled_names(profile=None, config: Optional[dict] = None) -> list[str]:
    """The toolbox names a turn of `profile` gets: the profile's config["tools"], else [tools] enabled."""
    config = tools_config() if config is None else config
    chosen = (getattr(profile, "config", None) or {}).get("tools") if profile is not None else None
    if chosen is None:
        chosen = config.get("enabled", list(DEFAULT_ENABLED))
    return [str(n) for n in chosen]


def workspace_roots(ctx: ToolContext) -> dict:
    workspace = Path(conversation_workspace(ctx.conversation))  # a channel plugin may give its conversations their own
    roots = {"workspace": str(workspace)}
    cwd = (ctx.turn.context or {}).get("working_directory") or getattr(ctx.conversation, "working_directory", "")
    if cwd:  # stored relative to the workspace (PUT /v1/ugent/directory); confine() still checks it
        roots["conversation"] = str(workspace / cwd)
    return roots


def _plugin_boxes(config: dict, names: list[str]) -> list:
    from plugins_app.agent.tools.plugins import mcp_toolbox, toolbox_plugin
    boxes = []
    for entry, conf in (config.get("plugins") or {}).items():
        if "plugins" not in names and entry not in names and f"plugin:{entry}" not in names:
            continue
        try:
            boxes.append(toolbox_plugin(entry, conf if isinstance(conf, dict) else {},
                                        start_timeout=settings.UGENT_PLUGIN_START_TIMEOUT))
        except Exception as exc:
            log.warning("toolbox plugin %s could not be loaded: %s", entry, exc)
    for spec in config.get("mcp") or []:
        name = str(spec.get("name") or spec.get("command") or "mcp")
        if "mcp" not in names and f"mcp:{name}" not in names:
            continue
        try:
            boxes.append(mcp_toolbox(name, command=spec["command"], args=spec.get("args") or [],
                                     env=spec.get("env") or None, timeout=spec.get("timeout", 30),
                                     start_timeout=settings.UGENT_PLUGIN_START_TIMEOUT))
        except Exception as exc:
            log.warning("MCP server %s could not be started: %s", name, exc)
    return boxes


def toolboxes_for(ctx: ToolContext, config: Optional[dict] = None) -> list:
    """Every toolbox enabled for the turn, built for it."""
    config = tools_config() if config is None else config
    names = enabled_names(ctx.profile, config)
    boxes = []
    for name in names:
        if name == "workspace":
            from plugins_app.agent.tools.workspace import WorkspaceToolBox
            boxes.append(WorkspaceToolBox({"roots": workspace_roots(ctx)}))
        elif name in HUB_TOOLBOXES:
            box = HUB_TOOLBOXES[name](ctx)
            if box is not None:
                boxes.append(box)
    boxes.extend(_plugin_boxes(config, names))
    return boxes


# --- a turn's offered tools --------------------------------------------------------------------

_spec_cache: dict[tuple, list] = {}


def _box_specs(box) -> list[dict]:
    """A toolbox's OpenAI specs; kept per class for built-in boxes, whose schemas never change."""
    key = (type(box), box.toolbox_id, tuple(box.tools)) if getattr(box, "static_specs", True) else None
    if key is not None and key in _spec_cache:
        return _spec_cache[key]
    specs = box.openai_tools
    if key is not None:
        _spec_cache[key] = specs
    return specs


class TurnTools:
    """The tools one turn (or delegated task) is offered: name → toolbox, and their OpenAI specs."""

    def __init__(self, boxes: list, *, allowed: Optional[list], denied: Optional[list]):
        self.boxes = boxes
        by_name: dict[str, Any] = {}
        specs: dict[str, dict] = {}
        for box in boxes:
            for spec in _box_specs(box):
                name = spec["function"]["name"]
                if name not in by_name:  # the first toolbox that offers a name keeps it
                    by_name[name], specs[name] = box, spec
        offered = tools_narrow(list(by_name), allowed=allowed, denied=denied)
        self.by_name = {n: by_name[n] for n in offered}
        self.specs = [specs[n] for n in offered]

    def __bool__(self) -> bool:
        return bool(self.by_name)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)


def turn_tools(ctx: ToolContext, *, config: Optional[dict] = None) -> TurnTools:
    return TurnTools(toolboxes_for(ctx, config), allowed=ctx.allowed, denied=ctx.denied)


# --- one call ----------------------------------------------------------------------------------

def _arguments(raw: Any) -> tuple[dict, str]:
    if isinstance(raw, dict):
        return raw, ""
    if raw in (None, ""):
        return {}, ""
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}, BAD_ARGUMENTS_ERROR
    return (value, "") if isinstance(value, dict) else ({}, BAD_ARGUMENTS_ERROR)


def _reason(exc: BaseException) -> str:
    """The innermost message of a ToolBox's wrapped exception (call_tool wraps the tool's own)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc) or type(exc).__name__
    return text if not hasattr(exc, "errors") else f"invalid arguments: {text.splitlines()[0]}"


def _too_large(result: Any) -> str:
    """The error for a result over UGENT_TOOL_RESULT_MAX_BYTES (its files already taken out as artifacts): it
    would be stored in the ToolCall row, streamed in a turn.delta to every listener and sent to the model
    whole. An error the engine can act on, not a cut result that is no longer JSON."""
    size = len(json.dumps(result, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
    limit = settings.UGENT_TOOL_RESULT_MAX_BYTES
    return TOO_LARGE_ERROR.format(size=size, limit=limit) if size > limit else ""


def _json_safe(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return json.loads(json.dumps(value, default=str))


@dataclass
class CallOutcome:
    call_id: str
    name: str
    result: Any = None
    error: str = ""
    ms: float = 0.0
    artifacts: list = field(default_factory=list)

    @property
    def content(self) -> str:
        """What the engine is shown as the TOOL message."""
        if self.error:
            return json.dumps({"error": self.error})
        return json.dumps(self.result, ensure_ascii=False, default=str)


def overrunning() -> dict[str, int]:
    """Toolbox → its calls still running past their time limit (the status report's `overrunning`)."""
    return {k[len("toolbox:"):]: v for k, v in bounded.overrunning("toolbox:").items()}


def _run_in_thread(fn: Callable[[], Any], *, timeout: float, should_stop: Callable[[], bool],
                   owner: str) -> tuple[Any, str]:
    """fn() on its own thread; (result, "") or (None, why). A tool that overruns is left to finish
    on its (daemon) thread; its answer is dropped, and it counts against its toolbox (`owner`) until it
    ends: at UGENT_TOOL_OVERRUN_MAX such calls the toolbox is refused at once, without a thread."""
    done = bounded.call_bounded(fn, timeout=timeout, should_stop=should_stop, owner=f"toolbox:{owner}",
                                limit=settings.UGENT_TOOL_OVERRUN_MAX, name="ugent-tool")
    if done.refused:
        return None, OVERRUN_ERROR.format(count=done.refused)
    if done.timed_out:
        return None, TIMEOUT_ERROR.format(seconds=timeout)
    if done.stopped:
        return None, STOPPED_ERROR
    if done.error is not None:
        return None, _reason(done.error)
    return done.value, ""


def tool_delta(turn: Turn, tool: dict) -> tuple:
    return ("turn.delta", {"turn_id": turn.turn_id, "segment": "tool", "text": tool.get("name", ""),
                           "tool": tool}, [])


def emitter_for(turn: Turn) -> Callable[[list], None]:
    """Append items to the turn's events while it runs (the log's lock, as the runner's writer)."""
    def emit(items: list) -> None:
        if not items:
            return
        with transaction.atomic():
            log_lock()
            from channels_app import statements
            if statements.turn_state(turn.pk) != TurnState.RUNNING:
                return  # ended elsewhere: the runner notices on its own
            events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, items=items)
    return emit


def call_timeout(box, name: str, args: dict) -> float:
    """The seconds a call may run: UGENT_TOOL_TIMEOUT_SECONDS, or what its toolbox's `call_timeout(name, args)`
    says for a tool that waits by design (ask_user waits for its user, a delegated task runs a loop of its own)."""
    own = getattr(box, "call_timeout", None)
    if callable(own):
        try:
            seconds = own(name, args)
        except Exception:  # a toolbox's bug: the default
            log.warning("toolbox %s: call_timeout failed", getattr(box, "toolbox_id", "-"), exc_info=True)
            seconds = None
        if seconds:
            return float(seconds)
    return float(settings.UGENT_TOOL_TIMEOUT_SECONDS)


def tool_call_run(*, tools: TurnTools, ctx: ToolContext, call: dict, step: int,
                  refuse: str = "") -> CallOutcome:
    """Run one call the engine asked for (`call`: {"id", "name", "arguments"}), recorded as a ToolCall
    row and two tool deltas. `refuse`: do not run it, answer this error (the step limit)."""
    name = str(call.get("name") or "")
    call_id = str(call.get("id") or f"call-{step}-{name}")
    args, error = _arguments(call.get("arguments"))
    box = tools.by_name.get(name)
    if not error and box is None:
        error = UNKNOWN_ERROR.format(name=name)
    error = refuse or error
    record = rows.table(ToolCall).create(turn_id=ctx.turn.pk, call_id=call_id[:200], name=name[:200],
                                         toolbox=getattr(box, "toolbox_id", "")[:200], arguments=args,
                                         step=step, depth=ctx.depth)
    base = {"id": call_id, "name": name, "arguments": args, "depth": ctx.depth}
    ctx.emit([tool_delta(ctx.turn, {**base, "status": "running"})])
    started = time.monotonic()
    result = None
    if not error:
        timeout = call_timeout(box, name, args)
        raw, error = _run_in_thread(lambda: box.call_tool(name, args), timeout=timeout,
                                    should_stop=ctx.should_stop, owner=getattr(box, "toolbox_id", "") or name)
        if not error:
            try:
                result = _json_safe(raw)
            except Exception as exc:
                error = f"the tool's result is not JSON: {exc}"
    artifacts: list = []
    if not error:  # its files stored in the conversation and announced; the engine sees no bytes
        from channels_app import artifacts as artifacts_mod
        result, artifacts = artifacts_mod.artifacts_take(turn=ctx.turn, result=result, emit=ctx.emit)
        error = _too_large(result)
        if error:
            result = None
    ms = round((time.monotonic() - started) * 1000, 2)
    outcome = CallOutcome(call_id=call_id, name=name, result=result, error=error, ms=ms, artifacts=artifacts)
    rows.table(ToolCall).update({"id": record.pk}, state=ToolCallState.ERROR if error else ToolCallState.DONE,
                                result=result, error=error, ms=ms)
    end = {**base, "status": "error" if error else "done", "ms": ms}
    end.update({"error": error} if error else {"result": result})
    ctx.emit([tool_delta(ctx.turn, end)])
    return outcome


# --- the loop of a delegated task, and delegation itself -------------------------------------------

RESEARCH_PROMPT = ("You are doing one research task for another assistant. Use the tools you have, "
                   "then answer with what you found, briefly and completely.")


def tool_messages(content: str, outcomes: list[CallOutcome], calls: list[dict]) -> list:
    """The assistant message that asked for `calls`, then one TOOL message per outcome."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole, ToolCall as OpmToolCall
    asked = [OpmToolCall(id=o.call_id, name=o.name, arguments=_arguments(c.get("arguments"))[0])
             for o, c in zip(outcomes, calls)]
    out = [AgentMessage(role=MessageRole.ASSISTANT, content=content, tool_calls=asked)]
    out.extend(AgentMessage(role=MessageRole.TOOL, content=o.content, tool_call_id=o.call_id, name=o.name)
               for o in outcomes)
    return out


def calls_of(pending: dict) -> list[dict]:
    return list(pending.values())


def task_run(ctx: ToolContext, *, engine, messages: list, tools: TurnTools) -> tuple[str, list]:
    """Run an engine over `messages` with `tools` until it answers without calls (or the step limit):
    the answer and the artifacts its tools returned. The delegated task's loop."""
    from plugins_app.agent.engines.base import ANSWER, ERROR, TOOL, EngineError, stream_items
    limit = settings.UGENT_TOOL_STEP_LIMIT
    answer: list[str] = []
    artifacts: list = []
    step = 0
    messages = list(messages)
    while True:
        pending: dict[str, dict] = {}
        text: list[str] = []
        offered = tools.specs if (tools and step <= limit) else None
        for item in stream_items(engine, list(messages), session_id=f"conv-{ctx.conversation.pk}#task",
                                 tools=offered, should_stop=ctx.should_stop):
            if item.kind == ANSWER:
                text.append(item.text)
            elif item.kind == TOOL and offered and not (item.data or {}).get("executed"):
                data = item.data or {}
                pending[str(data.get("id") or len(pending))] = data
            elif item.kind == ERROR:
                raise EngineError(item.text or "The engine reported an error.")
            if ctx.should_stop():
                return "".join(answer + text), artifacts
        answer.extend(text)
        if not pending:
            return "".join(answer), artifacts
        calls = calls_of(pending)
        refuse = STEP_LIMIT_ERROR.format(limit=limit) if step >= limit else ""
        outcomes = [tool_call_run(tools=tools, ctx=ctx, call=c, step=step, refuse=refuse) for c in calls]
        for o in outcomes:
            artifacts.extend(o.artifacts)
        messages.extend(tool_messages("".join(text), outcomes, calls))
        step += 1


def research_delegate(ctx: ToolContext, task: str) -> dict:
    """Run `task` as a delegated task of ctx's turn: its engine, the parent's limits (narrowed tools
    follow it), one level deeper. Its answer is the result."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
    from plugins_app.agent.engines.registry import engine_for_profile
    sub = ToolContext(turn=ctx.turn, actor=ctx.actor, conversation=ctx.conversation,
                      should_stop=ctx.should_stop, emit=ctx.emit, allowed=ctx.allowed, denied=list(ctx.denied),
                      depth=ctx.depth + 1, profile=ctx.profile)
    engine = engine_for_profile(ctx.profile)
    tools = turn_tools(sub) if getattr(engine, "supports_tools", False) else TurnTools([], allowed=None, denied=None)
    messages = [AgentMessage(role=MessageRole.SYSTEM, content=RESEARCH_PROMPT),
                AgentMessage(role=MessageRole.USER, content=task)]
    answer, artifacts = task_run(sub, engine=engine, messages=messages, tools=tools)
    result = {"answer": answer, "tools": tools.names}
    if artifacts:
        result["artifacts"] = artifacts
    return result


def _delegation_box_class():
    from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput
    from pydantic import Field

    class ResearchArgs(ToolArguments):
        task: str = Field(min_length=1, description="What to find out, as a self-contained request.")

    class ResearchOutput(ToolOutput):
        answer: str
        tools: list = []
        artifacts: list = []

    class DelegationToolBox(ToolBox):
        """`delegate_research`: hand a research task to a sub-turn with this turn's limits."""

        def __init__(self, ctx: ToolContext):
            self.ctx = ctx
            super().__init__(toolbox_id="delegation")

        def delegate(self, args: ResearchArgs) -> dict:
            return research_delegate(self.ctx, args.task)

        def call_timeout(self, name: str, args: dict) -> float:
            """A delegated task runs engine steps and tools of its own, within its turn's run limit (it stops
            with its turn), not the per-tool timeout."""
            return float(settings.UGENT_TURN_RUN_LIMIT)

        def discover_tools(self):
            return [AgentTool(name="delegate_research",
                              description="Delegate a research task to a helper with the same tools and "
                                          "limits; returns its answer.",
                              argument_schema=ResearchArgs, output_schema=ResearchOutput,
                              tool_call=self.delegate)]

    return DelegationToolBox


_DELEGATION_BOX = None


def DelegationToolBox(ctx: ToolContext):  # noqa: N802 - a class, built once on first use
    global _DELEGATION_BOX
    if _DELEGATION_BOX is None:
        _DELEGATION_BOX = _delegation_box_class()
    return _DELEGATION_BOX(ctx)


def tools_status() -> dict:
    """The `tools` section of GET /v1/ugent/status: what is enabled, installed and running."""
    from plugins_app.agent.tools.plugins import toolbox_entry_points, toolboxes_kept
    config = tools_config()
    return {
        "enabled": enabled_names(None, config),
        "step_limit": settings.UGENT_TOOL_STEP_LIMIT,
        "timeout_seconds": settings.UGENT_TOOL_TIMEOUT_SECONDS,
        "overrun_max": settings.UGENT_TOOL_OVERRUN_MAX,
        "overrunning": overrunning(),
        "hub_toolboxes": sorted(HUB_TOOLBOXES),
        "plugins_installed": sorted(toolbox_entry_points()),
        "plugins_configured": sorted((config.get("plugins") or {})),
        "mcp_servers": [{"name": str(s.get("name") or s.get("command")), "command": s.get("command")}
                        for s in config.get("mcp") or []],
        "running": [{"toolbox": b.toolbox_id, "tools": sorted(b.tools)} for b in toolboxes_kept()],
    }
