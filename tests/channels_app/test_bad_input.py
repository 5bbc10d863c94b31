"""Bad input never 500s: it gets a 400 (or the refusal it earns) and writes no row, in both run modes."""
from __future__ import annotations

import json

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from channels_app import services
from channels_app.errors import ApplicationError
from channels_app.models import Actor, Conversation, Event, Message, Receipt, Steering, Turn
from tests.conftest import APP_KEY, OPERATOR_KEY
from tests.support.http import body_bytes

pytestmark = pytest.mark.django_db(transaction=True)

DEEP = "[" * 5000 + "]" * 5000


def counts() -> dict:
    # the operator key's own actor (operator@<caller>, one per operator caller) is kept on its first request
    return {"Actor": Actor.objects.exclude(key__startswith="operator@").count(),
            **{m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Message, Event, Steering)}}


def post_raw(path: str, body, key: str = OPERATOR_KEY):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return Client().post(path, data=data, content_type="application/json", HTTP_X_API_KEY=key)


def chat_body(content, **extra) -> dict:
    return {"user": "alice", "conversation_id": "c1", "messages": [{"role": "user", "content": content}], **extra}


def refused(resp, status=400) -> dict:
    assert resp.status_code == status, resp.content
    return resp.json()["error"]


# --- the cases the issue names ----------------------------------------------

@pytest.mark.parametrize("content", ["\ud800", "before \udfff after", [{"type": "text", "text": "a\ud800"}]])
def test_a_lone_surrogate_in_the_content_is_a_400_and_writes_nothing(tcast, content):
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body(content)))
    assert err["param"] == "messages" and "lone surrogate" in err["message"]
    assert counts() == before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/ugent/stop", "/v1/ugent/steering"])
@pytest.mark.parametrize("body", [DEEP, '{"conversation_id": ' + DEEP + "}",
                                  '{"messages": [{"role": "user", "content": ' + DEEP + "}]}"])
def test_json_nested_five_thousand_levels_is_a_400(tcast, path, body):
    before = counts()
    err = refused(post_raw(path, body))
    assert err["code"] == "json_too_deep" and err["message"] == "The request body is nested too deeply."
    assert counts() == before


def test_a_nul_in_the_content_is_refused_alike_in_both_modes(tcast):
    # PostgreSQL text cannot hold U+0000, so SQLite refuses it too: one behaviour in both run modes
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body("a\x00b")))
    assert "NUL character (U+0000)" in err["message"]
    refused(post_raw("/v1/chat/completions", chat_body([{"type": "text", "text": "\x00"}])))
    refused(post_raw("/v1/ugent/steering", {"conversation_id": "c1", "message": "a\x00b"}))
    assert counts() == before


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
    [{"type": "text", "text": "look"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
    [{"type": "text"}], [{"type": "text", "text": 5}], ["plain string part"], [1, 2], [],
])
def test_content_parts_that_are_not_text_objects_are_a_400_not_an_empty_turn(tcast, content):
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body(content)))
    assert err["param"] == "messages"
    assert counts() == before


@pytest.mark.parametrize("content", [None, 5, {"type": "text", "text": "x"}, True])
def test_content_that_is_neither_text_nor_parts_is_a_400(tcast, content):
    err = refused(post_raw("/v1/chat/completions", chat_body(content)))
    assert err["message"] == "messages: the last user entry's content must be a string or a list of text parts."


def test_text_parts_are_still_joined_into_the_turns_text(tcast):
    resp = post_raw("/v1/chat/completions", chat_body([{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]))
    assert resp.status_code == 200
    assert Message.objects.get(role="user").content == "one two"


@pytest.mark.parametrize("extra,param,message", [
    ({"stream": "yes"}, "stream", "stream: must be true or false"),
    ({"stream": 1}, "stream", "stream: must be true or false"),
    ({"echo_user_message": "true"}, "echo_user_message", "echo_user_message: must be true or false"),
    ({"model": 5}, "model", "model: must be a string"),
    ({"conversation_id": 42}, "conversation_id", "conversation_id: must be a string"),
    ({"client_message_id": ["m1"]}, "client_message_id", "client_message_id: must be a string"),
    ({"user": True}, "user", "user: must be a string"),
    ({"ugent_allowed_tools": ["shell", 1]}, "ugent_allowed_tools.1", "ugent_allowed_tools.1: must be a string"),
])
def test_a_json_value_of_the_wrong_type_is_a_400_not_coerced(tcast, extra, param, message):
    # DRF's fields read "yes" and 1 as true and 5 as "5": in a JSON body that answers a request nobody sent
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body("hello", **extra)))
    assert (err["param"], err["message"]) == (param, message)
    assert counts() == before


