"""Code context through the one message path: the engine is shown the working directory's most relevant
chunks with their path:lines before the model call, within the budget; off by default, off for a turn
that asks (ugent_disable_code_context) or whose caller's defaults do; nothing behind a symlink out."""
from __future__ import annotations

import json
import os

import pytest
from django.test import Client

from channels_app.models import CallerDefaults, Conversation
from plugins_app.agent.code_context import CODE_CONTEXT_HEADER
from plugins_app.agent.engines.base import count_tokens
from tests.conftest import APP_KEY, OPERATOR_KEY
from tests.support.code import code_blocks, code_ws  # noqa: F401
from tests.support.scripted import CALLS

pytestmark = pytest.mark.django_db(transaction=True)
CAROL = {"federation_issuer": "example-crm", "federation_subject": "carol"}
ASK = "How does the PaymentGateway charge an amount?"


def chat(text, key=OPERATOR_KEY, **extra):
    body = {"messages": [{"role": "user", "content": text}], **({"user": "alice"} if key == OPERATOR_KEY else {}),
            **extra}
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)
    assert resp.status_code == 200, resp.content
    return resp.json()["choices"][0]["message"]["content"]


def seen():
    """The code-context blocks of the engine's last call."""
    return code_blocks(CALLS[-1:])[0]


def test_the_engine_sees_the_relevant_snippet_with_its_path_before_the_message(code_ws, tcast):
    chat(ASK, conversation_id="c1")
    [block] = seen()
    assert block.startswith(CODE_CONTEXT_HEADER + "\n--- pkg/billing.py:9-13\nclass PaymentGateway:")
    assert "def charge(self, amount):" in block
    assert "sendEmail" not in block  # only what the message calls up
    messages = CALLS[-1]["messages"]
    assert messages[-1] == ("user", ASK) and messages[-2] == ("system", block)


def test_code_context_is_off_unless_ugent_toml_turns_it_on(code_ws, tcast):
    code_ws.config("")
    chat(ASK, conversation_id="c2")
    assert seen() == []
    code_ws.config("enabled = false")
    chat(ASK, conversation_id="c2")
    assert seen() == []


def test_a_request_with_ugent_disable_code_context_fetches_none(code_ws, tcast):
    chat(ASK, conversation_id="c3", ugent_disable_code_context=True)
    assert seen() == []
    chat(ASK, conversation_id="c3")
    assert len(seen()) == 1


def test_the_callers_default_turns_it_off_for_every_turn_of_its_issuer(code_ws, tcast):
    chat(ASK, key=APP_KEY, conversation_id="c4", **CAROL)
    assert len(seen()) == 1
    CallerDefaults.objects.create(issuer="example-crm", disable_code_context=True)
    chat(ASK, key=APP_KEY, conversation_id="c4", ugent_disable_code_context=False, **CAROL)
    assert seen() == []


def test_a_symlink_out_of_the_workspace_is_never_read(code_ws, tcast):
    chat("what does zebra_secret_token return?", conversation_id="c5")
    assert not any("zebra" in block or "vault.py" in block or "linked/" in block for block in seen())
    assert not any("secret outside" in c for call in CALLS for _, c in call["messages"])


def test_only_the_conversations_working_directory_is_searched(code_ws, tcast):
    from channels_app.sandbox import conversation_directory_set
    chat("hello", conversation_id="c6")
    conversation_directory_set(conversation=Conversation.objects.get(external_id="c6"), directory="web")
    chat(ASK + " Or sendEmail to a recipient?", conversation_id="c6")
    [block] = seen()
    assert "--- mailer.js:1-3" in block and "PaymentGateway" not in block
    # a working directory that became a link out of the workspace is not followed
    os.rename(code_ws.ws / "web", code_ws.ws / "web-old")
    os.symlink(code_ws.outside, code_ws.ws / "web")
    chat("what does zebra_secret_token return?", conversation_id="c6")
    assert seen() == []


