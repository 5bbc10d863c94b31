"""Memory through the one message path: recall changes what the engine sees, the opt-outs recall
nothing, a turn's message is saved after it, extract_memory answers with the spec's texts."""
from __future__ import annotations

import pytest
from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput

from channels_app import tools as hub_tools
from plugins_app.agent.memory import services
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.agent.memory.recall import RECALL_HEADER
from tests.rules_app.conftest import answer, chat, site  # noqa: F401
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