def test_json_types_are_held_on_the_other_json_bodies_and_query_strings_are_read_as_text(tcast):
    err = refused(post_raw("/v1/ugent/steering", {"conversation_id": 7, "message": "x"}))
    assert err["message"] == "conversation_id: must be a string"
    err = refused(post_raw("/v1/ugent/commands", {"command": "/models", "user": 5}))
    assert err["message"] == "user: must be a string"
    err = refused(post_raw("/v1/ugent/speech", {"conversation_id": "c1", "turn_id": "t", "segment": "0"}))
    assert err["message"] == "segment: must be an integer"
    # a query string is text: its values are not JSON's types (receipt lookup's 404 is its own answer)
    resp = Client().get("/v1/ugent/receipt", {"conversation_id": "1", "client_message_id": "2"},
                        HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 404, resp.content


@pytest.mark.parametrize("n", [2, 0, -1])
def test_n_other_than_one_is_a_400_as_a_turn_gives_one_answer(tcast, n):
    # a client asking for n choices reads choices[1]: one answer would break it where a 400 says why
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body("hello", n=n)))
    assert (err["param"], err["message"]) == ("n", "n: only 1 is supported: a turn gives one answer.")
    assert counts() == before


def test_json_booleans_and_strings_still_pass(tcast):
    resp = post_raw("/v1/chat/completions", chat_body("hello", stream=False, model=None, echo_user_message=True,
                                                       ugent_allowed_tools=["shell"], n=1.0))
    assert resp.status_code == 200, resp.content


@pytest.mark.parametrize("body", [b"not json", b"\xff\xfe", b"[1, 2]", b'"a string"', b"", b"{"])
def test_a_body_that_is_no_json_object_is_a_400(tcast, body):
    for path in ("/v1/chat/completions", "/v1/ugent/stop", "/v1/ugent/steering"):
        resp = post_raw(path, body)
        if path != "/v1/chat/completions" and body == b"":
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "conversation_id"
            continue
        assert resp.status_code == 400, (path, body, resp.content)


def test_a_federated_subject_too_long_for_the_actor_column_still_gets_one_actor(tcast):
    # percent-encoded, 255 non-ASCII characters would overflow the 300-character key (a 500 on PostgreSQL)
    subject = "\U0001F600" * 255
    body = chat_body("hi", conversation_id="long", federation_issuer="example-crm", federation_subject=subject)
    del body["user"]
    for _ in range(2):
        body["client_message_id"] = f"m{_}"
        assert post_raw("/v1/chat/completions", body, key=APP_KEY).status_code == 200
    turns = Turn.objects.select_related("actor")
    assert len({t.actor.key for t in turns}) == 1 and turns[0].actor.federation_subject == subject


def test_a_channel_workers_text_is_checked_on_the_one_path_too(tcast):
    actor = services.channel_actor_resolve(channel="echo", user_id="u1")
    before = counts()
    for text in ("\ud800", "a\x00"):
        with pytest.raises(ApplicationError) as exc:
            services.message_submit(inbound=services.Submission(actor=actor, text=text, channel="echo",
                                                                    conversation_id="chat-1"))
        assert exc.value.status == 400 and exc.value.code == "invalid_content"
    assert counts() == before


# --- property: no body of any shape gets a 5xx, and a 4xx writes nothing ---------

odd_char = st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00", "\u2028", '"', "\\", "\U0001F600"]))
odd_text = st.text(odd_char, max_size=12)
some_text = st.text(odd_char, min_size=1, max_size=12)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), odd_text)
json_value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
                          max_leaves=8)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": odd_text})
text_content = st.one_of(odd_text, st.lists(text_part, min_size=1, max_size=3))
odd_content = st.one_of(st.lists(st.one_of(text_part, json_value), max_size=3), json_value)
earlier = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["assistant", "system", "user"]),
                                                    "content": st.one_of(text_content, odd_content)}), json_value),
                   max_size=2)
# mostly a last user entry of text (odd characters and all), sometimes of any shape, sometimes none
messages = st.one_of(
    st.tuples(earlier, st.fixed_dictionaries({"role": st.just("user"), "content": text_content})).map(lambda t: t[0] + [t[1]]),
    st.tuples(earlier, st.fixed_dictionaries({"role": st.just("user"), "content": text_content})).map(lambda t: t[0] + [t[1]]),
    st.tuples(earlier, st.fixed_dictionaries({"role": st.just("user"), "content": odd_content})).map(lambda t: t[0] + [t[1]]),
    earlier)
