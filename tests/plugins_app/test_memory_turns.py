"""Memory through the one message path: recall changes what the engine sees, the opt-outs recall
nothing, a turn's message is saved after it, extract_memory answers with the spec's texts."""
from __future__ import annotations

import pytest
from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput

from channels_app import tools as hub_tools
from plugins_app.agent.memory import services
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.agent.memory.recall import RECALL_HEADER
from tests.rules_app.conftest import answer, site  # noqa: F401
from tests.support.http import chat
from tests.support.memory import memory_config  # noqa: F401
from tests.support.scripted import CALLS


def seen_recall():
    return [c for r, c in CALLS[-1]["messages"] if r == "system" and c.startswith(RECALL_HEADER)]


@pytest.fixture
def fts(memory_config, tcast):  # noqa: F811
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key="web:alice", text="User likes green tea.")
    return tcast


def test_recall_puts_the_users_facts_before_the_message_the_engine_sees(fts):
    answer(chat(fts.alice, "Which tea do I like?"))
    assert seen_recall() == [RECALL_HEADER + "\n- User likes green tea."]
    assert CALLS[-1]["messages"][-1] == ("user", "Which tea do I like?")


def test_bob_never_recalls_alices_facts_through_a_turn(fts):
    answer(chat(fts.bob, "Which tea do I like?"))
    assert seen_recall() == []


def test_disable_memory_recall_recalls_nothing(fts):
    answer(chat(fts.alice, "Which tea do I like?", ugent_disable_memory_recall=True))
    assert seen_recall() == []


def test_a_turns_message_is_saved_after_it_unless_memory_writes_are_off(fts):
    answer(chat(fts.alice, "my name is Alice", ugent_disable_memory_write=True))
    assert not MemoryFact.objects.filter(text="User's name is Alice.").exists()
    answer(chat(fts.alice, "my name is Alice"))
    assert MemoryFact.objects.get(text="User's name is Alice.").source == "turn"


def test_extract_memory_answers(site, fts):  # noqa: F811
    from tests.rules_app.test_django_seed import DECISIONS
    site.rules(DECISIONS)
    assert answer(chat(fts.alice, "remember this: I like black coffee")) == "Saved 1 fact to memory."
    assert answer(chat(fts.alice, "remember this: I like black coffee")) == "Found nothing new to save to memory."


# --- the recall cadence over a tool loop -------------------------------------------------------

class _FactArgs(ToolArguments):
    text: str


class _FactOut(ToolOutput):
    model_config = {"extra": "allow"}


class FactSavingToolBox(ToolBox):
    """remember_fact: saves a fact in the turn's user's memory mid-turn, so a later recall can differ."""

    def __init__(self, ctx=None):
        self.ctx = ctx
        super().__init__(toolbox_id="fact-saving")

    def discover_tools(self):
        def save(args):
            services.fact_save(actor_key=self.ctx.actor.key, text=args.text)
            return {"saved": True}
        return [AgentTool(name="remember_fact", description="remember_fact", argument_schema=_FactArgs,
                          output_schema=_FactOut, tool_call=save)]


hub_tools.hub_toolbox_register("fact-saving", lambda ctx: FactSavingToolBox(ctx))
LOOP = 'script:call=remember_fact{"text": "User owns a red bicycle."}|answer=Which bicycle do I own?'


def recall_blocks(call) -> list[str]:
    return [c for r, c in call["messages"] if r == "system" and c.startswith(RECALL_HEADER)]


@pytest.fixture
def looping(memory_config, tcast):  # noqa: F811
    def cadence(name: str):
        memory_config.write(f'[memory]\nbackend = "sqlite_fts"\nrecall_cadence = "{name}"\n'
                            '[tools]\nenabled = ["fact-saving"]\n')
        services.fact_save(actor_key="web:alice", text="User's name is Alice.", tier="core")
        CALLS.clear()
        answer(chat(tcast.alice, LOOP))
        assert len(CALLS) == 2 and [r for r, _ in CALLS[1]["messages"]][-2:] == ["assistant", "tool"]
        return [recall_blocks(c) for c in CALLS]
    return cadence


