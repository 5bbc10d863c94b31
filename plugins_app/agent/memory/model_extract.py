"""The model extractor (`[memory] extractor = "openai-compatible"`): an OpenAI-compatible model reads
what a user said and lists the durable facts it states, worded as the offline extractor words them
("User's name is Ana.", "User prefers tea.", "Always answer in French.").

One request for all the texts of one extraction (an after-turn message, or extract_memory's latest
exchanges and the message), numbered, so each fact keeps the message it came from (memory counts a
fact once per turn that stated it). The server is the turn's agent profile's when the profile is
OpenAI-compatible (its base_url, api_key, model, timeout), else UGENT_LLM_*: the chat engine's own
fallbacks. A reply that is not the JSON asked for raises ModelExtractionError; the caller then uses
the offline extractor (services.facts_said), so a failing model costs quality, never the facts.
"""
from __future__ import annotations

import json
import re

from plugins_app.agent.memory.extract import MAX_FACT_CHARS, Candidate, normalize
from plugins_app.agent.memory.models import Tier

EXTRACT_PROMPT = (
    "You keep a user's long-term memory. Below are numbered messages the user wrote. List the durable "
    "facts they state about themselves (name, preferences, allergies, where they live or work, people and "
    "things that matter to them) and the standing instructions they give the assistant. Write each fact as "
    "one short sentence about \"User\" (\"User's name is Ana.\", \"User is allergic to peanuts.\") and each "
    "instruction as the instruction (\"Always answer in French.\"). Leave out questions, greetings, "
    "requests for this conversation only, and what the messages say about other people's views. "
    "Answer with a JSON array only, no other text: "
    "[{\"fact\": \"...\", \"tier\": \"core\" or \"contextual\" or \"ephemeral\", \"message\": <its number>}]. "
    "tier: core for a name and for instructions, ephemeral for what holds only today or this week, "
    "contextual otherwise. Answer [] when the messages state nothing to remember."
)
EXTRACT_TIMEOUT_SECS = 30
_TIERS = {Tier.CORE, Tier.CONTEXTUAL, Tier.EPHEMERAL}
_ARRAY = re.compile(r"\[.*\]", re.S)


class ModelExtractionError(Exception):
    """The model could not be asked, or did not answer with the facts' JSON."""


def transcript(texts: list[str]) -> str:
    return "\n\n".join(f"Message {i}:\n{text.strip()}" for i, text in enumerate(texts, 1))


def facts_parsed(content: str, count: int) -> list[list[Candidate]]:
    """The facts of a reply, per message (`count` of them): each fact once, in the reply's order. A fact
    naming no message, or one that is not among them, is the last message's (the one being extracted)."""
    found = _ARRAY.search(content or "")
    try:
        items = json.loads(found.group(0)) if found else None
    except ValueError:
        items = None
    if not isinstance(items, list):
        raise ModelExtractionError(f"the model did not answer with a JSON array: {(content or '')[:200]!r}")
    out: list[list[Candidate]] = [[] for _ in range(count)]
    seen: set[str] = set()
    for item in items:
        text = item.get("fact") if isinstance(item, dict) else None
        if not isinstance(text, str) or not " ".join(text.split()):
            continue
        text = " ".join(text.split())[:MAX_FACT_CHARS]
        text = text if text.endswith((".", "!")) else text + "."
        if normalize(text) in seen:
            continue
        seen.add(normalize(text))
        tier = item.get("tier") if item.get("tier") in _TIERS else Tier.CONTEXTUAL
        number = item.get("message")
        index = number - 1 if isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= count \
            else count - 1
        out[index].append(Candidate(text, tier))
    return out


def model_facts(texts: list[str], config: dict) -> list[list[Candidate]]:
    """The facts each of `texts` states, by the model `config` names (the chat engine's keys)."""
    from plugins_app.agent.engines.base import EngineError
    from plugins_app.agent.engines.openai_compat import OpenAICompatibleEngine
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
    # a reply within 30 s unless the profile says otherwise: the after-turn task is cut off at 60
    engine = OpenAICompatibleEngine({"timeout": EXTRACT_TIMEOUT_SECS, **{
        k: v for k, v in config.items() if k not in ("system_prompt", "prompt") and v not in (None, "")}})
    try:
        reply = engine.continue_chat([AgentMessage(role=MessageRole.SYSTEM, content=EXTRACT_PROMPT),
                                      AgentMessage(role=MessageRole.USER, content=transcript(texts))],
                                     session_id="memory-extraction")
    except EngineError as exc:
        raise ModelExtractionError(str(exc)) from exc
    finally:
        engine.close()
    return facts_parsed(reply.content or "", len(texts))