identity = {"user": st.one_of(st.sampled_from(["alice", "bob"]), some_text),
            "federation_issuer": st.just("example-crm"), "federation_subject": some_text}
conversation = st.one_of(st.sampled_from(["ca", "fresh"]), some_text)


def _bodies(required: dict, optional: dict):
    """Bodies that are well formed but for their odd text, and the same with one field made anything."""
    valid = st.fixed_dictionaries(required, optional=optional)
    names = sorted({*required, *optional})
    broken = st.tuples(valid, st.sampled_from(names), json_value).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, broken)


chat_bodies = _bodies(
    {"messages": messages},
    {"conversation_id": conversation, "client_message_id": some_text, "client_id": odd_text,
     "turn_id": some_text, "model": st.sampled_from(["scripted", "ugent-default", "no-such-model"]),
     "stream": st.booleans(), "include_thinking": st.booleans(), "echo_user_message": st.booleans(),
     "ugent_allowed_tools": st.lists(odd_text, max_size=2), "ugent_denied_tools": st.lists(odd_text, max_size=2),
     "ugent_citation_ids": st.lists(odd_text, max_size=2),
     "ugent_input_mode": st.sampled_from(["voice", "live", "typed"]), **identity})
turn_bodies = _bodies(
    {"conversation_id": conversation},
    {"turn_id": st.one_of(st.just("{turn_id}"), some_text), "client_id": odd_text,
     "channel": st.sampled_from(["web", "echo"]), "message": odd_text, **identity})
keys = st.sampled_from([OPERATOR_KEY, APP_KEY])
PROPERTY = hsettings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _alices_turn() -> str:
    resp = post_raw("/v1/chat/completions", chat_body("hello", conversation_id="ca"))
    assert resp.status_code == 200
    return resp["x-ugent-turn-id"]


def _check(path: str, body, key: str) -> None:
    before = counts()
    resp = post_raw(path, body, key=key)
    body_bytes(resp)  # a stream is read to its end, so its turn is done before the counts are taken
    assert resp.status_code < 500, (path, body, resp.status_code, resp.content[:300])
    if 400 <= resp.status_code < 500:
        assert counts() == before, (path, body, resp.status_code, resp.content[:300])


def test_no_chat_body_gets_a_5xx_and_a_refused_one_writes_nothing(tcast):
    _alices_turn()

    @PROPERTY
    @given(body=chat_bodies, key=keys)
    def check(body, key):
        _check("/v1/chat/completions", body, key)
    check()


@pytest.mark.parametrize("path", ["/v1/ugent/stop", "/v1/ugent/steering"])
def test_no_stop_or_steering_body_gets_a_5xx_and_a_refused_one_writes_nothing(tcast, path):
    turn_id = _alices_turn()

    @PROPERTY
    @given(body=turn_bodies, key=keys)
    def check(body, key):
        if body.get("turn_id") == "{turn_id}":
            body["turn_id"] = turn_id
        _check(path, body, key)
    check()


def test_no_raw_body_gets_a_5xx_and_a_refused_one_writes_nothing(tcast):
    @PROPERTY
    @given(raw=st.one_of(st.binary(max_size=40),
                         st.text(odd_char, max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))))
    def check(raw):
        for path in ("/v1/chat/completions", "/v1/ugent/stop", "/v1/ugent/steering"):
            _check(path, raw, OPERATOR_KEY)
    check()


# --- whom a request speaks for: one set of fields, held to their columns and to one line -------------------

def get_raw(path: str, params: dict, key: str = OPERATOR_KEY):
    return Client().get(path, params, HTTP_X_API_KEY=key)


def upload(fields: dict, key: str = OPERATOR_KEY):
    from django.core.files.uploadedfile import SimpleUploadedFile
    return Client().post("/v1/files", data={"file": SimpleUploadedFile("a.txt", b"hello"), **fields},
                         HTTP_X_API_KEY=key)


def without_user(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "user"}


RECEIPT = {"conversation_id": "c1", "client_message_id": "m1"}
SPEECH = {"conversation_id": "c1", "turn_id": "t1"}


@pytest.mark.parametrize("field, value", [("user", "u" * 400), ("federation_issuer", "i" * 300),
                                          ("federation_subject", "s" * 300)])
