"""channel-discord's parts on their own: normalisation, markup, nonces, and REST rate limits against the fake."""
from __future__ import annotations

import pytest

from plugins_app.channel.sdk import DeliveryFailed
from plugins_app.channel.workers import discord as worker
from plugins_app.channel.workers import installed_kinds
from tests.fakes.discord import FakeDiscord

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

BOT_ID = "1100000000000000001"


def message(**over):
    d = {"id": "900", "channel_id": "77", "author": {"id": "42", "username": "alice", "global_name": "Alice"},
         "content": "hi", "timestamp": "2024-05-01T12:00:00.000000+00:00", "attachments": [], "type": 0}
    d.update(over)
    return d


def test_a_dm_is_a_user_conversation_and_a_guild_channel_a_room():
    dm = worker.normalise_message(message())
    assert (dm.channel, dm.conversation_id, dm.message_id, dm.sender_id, dm.sender_name, dm.source_type) == \
        ("discord", "77", "900", "42", "Alice", "user")
    room = worker.normalise_message(message(guild_id="5", member={"nick": "Ali"}))
    assert (room.source_type, room.sender_name, room.metadata) == ("room", "Ali", {"guild_id": "5"})
    assert dm.timestamp == "2024-05-01T12:00:00.000000Z"
    dm.validate()


def test_a_reply_carries_the_message_it_answers_and_attachments_their_cdn_url():
    d = message(type=19, message_reference={"message_id": "800", "channel_id": "77"},
                referenced_message={"id": "800", "content": "earlier", "author": {"id": "43"}},
                attachments=[{"id": "1", "filename": "a.png", "size": 3, "url": "https://cdn.discordapp.com/a.png",
                              "content_type": "image/png"},
                             {"id": "2", "filename": "notes", "size": 3, "url": "https://cdn.discordapp.com/n"}])
    msg = worker.normalise_message(d)
    assert (msg.reply_to.message_id, msg.reply_to.text, msg.reply_to.sender_id) == ("800", "earlier", "43")
    assert [(a.kind, a.content_type, a.filename, a.url) for a in msg.attachments] == [
        ("image", "image/png", "a.png", "https://cdn.discordapp.com/a.png"),
        ("other", "application/octet-stream", "notes", "https://cdn.discordapp.com/n")]
    msg.validate()


@pytest.mark.parametrize("over", [
    {"author": {"id": BOT_ID, "username": "me"}},                # the bot itself
    {"author": {"id": "9", "username": "other", "bot": True}},  # another bot
    {"webhook_id": "3"},                                         # a webhook's post
    {"type": 7},                                                 # a member joined
])
def test_what_is_not_a_person_speaking_is_not_submitted(over):
    assert worker.normalise_message(message(**over), own_user_id=BOT_ID) is None


def test_markdown_is_converted_to_what_discord_renders():
    text = ("#### Deep heading\n**bold** and `code`\n\n![chart](https://x/c.png)\n\n---\n"
            "| a | b |\n|---|---|\n| 1 | 2 |\n\n```py\n#### not a heading\n```")
    assert worker.markdown_to_discord(text) == (
        "**Deep heading**\n**bold** and `code`\n\n[chart](https://x/c.png)\n\n"
        "```\n| a | b |\n|---|---|\n| 1 | 2 |\n```\n\n```py\n#### not a heading\n```")
    assert worker.markdown_to_discord("# Title\n- item") == "# Title\n- item"


def test_nonces_fit_discords_25_characters_and_differ_per_part():
    a0, a1, b0 = worker.nonce_for("d-1", 0), worker.nonce_for("d-1", 1), worker.nonce_for("d-2", 0)
    assert len({a0, a1, b0}) == 3 and all(len(n) == 25 for n in (a0, a1, b0))
    assert worker.nonce_for("d-1", 0) == a0


def test_channel_discord_is_an_installed_kind_with_its_env_refs():
    kind = installed_kinds()["channel-discord"]
    assert (kind.module, kind.env_refs) == ("plugins_app.channel.workers.discord",
                                            ("DISCORD_BOT_TOKEN", "DISCORD_API_BASE_URL"))


@pytest.fixture
def fake():
    fake = FakeDiscord().start()
    yield fake
    fake.stop()


def test_a_per_route_and_a_global_429_are_waited_out_and_the_request_repeated(fake):
    rest = worker.Rest(fake.api_base_url, fake.token)
    fake.inject_429(retry_after=0.2)
    fake.inject_429(retry_after=0.2, is_global=True)
    resp = rest.request("POST", "/channels/7/messages", json={"content": "x"})
    assert resp.status_code == 200
    assert [r["status"] for r in fake.requests] == [429, 429, 200]
    assert [m["content"] for m in fake.sent()] == ["x"]


def test_a_rate_limit_longer_than_a_minute_fails_the_send_for_a_later_retry(fake):
    rest = worker.Rest(fake.api_base_url, fake.token)
    fake.inject_429(retry_after=3600)
    with pytest.raises(DeliveryFailed) as err:
        rest.request("POST", "/channels/7/messages", json={"content": "x"})
    assert not err.value.permanent and "rate limited" in err.value.reason
    assert fake.sent() == []


def test_an_empty_bucket_waits_for_its_reset_before_the_next_request(fake, monkeypatch):
    rest = worker.Rest(fake.api_base_url, fake.token)
    slept = []
    monkeypatch.setattr(worker.time, "sleep", lambda s: slept.append(s))

    class Resp:
        headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset-After": "2.5"}
    rest._note_bucket("POST /channels/7/messages", Resp())
    rest.request("POST", "/channels/7/messages", json={"content": "x"})
    assert len(slept) == 1 and 0 < slept[0] <= 2.5
    rest.request("POST", "/channels/8/messages", json={"content": "y"})  # another chat's bucket is free
    assert len(slept) == 1


def test_the_same_nonce_sent_twice_makes_one_message(fake):
    rest = worker.Rest(fake.api_base_url, fake.token)
    body = {"content": "x", "nonce": worker.nonce_for("d", 0), "enforce_nonce": True}
    first = rest.request("POST", "/channels/7/messages", json=body).json()
    again = rest.request("POST", "/channels/7/messages", json=body).json()
    assert first["id"] == again["id"] and len(fake.sent()) == 1
