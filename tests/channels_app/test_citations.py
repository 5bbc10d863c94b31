"""Citations: ugent_citation_ids come back in ugent.citations only when the answer used that evidence —
by the lexical check without an NLI engine, by the engine's entailment with one ([citations] nli_engine)."""
from __future__ import annotations

import json
import tomllib
from importlib import import_module
from pathlib import Path

import pytest
from django.test import Client
from ovos_plugin_manager.templates.agents import NaturalLanguageInferenceEngine

from channels_app import citations, hooks
from channels_app.models import Receipt
from plugins_app.agent.engines import registry
from plugins_app.agent.engines.nli import LexicalOverlapNLI
from tests.support import blocking
from tests.support.http import body_bytes, parse_sse
from ugent_common import config

pytestmark = pytest.mark.django_db(transaction=True)

EVIDENCE = ("\n\n[ev-1] The Eiffel Tower is 330 metres tall and stands in Paris."
            "\n\n[ev-2] Bananas are a yellow fruit grown in the tropics."
            "\n\nQuestion: where is the tower?")


class ScriptedNLI(NaturalLanguageInferenceEngine):
    """Entailed exactly when the premise contains config["when"]; every call is recorded."""

    calls: list = []

    def predict_entailment(self, premise, hypothesis, lang=None):
        ScriptedNLI.calls.append((premise, hypothesis))
        if self.config.get("fail"):
            raise RuntimeError("the NLI model is down")
        return self.config["when"] in premise


class NotAnEngine:
    pass


@pytest.fixture
def toml_config(tmp_path, settings):
    def write(text: str):
        path = tmp_path / "ugent.toml"
        path.write_text(text)
        settings.UGENT_CONFIG = str(path)
        config.reset_caches()
    registry.register_engine("scripted-nli", ScriptedNLI)
    ScriptedNLI.calls = []
    write("[web.auth]\n")  # no [citations] (an empty file is refused, ugent.E001)
    yield write
    registry._extra.pop("scripted-nli", None)
    config.reset_caches()