def test_identity_fields_longer_than_their_columns_are_a_400_on_every_endpoint(tcast, field, value):
    # the receipt and read-aloud had no limit: PostgreSQL's "value too long" came back as a 500
    from channels_app.models import Actor
    ident = {field: value}
    if field.startswith("federation"):
        ident = {"federation_issuer": "example-crm", "federation_subject": "zoe", **ident}
    before = counts(), Actor.objects.count()
    for resp in (get_raw("/v1/ugent/receipt", {**RECEIPT, **ident}),
                 post_raw("/v1/ugent/speech", {**SPEECH, **ident}),
                 post_raw("/v1/chat/completions", {**without_user(chat_body("hi")), **ident}),
                 get_raw("/v1/ugent/history", {"conversation_id": "c1", **ident})):
        err = refused(resp)
        assert err["param"] == field and "no more than" in err["message"], err
    assert (counts(), Actor.objects.count()) == before


@pytest.mark.parametrize("field", ["user", "federation_issuer", "federation_subject", "client_id"])
def test_a_control_character_in_whom_a_request_speaks_for_is_a_400_on_every_endpoint(tcast, field):
    # a newline in the user forged a second line of the request log (actor=web:eve\n… INFO ugent.requests …)
    from channels_app.models import Actor
    value = "eve\n2026-12-07 08:00:00,000 INFO ugent.requests request (status=200, actor=web:admin)"
    ident = {field: value}
    if field.startswith("federation"):
        ident = {"federation_issuer": "example-crm", "federation_subject": "zoe", **ident}
    before = counts(), Actor.objects.count()
    speech = [] if field == "client_id" else [post_raw("/v1/ugent/speech", {**SPEECH, "user": "alice", **ident})]
    for resp in (post_raw("/v1/chat/completions", {**chat_body("hi"), **ident}),
                 get_raw("/v1/ugent/receipt", {**RECEIPT, "user": "alice", **ident}),
                 *speech,
                 post_raw("/v1/ugent/commands", {"command": "/models", "user": "alice", **ident}),
                 post_raw("/v1/ugent/steering", {"conversation_id": "c1", "message": "go", "user": "alice", **ident}),
                 get_raw("/v1/ugent/conversation/snapshot", {"conversation_id": "c1", "user": "alice", **ident}),
                 get_raw("/v1/ugent/events", {"user": "alice", **ident}),
                 upload({"conversation_id": "c1", "user": "alice", **ident})):
        err = refused(resp)
        assert err["param"] == field and err["message"] == (
            f"{field}: must not contain control characters (a newline, a tab, ...)"), err
    assert (counts(), Actor.objects.count()) == before


def test_an_upload_into_a_conversation_id_no_chat_could_name_is_a_400(tcast):
    # "x\ny" was created by the upload, yet every chat naming it is refused: a conversation nobody can use
    from channels_app.models import File
    err = refused(upload({"conversation_id": "x\ny", "user": "alice"}))
    assert err["param"] == "conversation_id"
    assert not Conversation.objects.exists() and not File.objects.exists()


# --- a body over the limit ------------------------------------------------------------------------------

def test_a_chat_body_over_the_default_limit_is_a_413_error_object(tcast):
    # Django answered RequestDataTooBig with its HTML 400 page, not an error object
    before = counts()
    err = refused(post_raw("/v1/chat/completions", chat_body("x" * 3_000_000)), status=413)
    assert err["code"] == "request_too_large" and err["message"] == (
        "The request body is larger than this daemon takes: at most 2621440 bytes (UGENT_MAX_REQUEST_BYTES). "
        "Send a file with POST /v1/files and name it by its id.")
    assert counts() == before


