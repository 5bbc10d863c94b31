"""The role matrix of federated identity, on every endpoint that names a user.

The object is `cc`, a conversation that the verified user crm:carol (an application key with carol's
token) started. Each endpoint is called by: carol's token, another verified user's token, the
operator with carol's token, the application naming carol in the body without a token, the body
naming carol beside dave's token, another application carrying carol's token, the application naming
nobody, and the operator naming `carol`. With require_verified_identity on and off. Every refusal
is checked for its status, its wording where it is an identity rule, and for writing no row.
"""
from __future__ import annotations

import json

import pytest
from django.test import Client

from channels_app import federation
from channels_app.models import Conversation, Event, File, Issuer, Message, Receipt, Steering, Turn
from channels_app.services import VERIFIED_IDENTITY_REQUIRED
from tests.channels_app.test_permissions import v1_routes
from tests.conftest import APP_KEY, OPERATOR_KEY, OUTSIDER_KEY
from tests.streams.conftest import read_frames
from tests.support import idp
from ugent_common import config

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "carols-own-words"
BODY_CAROL = {"federation_issuer": idp.ISSUER, "federation_subject": "carol"}
TOKEN_REFUSED_FOR_OUTSIDER = ("An application key may name only federated users of the issuers it lists: "
                              "the identity token's issuer 'example-crm' is not one of them.")

# (method, params, the status for carol, the status for anyone else) for every endpoint naming a user
ENDPOINTS = {
    "v1/chat/completions": ("POST", {"conversation_id": "cc", "messages": [{"role": "user", "content": "more"}]},
                            200, 403),
    "v1/files": ("UPLOAD", {"conversation_id": "cc"}, 200, 403),  # multipart, with a file
    "v1/files/<str:file_id>": ("GET", {}, 200, 404),  # carol's file-carol
    "v1/ugent/receipt": ("GET", {"conversation_id": "cc", "client_message_id": "m1"}, 200, 404),
    "v1/ugent/events": ("GET", {"conversation_id": "cc", "cursor": "0"}, 200, 404),
    "v1/ugent/activity": ("GET", {"conversation_id": "cc", "cursor": "0"}, 200, 404),
    "v1/ugent/conversation/snapshot": ("GET", {"conversation_id": "cc"}, 200, 404),
    "v1/ugent/snapshot": ("GET", {"conversation_id": "cc"}, 200, 404),
    "v1/ugent/history": ("GET", {"conversation_id": "cc"}, 200, 404),
    "v1/ugent/stop": ("POST", {"conversation_id": "cc"}, 409, 404),  # the turn has finished: 409
    "v1/ugent/steering": ("POST", {"conversation_id": "cc", "message": "steer"}, 409, 404),
    # /refine offers carol's own last message back: a command reaches the conversation as a message does
    "v1/ugent/commands": ("POST", {"conversation_id": "cc", "command": "/refine"}, 200, 403),
    # read aloud: carol's finished turn is hers (then: no speech engine here, a 503); anyone else's a 404
    "v1/ugent/speech": ("POST", {"conversation_id": "cc", "turn_id": "turn-carol"}, 503, 404),
}
# The API schema and its page describe the API, never anyone's data: no key, no user.
NAMES_NOBODY = {"v1/models", "v1/models/<path:model>", "v1/health", "v1/ugent/status", "v1/openapi.json", "v1/docs",
                # the operator's host endpoints: operator keys only, naming nobody
                "v1/ugent/sandbox", "v1/ugent/directory", "v1/ugent/conversations/repair",
                # dictation and live calls: nothing installed here to do them, a 503 before anyone is named
                "v1/ugent/transcribe", "v1/ugent/live"}


def test_every_endpoint_that_names_a_user_is_in_the_identity_matrix():
    assert sorted(set(v1_routes()) - NAMES_NOBODY) == sorted(ENDPOINTS)