def test_every_call_recalls_again_before_each_model_call_of_a_tool_loop(looping):
    first, second = looping("every_call")
    assert first == [RECALL_HEADER + "\n- User's name is Alice."]
    assert len(second) == 1 and "- User owns a red bicycle." in second[0] and "- User's name is Alice." in second[0]


def test_per_prompt_recalls_once_and_shows_that_recall_to_every_model_call(looping):
    first, second = looping("per_prompt")
    assert first == second == [RECALL_HEADER + "\n- User's name is Alice."]


# --- a profile's own memory engine (AgentProfile.memory_engine, an AgentContextManager) --------------

class KnowledgeContext:
    """A test AgentContextManager: the history it is handed, a context block from its config, the message."""

    handed: list = []
    sessions: list = []

    def __init__(self, config=None):
        self.config = config or {}
        self.history: dict = {}

    def get_history(self, session_id):
        return list(self.history.get(session_id, []))

    def update_history(self, new_messages, session_id):
        self.history.setdefault(session_id, []).extend(new_messages)
        KnowledgeContext.handed.append([(m.role.value, m.content) for m in new_messages])

    def build_conversation_context(self, utterance, session_id):
        from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
        KnowledgeContext.sessions.append(session_id)
        if self.config.get("fail"):
            raise RuntimeError("the knowledge base is down")
        if self.config.get("dicts"):  # a plugin that answers the wrong shape
            return [{"role": "user", "content": utterance}]
        if self.config.get("into_message"):  # RAG put into the user's message, as ovos-openai-rag's "user" mode
            return [*self.get_history(session_id),
                    AgentMessage(role=MessageRole.USER, content=f"Context: {self.config['header']}\n\n"
                                                                f"Question: {utterance}")]
        return [*self.get_history(session_id),
                AgentMessage(role=MessageRole.SYSTEM, content=f"{self.config['header']} {utterance}"),
                AgentMessage(role=MessageRole.USER, content=utterance)]


@pytest.fixture
def knowledge(tcast):
    from plugins_app.agent.engines.registry import register_memory_engine
    register_memory_engine("test-knowledge", KnowledgeContext)
    KnowledgeContext.handed = []
    KnowledgeContext.sessions = []
    tcast.profile.memory_engine = "test-knowledge"
    tcast.profile.config = {"test-knowledge": {"header": "Knowledge for:"}}
    tcast.profile.save()
    return tcast


def test_a_profiles_memory_engine_builds_the_context_the_engine_sees(knowledge):
    answer(chat(knowledge.alice, "first question", conversation_id="k1"))
    assert CALLS[-1]["messages"][-2:] == [("system", "Knowledge for: first question"), ("user", "first question")]
    answer(chat(knowledge.alice, "second question", conversation_id="k1"))
    messages = CALLS[-1]["messages"]
    assert messages[-2:] == [("system", "Knowledge for: second question"), ("user", "second question")]
    assert ("user", "first question") in messages  # the conversation's history, handed to it by the hub
    # each turn's engine is handed the history once, not the history of every turn before piled up
    assert KnowledgeContext.handed[-1].count(("user", "first question")) == 1
    # its session is the conversation's own key (external ids repeat across channels and clients)
    from channels_app.models import Conversation
    assert set(KnowledgeContext.sessions) == {f"conv-{Conversation.objects.get(external_id='k1').pk}"}


def test_what_a_memory_engine_puts_into_the_users_message_is_what_the_engine_sees(knowledge):
    """Seed 001: build_conversation_context "returns the message list the chat engine will actually see"."""
    knowledge.profile.config = {"test-knowledge": {"header": "Paris is the capital.", "into_message": True}}
    knowledge.profile.save()
    answer(chat(knowledge.alice, "capital of France?", conversation_id="k2"))
    assert CALLS[-1]["messages"][-1] == ("user", "Context: Paris is the capital.\n\nQuestion: capital of France?")


