"""An open stream ends when what authenticated it no longer does (channels_app.api_streams._auth_check):
it is asked again when a credentials change wakes it, when ugent.toml was read anew, when its identity
token expires, and every UGENT_SSE_CREDENTIALS_RECHECK_SECS for what nothing announces; a revoked key
ends the stream with one ugent.error carrying the API's own refusal."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.test import Client

from channels_app import services
from channels_app.models import Conversation
from channels_app.events import event_append
from tests.streams.conftest import ident, open_stream
from tests.streams import test_fanout
from tests.streams.test_fanout import GUARD, Sse, _append, _closed, _conversation

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
def test_a_stream_ends_when_its_caller_s_role_changes_or_its_key_is_deleted(tcast, settings, change, code):
    """The other changes docs/streams.md names end an open stream too: the caller's role, a deleted key.
    The role is changed by a raw UPDATE, which wakes nothing: the backstop check finds it."""
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 0.5
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


# --- at once, not at the next keep-alive -------------------------------------------------------------------
# A revocation, a rotation, a deleted key or a caller's changed role wakes every open stream's check
# (channels_app.auth.CREDENTIALS_TOPIC, channels_app.fanout._Recheck). With the keep-alive at a minute, a
# stream that ended only at its next keep-alive would fail these on their five seconds.

AT_ONCE = 5.0


def _revoke(tcast, key):
    assert services.api_key_revoke(key_pk=key.pk)


def _rotate(tcast, key):
    assert services.api_key_rotate(key_pk=key.pk) is not None


def _role_saved(tcast, key):
    caller = key.caller
    caller.role = "application"
    caller.save()  # as the admin does


async def _live(conv, *opened: Sse) -> None:
    """The streams are open and past their history: an event appended now reaches them (no ping needed)."""
    await _append(conv, 1)
    for s in opened:
        assert (await s.event())["data"]["data"] == {"k": 1}


@pytest.mark.parametrize("change,code", [(_revoke, "invalid_api_key"), (_rotate, "invalid_api_key"),
                                         (_delete, "invalid_api_key"), (_role_saved, "stream_credentials_changed")])
def test_a_change_of_credentials_ends_an_open_stream_at_once_not_at_the_next_keep_alive(tcast, settings,
                                                                                         change, code):
    settings.UGENT_SSE_KEEPALIVE = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))
    other_key, other_raw = services.api_key_issue(caller=tcast.operator, label="desk")
    kept = Sse(open_stream("/v1/ugent/events", other_raw, conversation_id="cb", **ident(tcast.bob)))

    async def run():
        try:
            await _live(cb, s, kept)
            await sync_to_async(change)(tcast, key)
            seen = await asyncio.wait_for(to_the_end(s), AT_ONCE)
            # nothing after the change reached the ended stream; the other stream goes on (its key was
            # not changed: a rotation or revocation of one key leaves the caller's others alone)
            await _append(cb, 2)
            if change is not _role_saved:
                assert (await asyncio.wait_for(kept.event(), AT_ONCE))["data"]["data"] == {"k": 2}
            return seen
        finally:
            await _closed([s, kept])
    seen = async_to_sync(run)()
    assert [f["event"] for f in seen] == ["ugent.error"]
    assert seen[0]["data"]["error"]["code"] == code


def test_a_new_key_ends_no_stream(tcast, settings):
    settings.UGENT_SSE_KEEPALIVE = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))

    async def run():
        try:
            await _live(cb, s)
            await sync_to_async(services.api_key_issue)(caller=tcast.operator, label="another")
            await _append(cb, 2)
            return await asyncio.wait_for(s.event(), AT_ONCE)
        finally:
            await _closed([s])
    assert async_to_sync(run)()["data"]["data"] == {"k": 2}


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="servers mode: a change made in another process")
def test_a_change_made_in_another_process_ends_the_stream_at_once(tcast, settings):
    """Another process's change reaches this one over Redis: the row changed behind this process's back
    (no signal here) and only the other process's wake-up, published as it would, tells the stream."""
    import redis
    from channels_app import auth, notify
    from channels_app.models import ApiKey

    settings.UGENT_SSE_KEEPALIVE = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))

    def elsewhere():
        ApiKey.objects.filter(pk=key.pk).update(active=False)
        redis.Redis.from_url(settings.REDIS_URL).publish(
            notify.channel_prefix() + auth.credentials_topic(key.caller_id), b"1")

    async def run():
        try:
            await _live(cb, s)
            await sync_to_async(elsewhere)()
            return await asyncio.wait_for(to_the_end(s), AT_ONCE)
        finally:
            await _closed([s])
    seen = async_to_sync(run)()
    assert [f["event"] for f in seen] == ["ugent.error"]
    assert seen[0]["data"]["error"]["code"] == "invalid_api_key"


