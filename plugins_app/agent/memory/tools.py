"""The memory_control tool: the agent lists, pins, unpins and forgets the acting user's facts.

A ToolBox (ovos_plugin_manager.templates.agent_tools) made per turn with
config={"actor_key": the turn's user, "disable_memory_write": the turn's flag}. A turn kept out of
memory (ugent_disable_memory_write), a user who is not identified, or memory on backend none gets
no tool at all. Every call acts on that user's facts only: another user's fact id is "no such fact".
"""
from __future__ import annotations

from typing import Literal, Optional

from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput
from pydantic import Field

TOOL_NAME = "memory_control"
LIST_LIMIT = 50


class MemoryControlArguments(ToolArguments):
    action: Literal["list", "forget", "pin", "unpin"] = Field(
        description="list: the user's saved facts (optionally matching `query`); forget: delete one fact; "
                    "pin: always recall it; unpin: recall it only when relevant.")
    fact_id: Optional[int] = Field(None, description="The fact to forget, pin or unpin (an id from list).")
    query: Optional[str] = Field(None, description="list only: keep the facts containing these words.")


class MemoryFactOut(ToolOutput):
    id: int
    text: str
    tier: str
    pinned: bool


class MemoryControlOutput(ToolOutput):
    ok: bool
    message: str
    facts: list[MemoryFactOut] = []


class MemoryToolBox(ToolBox):
    def __init__(self, config: dict | None = None, bus=None, toolbox_id: str = "ugent-memory"):
        super().__init__(toolbox_id, config=config, bus=bus)

    def discover_tools(self) -> list[AgentTool]:
        from plugins_app.agent.memory.conf import memory_conf
        if self.config.get("disable_memory_write") or not self.config.get("actor_key"):
            return []
        if not memory_conf().durable:
            return []
        return [AgentTool(name=TOOL_NAME, description=(
            "Manage what you remember about the current user: list saved facts, pin one so it is always "
            "recalled, unpin it, or forget it."), argument_schema=MemoryControlArguments,
            output_schema=MemoryControlOutput, tool_call=self.memory_control)]

    def memory_control(self, args: MemoryControlArguments) -> dict:
        from plugins_app.agent.memory import services
        from plugins_app.agent.memory.models import MemoryFact
        actor_key = self.config["actor_key"]
        if args.action == "list":
            facts = MemoryFact.objects.filter(actor_key=actor_key).order_by("-updated_at")
            for word in (args.query or "").split():
                facts = facts.filter(text__icontains=word)
            # pinned first, then the rest, each newest first: two reads down the user's (actor_key, updated_at)
            # indexes that stop at the limit, where one ORDER BY pinned, updated_at sorted all of the user's facts
            listed = list(facts.filter(pinned=True)[:LIST_LIMIT])
            if len(listed) < LIST_LIMIT:
                listed += facts.filter(pinned=False)[:LIST_LIMIT - len(listed)]
            rows = [{"id": f.id, "text": f.text, "tier": f.tier, "pinned": f.pinned} for f in listed]
            return {"ok": True, "message": f"{len(rows)} saved fact{'s' if len(rows) != 1 else ''}.", "facts": rows}
        if args.fact_id is None:
            return {"ok": False, "message": f"{args.action} needs fact_id."}
        if args.action == "forget":
            done = services.fact_forget(actor_key=actor_key, fact_id=args.fact_id)
            word = "Forgot"
        else:
            done = services.fact_pin(actor_key=actor_key, fact_id=args.fact_id, pinned=args.action == "pin")
            word = "Pinned" if args.action == "pin" else "Unpinned"
        if not done:
            return {"ok": False, "message": f"There is no saved fact {args.fact_id}."}
        return {"ok": True, "message": f"{word} fact {args.fact_id}."}
