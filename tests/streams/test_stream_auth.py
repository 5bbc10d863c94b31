"""An open stream ends when what authenticated it no longer does (channels_app.api_streams._auth_check):
it is asked again at each keep-alive interval, and a revoked key ends the stream with one ugent.error
carrying the API's own refusal."""
from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from channels_app import services
from channels_app.events import event_append
from tests.streams.conftest import open_stream
from tests.streams.test_fanout import Sse, _closed, _conversation, _keep_bodies  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_stream_ends_when_the_key_that_opened_it_is_revoked(tcast):
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))

    async def run():
        try:
            await s.caught_up()
            assert await sync_to_async(services.api_key_revoke)(key_pk=key.pk)
            seen = []
            try:
                while True:
                    seen.append(await s.event())
            except StopAsyncIteration:
                pass
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
