"""Who may call every /v1/ endpoint, generated from the URL conf: an endpoint without a row fails here.

The object is alice's conversation `ca` (a finished turn that said ALICE_SECRET). Every endpoint is
called by the whole cast: the operator acting as itself, the operator naming alice (A) and bob (B),
the application's anonymous user and a federated user of it, no key and a wrong key. Each cell
asserts the status, whether alice's words may (True), must not (False) or need not (None) be in the
answer, and that a refusal (any 4xx) wrote no row, a user's Actor row included.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from channels_app.models import Actor, Conversation, Event, File, Message, Receipt, Steering, Turn
from tests.conftest import APP_KEY, OPERATOR_KEY
from tests.streams.conftest import read_frames, threaded_turns  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

ALICE_SECRET = "alice-secret-words"
REVOKED_KEY = "ugk_test_revoked_operator_key"


def _revoked_operator_key(cast) -> None:
    from channels_app import services
    from channels_app.models import ApiKey
    key = ApiKey(caller=cast.operator, label="revoked in the admin")
    key.set_key(REVOKED_KEY)
    key.save()
    assert Client().get("/v1/models", HTTP_X_API_KEY=REVOKED_KEY).status_code == 200  # a key until revoked
    assert services.api_key_revoke(key_pk=key.pk)

CAST = {
    "operator": {"key": OPERATOR_KEY},
    "operator as A": {"key": OPERATOR_KEY, "user": "alice"},
    "operator as B": {"key": OPERATOR_KEY, "user": "bob"},
    "application, anonymous": {"key": APP_KEY},
    "application, federated": {"key": APP_KEY, "federation_issuer": "example-crm", "federation_subject": "carol"},
    "no key": {"key": None},
    "wrong key": {"key": "ugk_not_a_key"},
    # an operator key the admin has revoked (_revoked_operator_key): refused at once, everywhere, as a wrong one
    "revoked key": {"key": REVOKED_KEY},
}
NO_KEY = {"no key": (401, False), "wrong key": (401, False), "revoked key": (401, False)}


def owner_only(allowed=(200, True), denied=(404, False)) -> dict:
    """The conversation's owner and the operator; anyone else as if it did not exist."""
    return {"operator": allowed, "operator as A": allowed, "operator as B": denied,
            "application, anonymous": denied, "application, federated": denied, **NO_KEY}


def any_key(cell=(200, False)) -> dict:
    return {name: cell for name in CAST if name not in NO_KEY} | NO_KEY


@dataclass
class Case:
    method: str
    params: dict
    expect: dict
    prepare: object = None  # called with the setup's state before the cast calls
    denied_message: str | None = None  # a refusal's wording, the same as for a missing object
    extra: dict = field(default_factory=dict)
    path: str | None = None  # the path to call, for a route with a parameter
    multipart: bool = False  # the params as a multipart form with a file (POST /v1/files)


def _hide_alices_messages(state):
    Message.objects.filter(conversation__external_id="ca").update(hidden=True)


def _alices_file(state):
    """A file of alice's conversation `ca` that holds her words, under a known id."""
    from django.core.files.uploadedfile import SimpleUploadedFile
    from channels_app import files
    conv = Conversation.objects.get(external_id="ca")
    f = files.file_upload(actor=conv.owner, caller=conv.caller, conversation_id="ca",
                          upload=SimpleUploadedFile("alice.txt", ALICE_SECRET.encode()))
    File.objects.filter(pk=f.pk).update(file_id="file-alice")


