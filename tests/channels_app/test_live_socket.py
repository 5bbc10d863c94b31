"""GET /v1/ugent/live as a WebSocket: the ASGI app's own routing and consumer, driven in-process by Channels'
WebsocketCommunicator. No voice model is installed in this build, so every call closes at once, with the
spec's code: 4403 another person's conversation, 4422 calls unavailable here; a missing or wrong key 4401.
The real server's handshake (uvicorn, both run modes) is tests/e2e/test_live_socket_e2e.py's."""
from __future__ import annotations

import asyncio
from urllib.parse import urlencode

import pytest
from channels.testing import WebsocketCommunicator

from channels_app import services, voice
from channels_app.api_voice import LiveCallSocket, close_reason
from channels_app.models import Actor, Conversation
from tests.conftest import APP_KEY, OPERATOR_KEY, OUTSIDER_KEY
from ugent_site.api_handler import websocket_route

pytestmark = pytest.mark.django_db(transaction=True)

APP = websocket_route({"/v1/ugent/live": LiveCallSocket.as_asgi()})


def close_of(query: dict | None = None, key: str | None = OPERATOR_KEY, path: str = "/v1/ugent/live"):
    """(accepted, the close message) of one call."""
    async def call():
        headers = [(b"x-api-key", key.encode())] if key else []
        comm = WebsocketCommunicator(APP, path + ("?" + urlencode(query) if query else ""), headers=headers)
        accepted, _ = await comm.connect(timeout=10)
        if not accepted:
            return False, None
        message = await comm.receive_output(timeout=10)
        await comm.disconnect()  # the client answers the close
        return True, message
    return asyncio.run(call())


def test_a_call_closes_with_4422_and_why_when_no_voice_model_is_installed(tcast):
    before = Conversation.objects.count()
    accepted, message = close_of({"conversation_id": "call-1", "user": "alice"})
    assert accepted and message["type"] == "websocket.close"
    assert (message["code"], message["reason"]) == (4422, close_reason(voice.LIVE_UNAVAILABLE))
    assert message["reason"].startswith("Live calls are unavailable here")
    assert Conversation.objects.count() == before  # a refused call creates nothing


def test_a_call_to_the_callers_own_conversation_closes_with_4422(tcast):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator, text="hi",
                                                        conversation_id="alices-call"))
    _, message = close_of({"conversation_id": "alices-call", "user": "alice"})
    assert message["code"] == 4422


def test_another_persons_conversation_closes_with_4403(tcast):
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator, text="hi",
                                                        conversation_id="alices-call"))
    _, message = close_of({"conversation_id": "alices-call", "user": "bob"})
    assert (message["code"], message["reason"]) == (4403, services.NOT_YOURS)


def test_an_operator_key_naming_no_user_may_not_call_into_a_users_conversation(tcast):
    """A call speaks into the conversation: the operator may read it, but writes into it as nobody else."""
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator, text="hi",
                                                        conversation_id="alices-call"))
    _, message = close_of({"conversation_id": "alices-call"})
    assert (message["code"], message["reason"]) == (4403, services.NOT_YOURS)


def test_user_fields_that_do_not_go_together_close_with_4400(tcast):
    _, message = close_of({"conversation_id": "call-1", "federation_issuer": "example-crm"}, key=APP_KEY)
    assert message["code"] == 4400



@pytest.mark.parametrize("query, param", [({"user": "u" * 400}, "user"),
                                          ({"user": "alice", "federation_subject": "s" * 300}, "federation_subject"),
                                          ({"user": "alice", "conversation_id": "x\x00"}, "conversation_id"),
                                          ({"user": "alice", "conversation_id": "x\ny"}, "conversation_id"),
                                          ({"user": "eve\nforged"}, "user")])
def test_a_query_field_a_request_would_refuse_closes_with_4400_and_writes_nothing(tcast, query, param):
    # read without a serializer, a long user or a NUL was PostgreSQL's DataError out of connect (no close code)
    before = (Actor.objects.count(), Conversation.objects.count())
    _, message = close_of(query)
    assert message["code"] == 4400 and message["reason"].startswith(f"{param}: "), message
    assert (Actor.objects.count(), Conversation.objects.count()) == before

@pytest.mark.parametrize("key, reason", [(None, "Missing API key: send it as x-api-key or Authorization: Bearer."),
                                         ("ugk_not_a_key", "Invalid API key.")])
def test_a_missing_or_wrong_key_closes_with_4401(tcast, key, reason):
    _, message = close_of({"conversation_id": "call-1", "user": "alice"}, key=key)
    assert (message["code"], message["reason"]) == (4401, reason)


def test_a_user_the_key_may_not_name_closes_with_4403(tcast):
    """An application names users only through its federation issuers (channels_app.services)."""
    _, message = close_of({"conversation_id": "call-1", "federation_issuer": "elsewhere",
                           "federation_subject": "zoe"}, key=APP_KEY)
    assert message["code"] == 4403


def test_no_other_websocket_path_is_served(tcast):
    accepted, _ = close_of({"conversation_id": "call-1"}, path="/v1/ugent/events")
    assert not accepted


def test_a_long_reason_is_cut_to_what_a_close_frame_carries():
    assert close_reason("x" * 123) == "x" * 123
    cut = close_reason("é" * 100)
    assert len(cut.encode()) <= 123 and cut.endswith("...")


def test_an_outsider_application_may_not_call_into_a_users_conversation(tcast):
    """The permission rows: owner 4422 and operator-as-itself 4403 above; an application whose own user
    names the conversation of another caller's user gets 4403 too."""
    actor = services.actor_resolve(caller=tcast.app, federation_issuer="example-crm", federation_subject="carol")
    services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.app, text="hi",
                                                        conversation_id="carols-call"))
    _, own = close_of({"conversation_id": "carols-call", "federation_issuer": "example-crm",
                       "federation_subject": "carol"}, key=APP_KEY)
    assert own["code"] == 4422
    _, message = close_of({"conversation_id": "carols-call", "federation_issuer": "elsewhere",
                           "federation_subject": "carol"}, key=OUTSIDER_KEY)
    assert (message["code"], message["reason"]) == (4403, services.NOT_YOURS)


def test_a_refused_call_by_someone_never_seen_writes_no_actor(tcast):
    # every call is refused in this build: it keeps nothing, its caller's row included
    before = Actor.objects.count()
    accepted, message = close_of({"conversation_id": "call-new", "user": "never-seen"})
    assert accepted and message["code"] == 4422
    assert Actor.objects.count() == before