def test_the_chat_engines_session_is_the_conversations_own_key_like_the_memory_engines(tcast):
    """Seed 001: session_id lets an engine that fronts a stateful backend route. Two clients' conversations may
    share an external id; their sessions must not."""
    from channels_app.models import Conversation
    answer(chat(tcast.alice, "hello", conversation_id="same", client_id="client-a"))
    answer(chat(tcast.alice, "hello", conversation_id="same", client_id="client-b"))
    pks = [Conversation.objects.get(external_id="same", client_id=c).pk for c in ("client-a", "client-b")]
    assert [call["session_id"] for call in CALLS[-2:]] == [f"conv-{pk}" for pk in pks]


def test_a_failing_memory_engine_costs_its_context_never_the_turn(knowledge, caplog):
    import logging
    knowledge.profile.config = {"test-knowledge": {"header": "x", "fail": True}}
    knowledge.profile.save()
    with caplog.at_level(logging.WARNING, logger="ugent.memory"):
        text = answer(chat(knowledge.alice, "still answered", conversation_id="k2"))
    assert "still answered" in text
    assert CALLS[-1]["messages"][-1] == ("user", "still answered")
    assert not any(c.startswith("x ") for _, c in CALLS[-1]["messages"])
    assert any("memory engine failed" in m and "the knowledge base is down" in m for m in caplog.messages)


def test_a_memory_engine_answering_the_wrong_shape_costs_its_context_never_the_turn(knowledge, caplog):
    import logging
    knowledge.profile.config = {"test-knowledge": {"header": "x", "dicts": True}}
    knowledge.profile.save()
    with caplog.at_level(logging.WARNING, logger="ugent.memory"):
        assert "shaped" in answer(chat(knowledge.alice, "shaped", conversation_id="k4"))
    assert any("not a list of AgentMessage" in m for m in caplog.messages)


def test_a_memory_engine_that_is_not_installed_costs_nothing_but_a_warning(tcast, caplog):
    import logging
    tcast.profile.memory_engine = "no-such-memory-engine"
    tcast.profile.save()
    with caplog.at_level(logging.WARNING, logger="ugent.memory"):
        assert "hello" in answer(chat(tcast.alice, "hello", conversation_id="k3"))
    assert any("no memory engine named 'no-such-memory-engine'" in m for m in caplog.messages)


def test_a_memory_engine_that_is_not_installed_is_looked_for_once_per_recheck_interval(monkeypatch):
    """A turn asks at every model call: the entry points (every installed package's) are scanned again for a
    missing engine only once MISSING_RECHECK_SECS have passed, and then find one installed meanwhile."""
    from plugins_app.agent.engines import registry
    scans, now = [], [1000.0]
    installed: dict[str, type] = {}

    def scan(group, name, what):
        scans.append(name)
        if name in installed:
            return installed[name]
        raise LookupError(f"no {what} named '{name}' is installed")
    monkeypatch.setattr(registry, "_plugin_class", scan)
    monkeypatch.setattr(registry, "_clock", lambda: now[0])
    registry._memory_entry_point.cache_clear()
    registry._memory_missing.clear()
    try:
        for _ in range(3):
            with pytest.raises(LookupError, match="no memory engine named 'later-memory' is installed"):
                registry.memory_engine_class("later-memory")
        assert scans == ["later-memory"]
        installed["later-memory"] = dict  # installed meanwhile
        now[0] += registry.MISSING_RECHECK_SECS + 1
        assert registry.memory_engine_class("later-memory") is dict
        assert registry.memory_engine_class("later-memory") is dict
        assert scans == ["later-memory", "later-memory"]
    finally:
        registry._memory_entry_point.cache_clear()
        registry._memory_missing.clear()


# --- which turns are offered memory_control -------------------------------------------------------

def offered_tools() -> list[str]:
    return CALLS[-1]["tools"]


def test_memory_control_is_offered_only_to_a_turn_that_may_write_the_users_memory(fts):
    answer(chat(fts.alice, "What do you remember?"))
    assert "memory_control" in offered_tools()
    answer(chat(fts.alice, "What do you remember?", ugent_disable_memory_write=True))
    assert "memory_control" not in offered_tools()
    answer(chat(fts.alice, "What do you remember?", ugent_input_mode="voice"))  # spoken: kept out of memory
    assert "memory_control" not in offered_tools()
    answer(chat({"key": fts.keys["app"]}, "What do you remember?"))  # a sender who is not identified
    assert "memory_control" not in offered_tools()