# One row per endpoint (its URL conf route); several cases where the endpoint takes different shapes.
MATRIX: dict[str, list[Case]] = {
    "v1/chat/completions": [
        # a turn on someone else's conversation is refused with 403, the operator itself included
        Case("POST", {"conversation_id": "ca", "messages": [{"role": "user", "content": "hello again"}]},
             {**owner_only(allowed=(403, False), denied=(403, False)), "operator as A": (200, None)},
             denied_message="This conversation belongs to another user."),
    ],
    "v1/models": [Case("GET", {}, any_key())],
    # one model of that list, with the list's keys; any other name is OpenAI's 404
    "v1/models/<path:model>": [Case("GET", {}, any_key(), path="/v1/models/scripted"),
                               Case("GET", {}, any_key((404, False)), path="/v1/models/no-such-model",
                                    denied_message="The model 'no-such-model' does not exist or you do not "
                                                   "have access to it.")],
    "v1/health": [Case("GET", {}, {name: (200, False) for name in CAST})],
    # the API schema and its page describe the API, never anyone's data: no key needed, any key ignored
    "v1/openapi.json": [Case("GET", {}, {name: (200, False) for name in CAST})],
    "v1/docs": [Case("GET", {}, {name: (200, False) for name in CAST})],
    "v1/ugent/status": [Case("GET", {}, {**any_key(), "application, anonymous": (403, False),
                                          "application, federated": (403, False)})],
    # a file into someone else's conversation is refused as a turn is, the operator itself included
    "v1/files": [
        Case("POST", {"conversation_id": "ca"},
             {**owner_only(allowed=(403, False), denied=(403, False)), "operator as A": (200, None)},
             denied_message="This conversation belongs to another user.", multipart=True),
    ],
    "v1/files/<str:file_id>": [
        Case("GET", {}, owner_only(), prepare=_alices_file, path="/v1/files/file-alice",
             denied_message="No such file."),
    ],
    "v1/ugent/receipt": [
        Case("GET", {"conversation_id": "ca", "client_message_id": "m1"}, owner_only(),
             denied_message="No such message."),
    ],
    "v1/ugent/events": [
        Case("GET", {"conversation_id": "ca", "cursor": "0"}, owner_only(), denied_message="No such conversation."),
        # every conversation the viewer may see: alice's words reach only alice and the operator
        Case("GET", {"cursor": "0"}, {**any_key(), "operator": (200, True), "operator as A": (200, True)}),
    ],
    "v1/ugent/activity": [
        Case("GET", {"conversation_id": "ca", "cursor": "0"}, owner_only(allowed=(200, None)),
             denied_message="No such conversation."),
    ],
    "v1/ugent/conversation/snapshot": [
        Case("GET", {"conversation_id": "ca"}, owner_only(), denied_message="No such conversation."),
    ],
    "v1/ugent/snapshot": [
        Case("GET", {"conversation_id": "ca"}, owner_only(), denied_message="No such conversation."),
    ],
    "v1/ugent/history": [
        Case("GET", {"conversation_id": "ca"}, owner_only(), prepare=_hide_alices_messages,
             denied_message="No such conversation."),
    ],
    "v1/ugent/stop": [
        # the conversation's turn: its user and the operator reach it (it finished: 409)
        Case("POST", {"conversation_id": "ca"}, owner_only(allowed=(409, False)),
             denied_message="No such conversation."),
        # the exact turn_id is enough to stop a turn, whoever holds it
        Case("POST", {"conversation_id": "ca", "turn_id": "{turn_id}"}, any_key((409, False))),
    ],
    "v1/ugent/steering": [
        Case("POST", {"conversation_id": "ca", "message": "steer"}, owner_only(allowed=(409, False)),
             denied_message="No such conversation."),
        # but never to steer another user's turn
        Case("POST", {"conversation_id": "ca", "turn_id": "{turn_id}", "message": "steer"},
             owner_only(allowed=(409, False)), denied_message="No such turn in this conversation."),
    ],
    # a command reaches a conversation as a message does (403 on another's), and /refine reads alice's words
    "v1/ugent/commands": [
        Case("POST", {"conversation_id": "ca", "command": "/refine"},
             {**owner_only(allowed=(403, False), denied=(403, False)), "operator as A": (200, True)},
             denied_message="This conversation belongs to another user."),
        Case("POST", {"command": "/models"}, any_key()),
        # a change needs allow_remote_control: operators have it, applications do not
        Case("POST", {"command": "/model scripted"}, {**any_key(), "application, anonymous": (403, False),
                                                     "application, federated": (403, False)}),
    ],
    # voice (channels_app.voice): nothing installed can transcribe, speak or hold a call, so a 503 to every
    # key; dictation first refuses someone else's conversation as a message into it (403; the operator acting
    # as itself writes into nobody's), read aloud answers 404 to anyone whose turn it is not, as for an unknown one
    "v1/ugent/transcribe": [Case("POST", {"conversation_id": "ca"},
                                 {**owner_only(allowed=(403, False), denied=(403, False)), "operator as A": (503, False)},
                                 denied_message="This conversation belongs to another user.", multipart=True),
                            Case("POST", {"conversation_id": "not-yet"}, any_key((503, False)), multipart=True)],
    "v1/ugent/speech": [Case("POST", {"conversation_id": "ca", "turn_id": "{turn_id}", "segment": 0},
                             owner_only(allowed=(503, False), denied=(404, False)),
                             denied_message="No such finished turn in this conversation.")],
    "v1/ugent/live": [Case("GET", {}, any_key((503, False)))],
    # the operator's host endpoints: operator keys only, as /v1/ugent/status
    "v1/ugent/sandbox": [Case("GET", {}, {**any_key(), "application, anonymous": (403, False),
                                           "application, federated": (403, False)})],
    "v1/ugent/directory": [Case("PUT", {"conversation_id": "ca", "directory": ""},
                                {**any_key(), "application, anonymous": (403, False),
                                 "application, federated": (403, False)})],
    "v1/ugent/conversations/repair": [Case("POST", {"conversation_id": "ca"},
                                           {**any_key(), "application, anonymous": (403, False),
                                            "application, federated": (403, False)})],
}


