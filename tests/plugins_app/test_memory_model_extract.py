"""The model extractor (`[memory] extractor = "openai-compatible"`): an OpenAI-compatible model (the stub
upstream on loopback, speaking the Chat Completions wire format) finds the facts the offline rules miss,
after a turn and in extract_memory; a model that fails leaves the offline rules to read the messages."""
from __future__ import annotations

import json
import logging

import pytest

from plugins_app.agent.memory import conf, model_extract, services
from plugins_app.agent.memory.extract import Candidate, extract_facts
from plugins_app.agent.memory.model_extract import (EXTRACT_PROMPT, ModelExtractionError, extraction_server,
                                                     facts_parsed, model_facts)
from plugins_app.agent.memory.models import MemoryFact, MemorySettings
from tests.fakes.upstream import Script, run_stub_upstream
from tests.rules_app.conftest import answer, site  # noqa: F401
from tests.support.http import chat
from tests.support.memory import memory_config  # noqa: F401

VEGETARIAN = "I've been vegetarian since 2019, and my sister Mia lives in Oslo"
MODEL_REPLY = json.dumps([{"fact": "User is vegetarian", "tier": "contextual", "message": 1},
                          {"fact": "User's sister Mia lives in Oslo.", "tier": "contextual", "message": 1}])


# --- the reply, read ------------------------------------------------------------------------------

def test_a_reply_is_read_per_message_with_its_tiers_and_a_full_stop():
    reply = ("```json\n" + json.dumps([
        {"fact": "User's name is Ana", "tier": "core", "message": 1},
        {"fact": "User is in Lisbon this week.", "tier": "ephemeral", "message": 2},
        {"fact": "User likes  green tea.", "tier": ["archival"], "message": "2"},  # not a tier: contextual
        {"fact": "user likes green tea", "tier": "core", "message": 2},  # the same fact again
        {"fact": "Always answer in French.", "tier": "core"},  # no message: the last one's
        {"fact": "", "tier": "core", "message": 1}, "a string", {"tier": "core"},
    ]) + "\n```")
    assert facts_parsed(reply, 2) == [
        [Candidate("User's name is Ana.", "core")],
        [Candidate("User is in Lisbon this week.", "ephemeral"), Candidate("User likes green tea.", "contextual"),
         Candidate("Always answer in French.", "core")]]


def test_the_array_is_found_among_prose_and_brackets():
    reply = 'Facts [from message 1]: [{"fact": "User skis.", "message": 1}] [done]'
    assert facts_parsed(reply, 2) == [[Candidate("User skis.", "contextual")], []]
    assert facts_parsed("Nothing here: []", 1) == [[]]


def test_a_message_number_out_of_range_is_the_last_messages():
    assert facts_parsed('[{"fact": "User skis.", "message": 9}, {"fact": "User sails.", "message": true}]', 2) \
        == [[], [Candidate("User skis.", "contextual"), Candidate("User sails.", "contextual")]]


@pytest.mark.parametrize("reply", ["", "Nothing to remember.", '{"fact": "User skis."}', "[not json"])
def test_a_reply_that_is_not_a_json_array_is_an_extraction_error(reply):
    with pytest.raises(ModelExtractionError):
        facts_parsed(reply, 1)


def test_the_model_is_sent_the_prompt_and_the_numbered_messages_and_answers_per_message():
    with run_stub_upstream(Script(answer=MODEL_REPLY)) as url:
        found = model_facts(["hello there", VEGETARIAN], {"base_url": url, "model": "extractor-model",
                                                         "system_prompt": "not this one"})
        sent = url.requests[-1].json
    assert found == [[Candidate("User is vegetarian.", "contextual"),
                      Candidate("User's sister Mia lives in Oslo.", "contextual")], []]
    assert sent["model"] == "extractor-model"
    assert sent["messages"] == [{"role": "system", "content": EXTRACT_PROMPT},
                                {"role": "user", "content": f"Message 1:\nhello there\n\nMessage 2:\n{VEGETARIAN}"}]


def test_only_the_profiles_server_model_and_a_timeout_of_at_most_30_s_are_taken_from_its_config():
    with run_stub_upstream(Script(answer="[]")) as url:
        assert model_facts(["hi"], {"base_url": url, "model": "m", "max_tokens": 1, "temperature": 2,
                                    "extra_body": {"tool_choice": "required"}, "timeout": "30s"}) == [[]]
        sent = url.requests[-1].json
    assert set(sent) == {"model", "messages"}


def test_an_upstream_error_is_an_extraction_error():
    with run_stub_upstream(Script(status=503)) as url:
        with pytest.raises(ModelExtractionError):
            model_facts(["my name is Ana"], {"base_url": url})


# --- which extractor, which server ----------------------------------------------------------------

