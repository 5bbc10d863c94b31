"""A rule-started workflow keeps the sender's limits end to end, through the rule engine's own hook and the
run's turns (seed 002: "is held to the sender's limits: what their own turn would have declined (memory
recall, memory write, code context)"): code context as the sender chose it, and no memory written from a
run a spoken message started."""
from __future__ import annotations

import pytest

from channels_app.models import CallerDefaults, Turn
from cron_app.models import CronRun
from plugins_app.agent.memory.models import MemoryFact
from tests.conftest import APP_KEY
from tests.cron_app.test_workflow_start import SEED_RULE
from tests.support import http
from tests.support.code import code_blocks, code_ws  # noqa: F401
from tests.support.memory import memory_config  # noqa: F401
from tests.support.scripted import CALLS

pytestmark = pytest.mark.django_db(transaction=True)
STARTED = "Started workflow 'digest'. Its result goes to the workflow's destinations."


def chat(who: dict, text: str, **extra):
    resp = http.chat(who, text, **extra)
    assert resp.status_code == 200, resp.content
    assert resp.json()["choices"][0]["message"]["content"] == STARTED
    return CronRun.objects.order_by("-id").first()


def run_turns(run: CronRun) -> list[Turn]:
    return list(Turn.objects.filter(conversation_id=run.conversation_id))


# --- code context ---------------------------------------------------------------------

@pytest.fixture
def digest(seed_job, real_rules, code_ws):  # noqa: F811
    real_rules(SEED_RULE)
    CALLS.clear()
    return seed_job


def test_a_workflow_run_gets_code_context_when_its_sender_allows_it(digest):
    run = chat(digest.alice, "digest how the PaymentGateway charges an amount", conversation_id="k1")
    assert run.state == "completed" and not any(t.disable_code_context for t in run_turns(run))
    [blocks] = code_blocks(CALLS)  # the sender's own message is the rule's: only the run's turn calls the engine
    assert len(blocks) == 1 and "--- pkg/billing.py:9-13" in blocks[0]


def test_a_workflow_run_keeps_the_senders_ugent_disable_code_context(digest):
    run = chat(digest.alice, "digest how the PaymentGateway charges an amount", conversation_id="k2",
               ugent_disable_code_context=True)
    assert run.state == "completed" and run.limits["disable_code_context"] is True
    turns = run_turns(run)
    assert turns and all(t.disable_code_context for t in turns)
    assert code_blocks(CALLS) == [[]]


def test_a_workflow_run_keeps_the_code_context_default_of_the_senders_caller(digest):
    CallerDefaults.objects.create(issuer="example-crm", disable_code_context=True)
    carol = {"key": APP_KEY, "federation_issuer": "example-crm", "federation_subject": "carol"}
    run = chat(carol, "digest how the PaymentGateway charges an amount", conversation_id="k3")
    assert run.acts_for.key == "fed:example-crm:carol" and all(t.disable_code_context for t in run_turns(run))
    assert code_blocks(CALLS) == [[]]


# --- the voice rule run ---------------------------------------------------------------

@pytest.fixture
def digest_with_memory(seed_job, real_rules, memory_config):  # noqa: F811
    real_rules(SEED_RULE)
    memory_config.backend("sqlite_fts")
    return seed_job


def test_a_typed_message_starts_a_run_whose_turn_saves_the_facts_it_states(digest_with_memory):
    # the control: the same message typed, so the voice test below can fail
    run = chat(digest_with_memory.alice, "digest. My name is Alice.", conversation_id="v0")
    assert run.state == "completed" and not run.limits["disable_memory_write"]
    [turn] = run_turns(run)
    assert not turn.disable_memory_write
    fact = MemoryFact.objects.get(actor_key="web:alice", text="User's name is Alice.")
    # the run's turn saved it: first (its turn id), or merged into what the sender's own turn saved
    assert fact.source_ref == turn.turn_id or fact.seen_count == 2


def test_a_voice_message_a_rule_starts_a_workflow_from_runs_it_with_memory_writing_off(digest_with_memory):
    run = chat(digest_with_memory.alice, "digest. My name is Alice.", conversation_id="v1",
               ugent_input_mode="voice")
    assert run.state == "completed" and run.limits["disable_memory_write"] is True
    [turn] = run_turns(run)
    assert turn.actor.key == "web:alice" and turn.disable_memory_write and turn.input_mode != "voice"
    assert "My name is Alice." in turn.context["text"]  # the run read the message, and saved nothing of it
    assert not MemoryFact.objects.exists()
