"""An open stream ends when what authenticated it no longer does (channels_app.api_streams._auth_check):
it is asked again at each keep-alive interval, and a revoked key ends the stream with one ugent.error
carrying the API's own refusal."""
from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from channels_app import services
from channels_app.events import event_append
from tests.streams.conftest import open_stream
from tests.streams import test_fanout
from tests.streams.test_fanout import GUARD, Sse, _closed, _conversation

pytestmark = pytest.mark.django_db(transaction=True)
_keep_bodies = test_fanout._keep_bodies  # the fixture (autouse) that lets Sse close each stream


async def to_the_end(s: Sse) -> list:
    """Every frame until the stream ends. Pings keep an open stream going: the guard fails a stream that never
    ends instead of hanging."""
    seen = []

    async def read():
        try:
            while True:
                seen.append(await s.event())
        except StopAsyncIteration:
            pass
    await asyncio.wait_for(read(), GUARD)
    return seen


def test_a_stream_ends_when_the_key_that_opened_it_is_revoked(tcast):
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))

    async def run():
        try:
            await s.caught_up()
            assert await sync_to_async(services.api_key_revoke)(key_pk=key.pk)
            seen = await to_the_end(s)
            # ended: nothing more reaches it, bob's next event included
            await sync_to_async(event_append)(conversation_id=cb.pk, type="turn.delta",
                                              data={"segment": "answer", "text": "bob's secret"})
            return seen
        finally:
            await _closed([s])
    seen = async_to_sync(run)()
    assert [f["event"] for f in seen] == ["ugent.error"] and seen[0]["id"] is None
    assert seen[0]["data"]["error"]["code"] == "invalid_api_key"
    assert open_stream("/v1/ugent/events", raw).status_code == 401


def _demote(tcast, key):
    from channels_app.models import Caller
    Caller.objects.filter(pk=tcast.operator.pk).update(role="application")


def _delete(tcast, key):
    key.delete()


@pytest.mark.parametrize("change,code", [(_demote, None), (_delete, "invalid_api_key")])
def test_a_stream_ends_when_its_caller_s_role_changes_or_its_key_is_deleted(tcast, change, code):
    """The other changes docs/streams.md names end an open stream too: the caller's role, a deleted key."""
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))

    async def run():
        try:
            await s.caught_up()
            await sync_to_async(change)(tcast, key)
            return await to_the_end(s)
        finally:
            await _closed([s])
    seen = async_to_sync(run)()
    assert [f["event"] for f in seen] == ["ugent.error"] and seen[0]["id"] is None
    if code is not None:
        assert seen[0]["data"]["error"]["code"] == code
