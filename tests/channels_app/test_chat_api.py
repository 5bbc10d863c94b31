"""POST /v1/chat/completions: the stream, the extensions, idempotency, ownership and model choice."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app.models import Conversation, Event, Receipt, Turn
from tests.support.http import answer_text, body_bytes, parse_sse
from tests.support.schema import validate

pytestmark = pytest.mark.django_db(transaction=True)


def chat(who: dict | str, text: str = "hello", *, stream=False, **extra):
    if isinstance(who, str):
        who = {"key": who}
    body = {"messages": [{"role": "user", "content": text}], "stream": stream}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(extra)
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])
    return resp


def frames_of(resp):
    return parse_sse(body_bytes(resp))


def test_non_stream_answer_matches_the_openai_schema(tcast):
    resp = chat(tcast.alice, "hi there", conversation_id="c1")
    assert resp.status_code == 200
    body = resp.json()
    validate(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["content"] == "echo: hi there (history=0)"
    assert resp["x-ugent-turn-id"] == body["ugent_turn_id"]
    receipt = Receipt.objects.get()
    assert receipt.state == "completed" and receipt.answer == "echo: hi there (history=0)"


def test_stream_sends_user_message_first_then_tagged_chunks_and_done(tcast):
    resp = chat(tcast.alice, "script:answer=one two three", stream=True, conversation_id="c1")
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/event-stream")
    turn_id = resp["x-ugent-turn-id"]
    frames = frames_of(resp)
    assert frames[0]["event"] == "ugent.user_message"
    assert frames[0]["data"]["ugent_user_message"]["content"] == "script:answer=one two three"
    assert frames[-1]["data"] == "[DONE]"
    assert [f["event"] for f in frames].count("ugent.user_message") == 1
    for f in frames[:-1]:
        validate(f["data"], "CreateChatCompletionStreamResponse")
        assert f["data"]["id"] == f"chatcmpl-{turn_id}"
    deltas = [f["data"]["choices"][0]["delta"] for f in frames if f["event"] is None and f["data"] != "[DONE]"]
    assert all(d.get("ugent_segment") == "answer" for d in deltas if d)
    assert answer_text(frames) == "one two three"
    assert frames[-2]["data"]["choices"][0]["finish_reason"] == "stop"


def test_thinking_is_streamed_only_when_asked(tcast):
    script = "script:thinking=let me see|answer=done"
    plain = frames_of(chat(tcast.alice, script, stream=True))
    assert not any(f["event"] is None and isinstance(f["data"], dict) and f["data"].get("choices")
                   and f["data"]["choices"][0]["delta"].get("ugent_segment") == "thinking" for f in plain)
    frames = frames_of(chat(tcast.bob, script, stream=True, include_thinking=True))
    thinking = "".join(f["data"]["choices"][0]["delta"]["reasoning_content"] for f in frames
                       if f["event"] is None and isinstance(f["data"], dict) and f["data"].get("choices")
                       and f["data"]["choices"][0]["delta"].get("ugent_segment") == "thinking")
    assert thinking == "let me see"
    assert answer_text(frames) == "done"


def test_answer_reset_withdraws_the_answer_so_far(tcast):
    frames = frames_of(chat(tcast.alice, "script:answer=draft text|reset|answer=final", stream=True))
    segs = [f["data"]["choices"][0]["delta"].get("ugent_segment") for f in frames
            if f["event"] is None and isinstance(f["data"], dict) and f["data"].get("choices")]
    assert "answer_reset" in segs
    assert answer_text(frames) == "final"
    assert Receipt.objects.get().answer == "final"


def test_tool_events_only_when_asked(tcast):
    frames = frames_of(chat(tcast.alice, "script:tool=lookup|answer=ok", stream=True,
                            ugent_include_tool_events=True))
    tools = [f["data"]["choices"][0]["delta"] for f in frames if f["event"] is None
             and isinstance(f["data"], dict) and f["data"].get("choices")
             and f["data"]["choices"][0]["delta"].get("ugent_segment") == "tool"]
    assert tools and tools[0]["ugent_tool"]["name"] == "lookup"
    frames = frames_of(chat(tcast.bob, "script:tool=lookup|answer=ok", stream=True))
    assert "ugent_tool" not in json.dumps([f["data"] for f in frames])


def test_a_failure_after_streaming_ends_with_an_error_chunk(tcast):
    frames = frames_of(chat(tcast.alice, "script:answer=partial words|fail=upstream went away", stream=True))
    assert answer_text(frames) == "partial words"
    err = frames[-2]["data"]
    validate({"error": {k: err["error"][k] for k in ("message", "type", "param", "code")}}, "ErrorResponse")
    assert err["error"]["message"] == "upstream went away" and err["ugent_segment"] == "error"
    assert frames[-1]["data"] == "[DONE]"
    r = Receipt.objects.get()
    assert r.state == "failed" and r.reason == "upstream went away"
    assert Event.objects.filter(type="turn.failed", audience=["web:alice"]).count() == 1


def test_a_plugin_crash_fails_the_turn_not_the_daemon(tcast):
    resp = chat(tcast.alice, "script:crash=boom")
    assert resp.status_code == 502
    assert "boom" in resp.json()["error"]["message"]
    assert chat(tcast.alice, "still alive").status_code == 200


def test_history_is_kept_server_side_and_only_the_last_user_entry_is_read(tcast):
    chat(tcast.alice, "first", conversation_id="c1")
    resp = chat(tcast.alice, "ignored", conversation_id="c1",
                messages=[{"role": "user", "content": "old text"}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": "second"}])
    assert resp.json()["choices"][0]["message"]["content"] == "echo: second (history=2)"


# --- idempotency ---------------------------------------------------------------------------

def test_a_repeated_client_message_id_runs_nothing(tcast):
    first = chat(tcast.alice, "once", conversation_id="c1", client_message_id="m1")
    again = chat(tcast.alice, "once", conversation_id="c1", client_message_id="m1")
    assert again.status_code == 409
    assert again["x-should-retry"] == "false"
    err = again.json()["error"]
    assert err["code"] == "DuplicateProcessed"
    assert err["turn_id"] == first["x-ugent-turn-id"] == again["x-ugent-turn-id"]
    assert again["x-ugent-conversation-id"] == "c1"
    assert Turn.objects.count() == 1 and Receipt.objects.count() == 1


def test_a_repeat_that_names_no_conversation_runs_nothing_either(tcast):
    # the client learns a new conversation's id from the answer: when that answer is lost, its resend names none
    key = "9f1c2e4a-7b3d-4e5f-8a6b-1c2d3e4f5a6b"  # a UUID: unique to its sender, not a counter
    first = chat(tcast.alice, "once", client_message_id=key)
    again = chat(tcast.alice, "once", client_message_id=key)
    assert first.status_code == 200 and again.status_code == 409, again.content
    assert again.json()["error"]["code"] == "DuplicateProcessed"
    assert again["x-ugent-conversation-id"] == first["x-ugent-conversation-id"]
    assert again["x-ugent-turn-id"] == first["x-ugent-turn-id"]
    assert Turn.objects.count() == 1 and Receipt.objects.count() == 1
    # another message of the same sender, or the same key from someone else, is a conversation of its own
    other = chat(tcast.alice, "twice", client_message_id="0e8d7c6b-5a49-4382-9170-6f5e4d3c2b1a")
    bobs = chat(tcast.bob, "once", client_message_id=key)
    assert other.status_code == 200 and bobs.status_code == 200, bobs.content
    ids = {first["x-ugent-conversation-id"], other["x-ugent-conversation-id"], bobs["x-ugent-conversation-id"]}
    assert len(ids) == 3 and Conversation.objects.count() == 3
    # and the conversation can be spoken into by the id the answer named
    follow = chat(tcast.alice, "next", conversation_id=first["x-ugent-conversation-id"], client_message_id="m2")
    assert follow.status_code == 200 and Turn.objects.count() == 4


def test_a_short_key_is_a_counter_so_each_new_conversation_may_use_it_again(tcast):
    # "1", "msg-1": numbered within a conversation; a client starting new ones counts from 1 again
    one = chat(tcast.alice, "first chat", client_message_id="msg-1")
    two = chat(tcast.alice, "second chat", client_message_id="msg-1")
    assert one.status_code == two.status_code == 200, two.content
    assert one["x-ugent-conversation-id"] != two["x-ugent-conversation-id"] and Turn.objects.count() == 2


def test_a_streamed_repeat_gets_the_receipt_then_the_refusal(tcast):
    first = chat(tcast.alice, "once", conversation_id="c1", client_message_id="m1")
    repeat = chat(tcast.alice, "once", stream=True, conversation_id="c1", client_message_id="m1")
    assert repeat["x-ugent-conversation-id"] == "c1" and repeat["x-ugent-turn-id"] == first["x-ugent-turn-id"]
    frames = frames_of(repeat)
    assert frames[0]["event"] == "ugent.receipt"
    assert frames[0]["data"]["ugent_receipt"]["turn_id"] == first["x-ugent-turn-id"]
    assert frames[0]["data"]["ugent_receipt"]["state"] == "completed"
    assert frames[1]["data"]["error"]["code"] == "DuplicateProcessed"
    assert frames[-1]["data"] == "[DONE]"
    assert Turn.objects.count() == 1


def test_same_id_with_different_content_is_a_409_with_the_reason(tcast):
    chat(tcast.alice, "once", conversation_id="c1", client_message_id="m1")
    resp = chat(tcast.alice, "something else", conversation_id="c1", client_message_id="m1")
    assert resp.status_code == 409
    assert "send it as a new message" in resp.json()["error"]["message"]
    assert Turn.objects.count() == 1


def test_a_repeat_of_a_turn_that_failed_after_it_started_is_refused(tcast):
    chat(tcast.alice, "script:fail=nope", conversation_id="c1", client_message_id="m1")
    resp = chat(tcast.alice, "script:fail=nope", conversation_id="c1", client_message_id="m1")
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "DuplicateAfterFailure"
    assert "may already have acted" in resp.json()["error"]["message"]


def test_an_in_flight_repeat_is_duplicate_in_flight(tcast):
    from ugent_site.celery import app
    from channels_app import services
    app.conf.task_always_eager = False
    from unittest import mock
    with mock.patch("channels_app.tasks.run_turn.delay") as delay:  # the worker has not picked it up yet
        actor = services.actor_resolve(caller=tcast.operator, user="alice")
        services.message_submit(inbound=services.Submission(
            actor=actor, caller=tcast.operator, text="once", conversation_id="c1", client_message_id="m1"))
    assert delay.call_count == 1
    resp = chat(tcast.alice, "once", conversation_id="c1", client_message_id="m1")
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "DuplicateInFlight"
    assert Turn.objects.get().state == "accepted"


# --- who may do what ----------------------------------------------------------------------

def test_a_turn_on_someone_elses_conversation_is_refused_and_runs_nothing(tcast):
    chat(tcast.alice, "mine", conversation_id="c1")
    resp = chat(tcast.bob, "let me in", conversation_id="c1")
    assert resp.status_code == 403
    assert Turn.objects.count() == 1 and Receipt.objects.count() == 1
    frames = frames_of(chat(tcast.bob, "let me in", conversation_id="c1", stream=True))
    assert frames[0]["data"]["error"]["code"] == "conversation_not_owned"
    assert Turn.objects.count() == 1


def test_a_turn_id_held_by_anyones_turn_is_one_answer_that_tells_nothing_of_that_turn(tcast):
    """Two application callers: B naming A's turn_id gets exactly what B gets for a turn_id of its own, which
    says nothing of the turn that holds it (not whose, which conversation or its header), and runs nothing."""
    from channels_app import services
    a, b = {"key": tcast.keys["app"]}, {"key": tcast.keys["outsider"]}
    held_by_a = chat(a, "a's words", conversation_id="conv-a", turn_id="turn-shared-1")
    assert held_by_a.status_code == 200 and held_by_a["x-ugent-turn-id"] == "turn-shared-1"
    assert chat(b, "b's words", conversation_id="conv-b", turn_id="turn-b-own").status_code == 200
    before = {m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Event)}
    answers = {}
    for name, turn_id in (("a's", "turn-shared-1"), ("b's own", "turn-b-own")):
        for conversation in ("conv-b", "conv-b-new"):
            resp = chat(b, "again", conversation_id=conversation, client_message_id=f"m-{name}", turn_id=turn_id)
            assert resp.status_code == 409 and resp["x-should-retry"] == "false", resp.content
            assert not resp.has_header("x-ugent-turn-id")
            answers[(name, conversation)] = resp.json()
            frames = frames_of(chat(b, "again", stream=True, conversation_id=conversation, turn_id=turn_id))
            assert len(frames) == 2 and frames[-1]["data"] == "[DONE]", frames  # no receipt, only the refusal
            assert frames[0]["data"]["error"] == resp.json()["error"]
            assert "conv-a" not in json.dumps(frames) and "a's words" not in json.dumps(frames)
    assert all(body == {"error": {"message": services.TURN_ID_UNAVAILABLE, "type": "conflict_error",
                                  "param": "turn_id", "code": "turn_id_in_use"}}
               for body in answers.values()), answers
    assert {m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Event)} == before
    assert not Conversation.objects.filter(external_id="conv-b-new").exists()


def test_an_application_may_name_only_its_federated_users(tcast):
    assert chat({"key": tcast.keys["app"], "user": "alice"}).status_code == 403
    assert chat({"key": tcast.keys["app"], "federation_issuer": "elsewhere",
                 "federation_subject": "x"}).status_code == 403
    assert chat(tcast.carol, "hi").status_code == 200
    anon = chat({"key": tcast.keys["app"]}, "hi", conversation_id="anon-1")
    assert anon.status_code == 200
    assert Conversation.objects.get(external_id="anon-1").owner.key == "web-user@crm"
    assert Turn.objects.count() == 2


def test_an_operator_naming_nobody_acts_as_the_operator(tcast):
    chat(tcast.keys["operator"], "hi", conversation_id="op-1")
    assert Conversation.objects.get(external_id="op-1").owner.key == "operator@workspace"


def test_client_id_namespaces_conversation_ids(tcast):
    chat(tcast.alice, "a", conversation_id="same", client_id="phone")
    resp = chat(tcast.bob, "b", conversation_id="same", client_id="laptop")
    assert resp.status_code == 200
    assert Conversation.objects.filter(external_id="same").count() == 2


@pytest.mark.parametrize("headers,status", [({}, 401), ({"HTTP_X_API_KEY": "nope"}, 401),
                                            ({"HTTP_AUTHORIZATION": "Bearer nope"}, 401)])
def test_a_request_without_a_valid_key_is_401(tcast, headers, status):
    resp = Client().post("/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                         content_type="application/json", **headers)
    assert resp.status_code == status
    validate(resp.json(), "ErrorResponse")
    assert Turn.objects.count() == 0


def test_bearer_authorization_works_like_x_api_key(tcast):
    resp = Client().post("/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                         content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {tcast.keys['operator']}")
    assert resp.status_code == 200


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"ugent_allowed_tools": []}, "ugent_allowed_tools"),
    ({"ugent_input_mode": "telepathy"}, "ugent_input_mode"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"turn_id": "has spaces"}, "turn_id"),
    ({"conversation_id": "a\nb"}, "conversation_id"),  # (the answer's x-ugent-conversation-id cannot carry it)
    ({"conversation_id": "a\tb", "stream": True}, "conversation_id"),
])
def test_bad_input_is_a_400_and_changes_nothing(tcast, extra, param):
    resp = chat(tcast.alice, "x", **extra)
    assert resp.status_code == 400
    err = resp.json()["error"]
    validate(resp.json(), "ErrorResponse")
    assert err["param"] == param
    assert Turn.objects.count() == 0 and Receipt.objects.count() == 0 and Conversation.objects.count() == 0


def test_a_conversation_id_with_a_control_character_says_why(tcast):
    err = chat(tcast.alice, "x", conversation_id="a\rb").json()["error"]
    assert err["message"] == "conversation_id: must not contain control characters (a newline, a tab, ...)"


def test_allowed_tools_empty_says_why(tcast):
    err = chat(tcast.alice, "x", ugent_allowed_tools=[]).json()["error"]
    assert err["message"] == ('ugent_allowed_tools: [] is refused: leave the field out for no restriction, '
                              'or send ugent_denied_tools: ["*"] to run the turn with no tools.')


def test_messages_without_a_user_entry_names_the_field_once(tcast):
    err = chat(tcast.alice, "x", messages=[{"role": "assistant", "content": "x"}]).json()["error"]
    assert err["message"] == "messages: it holds no user entry."


def test_invalid_json_is_a_400(tcast):
    resp = Client().post("/v1/chat/completions", data="{nope", content_type="application/json",
                         HTTP_X_API_KEY=tcast.keys["operator"])
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_opt_outs_and_tool_narrowing_are_stored_on_the_turn(tcast):
    chat(tcast.alice, "x", ugent_allowed_tools=["search"], ugent_denied_tools=["*"],
         ugent_disable_memory_recall=True, ugent_disable_code_context=True, ugent_disable_memory_write=True,
         ugent_input_mode="voice")
    t = Turn.objects.get()
    assert t.allowed_tools == ["search"] and t.denied_tools == ["*"]
    assert t.disable_memory_recall and t.disable_code_context and t.disable_memory_write
    assert t.input_mode == "voice"


# --- model choice -------------------------------------------------------------------------

def test_model_runs_one_turn_and_stores_nothing(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="other", provider="scripted", config={"prefix": "other"})
    resp = chat(tcast.alice, "x", conversation_id="c1", model="other")
    assert resp.json()["choices"][0]["message"]["content"].startswith("other:")
    assert resp.json()["model"] == "other"
    resp = chat(tcast.alice, "y", conversation_id="c1")
    assert resp.json()["choices"][0]["message"]["content"].startswith("echo:")
    assert Conversation.objects.get(external_id="c1").model_choice == ""


def test_default_model_chain_stored_choice_then_caller_then_global(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="stored", provider="scripted", config={"prefix": "stored"})
    AgentProfile.objects.create(name="callers", provider="scripted", config={"prefix": "callers"})
    tcast.operator.default_model = "callers"
    tcast.operator.save()
    assert chat(tcast.alice, "x", conversation_id="c1", model="ugent-default").json()["model"] == "callers"
    Conversation.objects.filter(external_id="c1").update(model_choice="stored")
    assert chat(tcast.alice, "y", conversation_id="c1").json()["model"] == "stored"
    assert chat(tcast.carol, "z").json()["model"] == "scripted"


def test_a_model_the_operator_does_not_allow_is_a_400_and_changes_nothing(tcast):
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="forbidden", provider="scripted", allowed=False)
    for model in ("forbidden", "no-such-model"):
        resp = chat(tcast.alice, "x", model=model)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert Turn.objects.count() == 0 and Receipt.objects.count() == 0 and Conversation.objects.count() == 0


# --- how a streaming request is refused (docs/identity.md, Refusals) -------------------------------

@pytest.mark.parametrize("who,extra,headers,status,code", [
    ({"key": None}, {}, {}, 401, "missing_api_key"),
    ({"key": "ugk_not_a_key"}, {}, {}, 401, "invalid_api_key"),
    ({"key": "app"}, {}, {"HTTP_X_UGENT_IDENTITY": "notajwt"}, 403, "identity_token_invalid"),
    ({"key": "app"}, {"federation_issuer": "example-crm"}, {}, 400, "invalid_request"),
    ({"key": "app"}, {"ugent_allowed_tools": []}, {}, 400, "invalid_request"),
    ({"key": "app"}, {"model": "no-such-model"}, {}, 400, "model_not_found"),
])
def test_a_streaming_request_refused_before_the_stream_starts_is_an_http_error(tcast, who, extra, headers,
                                                                               status, code):
    key = tcast.keys.get(who["key"], who["key"])
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    resp = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         **({"HTTP_X_API_KEY": key} if key else {}), **headers)
    assert resp.status_code == status and resp["Content-Type"] == "application/json"
    assert resp.json()["error"]["code"] == code


@pytest.mark.parametrize("extra,code", [
    ({"user": "someone"}, "actor_not_allowed"),
    ({"federation_issuer": "elsewhere", "federation_subject": "s"}, "actor_not_allowed"),
    ({"conversation_id": "c-carol"}, "conversation_not_owned"),
])
def test_a_streaming_request_refused_as_a_message_is_an_error_chunk(tcast, extra, code):
    assert chat(tcast.carol, "mine", conversation_id="c-carol").status_code == 200
    resp = chat({"key": tcast.keys["app"]}, "hi", stream=True, **extra)
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/event-stream")
    frames = frames_of(resp)
    assert frames[-1]["data"] == "[DONE]"
    assert frames[-2]["data"]["error"]["code"] == code


def test_a_conversation_id_outside_latin1_is_named_in_the_header_as_rfc2047_has_it(tcast):
    import email.header
    resp = chat(tcast.alice, "hi", conversation_id="会話-1")
    assert resp.status_code == 200 and resp.json()["ugent_conversation_id"] == "会話-1"
    (raw, charset), = email.header.decode_header(resp["x-ugent-conversation-id"])
    assert raw.decode(charset) == "会話-1"