def test_the_recheck_waiter_goes_with_the_last_stream(tcast):
    """Each loop's credentials waiter for a caller lives as long as a stream its credentials opened does."""
    from channels_app import auth, fanout, notify
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    topic = auth.credentials_topic(tcast.operator.pk)
    streams_ = [Sse(open_stream("/v1/ugent/events", raw)) for _ in range(2)]

    async def run():
        for st in streams_:
            await st.caught_up()
        assert notify.listening(topic) and len(fanout.hub()._rechecks) == 1
        await _closed(streams_[:1])
        assert notify.listening(topic)
        await _closed(streams_[1:])
    async_to_sync(run)()
    assert not notify.listening(topic) and fanout.hub()._rechecks == {}


# --- only the changes that matter, only for the streams they concern --------------------------------------

@pytest.fixture
def checks(monkeypatch):
    """Every credentials check a stream runs, as (seconds to hold its answer, after it) can be set."""
    from channels_app import fanout
    real = fanout._auth_refused
    seen = []
    hold = []

    def counted(sub):
        out = real(sub)
        seen.append(out)
        if hold:
            time.sleep(hold.pop())
        return out
    monkeypatch.setattr(fanout, "_auth_refused", counted)
    return seen, hold


def _opened(tcast, settings, caller=None):
    """Bob's conversation, and a stream opened with a new key of `caller` (the operator's), its next
    keep-alive a minute away."""
    settings.UGENT_SSE_KEEPALIVE = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=caller or tcast.operator, label="laptop")
    return cb, key, Sse(open_stream("/v1/ugent/events", raw))


async def _until(done) -> None:
    deadline = time.monotonic() + AT_ONCE
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_a_save_that_changes_no_credential_wakes_no_stream_and_another_caller_s_wakes_not_this_one(
        tcast, settings, checks):
    seen, _ = checks
    cb, key, s = _opened(tcast, settings)
    theirs, _ = services.api_key_issue(caller=tcast.app, label="x")

    def saves():
        key.label = "renamed"
        key.save()
        caller = key.caller
        caller.default_model = "gpt-x"
        caller.save()
        assert services.api_key_revoke(key_pk=theirs.pk)  # another caller's key

    async def run():
        try:
            await _live(cb, s)
            seen.clear()  # (the stream's one check as it started)
            await sync_to_async(saves)()
            await asyncio.sleep(0.5)
            await _append(cb, 2)
            return await asyncio.wait_for(s.event(), AT_ONCE)
        finally:
            await _closed([s])
    assert async_to_sync(run)()["data"]["data"] == {"k": 2}
    assert seen == []  # no check ran: nothing that authenticates this stream changed