def test_the_block_keeps_to_the_snippet_count_and_the_token_budget(code_ws, tcast):
    for n in range(12):
        (code_ws.ws / "pkg" / f"gateway_{n}.py").write_text(
            f"def payment_gateway_charge_{n}(amount):\n" + "".join(f"    step_{i} = amount + {i}\n" for i in range(30))
            + "    return amount\n")
    code_ws.config("enabled = true\nmax_snippets = 3\nrescan_interval_secs = 0.0")
    chat(ASK, conversation_id="c7")
    [block] = seen()
    assert block.count("\n--- ") == 3
    code_ws.config("enabled = true\nmax_injected_tokens_est = 120\nrescan_interval_secs = 0.0")
    chat(ASK, conversation_id="c7")
    [block] = seen()
    assert count_tokens(block) <= 120 and block.count("\n--- ") >= 1
    code_ws.config("enabled = true\nmax_injected_tokens_est = 10\nrescan_interval_secs = 0.0")
    chat(ASK, conversation_id="c7")
    assert seen() == []  # not even the header fits with a snippet


def test_an_unusable_table_is_logged_naming_the_key_and_code_context_stays_off(code_ws, tcast, caplog):
    code_ws.config("enabled = true\nmax_snipets = 3")
    chat(ASK, conversation_id="c8")
    assert seen() == []
    assert any("code_context" in r.getMessage() and "max_snipets" in r.getMessage() for r in caplog.records)


def test_every_engine_call_of_a_tool_loop_is_shown_the_block_fetched_once(code_ws, tcast):
    import tests.support.toolboxes  # noqa: F401 - registers the "testing" toolbox
    code_ws.config("enabled = true\nrescan_interval_secs = 0.0", more='[tools]\nenabled = ["testing"]\n')
    CALLS.clear()
    chat("script:call=noop{}|answer=the PaymentGateway charges", conversation_id="c9")
    blocks = code_blocks(CALLS)
    assert len(CALLS) == 2 and blocks[0] == blocks[1] and len(blocks[0]) == 1
    assert "--- pkg/billing.py:9-13" in blocks[0][0]
    second = CALLS[1]["messages"]
    assert [r for r, _ in second[-4:]] == ["system", "user", "assistant", "tool"]


def test_warming_at_start_indexes_the_workspace_so_the_first_turn_finds_it_built(code_ws, tcast):
    from plugins_app.agent.code_context import code_context_conf, code_context_warm, folder_engine
    code_ws.config("")
    assert code_context_warm() == 0  # off: nothing indexed
    code_ws.config("enabled = true")
    assert code_context_warm() > 0
    engine = folder_engine(code_ws.ws.resolve(), code_context_conf())
    assert engine.builds == 1
    chat(ASK, conversation_id="c10")
    assert engine.builds == 1 and len(seen()) == 1  # the turn used the index warming built


def test_with_embeddings_on_the_engine_sees_a_chunk_the_message_shares_no_word_with(code_ws, tcast):
    """`embeddings = true`: the chunks' e5 vectors (made in the background; warming waits here) find what
    BM25 cannot; with them off the same message gets no code context."""
    from plugins_app.agent.code_context import code_context_conf, code_context_warm, folder_engine, vector_cache_path
    code_ws.settings.VAR_DIR = code_ws.ws.parent / "var"
    (code_ws.ws / "pkg" / "weather.py").write_text(
        'def forecast_rain(region):\n    """Predict precipitation for a region from the radar feed."""\n'
        '    return radar.read(region).precipitation()\n')
    ask = "Will it be wet tomorrow in the north?"
    chat(ask, conversation_id="c11")
    assert seen() == []  # BM25 alone: no word in common
    code_ws.config("enabled = true\nrescan_interval_secs = 0.0\nembeddings = true\n")
    assert code_context_warm() > 0
    assert folder_engine(code_ws.ws.resolve(), code_context_conf()).wait_embedded(120)
    chat(ask, conversation_id="c11")
    [block] = seen()
    assert block.startswith(CODE_CONTEXT_HEADER + "\n--- pkg/weather.py:1-3\ndef forecast_rain(region):")
    assert "PaymentGateway" not in block and "sendEmail" not in block
    assert vector_cache_path(code_ws.ws.resolve()).is_file()  # kept for the next start, under the var dir
    assert str(vector_cache_path(code_ws.ws.resolve())).startswith(str(code_ws.ws.parent / "var" / "code-embeddings"))


def test_an_embeddings_value_that_is_no_boolean_is_logged_and_code_context_stays_off(code_ws, tcast, caplog):
    code_ws.config('enabled = true\nembeddings = "yes"\n')
    with caplog.at_level("ERROR", logger="ugent.code_context"):
        chat(ASK, conversation_id="c12")
    assert seen() == []
    assert "ugent.toml: code_context.embeddings" in caplog.text and "code context is off" in caplog.text