def chat(who: dict, text: str, *, stream=False, **extra):
    body = {"messages": [{"role": "user", "content": text}], "stream": stream, "model": "scripted",
            **{k: v for k, v in who.items() if k != "key"}, **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def turn_citations(who, answer: str, ids=("ev-1", "ev-2"), cite: str = "", **extra) -> list[str]:
    script = f"script:answer={answer}" + (f"|cite={cite}" if cite else "") + "|evidence" + EVIDENCE
    resp = chat(who, script, ugent_citation_ids=list(ids), **extra)
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert Receipt.objects.get(turn__turn_id=body["ugent_turn_id"]).citations == body["ugent_citations"]
    return body["ugent_citations"]


# --- without an NLI engine: the lexical check ----------------------------------------------------

def test_without_an_nli_engine_an_id_comes_back_only_when_the_answer_names_it(tcast, toml_config):
    assert turn_citations(tcast.alice, "It stands in Paris (ev-1).") == ["ev-1"]
    assert turn_citations(tcast.alice, "It stands in Paris.") == []
    # an id inside a longer one is not named
    assert turn_citations(tcast.alice, "See ev-10.", ids=["ev-1"]) == []
    # what the engine reported stays, as today
    assert turn_citations(tcast.alice, "It stands in Paris.", cite="ev-2,notes/x") == ["ev-2", "notes/x"]


# --- with the offline baseline (ugent-lexical-nli) ----------------------------------------------

def test_with_the_lexical_nli_baseline_the_answer_must_be_supported_by_the_evidence(tcast, toml_config):
    toml_config('[citations]\nnli_engine = "ugent-lexical-nli"\n')
    # used without being named: kept
    assert turn_citations(tcast.alice, "The Eiffel Tower stands in Paris.") == ["ev-1"]
    # named but not supported (the evidence says yellow): dropped, and so is the engine's claim of it
    assert turn_citations(tcast.alice, "Bananas are blue berries [ev-2].", cite="ev-2") == []
    # a number the evidence does not hold is no support
    assert turn_citations(tcast.alice, "The Eiffel Tower is 300 metres tall, see ev-1.") == []
    # both used, in the request's order; the engine's own id (not the request's) passes unchanged
    assert turn_citations(tcast.alice, "Bananas are a yellow tropical fruit. The Eiffel Tower stands in Paris.",
                          cite="notes/guide") == ["notes/guide", "ev-1", "ev-2"]


def test_the_stream_carries_only_the_verified_ids(tcast, toml_config):
    toml_config('[citations]\nnli_engine = "ugent-lexical-nli"\n')
    script = "script:answer=The Eiffel Tower stands in Paris, unlike ev-2.|evidence" + EVIDENCE
    resp = chat(tcast.alice, script, stream=True, ugent_citation_ids=["ev-1", "ev-2"])
    frames = parse_sse(body_bytes(resp))
    cites = [f["data"]["ugent_citations"] for f in frames if f["event"] == "ugent.citations"]
    assert cites == [["ev-1"]]


# --- a scripted engine: what it is asked, and what it decides -------------------------------------

def test_the_engine_is_asked_premise_evidence_hypothesis_sentence_and_decides(tcast, toml_config):
    toml_config('[citations]\nnli_engine = "scripted-nli"\n[citations.nli_config]\nwhen = "Bananas"\n')
    got = turn_citations(tcast.alice, "First claim here (ev-1). Second claim.", cite="ev-1")
    assert got == ["ev-2"]
    premises = {p for p, _ in ScriptedNLI.calls}
    assert premises == {"The Eiffel Tower is 330 metres tall and stands in Paris.",
                        "Bananas are a yellow fruit grown in the tropics."}
    hypotheses = {h for _, h in ScriptedNLI.calls}
    assert hypotheses == {"First claim here .", "Second claim."}


def test_an_id_whose_evidence_the_prompt_lacks_falls_back_to_the_lexical_check(tcast, toml_config):
    toml_config('[citations]\nnli_engine = "scripted-nli"\n[citations.nli_config]\nwhen = "nothing matches"\n')
    got = turn_citations(tcast.alice, "See ev-9 and ev-1.", ids=["ev-1", "ev-9"])
    assert got == ["ev-9"]  # ev-1's evidence was checked and refused; ev-9 has none in the prompt


@pytest.mark.parametrize("section", [
    '[citations]\nnli_engine = "scripted-nli"\n[citations.nli_config]\nwhen = "x"\nfail = true\n',
    '[citations]\nnli_engine = "no-such-nli-engine"\n',
])
def test_a_failing_or_missing_engine_leaves_the_lexical_check_deciding(tcast, toml_config, section):
    toml_config(section)
    assert turn_citations(tcast.alice, "The Eiffel Tower stands in Paris, see ev-2.") == ["ev-2"]
    assert Receipt.objects.filter(state="completed").count() == 1


# --- an NLI engine that never returns, and a hook's answer ----------------------------------------

def test_an_nli_engine_that_never_returns_leaves_the_lexical_check_deciding_in_time(tcast, toml_config, settings):
    # It was asked unbounded at the turn's end: one that never returned kept the turn from ending.
    settings.UGENT_CITATIONS_NLI_TIMEOUT = 0.5
    settings.UGENT_TURN_STUCK_MAX = 1
    with blocking.blocked_engine(blocking.BlockedNLI, "test-blocked-nli") as gate:
        toml_config('[citations]\nnli_engine = "test-blocked-nli"\n')
        answer = "The Eiffel Tower stands in Paris, see ev-2."
        assert blocking.within(lambda: turn_citations(tcast.alice, answer), gate) == ["ev-2"]
        assert gate.calls == 1
        # while that check runs past its limit, the engine is not asked again (UGENT_TURN_STUCK_MAX)
        assert blocking.within(lambda: turn_citations(tcast.alice, answer), gate) == ["ev-2"]
        assert gate.calls == 1


def test_a_hooks_answer_is_checked_lexically_the_nli_engine_never_asked_inside_the_messages_transaction(
        tcast, toml_config):
    # A hook's answer ends its turn inside message_submit's transaction (in embedded mode: the one SQLite
    # writer turn), and the NLI engine was asked there.
    toml_config('[citations]\nnli_engine = "scripted-nli"\n[citations.nli_config]\nwhen = "Eiffel"\n')
    hooks.register("test-answer", 1, lambda ctx: hooks.HookStop(
        answer="A hook answers: see ev-2.", state="completed", reason="test", decided_by="test"))
    try:
        resp = chat(tcast.alice, "anything" + EVIDENCE, ugent_citation_ids=["ev-1", "ev-2"])
    finally:
        hooks.unregister("test-answer")
    assert resp.status_code == 200, resp.content
    assert Receipt.objects.get(turn__turn_id=resp.json()["ugent_turn_id"]).citations == ["ev-2"]
    assert ScriptedNLI.calls == []


# --- the parts ------------------------------------------------------------------------------------

def test_evidence_passages_end_at_the_next_id_or_a_blank_line():
    prompt = "Sources:\n[a1] Alpha text here.\n[a2]: Beta text\nstill beta.\n\nAsk: a3 is not here"
    assert citations.evidence_passages(prompt, ["a1", "a2", "a9"]) == {
        "a1": "Alpha text here.", "a2": "Beta text\nstill beta."}
    assert citations.evidence_passages("ev-10 some long text", ["ev-1"]) == {}
    # the id named in an instruction first, its source later: the source is its evidence
    assert citations.evidence_passages("Use [s1] and [s2].\n\n[s1] One two three.\n[s2] Four five six.",
                                       ["s1", "s2"]) == {"s1": "One two three.", "s2": "Four five six."}


def test_the_baseline_checks_overlap_numbers_and_negation():
    nli = LexicalOverlapNLI()
    premise = "The Eiffel Tower is 330 metres tall and stands in Paris."
    assert nli.predict_entailment(premise, "The tower stands in Paris")
    assert not nli.predict_entailment(premise, "The tower is 300 metres tall")
    assert not nli.predict_entailment(premise, "The tower does not stand in Paris")
    assert not nli.predict_entailment("The tower is not in London.", "The tower is in London")
    assert not nli.predict_entailment(premise, "Bananas grow in the tropics")
    assert not nli.predict_entailment(premise, "Paris")  # fewer content words than min_words
    assert LexicalOverlapNLI({"threshold": 0.3}).predict_entailment(premise, "The tower is in Rome")


def test_the_baseline_is_registered_as_an_opm_nli_entry_point():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["opm.agents.nli"]["ugent-lexical-nli"]
    module, _, attr = target.partition(":")
    cls = getattr(import_module(module), attr)
    assert cls is LexicalOverlapNLI and issubclass(cls, NaturalLanguageInferenceEngine)
    assert isinstance(registry.nli_engine("ugent-lexical-nli"), LexicalOverlapNLI)
    with pytest.raises(LookupError):
        registry.nli_engine("no-such-nli-engine")


def test_the_status_says_which_check_runs_and_whether_its_engine_loads(tcast, toml_config):
    def section():
        return Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["citations"]
    assert section() == {"check": "lexical", "nli_engine": None}
    toml_config('[citations]\nnli_engine = "ugent-lexical-nli"\n')
    assert section() == {"check": "nli", "nli_engine": "ugent-lexical-nli", "installed": True,
                         "class": "plugins_app.agent.engines.nli.LexicalOverlapNLI"}
    toml_config('[citations]\nnli_engine = "no-such-nli-engine"\n')
    got = section()
    assert got["check"] == "lexical" and got["installed"] is False and "no-such-nli-engine" in got["error"]