def test_a_change_during_a_running_check_is_checked_before_anything_more_goes_out(tcast, settings, checks):
    """A change to the caller's other key starts a check; while it runs (its answer held back), this
    stream's own key is revoked and an event committed. The first check passes on what it read; the
    event must not go out before the second one ends the stream."""
    seen, hold = checks
    cb, key, s = _opened(tcast, settings)
    other, _ = services.api_key_issue(caller=tcast.operator, label="desk")

    async def run():
        try:
            await _live(cb, s)
            seen.clear()  # (the stream's one check as it started)
            reading = asyncio.ensure_future(to_the_end(s))  # the stream runs as its client reads it
            hold.append(1.0)
            await sync_to_async(services.api_key_revoke)(key_pk=other.pk)
            await _until(lambda: seen)  # the first check has read (and passed)
            await sync_to_async(services.api_key_revoke)(key_pk=key.pk)
            await _append(cb, 99)
            return await asyncio.wait_for(reading, AT_ONCE)
        finally:
            await _closed([s])
    frames = async_to_sync(run)()
    assert [f["event"] for f in frames] == ["ugent.error"], frames
    assert seen[0] is None and seen[-1] is not None, seen


def test_a_configured_caller_brought_in_line_with_the_file_wakes_nobody(tcast, tmp_path, settings):
    """Two processes whose ugent.toml disagree (a rolling deploy) each bring the row back to their own
    file; a wake-up from each would set the other off again without end."""
    from channels_app import auth, notify
    from channels_app.models import Caller
    from ugent_common import config
    path = tmp_path / "ugent.toml"
    path.write_text("[web.auth]\n")
    settings.UGENT_CONFIG = str(path)
    settings.UGENT_WEB_API_KEY = "env-operator-key-in-line"
    config.reset_caches()
    try:
        caller = auth.authenticate_headers({"x-api-key": "env-operator-key-in-line"}).caller
        woken = notify.register_blocking(auth.credentials_topic(caller.pk))
        try:
            Caller.objects.filter(pk=caller.pk).update(role="application")  # the other process's file
            auth._callers_forget()
            again = auth.authenticate_headers({"x-api-key": "env-operator-key-in-line"}).caller
            assert again.role == "operator" and Caller.objects.get(pk=caller.pk).role == "operator"
            assert not woken.wait(0.5)
        finally:
            woken.close()
    finally:
        config.reset_caches()


def test_an_issuer_changed_wakes_the_streams_of_the_callers_that_accept_its_tokens(tcast, settings, checks):
    from channels_app.models import Issuer
    seen, _ = checks
    issuer = Issuer.objects.create(issuer="https://id.example", jwks_url="https://id.example/jwks",
                                   audience="ugent", actor_prefix="ex")
    caller = tcast.operator
    caller.issuers = ["https://id.example"]
    caller.save()
    cb, key, s = _opened(tcast, settings, caller)

    def change():
        issuer.audience = "another"
        issuer.save()

    async def run():
        try:
            await _live(cb, s)
            seen.clear()  # (the stream's one check as it started)
            reading = asyncio.ensure_future(s.event())  # the stream runs as its client reads it
            await sync_to_async(change)()
            await _until(lambda: seen)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        finally:
            await _closed([s])
    async_to_sync(run)()
    assert seen == [None]  # checked once, at once; a key alone still holds


# --- asked when something may have changed, not at every keep-alive ---------------------------------------
# At 10,000 open streams a check per keep-alive (15 s) was about 670 key lookups a second on the readers'
# executor, nearly all finding nothing changed. What can change is announced (above), or is ugent.toml read
# anew, or a token's expiry, which is known; the backstop (UGENT_SSE_CREDENTIALS_RECHECK_SECS) is for the rest.

def test_keep_alives_run_no_credentials_check(tcast, settings, checks):
    seen, _ = checks
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))  # keep-alive 0.2 s (tests/streams/conftest.py)

    async def run():
        try:
            await _live(cb, s)
            assert seen == [None]  # the one check as it started (a change before it woke nobody)
            seen.clear()
            pings = 0
            while pings < 8:  # 1.6 s: eight keep-alives
                pings += (await asyncio.wait_for(s.frame(), AT_ONCE))["comment"] == "ping"
            await _append(cb, 2)
            return await asyncio.wait_for(s.event(), AT_ONCE)
        finally:
            await _closed([s])
    assert async_to_sync(run)()["data"]["data"] == {"k": 2}
    assert seen == []