def v1_routes() -> list[str]:
    """Every route of the URL conf under /v1/, as its pattern string."""
    found = []

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                found.append(prefix + str(p.pattern))
    walk(get_resolver().url_patterns)
    return sorted(r for r in found if r.startswith("v1/"))


def test_every_v1_endpoint_has_a_row_in_the_matrix_and_every_row_an_endpoint():
    routes = v1_routes()
    assert "v1/ugent/receipt" in routes and "v1/ugent/events" in routes  # the walk reaches included modules
    assert sorted(set(routes) - set(MATRIX)) == [], "endpoints without a permission row"
    assert sorted(set(MATRIX) - set(routes)) == [], "permission rows for endpoints that are gone"
    for cases in MATRIX.values():
        for case in cases:
            assert set(case.expect) == set(CAST)


def _counts() -> dict:
    counts = {m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Message, Event, Steering, File)}
    # a refusal keeps no user's row either (the operator's own, `operator@<caller>`, is kept by any of its reads)
    counts["Actor"] = Actor.objects.exclude(key__startswith="operator@").count()
    return counts


def _call(who: dict, case: Case, path: str, turn_id: str):
    params = {k: (v.format(turn_id=turn_id) if isinstance(v, str) else v) for k, v in case.params.items()}
    params.update({k: v for k, v in who.items() if k != "key"})
    headers = {"HTTP_X_API_KEY": who["key"]} if who["key"] else {}
    path = case.path or path
    if case.multipart:
        from django.core.files.uploadedfile import SimpleUploadedFile
        resp = Client().post(path, data={**params, "file": SimpleUploadedFile("n.txt", b"an upload")}, **headers)
    elif case.method == "GET":
        resp = Client().get(path, params, **headers)
    else:
        resp = getattr(Client(), case.method.lower())(path, data=json.dumps(params), content_type="application/json",
                                                      **headers)
    if getattr(resp, "streaming", False):
        return resp, json.dumps(read_frames(resp, until_ping=True))
    return resp, resp.content.decode()