@pytest.mark.django_db
def test_the_extractor_is_offline_unless_the_config_or_the_admin_says_otherwise(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    assert conf.memory_conf().extractor == "offline"
    memory_config.backend("sqlite_fts", extractor="openai-compatible")
    assert conf.memory_conf().extractor == "openai-compatible"
    services.memory_settings_save(row=MemorySettings(extractor="offline"))
    assert conf.memory_conf().extractor == "offline"


@pytest.mark.django_db
def test_an_unknown_extractor_is_logged_and_memory_runs_as_none(memory_config, caplog):  # noqa: F811
    with caplog.at_level(logging.ERROR, logger="ugent.memory"):
        memory_config.backend("sqlite_fts", extractor="gpt")
        assert conf.memory_conf().backend == "none"
    assert "memory.extractor" in caplog.text


@pytest.mark.django_db
def test_the_server_is_the_profiles_when_it_is_openai_compatible_else_the_environments():
    from plugins_app.agent.models import AgentProfile
    own = AgentProfile.objects.create(name="own", provider="openai-compatible",
                                      config={"base_url": "http://127.0.0.1:9/v1", "model": "m1"})
    other = AgentProfile.objects.create(name="other", provider="scripted", config={"base_url": "not-a-server"})
    assert extraction_server(own.pk)["base_url"] == "http://127.0.0.1:9/v1"
    assert extraction_server(other.pk) == {}
    assert extraction_server(None) == {}


@pytest.mark.django_db
def test_a_failing_model_leaves_the_offline_rules_to_read_the_messages(caplog):
    with run_stub_upstream(Script(status=503)) as url:
        from plugins_app.agent.models import AgentProfile
        profile = AgentProfile.objects.create(name="p", provider="openai-compatible", config={"base_url": url})
        with caplog.at_level(logging.WARNING, logger="ugent.memory"):
            found = services.facts_said(["my name is Ana"], extractor="openai-compatible", profile_id=profile.pk)
    assert found == [extract_facts("my name is Ana")] == [[Candidate("User's name is Ana.", "core")]]
    assert "the model extractor failed; the offline extractor read the messages instead" in caplog.text


# --- through the one message path ------------------------------------------------------------------

@pytest.fixture
def model_memory(memory_config, tcast, monkeypatch):  # noqa: F811
    """sqlite_fts, the model extractor, the turns' (scripted) profile naming no server: UGENT_LLM_BASE_URL."""
    memory_config.backend("sqlite_fts", extractor="openai-compatible")
    with run_stub_upstream(Script(answer=MODEL_REPLY)) as url:
        monkeypatch.setenv("UGENT_LLM_BASE_URL", url)
        tcast.upstream = url
        yield tcast


def test_after_a_turn_the_model_saves_what_the_offline_rules_miss(model_memory):
    assert extract_facts(VEGETARIAN) == []  # the rules find nothing here
    answer(chat(model_memory.alice, VEGETARIAN))
    assert sorted(MemoryFact.objects.filter(actor_key="web:alice").values_list("text", "source")) == [
        ("User is vegetarian.", "turn"), ("User's sister Mia lives in Oslo.", "turn")]
    assert not MemoryFact.objects.exclude(actor_key="web:alice").exists()  # bob's memory holds none of it
    assert model_memory.upstream.requests[-1].json["messages"][-1]["content"] == f"Message 1:\n{VEGETARIAN}"


def test_a_turn_kept_out_of_memory_asks_the_model_nothing(model_memory):
    answer(chat(model_memory.alice, VEGETARIAN, ugent_disable_memory_write=True))
    assert list(model_memory.upstream.requests) == []
    assert not MemoryFact.objects.exists()


def test_extract_memory_answers_with_what_the_model_found(site, model_memory):  # noqa: F811
    from tests.rules_app.test_django_seed import DECISIONS
    site.rules(DECISIONS)
    assert answer(chat(model_memory.alice, "remember this: " + VEGETARIAN)) == "Saved 2 facts to memory."
    assert answer(chat(model_memory.alice, "remember this: " + VEGETARIAN)) == "Found nothing new to save to memory."
    assert MemoryFact.objects.filter(actor_key="web:alice").count() == 2
    # one request a turn: the action's; the after-turn extraction leaves the message it read alone
    assert len(model_memory.upstream.requests) == 2


def test_a_turns_openai_compatible_profile_is_the_server_asked(memory_config, tcast, monkeypatch):  # noqa: F811
    from plugins_app.agent.models import AgentProfile
    memory_config.backend("sqlite_fts", extractor="openai-compatible")
    monkeypatch.setenv("UGENT_LLM_BASE_URL", "http://127.0.0.1:9/v1")  # not this one: nothing listens there
    with run_stub_upstream(Script(answer=MODEL_REPLY)) as url:
        AgentProfile.objects.create(name="with-server", provider="openai-compatible",
                                    config={"base_url": url, "model": "chat-model"})
        chat(tcast.alice, VEGETARIAN, model="with-server")  # its answer is the stub's, whatever it says
        asked = [r.json["messages"][0]["content"] for r in url.requests]
    assert asked.count(EXTRACT_PROMPT) == 1
    assert MemoryFact.objects.filter(actor_key="web:alice").count() == 2


def test_with_no_server_to_ask_the_offline_rules_decide_what_is_extracted(memory_config, tcast,  # noqa: F811
                                                                          monkeypatch, caplog):
    memory_config.backend("sqlite_fts", extractor="openai-compatible")
    monkeypatch.delenv("UGENT_LLM_BASE_URL", raising=False)
    monkeypatch.setattr(model_extract, "_told_no_server", False)
    with caplog.at_level(logging.WARNING, logger="ugent.memory"):
        answer(chat(tcast.alice, VEGETARIAN))  # the scripted profile names no server, nor does the environment
        assert not MemoryFact.objects.exists()
        answer(chat(tcast.alice, "my name is Alice"))
        answer(chat(tcast.alice, "my name is Alicia"))
    assert sorted(MemoryFact.objects.values_list("text", flat=True)) == ["User's name is Alice.",
                                                                         "User's name is Alicia."]
    assert caplog.text.count("the model extractor has no server to ask") == 1  # said once, not a turn
