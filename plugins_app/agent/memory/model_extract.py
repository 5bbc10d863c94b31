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
from ugent_common.digits import ascii_int

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
#: seconds for connect and each read, at most (a profile's longer chat timeout is not the extractor's): the
#: threads pool the workers run enforces no task time limit, and extract_memory's turn waits for it
EXTRACT_TIMEOUT_SECS = 30
_TIERS = {Tier.CORE, Tier.CONTEXTUAL, Tier.EPHEMERAL}


class ModelExtractionError(Exception):
    """The model could not be asked, or did not answer with the facts' JSON."""


def transcript(texts: list[str]) -> str:
    return "\n\n".join(f"Message {i}:\n{text.strip()}" for i, text in enumerate(texts, 1))


def _array_in(content: str) -> list | None:
    """The first JSON array in a reply (code fences, prose or brackets around it allowed)."""
    decoder = json.JSONDecoder()
    for at in (m.start() for m in re.finditer(r"\[", content)):
        try:
            found, _ = decoder.raw_decode(content, at)
        except ValueError:
            continue
        if isinstance(found, list) and (not found or any(isinstance(item, dict) for item in found)):
            return found
    return None


def _message_index(number, count: int) -> int:
    """The index of the message a fact names (an int or its digits); the last message's when it names
    none, or one that is not among them."""
    if isinstance(number, str):
        number = ascii_int(number.strip())
    if isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= count:
        return number - 1
    return count - 1


def facts_parsed(content: str, count: int) -> list[list[Candidate]]:
    """The facts of a reply, per message (`count` of them): each fact once, in the reply's order. A fact
    naming no message, or one that is not among them, is the last message's (the one being extracted)."""
    items = _array_in(content or "")
    if items is None:
        # the reply's length only: a reply restates what the user said, which the logs never carry
        raise ModelExtractionError(f"the model did not answer with a JSON array ({len(content or '')} characters)")
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
        tier = item.get("tier")
        tier = tier if isinstance(tier, str) and tier in _TIERS else Tier.CONTEXTUAL
        out[_message_index(item.get("message"), count)].append(Candidate(text, tier))
    return out


def model_facts(texts: list[str], config: dict) -> list[list[Candidate]]:
    """The facts each of `texts` states, by the model `config` names (its base_url, api_key, model and
    timeout: nothing else of a chat profile's, whose max_tokens or extra_body were set for chatting).
    Anything that goes wrong is a ModelExtractionError."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

    from plugins_app.agent.engines.openai_compat import OpenAICompatibleEngine
    try:
        timeout = min(float(config.get("timeout") or EXTRACT_TIMEOUT_SECS), EXTRACT_TIMEOUT_SECS)
    except (TypeError, ValueError):
        timeout = EXTRACT_TIMEOUT_SECS
    server = {k: config[k] for k in ("base_url", "api_key", "model") if config.get(k)}
    try:
        engine = OpenAICompatibleEngine({**server, "timeout": timeout})
        try:
            reply = engine.continue_chat([AgentMessage(role=MessageRole.SYSTEM, content=EXTRACT_PROMPT),
                                          AgentMessage(role=MessageRole.USER, content=transcript(texts))],
                                         session_id="memory-extraction")
        finally:
            engine.close()
        return facts_parsed(reply.content or "", len(texts))
    except ModelExtractionError:
        raise
    except Exception as exc:  # the engine's errors, and anything a server's odd answer makes it raise
        raise ModelExtractionError(f"{type(exc).__name__}: {exc}") from exc


def extraction_server(profile_id: int | None) -> dict:
    """The chat engine config the model extractor asks: the turn's agent profile's when it is
    OpenAI-compatible (its secrets opened), else nothing, so the engine falls back to UGENT_LLM_*."""
    from plugins_app.agent.models import AgentProfile
    profile = AgentProfile.objects.filter(pk=profile_id, provider="openai-compatible").first() \
        if profile_id else None
    if profile is None:
        return {}
    from ugent_common.secrets import secrets_opened
    return secrets_opened(dict(profile.config or {}))


def model_server_known(config: dict) -> bool:
    """Whether the model extractor has a server to ask: the profile's base_url, else UGENT_LLM_BASE_URL."""
    import os
    return bool(config.get("base_url") or os.environ.get("UGENT_LLM_BASE_URL"))


_told_no_server = False


def no_server_told(config: dict) -> bool:
    """True when the model extractor has no server to ask (model_server_known), said in the log once a
    process: the offline rules then read the messages, as with extractor "offline"."""
    global _told_no_server
    if model_server_known(config):
        return False
    if not _told_no_server:
        _told_no_server = True
        import logging
        logging.getLogger("ugent.memory").warning(
            "memory: the model extractor has no server to ask (the turn's agent profile is not OpenAI-compatible "
            "with a base_url, and UGENT_LLM_BASE_URL is not set); the offline extractor reads the messages")
    return True