@pytest.fixture
def token_issuer(tcast, settings):
    from channels_app import federation
    from channels_app.models import Issuer
    from tests.support import idp
    key = idp.SigningKey("ec")
    server = idp.JwksServer(key)
    federation.jwks_reset()
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 3600
    Issuer.objects.create(issuer=idp.ISSUER, jwks_url=server.url, audience=idp.AUDIENCE, actor_prefix=idp.PREFIX,
                          algorithms=["ES256"], leeway_secs=0)
    yield lambda exp_in, **extra: idp.sign(key, idp.claims("carol", exp_in=exp_in, **extra))
    server.close()
    federation.jwks_reset()


def _token_conversation(tcast, token_issuer) -> Conversation:
    """Carol's conversation "cc", started with a token of hers (the application's key)."""
    body = {"messages": [{"role": "user", "content": "hello"}], "conversation_id": "cc"}
    assert Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=tcast.keys["app"], HTTP_X_UGENT_IDENTITY=token_issuer(300)).status_code == 200
    return Conversation.objects.get(external_id="cc")


def _token_stream(tcast, token: str) -> Sse:
    return Sse(Client().get("/v1/ugent/events", {"conversation_id": "cc"}, HTTP_X_API_KEY=tcast.keys["app"],
                            HTTP_X_UGENT_IDENTITY=token))


def test_a_stream_opened_with_an_identity_token_ends_when_the_token_expires(tcast, settings, checks, token_issuer):
    """Its expiry is known when it is verified: the stream asks again then, not at a keep-alive or the
    backstop (both a minute here), and ends with the token's own refusal."""
    from channels_app.federation import CODE
    seen, _ = checks
    settings.UGENT_SSE_KEEPALIVE = 60
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 60
    cc = _token_conversation(tcast, token_issuer)
    s = _token_stream(tcast, token_issuer(3))

    async def run():
        try:
            await _live(cc, s)
            seen.clear()  # (the stream's one check as it started)
            return await asyncio.wait_for(to_the_end(s), 3 + AT_ONCE)
        finally:
            await _closed([s])
    frames = async_to_sync(run)()
    assert [f["event"] for f in frames] == ["ugent.error"]
    assert frames[0]["data"]["error"]["code"] == CODE
    assert "expired" in frames[0]["data"]["error"]["message"]
    assert len(seen) == 1  # one check: at the expiry


def test_a_key_taken_out_of_ugent_toml_ends_its_stream_at_the_next_keep_alive(tcast, settings, checks, tmp_path,
                                                                             monkeypatch):
    """A configured key's file is each process's own: no wake-up tells of it. The stream asks again once
    the process has read ugent.toml anew, without waiting for the backstop."""
    from ugent_common import config
    seen, _ = checks
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 60
    settings.UGENT_CONFIG_RECHECK_SECS = 0.1
    monkeypatch.setenv("UGENT_OPS_STREAM_KEY", "ops-stream-secret")
    path = tmp_path / "ugent.toml"
    entry = '[[web.auth.keys]]\nname = "ops"\nkey_env = "UGENT_OPS_STREAM_KEY"\nrole = "operator"\n'
    path.write_text(entry)
    settings.UGENT_CONFIG = str(path)
    config.reset_caches()
    try:
        cb = _conversation(tcast.bob, "cb")
        s = Sse(open_stream("/v1/ugent/events", "ops-stream-secret"))

        async def run():
            try:
                await _live(cb, s)
                seen.clear()  # (the stream's one check as it started)
                reading = asyncio.ensure_future(to_the_end(s))  # the stream runs as its client reads it
                await asyncio.sleep(0.6)  # keep-alives with the file unchanged: no check
                assert seen == [] and not reading.done()
                path.write_text("[web.auth]\n# the ops key is gone\n")
                return await asyncio.wait_for(reading, AT_ONCE)
            finally:
                await _closed([s])
        frames = async_to_sync(run)()
    finally:
        config.reset_caches()
    assert [f["event"] for f in frames] == ["ugent.error"]
    assert frames[0]["data"]["error"]["code"] == "invalid_api_key"