@pytest.mark.parametrize("route", v1_routes())
def test_the_cast_on_each_endpoint(route, tcast, settings, tmp_path):
    settings.UGENT_SSE_KEEPALIVE = 0.2
    settings.STORAGES = {**settings.STORAGES, "ugent_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    assert route in MATRIX, f"/{route} has no row in the permission matrix"
    _revoked_operator_key(tcast)
    first = Client().post("/v1/chat/completions", data=json.dumps(
        {"user": "alice", "conversation_id": "ca", "client_message_id": "m1",
         "messages": [{"role": "user", "content": ALICE_SECRET}]}),
        content_type="application/json", HTTP_X_API_KEY=OPERATOR_KEY)
    assert first.status_code == 200 and ALICE_SECRET in first.content.decode()
    turn_id = first["x-ugent-turn-id"]
    for i, case in enumerate(MATRIX[route]):
        if case.prepare:
            case.prepare({"turn_id": turn_id})
        for name, who in CAST.items():
            status, secret = case.expect[name]
            before = _counts()
            resp, body = _call(who, case, "/" + route, turn_id)
            cell = f"/{route} case {i} as {name}: {resp.status_code} {body[:300]}"
            assert resp.status_code == status, cell
            if secret is True:
                assert ALICE_SECRET in body, cell
            elif secret is False:
                assert ALICE_SECRET not in body, cell
            if 400 <= status < 500:
                assert _counts() == before, f"{cell}: a refusal wrote rows"
                if case.denied_message and status != 401 and case.expect["operator as A"][0] != status:
                    assert json.loads(body)["error"]["message"] == case.denied_message, cell


# --- who asked a turn to stop: the stopper's and the operator's to read ---------------------------

def test_a_stop_by_exact_turn_id_shows_the_stopper_only_to_the_stopper_and_the_operator(tcast, threaded_turns,
                                                                                         settings):
    """Two application callers (issuers): dave, another application's end user, may stop carol's turn by
    its exact turn_id (seed: "a stop needs ... the exact turn_id it stops"), but carol's streams must not
    show his identity; the operator's do. Read from the log (history) here; tests/streams/test_fanout.py
    reads the same event live."""
    from tests.streams.conftest import wait_for
    settings.UGENT_SSE_KEEPALIVE = 0.2
    carol = tcast.carol  # application "crm", issuer example-crm
    dave = {"key": tcast.keys["outsider"], "federation_issuer": "elsewhere", "federation_subject": "dave"}
    started = Client().post("/v1/chat/completions", content_type="application/json", HTTP_X_API_KEY=carol["key"],
                            data=json.dumps({"conversation_id": "cc", "stream": True, **_ident(carol),
                                             "messages": [{"role": "user", "content": "script:sleep=60|answer=x"}]}))
    turn_id = started["x-ugent-turn-id"]
    stop = Client().post("/v1/ugent/stop", content_type="application/json", HTTP_X_API_KEY=dave["key"],
                         data=json.dumps({"conversation_id": "cc", "turn_id": turn_id, **_ident(dave)}))
    assert stop.status_code == 202, stop.content
    wait_for(lambda: Turn.objects.filter(turn_id=turn_id, finished_at__isnull=False).exists(), timeout=30)
    dave_key = "fed:elsewhere:dave"
    assert Turn.objects.get(turn_id=turn_id).stop_requested_by == dave_key  # kept for the operator's admin

    readers = {"carol": (carol, "someone else"), "operator": ({"key": OPERATOR_KEY}, dave_key)}
    for path in ("/v1/ugent/activity", "/v1/ugent/events"):
        for name, (who, by) in readers.items():
            resp = Client().get(path, {"conversation_id": "cc", "cursor": "0", **_ident(who)},
                                HTTP_X_API_KEY=who["key"])
            frames = read_frames(resp, until_ping=True)
            stops = [f["data"]["data"] for f in frames if f["event"] == "turn.stop_requested"]
            assert stops == [{"turn_id": turn_id, "by": by}], (path, name, frames)
            if name != "operator":
                assert "dave" not in json.dumps(frames), (path, name)
        # the stopper cannot read carol's conversation at all
        resp = Client().get(path, {"conversation_id": "cc", "cursor": "0", **_ident(dave)}, HTTP_X_API_KEY=dave["key"])
        assert resp.status_code == 404
    # every conversation carol may see: the same
    frames = read_frames(Client().get("/v1/ugent/events", {"cursor": "0", **_ident(carol)},
                                      HTTP_X_API_KEY=carol["key"]), until_ping=True)
    assert "dave" not in json.dumps(frames) and any(f["event"] == "turn.stop_requested" for f in frames)


def test_a_turns_own_user_who_stops_it_reads_their_own_name(tcast, threaded_turns, settings):
    from tests.streams.conftest import wait_for
    settings.UGENT_SSE_KEEPALIVE = 0.2
    carol = tcast.carol
    started = Client().post("/v1/chat/completions", content_type="application/json", HTTP_X_API_KEY=carol["key"],
                            data=json.dumps({"conversation_id": "cc", "stream": True, **_ident(carol),
                                             "messages": [{"role": "user", "content": "script:sleep=60|answer=x"}]}))
    turn_id = started["x-ugent-turn-id"]
    stop = Client().post("/v1/ugent/stop", content_type="application/json", HTTP_X_API_KEY=carol["key"],
                         data=json.dumps({"conversation_id": "cc", **_ident(carol)}))
    assert stop.status_code == 202
    wait_for(lambda: Turn.objects.filter(turn_id=turn_id, finished_at__isnull=False).exists(), timeout=30)
    frames = read_frames(Client().get("/v1/ugent/activity", {"conversation_id": "cc", "cursor": "0", **_ident(carol)},
                                      HTTP_X_API_KEY=carol["key"]), until_ping=True)
    stops = [f["data"]["data"] for f in frames if f["event"] == "turn.stop_requested"]
    assert stops == [{"turn_id": turn_id, "by": "fed:example-crm:carol"}]


def _ident(who: dict) -> dict:
    return {k: v for k, v in who.items() if k != "key"}
