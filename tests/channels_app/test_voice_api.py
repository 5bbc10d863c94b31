"""The voice endpoints in a build with no transcription, speech or voice-call engine: each answers why
(a 503), after the checks a working endpoint makes; read aloud never reveals another person's turn."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app import voice
from channels_app.models import Turn
from tests.conftest import OPERATOR_KEY

pytestmark = pytest.mark.django_db


def chat(user, text="hello", conversation_id="cv"):
    body = {"messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, "user": user}
    r = Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                      HTTP_X_API_KEY=OPERATOR_KEY)
    assert r.status_code == 200, r.content
    return r.json()["ugent_turn_id"]


def speech(user, **body):
    return Client().post("/v1/ugent/speech", data=json.dumps({"user": user, **body}),
                         content_type="application/json", HTTP_X_API_KEY=OPERATOR_KEY)


def test_read_aloud_names_a_finished_turn_of_ones_own_and_says_why_it_cannot_speak(tcast):
    turn_id = chat("alice")
    r = speech("alice", conversation_id="cv", turn_id=turn_id, segment=0)
    assert r.status_code == 503 and r.json()["error"]["message"] == voice.SPEECH_UNAVAILABLE
    assert r.json()["error"]["code"] == "voice_unavailable"
    # another person's turn, an unknown one and an unfinished one are all the same 404
    for user, conv, tid in (("bob", "cv", turn_id), ("alice", "cv", "turn-nope"), ("alice", "other", turn_id)):
        r = speech(user, conversation_id=conv, turn_id=tid)
        assert r.status_code == 404 and r.json()["error"]["message"] == voice.NO_FINISHED_TURN, (user, conv, tid)
    Turn.objects.filter(turn_id=turn_id).update(state="running")
    assert speech("alice", conversation_id="cv", turn_id=turn_id).status_code == 404


@pytest.mark.parametrize("body, param", [({"turn_id": "t"}, "conversation_id"), ({"conversation_id": "cv"}, "turn_id"),
                                         ({"conversation_id": "cv", "turn_id": "t", "segment": -1}, "segment")])
def test_read_aloud_refuses_bad_input_naming_the_field(tcast, body, param):
    r = speech("alice", **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_dictation_and_live_calls_say_why_they_are_unavailable(tcast):
    import io
    f = io.BytesIO(b"RIFF")
    f.name = "v.wav"
    r = Client().post("/v1/ugent/transcribe", data={"file": f, "conversation_id": "cv"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert r.status_code == 503 and r.json()["error"]["message"] == voice.DICTATION_UNAVAILABLE
    r = Client().get("/v1/ugent/live", {"conversation_id": "cv"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert r.status_code == 503 and r.json()["error"]["message"] == voice.LIVE_UNAVAILABLE


def test_dictation_refuses_someone_elses_conversation_before_saying_it_is_unavailable(tcast):
    """The spec: a turn, a question reply or a file on someone else's conversation is refused (403); dictation
    names a conversation too. Two keys: alice's (an operator key naming her) and an application's user."""
    import io
    from channels_app.models import Conversation
    from tests.conftest import APP_KEY

    def transcribe(key, **fields):
        f = io.BytesIO(b"RIFF")
        f.name = "v.wav"
        return Client().post("/v1/ugent/transcribe", data={"file": f, **fields}, HTTP_X_API_KEY=key)

    chat("alice", conversation_id="alices")
    carol = {"federation_issuer": "example-crm", "federation_subject": "carol"}
    for key, fields in ((APP_KEY, carol), (APP_KEY, {}), (OPERATOR_KEY, {"user": "bob"})):
        r = transcribe(key, conversation_id="alices", **fields)
        assert r.status_code == 403, (fields, r.content)
        assert r.json()["error"] == {"message": "This conversation belongs to another user.",
                                     "type": "permission_error", "param": "conversation_id",
                                     "code": "conversation_not_owned"}
    # her own, and one that does not exist yet (created by nothing here), reach the 503
    assert transcribe(OPERATOR_KEY, conversation_id="alices", user="alice").status_code == 503
    r = transcribe(APP_KEY, conversation_id="carols-next", **carol)
    assert r.status_code == 503 and r.json()["error"]["message"] == voice.DICTATION_UNAVAILABLE
    assert list(Conversation.objects.values_list("external_id", flat=True)) == ["alices"]


def test_dictation_keeps_nothing_not_even_the_actor_it_names(tcast):
    """The spec: dictation keeps nothing. A federated subject the daemon has never seen is no Actor row after
    it, whether its conversation exists (someone else's: 403, as one with no row owns none) or not yet (503)."""
    import io
    from channels_app.models import Actor
    from tests.conftest import APP_KEY

    def transcribe(**fields):
        f = io.BytesIO(b"RIFF")
        f.name = "v.wav"
        return Client().post("/v1/ugent/transcribe", data={"file": f, **fields}, HTTP_X_API_KEY=APP_KEY)

    chat("alice", conversation_id="alices")
    actors = set(Actor.objects.values_list("key", flat=True))
    dave = {"federation_issuer": "example-crm", "federation_subject": "dave-new"}
    r = transcribe(conversation_id="alices", **dave)
    assert r.status_code == 403 and r.json()["error"]["code"] == "conversation_not_owned", r.content
    r = transcribe(conversation_id="daves-next", **dave)
    assert r.status_code == 503 and r.json()["error"]["message"] == voice.DICTATION_UNAVAILABLE
    assert set(Actor.objects.values_list("key", flat=True)) == actors
    # the role rules still hold first: an application naming a plain user is refused, and creates nobody
    assert transcribe(conversation_id="alices", user="erin").status_code == 403
    assert set(Actor.objects.values_list("key", flat=True)) == actors