def test_a_token_that_expires_before_its_stream_s_body_starts_is_still_asked_about(tcast, settings, checks,
                                                                                  token_issuer):
    """Verified when the request came (valid), expired by the time the response's body first runs (a loaded
    process, a client slow to read): the stream asks at once, not at the backstop."""
    from channels_app.federation import CODE
    seen, _ = checks
    settings.UGENT_SSE_KEEPALIVE = 60
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 60
    cc = _token_conversation(tcast, token_issuer)
    # exp is whole seconds (now truncated, plus 2): valid for 1 to 2 s, room for the request on a loaded machine
    # (with exp_in=1 it was 0 to 1 s, and CI once saw the stream refused at its request, a 403)
    s = _token_stream(tcast, token_issuer(2))
    time.sleep(2.5)  # the body has not started: the token is expired now

    async def run():
        try:
            reading = asyncio.ensure_future(to_the_end(s))
            await _until(lambda: seen)
            await _append(cc, 2)
            return await asyncio.wait_for(reading, AT_ONCE)
        finally:
            await _closed([s])
    frames = async_to_sync(run)()
    assert [f["event"] for f in frames] == ["ugent.error"], frames
    assert frames[0]["data"]["error"]["code"] == CODE


def test_a_token_whose_exp_no_float_holds_is_verified_as_before(tcast, token_issuer):
    """PyJWT takes any integer exp; the expiry kept for the stream is then never."""
    import math

    from channels_app import federation
    token = token_issuer(None, exp=10 ** 400)
    assert federation.token_verify(token).expires_at == math.inf
    assert federation.token_verify(token_issuer(60)).expires_at == pytest.approx(time.time() + 60, abs=5)


@pytest.mark.parametrize("value", ["0", "-5", "0.5"])
def test_a_backstop_that_is_no_positive_number_of_seconds_stops_the_start(value, tmp_path):
    """0 would make every idle stream check without end. Refused when the settings load, with the variable
    named (django-environ refuses "nan" and "inf" itself)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(UGENT_SSE_CREDENTIALS_RECHECK_SECS=value, DJANGO_SETTINGS_MODULE="ugent_site.settings",
               UGENT_VAR_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "UGENT_SSE_CREDENTIALS_RECHECK_SECS" in done.stderr and "at least 1" in done.stderr


def test_a_key_revoked_before_the_stream_s_body_starts_ends_it(tcast, settings):
    """Revoked after the request's own check, before the stream joined its caller's wake-ups: the wake-up
    reached no stream, so each stream asks once as it starts (it waited for the backstop, 225-300 s)."""
    settings.UGENT_SSE_KEEPALIVE = 60
    settings.UGENT_SSE_CREDENTIALS_RECHECK_SECS = 60
    cb = _conversation(tcast.bob, "cb")
    key, raw = services.api_key_issue(caller=tcast.operator, label="laptop")
    s = Sse(open_stream("/v1/ugent/events", raw))  # authenticated; its body has not run yet
    assert services.api_key_revoke(key_pk=key.pk)

    async def run():
        try:
            reading = asyncio.ensure_future(to_the_end(s))
            await asyncio.sleep(0.5)
            await _append(cb, 2)  # bob's event, after the revocation
            return await asyncio.wait_for(reading, AT_ONCE)
        finally:
            await _closed([s])
    frames = async_to_sync(run)()
    assert [f["event"] for f in frames] == ["ugent.error"], frames
    assert frames[0]["data"]["error"]["code"] == "invalid_api_key"