@pytest.fixture
def world(tcast, settings, tmp_path):
    keys = {"rsa": idp.SigningKey("rsa")}
    server = idp.JwksServer(keys["rsa"])
    federation.jwks_reset()
    settings.UGENT_SSE_KEEPALIVE = 0.2
    settings.UGENT_CONFIG_RECHECK_SECS = 0
    Issuer.objects.create(issuer=idp.ISSUER, jwks_url=server.url, audience=idp.AUDIENCE, actor_prefix=idp.PREFIX)
    path = tmp_path / "ugent.toml"

    def verified(on: bool):
        path.write_text(f"[web.auth]\nrequire_verified_identity = {'true' if on else 'false'}\n")
        settings.UGENT_CONFIG = str(path)
        config.reset_caches()

    verified(False)
    tokens = {sub: idp.sign(keys["rsa"], idp.claims(sub)) for sub in ("carol", "dave")}
    first = call({"key": APP_KEY, "token": tokens["carol"]}, "POST", "/v1/chat/completions",
                 {"conversation_id": "cc", "client_message_id": "m1",
                  "messages": [{"role": "user", "content": SECRET}]})
    assert first[0].status_code == 200 and SECRET in first[1]
    assert Conversation.objects.get(external_id="cc").owner.key == "crm:carol"
    settings.STORAGES = {**settings.STORAGES, "ugent_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "files")}}}
    from django.core.files.uploadedfile import SimpleUploadedFile
    from channels_app import files
    conv = Conversation.objects.get(external_id="cc")
    f = files.file_upload(actor=conv.owner, caller=conv.caller, conversation_id="cc",
                          upload=SimpleUploadedFile("carol.txt", SECRET.encode()))
    File.objects.filter(pk=f.pk).update(file_id="file-carol")
    Turn.objects.filter(conversation=conv).update(turn_id="turn-carol")
    yield {"tokens": tokens, "verified": verified}
    server.close()
    federation.jwks_reset()
    config.reset_caches()


def call(who: dict, method: str, path: str, params: dict):
    params = dict(params, **{k: v for k, v in who.items() if k not in ("key", "token")})
    headers = {"HTTP_X_API_KEY": who["key"]}
    if who.get("token"):
        headers["HTTP_AUTHORIZATION"] = f"Bearer {who['token']}"
    if method == "UPLOAD":
        from django.core.files.uploadedfile import SimpleUploadedFile
        resp = Client().post(path, data={**params, "file": SimpleUploadedFile("n.txt", b"an upload")}, **headers)
    elif method == "GET":
        resp = Client().get(path, params, **headers)
    else:
        resp = Client().post(path, data=json.dumps(params), content_type="application/json", **headers)
    if getattr(resp, "streaming", False):
        return resp, json.dumps(read_frames(resp, until_ping=True))
    return resp, resp.content.decode()


def counts():
    return {m.__name__: m.objects.count() for m in (Conversation, Receipt, Turn, Message, Event, Steering, File)}


def cast(tokens: dict, *, verified: bool) -> dict:
    """Each caller and what it gets: "owner", "other", or (status, message)."""
    return {
        "carol's token": ({"key": APP_KEY, "token": tokens["carol"]}, "owner"),
        "dave's token": ({"key": APP_KEY, "token": tokens["dave"]}, "other"),
        "operator with carol's token": ({"key": OPERATOR_KEY, "token": tokens["carol"]}, "owner"),
        "body names carol beside dave's token": ({"key": APP_KEY, "token": tokens["dave"], **BODY_CAROL}, "other"),
        "another application with carol's token": ({"key": OUTSIDER_KEY, "token": tokens["carol"]},
                                                   (403, TOKEN_REFUSED_FOR_OUTSIDER)),
        # an unverified claim is never the verified user: at best another actor (fed:example-crm:carol)
        "body names carol, no token": ({"key": APP_KEY, **BODY_CAROL},
                                       (403, VERIFIED_IDENTITY_REQUIRED) if verified else "other"),
        "application naming nobody": ({"key": APP_KEY}, "other"),  # web-user@crm
        "operator naming carol": ({"key": OPERATOR_KEY, "user": "carol"}, "other"),  # web:carol, allowed to name
    }


@pytest.mark.parametrize("verified", [True, False], ids=["require_verified_identity", "unverified allowed"])
@pytest.mark.parametrize("route", sorted(ENDPOINTS))
def test_the_identity_cast_on_each_endpoint(route, verified, world):
    world["verified"](verified)
    if route == "v1/ugent/history":  # history pages what compaction hid
        Message.objects.filter(conversation__external_id="cc").update(hidden=True)
    method, params, owner_status, other_status = ENDPOINTS[route]
    for name, (who, expect) in cast(world["tokens"], verified=verified).items():
        before = counts()
        resp, body = call(who, method, "/" + route.replace("<str:file_id>", "file-carol"), params)
        cell = f"/{route} as {name}: {resp.status_code} {body[:300]}"
        if expect == "owner":
            assert resp.status_code == owner_status, cell
            if route not in ("v1/chat/completions", "v1/ugent/stop", "v1/ugent/steering", "v1/ugent/activity",
                             "v1/files", "v1/ugent/speech"):
                assert SECRET in body, cell
            continue
        status, message = (other_status, None) if expect == "other" else expect
        assert resp.status_code == status, cell
        assert SECRET not in body, cell
        assert counts() == before, f"{cell}: a refusal wrote rows"
        if message is not None:
            assert json.loads(body)["error"]["message"] == message, cell


def test_require_verified_identity_leaves_the_operators_naming_and_the_anonymous_user_alone(world):
    world["verified"](True)
    ok = call({"key": OPERATOR_KEY, "user": "zoe"}, "POST", "/v1/chat/completions",
              {"conversation_id": "z1", "messages": [{"role": "user", "content": "hi"}]})[0]
    assert ok.status_code == 200 and Turn.objects.get(conversation__external_id="z1").actor.key == "web:zoe"
    anon = call({"key": APP_KEY}, "POST", "/v1/chat/completions",
                {"conversation_id": "a1", "messages": [{"role": "user", "content": "hi"}]})[0]
    assert anon.status_code == 200 and Turn.objects.get(conversation__external_id="a1").actor.key == "web-user@crm"


def test_require_verified_identity_refuses_a_named_user_in_the_stream_too(world):
    world["verified"](True)
    before = counts()
    resp, body = call({"key": APP_KEY, **BODY_CAROL}, "POST", "/v1/chat/completions",
                      {"conversation_id": "s1", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert VERIFIED_IDENTITY_REQUIRED in body
    assert counts() == before
