"""channel-telegram's parts on their own: normalising updates, Markdown → MarkdownV2, keyboards, limits."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from plugins_app.channel.sdk.text import split_text, utf16_len
from plugins_app.channel.workers import installed_kinds, kind_module
from plugins_app.channel.workers.telegram import (DEFAULT_BASE_URL, RateLimiter, escape_v2, file_base_url,
                                                  keyboard_of, markdown_to_v2, normalise, parse_args,
                                                  parse_conversation, reply_message_id, webhook_secret)
from tests.fakes.telegram import markdown_v2_problem

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

CHAT = {"id": 42, "type": "private", "first_name": "Ada", "username": "ada"}
ADA = {"id": 42, "is_bot": False, "first_name": "Ada", "last_name": "L", "username": "ada"}


def update(**message):
    body = {"message_id": 7, "date": 1700000000, "chat": CHAT, "from": ADA, "text": "hi"}
    body.update(message)
    return {"update_id": 555, "message": body}


def test_channel_telegram_is_a_builtin_kind_that_needs_only_the_bot_token():
    assert kind_module("channel-telegram") == "plugins_app.channel.workers.telegram"
    assert installed_kinds()["channel-telegram"].env_refs == ("TELEGRAM_BOT_TOKEN",)


def test_a_private_message_is_normalised_with_the_update_id_as_its_key():
    msg = normalise(update())
    assert (msg.channel, msg.conversation_id, msg.message_id, msg.sender_id, msg.sender_name, msg.source_type,
            msg.text) == ("telegram", "42", "555:7", "42", "Ada L", "user", "hi")
    assert reply_message_id(msg.message_id) == 7


@pytest.mark.parametrize("chat_type,source_type", [("private", "user"), ("group", "group"),
                                                   ("supergroup", "group"), ("channel", "room")])
def test_the_chat_type_maps_to_the_source_type(chat_type, source_type):
    u = update(chat={"id": -100, "type": chat_type, "title": "t"})
    assert normalise(u).source_type == source_type


def test_a_channel_post_comes_from_the_channel_itself():
    chan = {"id": -1002, "type": "channel", "title": "News"}
    msg = normalise({"update_id": 9, "channel_post": {"message_id": 3, "date": 1, "chat": chan,
                                                      "sender_chat": chan, "text": "post"}})
    assert (msg.conversation_id, msg.sender_id, msg.source_type, msg.sender_name) == ("-1002", "-1002", "room",
                                                                                      "News")


def test_a_forum_topic_is_its_own_conversation_and_answers_go_back_to_the_topic():
    u = update(chat={"id": -1001, "type": "supergroup", "title": "f", "is_forum": True},
               message_thread_id=12, is_topic_message=True)
    msg = normalise(u)
    assert msg.conversation_id == "-1001/12"
    assert parse_conversation(msg.conversation_id) == (-1001, 12)
    assert parse_conversation("42") == (42, None)


def test_a_reply_carries_the_message_it_answers():
    u = update(reply_to_message={"message_id": 5, "date": 1, "chat": CHAT, "from": {"id": 9, "is_bot": True,
                                                                                      "first_name": "b"},
                                 "text": "earlier"})
    reply = normalise(u).reply_to
    assert (reply.message_id, reply.text, reply.sender_id) == ("5", "earlier", "9")


def test_a_photo_with_a_caption_becomes_text_and_the_largest_size_as_an_attachment():
    sizes = [{"file_id": "small", "file_unique_id": "a", "width": 90, "height": 90, "file_size": 100},
             {"file_id": "big", "file_unique_id": "b", "width": 800, "height": 800, "file_size": 9000}]
    u = update(text=None, caption="look", photo=sizes)
    del u["message"]["text"]
    msg = normalise(u)
    assert msg.text == "look"
    (att,) = msg.attachments
    assert (att.kind, att.content_type, att.url, att.size) == ("image", "image/jpeg", "tg-file:big", 9000)


def test_a_document_and_a_voice_note_keep_their_types():
    u = update(document={"file_id": "d", "file_unique_id": "d1", "file_name": "a.pdf",
                         "mime_type": "application/pdf"}, voice={"file_id": "v", "file_unique_id": "v1",
                                                                 "duration": 2})
    kinds = [(a.kind, a.content_type, a.filename) for a in normalise(u).attachments]
    assert kinds == [("document", "application/pdf", "a.pdf"), ("audio", "audio/ogg", None)]


def test_a_service_message_or_an_unknown_update_is_not_submitted():
    u = update()
    del u["message"]["text"]
    u["message"]["new_chat_members"] = [ADA]
    assert normalise(u) is None
    assert normalise({"update_id": 1, "my_chat_member": {}}) is None


def test_a_button_press_is_a_message_from_the_presser_replying_to_the_question():
    cq = {"update_id": 77, "callback_query": {"id": "cq1", "from": ADA, "chat_instance": "x", "data": "yes",
                                              "message": {"message_id": 30, "date": 1, "chat": CHAT,
                                                          "text": "Deploy?"}}}
    msg = normalise(cq)
    assert (msg.conversation_id, msg.message_id, msg.sender_id, msg.text, msg.reply_to.message_id) == \
        ("42", "77:cb", "42", "yes", "30")
    assert msg.metadata["telegram"]["callback_query_id"] == "cq1"


def test_options_become_one_button_a_row_with_callback_data_cut_to_64_bytes():
    kb = keyboard_of({"options": ["yes", {"label": "Later", "value": "x" * 100}]})
    assert kb == {"inline_keyboard": [[{"text": "yes", "callback_data": "yes"}],
                                      [{"text": "Later", "callback_data": "x" * 64}]]}
    assert keyboard_of({}) is None and keyboard_of({"options": "yes"}) is None


@pytest.mark.parametrize("source,expected", [
    ("plain 1.5 + (x)!", r"plain 1\.5 \+ \(x\)\!"),
    ("**bold** and *it* and _it_ and ~~gone~~", r"*bold* and _it_ and _it_ and ~gone~"),
    ("snake_case_name stays", r"snake\_case\_name stays"),
    ("`a_b*c` code", r"`a_b*c` code"),
    ("[docs](https://x.y/a?b=1)", r"[docs](https://x.y/a?b=1)"),
    ("# Title", r"*Title*"),
    ("- one\n- two", "\u2022 one\n\u2022 two"),
    ("1. first", r"1\. first"),
    ("> said.", r">said\."),
    ("```python\nprint('`')\n```", "```python\nprint('\\`')\n```"),
    # italic within italic: V2 has no such thing, and "_" + "_a_" would read as "__", underline
    ("_*a*~_", r"_a\~_"),
    ("**a __b__ c**", r"*a b c*"),
])
def test_markdown_becomes_markdown_v2(source, expected):
    assert markdown_to_v2(source) == expected
    assert markdown_v2_problem(markdown_to_v2(source)) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("ab _*~`[]()#+-=|{}.!>\\\n") + ["**", "```", "__", "~~", "é", "😀"]),
                max_size=60).map("".join))
def test_any_text_converts_to_markdown_v2_that_telegram_parses(text):
    assert markdown_v2_problem(markdown_to_v2(text)) is None, markdown_to_v2(text)


def test_escape_v2_escapes_every_reserved_character():
    assert escape_v2(r"_*[]()~`>#+-=|{}.!\ ") == r"\_\*\[\]\(\)\~\`\>\#\+\-\=\|\{\}\.\!\\ "
    # the fake's parser, which the conversions above are checked by, does refuse what Telegram refuses
    assert markdown_v2_problem("costs 1.5") and markdown_v2_problem("*open bold") and markdown_v2_problem("`x")


def test_a_long_answer_splits_at_4096_utf16_units_and_each_part_is_valid_markdown_v2():
    text = ("😀 emoji word " * 600) + "\n\n```\n" + ("code line\n" * 300) + "```"
    parts = split_text(text, 4096, measure=utf16_len)
    assert len(parts) > 1 and all(utf16_len(p) <= 4096 for p in parts)
    assert all(markdown_v2_problem(markdown_to_v2(p)) is None for p in parts)


def test_the_rate_limiter_keeps_a_gap_per_chat_longer_in_groups_and_honours_retry_after():
    now = [100.0]
    rl = RateLimiter(per_chat_secs=1.0, group_secs=3.0, global_per_sec=10, clock=lambda: now[0])
    assert rl.reserve(42) == 0
    assert rl.reserve(-5) == pytest.approx(0.1)   # another chat waits only for the global rate
    assert rl.reserve(43) == pytest.approx(0.2)
    assert rl.reserve(42) == pytest.approx(1.0)   # a private chat's own gap
    assert rl.reserve(-5) == pytest.approx(3.1)   # a group's longer one
    rl.block(7, 30)
    assert rl.reserve(7) == pytest.approx(30.0)


def test_the_base_url_defaults_to_the_bot_api_and_files_live_beside_it():
    assert DEFAULT_BASE_URL == "https://api.telegram.org/bot"
    assert file_base_url(DEFAULT_BASE_URL) == "https://api.telegram.org/file/bot"
    assert file_base_url("http://localhost:8081/bot") == "http://localhost:8081/file/bot"


def test_the_webhook_secret_is_derived_from_the_token_in_the_characters_telegram_allows():
    secret = webhook_secret("123:abc")
    assert secret == webhook_secret("123:abc") != webhook_secret("123:abd")
    assert 1 <= len(secret) <= 256 and set(secret) <= set("0123456789abcdef")


def test_the_mode_is_polling_or_webhook_and_nothing_else():
    assert parse_args([]).mode == "polling"
    assert parse_args(["--mode", "webhook", "--webhook-port", "0"]).webhook_port == 0
    with pytest.raises(SystemExit):
        parse_args(["--mode", "carrier-pigeon"])