def test_every_body_over_the_limit_is_a_413_error_object_and_writes_nothing(tcast, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2000
    big = "x" * 3000
    before = counts()
    for resp in (post_raw("/v1/chat/completions", chat_body(big)),
                 post_raw("/v1/ugent/steering", {"user": "alice", "conversation_id": "c1", "message": big}),
                 post_raw("/v1/ugent/commands", {"user": "alice", "command": "/btw " + big}),
                 upload({"conversation_id": "c1", "user": "alice", "purpose": big})):
        assert resp["Content-Type"] == "application/json", resp.content[:200]
        err = refused(resp, status=413)
        assert err["code"] == "request_too_large" and "at most 2000 bytes" in err["message"]
    assert counts() == before


# --- a read or a refusal writes no actor ---------------------------------------------------------

@pytest.mark.parametrize("path,params", [
    ("/v1/ugent/receipt", {"conversation_id": "c1", "client_message_id": "m1"}),
    ("/v1/ugent/conversation/snapshot", {"conversation_id": "c1"}),
    ("/v1/ugent/history", {"conversation_id": "c1"}),
    ("/v1/ugent/snapshot", {"conversation_id": "c1"}),
    ("/v1/files/file-abc", {}),
])
def test_a_read_by_someone_never_seen_writes_no_actor(tcast, path, params):
    # any key could otherwise add rows without end just by reading under new user names
    chat_ok = post_raw("/v1/chat/completions", chat_body("hello", client_message_id="m1"))  # alice's c1
    assert chat_ok.status_code == 200, chat_ok.content
    before = counts()
    for user in ("nobody", "ghost"):
        resp = Client().get(path, {**params, "user": user}, HTTP_X_API_KEY=OPERATOR_KEY)
        assert resp.status_code == 404, (path, resp.status_code, resp.content)
    assert counts() == before


def test_a_refused_chat_writes_no_actor_and_an_accepted_one_does(tcast):
    before = counts()
    refused(post_raw("/v1/chat/completions", chat_body("hello", user="zed", model="no-such-model")))
    assert counts() == before
    assert post_raw("/v1/chat/completions", chat_body("hello", user="zed", conversation_id="cz")).status_code == 200
    assert Actor.objects.filter(user_id="zed").count() == 1


def test_the_operator_reading_with_no_row_yet_reads_what_it_may(tcast):
    assert post_raw("/v1/chat/completions", chat_body("hello")).status_code == 200  # alice's c1
    Actor.objects.filter(key__startswith="operator@").delete()
    resp = Client().get("/v1/ugent/conversation/snapshot", {"conversation_id": "c1"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 200, resp.content


def test_a_question_reply_from_someone_never_seen_is_the_404_and_writes_no_actor(tcast):
    before = counts()
    reply = {"request_id": "q-guess", "action": "submit", "value": "yes"}
    for extra in ({}, {"conversation_id": "c-none"}):
        err = refused(post_raw("/v1/chat/completions", chat_body("yes", user="never-seen", ugent_interaction_reply=reply,
                                                              **extra)), status=404)
        assert err["code"] == "question_not_found"
    assert counts() == before


@pytest.mark.parametrize("path", ["/v1/ugent/events", "/v1/ugent/activity"])
def test_a_stream_refused_on_someone_elses_conversation_writes_no_actor(tcast, path):
    assert post_raw("/v1/chat/completions", chat_body("hello")).status_code == 200  # alice's c1
    before = counts()
    for user in ("mallory1", "mallory2"):
        resp = Client().get(path, {"conversation_id": "c1", "user": user, "cursor": "0"}, HTTP_X_API_KEY=OPERATOR_KEY)
        assert resp.status_code == 404, resp.content
    assert counts() == before


def test_a_stream_that_opens_keeps_its_users_row(tcast):
    """A whole-log stream follows its user into conversations they have yet to start: the fan-out finds them by
    their row, so the stream that opens keeps one."""
    resp = Client().get("/v1/ugent/events", {"user": "newcomer", "cursor": "0"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 200
    resp.close()
    assert Actor.objects.filter(key="web:newcomer").count() == 1


def test_a_command_refused_or_only_read_writes_no_actor_and_a_stored_choice_does(tcast):
    assert post_raw("/v1/chat/completions", chat_body("hello")).status_code == 200  # alice's c1
    before = counts()
    refused(post_raw("/v1/ugent/commands", {"user": "mallory3", "conversation_id": "c1", "command": "/refine"}),
            status=403)
    refused(post_raw("/v1/ugent/commands", {"federation_issuer": "example-crm", "federation_subject": "mallory4",
                                            "command": "/model scripted"}, key=APP_KEY), status=403)
    refused(post_raw("/v1/ugent/commands", {"user": "mallory5", "command": "nocommand"}))
    for command in ("/models", "/model"):  # reads
        assert post_raw("/v1/ugent/commands", {"user": "reader", "command": command}).status_code == 200
    assert counts() == before
    resp = post_raw("/v1/ugent/commands", {"user": "chooser", "command": "/model scripted"})
    assert resp.status_code == 200 and resp.json()["changed"] is True, resp.content
    assert Actor.objects.get(key="web:chooser").model_choice == "scripted"


def test_an_upload_refused_writes_no_actor_and_a_stored_one_does(tcast):
    assert post_raw("/v1/chat/completions", chat_body("hello")).status_code == 200  # alice's c1
    before = counts()
    err = refused(upload({"conversation_id": "c1", "user": "mallory6"}), status=403)
    assert err["code"] == "conversation_not_owned"
    assert counts() == before
    assert upload({"conversation_id": "c-up", "user": "uploader"}).status_code == 200
    assert Actor.objects.filter(key="web:uploader").count() == 1
    assert Conversation.objects.get(external_id="c-up").owner.key == "web:uploader"
