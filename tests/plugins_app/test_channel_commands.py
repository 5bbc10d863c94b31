"""Slash commands typed on a chat channel: run for the sender, answered in the chat, never a turn.

The seed names /v1/ugent/commands as "Slash commands a channel may run", with changes only with
allow_remote_control; on a chat channel that is the plugin's `allow_remote_control` list of senders
(docs/commands.md, "From a chat channel"). The real services on the real database, as the bridge calls
them for each message a worker sends; the echo worker under the real supervisor at the end. Both run
modes run this file.
"""
from __future__ import annotations

import pytest

from channels_app import commands
from channels_app.models import Actor, Conversation, Message, Receipt, Steering, Turn
from plugins_app.agent.models import AgentProfile
from plugins_app.channel import services
from plugins_app.channel.models import OutboundDelivery
from plugins_app.channel.sdk import Attachment, InboundMessage
from plugins_app.channel.tomlio import PluginsFileError, plugins_export, plugins_import, plugins_parse
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PID = "echo-main"


@pytest.fixture
def other_model(tcast):
    return AgentProfile.objects.create(name="other", provider="scripted", config={"prefix": "other"})


def say(message_id, text, *, sender="42", chat="chat-1", attachments=()):
    msg = InboundMessage(channel="echo", conversation_id=chat, message_id=message_id, sender_id=sender, text=text,
                         source_type="user", attachments=list(attachments))
    return services.inbound_submit(plugin_id=PID, message=msg)


def answers() -> list[OutboundDelivery]:
    return list(OutboundDelivery.objects.filter(payload__metadata__kind="command").order_by("id"))


def no_turns() -> bool:
    return not Turn.objects.exists() and not Receipt.objects.exists() and not Message.objects.exists()


def model_choice(sender="42") -> str:
    return Actor.objects.get(key=f"echo:{sender}").model_choice


def test_a_read_only_command_is_answered_in_the_chat_and_runs_no_turn(tcast, other_model):
    make_plugin(PID)
    result = say("m-1", "/models")
    assert result == {"accepted": True, "duplicate": False, "command": "/models", "ok": True}
    [d] = answers()
    assert d.text.startswith("The models you may name:") and "- other" in d.text
    assert d.payload["reply_to_message_id"] == "m-1" and d.turn is None
    assert d.payload["metadata"] == {"kind": "command", "command": "/models", "ok": True, "changed": False}
    assert d.delivery_id == services.command_delivery_id(plugin_id=PID, conversation_id="chat-1", message_id="m-1")
    assert d.conversation == Conversation.objects.get(channel="echo", client_id=PID, external_id="chat-1")
    assert no_turns()


def test_the_same_message_again_runs_nothing_and_answers_nothing_twice(tcast, other_model, monkeypatch):
    make_plugin(PID, allow_remote_control=["echo:42"])
    assert say("m-1", "/model other")["duplicate"] is False
    ran = []
    monkeypatch.setitem(commands.HANDLERS, "/model", lambda ctx: ran.append(ctx) or commands._result(ctx, "ran"))
    assert say("m-1", "/model other") == {"accepted": True, "duplicate": True, "command": "/model"}
    assert ran == [] and len(answers()) == 1
    # the same id in another chat is another message
    assert say("m-1", "/model other", chat="chat-2")["duplicate"] is False and len(ran) == 1


def test_a_change_needs_the_sender_in_allow_remote_control_and_changes_nothing_otherwise(tcast, other_model):
    make_plugin(PID, allow_remote_control=["echo:7"])
    for i, text in enumerate(["/model other", "/harness goal ship it", "/compress", "/sandbox"]):
        result = say(f"m-{i}", text)
        assert result["accepted"] and result["ok"] is False, text
        name = text.split()[0]
        assert answers()[-1].text == commands.CHANNEL_REMOTE_CONTROL_REFUSED.format(
            name=name, read_only=commands.CHANNEL_READ_ONLY)
    assert model_choice() == ""
    assert say("m-9", "/harness")["ok"] is True and answers()[-1].text.startswith("No goals or tasks yet")
    # sender 7 may
    assert say("m-10", "/model other", sender="7")["ok"] is True
    assert model_choice("7") == "other" and model_choice() == ""
    assert answers()[-1].text.startswith("Your model is now other")
    assert answers()[-1].payload["metadata"]["changed"] is True
    assert say("m-11", "/sandbox", sender="7")["ok"] is True and "workspace" in answers()[-1].text.lower()
    assert no_turns()


def test_a_star_lets_every_allowed_sender_change_things(tcast, other_model):
    make_plugin(PID, allow_remote_control=["*"], allowed_senders=["echo:42", "echo:43"])
    assert say("m-1", "/model other", sender="43")["ok"] is True and model_choice("43") == "other"
    # a sender outside allowed_senders is refused before anything runs, as any message of theirs is
    assert say("m-2", "/model other", sender="99") == {"accepted": False, "duplicate": False,
                                                       "reason": services.SENDER_NOT_ALLOWED}
    assert not Actor.objects.filter(key="echo:99").exists() and len(answers()) == 1


def test_a_refusal_of_the_command_itself_is_its_answer(tcast):
    make_plugin(PID, allow_remote_control=["*"])
    say("m-1", "/model nosuchmodel")
    assert answers()[-1].text == "The model 'nosuchmodel' is not available here."
    say("m-2", "/steering go faster")
    assert answers()[-1].text == "No turn is running in this conversation."
    say("m-3", "/harness frobnicate")
    assert answers()[-1].text.startswith("Unknown /harness subcommand 'frobnicate'")
    say("m-4", "/recall")
    assert answers()[-1].text.startswith("Say what to recall for")
    say("m-5", "/recall the weather")
    assert answers()[-1].text == commands.NO_MEMORY
    assert [d.payload["metadata"]["ok"] for d in answers()] == [False, False, False, False, True]
    assert no_turns() and model_choice() == ""


def test_steering_from_the_chat_reaches_the_senders_running_turn(tcast):
    make_plugin(PID, allow_remote_control=["echo:42"])
    from tests.plugins_app.test_channel_questions import running_turn
    turn = running_turn(sender="42", chat="chat-1")
    assert say("m-1", "/steering use metric units")["ok"] is True
    steering = Steering.objects.get()
    assert steering.turn == turn and steering.text == "use metric units"
    assert answers()[-1].text.startswith(f"Steering queued for turn {turn.turn_id}")


# --- commands that ask the engine: answered from a task, the delivery held meanwhile -----------------

def test_btw_is_answered_by_its_task_into_the_one_delivery_and_a_repeat_asks_nothing(tcast):
    from tests.support import scripted
    make_plugin(PID)
    result = say("m-1", "/btw what is a turn?")  # (Celery is eager here: the task ran at the commit)
    assert result == {"accepted": True, "duplicate": False, "command": "/btw", "ok": False}
    [d] = answers()
    assert d.text.startswith("echo: what is a turn?") and d.not_before is None
    assert d.payload["metadata"] == {"kind": "command", "command": "/btw", "ok": True, "changed": False}
    assert scripted.CALLS[-1]["session_id"].startswith("aside-")
    asked = len(scripted.CALLS)
    assert say("m-1", "/btw what is a turn?")["duplicate"] is True
    assert len(scripted.CALLS) == asked and len(answers()) == 1 and no_turns()
    assert [d.delivery_id for d in services.deliveries_claim(plugin_id=PID, max_items=5)] == [d.delivery_id]


def test_until_its_task_answers_the_delivery_is_held_and_a_late_or_second_run_changes_nothing(tcast, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from plugins_app import tasks
    make_plugin(PID)
    queued = []
    monkeypatch.setattr(tasks.channel_command_answer, "delay", lambda *a: queued.append(a))
    say("m-1", "/refine")
    [d] = answers()
    assert d.text == services.COMMAND_NOT_ANSWERED and d.not_before > timezone.now() + timedelta(seconds=60)
    assert services.deliveries_claim(plugin_id=PID, max_items=5) == []  # held: not handed out
    assert tasks.channel_command_answer(*queued[0]) is True
    d.refresh_from_db()
    assert d.text == "There is no message of yours in this conversation to refine." and d.not_before is None
    assert tasks.channel_command_answer(*queued[0]) is False  # redelivered after a crash: the answer stays
    # a task that comes after the hold passed finds its placeholder gone out and leaves it be
    say("m-2", "/btw late?")
    late = answers()[-1]
    OutboundDelivery.objects.filter(pk=late.pk).update(not_before=timezone.now() - timedelta(seconds=1))
    assert [x.delivery_id for x in services.deliveries_claim(plugin_id=PID, max_items=5)] == [
        d.delivery_id, late.delivery_id]
    assert tasks.channel_command_answer(*queued[1]) is False
    late.refresh_from_db()
    assert late.text == services.COMMAND_NOT_ANSWERED


def test_compress_with_a_summariser_that_never_returns_answers_in_time_from_its_task(tcast, settings):
    # The task asked the summariser on the Celery worker's thread, unbounded: one that never returned kept
    # that thread for ever, and the chat got the placeholder only when the hold ran out.
    from channels_app.services import channel_actor_resolve, conversation_resolve
    from tests.support import blocking
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    settings.UGENT_COMMAND_ENGINE_TIMEOUT = 0.5
    plugin = make_plugin(PID, allow_remote_control=["echo:42"])
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id=plugin.plugin_id, external_id="chat-1", actor=actor,
                                   caller=None)
    for i in range(3):
        Message.objects.create(conversation=conv, role="user", content=f"question {i}", actor=actor)
        Message.objects.create(conversation=conv, role="assistant", content=f"answer {i}")
    with blocking.blocked_summarizer("test-blocked") as gate:
        AgentProfile.objects.filter(pk=tcast.profile.pk).update(summarizer_engine="test-blocked")
        blocking.within(lambda: say("m-1", "/compress"), gate)  # (Celery is eager: the task runs at the commit)
        [d] = answers()
        assert d.text == "Compacting the conversation failed; the agent's log says why." and d.not_before is None
        assert d.payload["metadata"]["ok"] is False and gate.calls == 1
        assert not Message.objects.filter(hidden=True).exists()


@pytest.mark.parametrize("text", ["/start", "/etc/hosts is empty, why?", "/ model", "hello /model", "/"])
def test_text_that_is_no_command_here_goes_to_the_model(tcast, text):
    make_plugin(PID, allow_remote_control=["*"])
    result = say("m-1", text)
    assert result["accepted"] and "command" not in result and result.get("turn_id")
    assert Receipt.objects.get().client_message_id == "m-1" and answers() == []


def test_a_command_is_read_case_blind_and_one_addressed_to_another_bot_is_none(tcast, other_model):
    from plugins_app.channel.workers.telegram.updates import addressed_to
    make_plugin(PID)
    assert say("m-1", "/MODEL")["command"] == "/model"
    assert len(answers()) == 1 and no_turns()
    # Telegram's group form: the worker strips its own bot's name; another bot's stays, and is no command
    assert addressed_to("/models@UGENT_bot", "ugent_bot") == "/models"
    assert addressed_to("/model@ugent_bot gpt-x", "ugent_bot") == "/model gpt-x"
    assert addressed_to("/model@ugent_botty", "ugent_bot") == "/model@ugent_botty"
    assert addressed_to("hi /model@ugent_bot", "ugent_bot") == "hi /model@ugent_bot"
    assert "command" not in say("m-2", "/models@other_bot") and len(answers()) == 1


def test_a_file_with_a_command_as_its_caption_is_a_message(tcast):
    make_plugin(PID)
    photo = Attachment(kind="image", content_type="image/jpeg", url="https://example.invalid/p.jpg")
    result = say("m-1", "/btw what is this?", attachments=[photo])
    assert result.get("turn_id") and answers() == []


# --- plugins.toml ----------------------------------------------------------------------------------

TOML = """schema_version = 1
[[plugins]]
id = "echo-main"
kind = "channel-echo"
command = "python"
[plugins.routing]
allow_remote_control = {senders}
"""


def test_plugins_toml_sets_allow_remote_control_and_exports_it(tcast):
    plugins_import(text=TOML.format(senders='["echo:42", "*"]'))
    plugin = services.Plugin.objects.get(plugin_id=PID)
    assert plugin.allow_remote_control == ["echo:42", "*"]
    assert plugins_parse(plugins_export())[0]["allow_remote_control"] == ["echo:42", "*"]
    with pytest.raises(PluginsFileError, match="'42' is not channel:sender_id"):
        plugins_parse(TOML.format(senders='["42"]'))
    assert plugins_parse(TOML.format(senders="[]"))[0]["allow_remote_control"] == []


# --- end to end: the echo worker under the real supervisor ------------------------------------------

def test_echo_a_typed_command_is_answered_in_the_chat_once(tcast, echo, start_runtime, other_model):
    make_plugin(PID, allow_remote_control=["echo:42"])
    rt = start_runtime()
    echo.say("m-1", "/model other")
    echo.say("m-2", "/models", sender_id="43")
    assert wait_until(lambda: len(echo.sends()) >= 2, 30), rt.log(PID)
    ids = {m: services.command_delivery_id(plugin_id=PID, conversation_id="chat-1", message_id=m) for m in ("m-1", "m-2")}
    texts = {s["delivery_id"]: s["text"] for s in echo.sends()}
    assert texts[ids["m-1"]].startswith("Your model is now other") and "- other" in texts[ids["m-2"]]
    assert model_choice() == "other" and no_turns()
    echo.say("m-1", "/model other")  # the channel sending it again
    echo.say("m-3", "hello")
    assert wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).exists(), 30), rt.log(PID)
    assert wait_until(lambda: len(echo.sends()) >= 3, 30), rt.log(PID)
    assert [s["delivery_id"] for s in echo.sends()].count(ids["m-1"]) == 1 and len(echo.sends()) == 3
    assert Turn.objects.get().receipt.client_message_id == "m-3"


# --- the admin -------------------------------------------------------------------------------------

def test_the_admin_edits_allow_remote_control_and_refuses_what_is_no_sender(tcast, admin_client):
    plugin = make_plugin(PID)
    url = f"/admin/plugins_app/plugin/{plugin.pk}/change/"
    form = {"plugin_id": PID, "kind": "channel-echo", "enabled": "on", "command": "python", "args": "[]",
            "env_refs": "[]", "secret_env_refs": "[]", "max_in_flight": 8, "max_retries": 2, "heartbeat_secs": 0.2,
            "workspace": "", "allowed_senders": "[]", "secrets-TOTAL_FORMS": 0, "secrets-INITIAL_FORMS": 0}
    for bad in ('"echo:42"', '["42"]', '[7]'):
        page = admin_client.post(url, {**form, "allow_remote_control": bad}).content.decode()
        assert "is not channel:sender_id" in page or "A list of" in page, bad
        plugin.refresh_from_db()
        assert plugin.allow_remote_control == []
    assert admin_client.post(url, {**form, "allow_remote_control": '["echo:42"]'}).status_code == 302
    plugin.refresh_from_db()
    assert plugin.allow_remote_control == ["echo:42"] and services.sender_may_remote_control(plugin, "42")
    assert not services.sender_may_remote_control(plugin, "43")


def test_telegram_a_command_addressed_to_the_bot_is_answered_in_the_chat(tcast, start_runtime, monkeypatch,
                                                                         other_model):
    from tests.fakes.telegram import FakeTelegram
    fake = FakeTelegram().start()
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake.token)
    monkeypatch.setenv("TELEGRAM_API_BASE_URL", fake.base_url)
    try:
        make_plugin("tg-main", kind="channel-telegram", command="",
                    args=["--mode", "polling", "--poll-timeout", "2", "--per-chat-secs", "0", "--group-secs", "0"],
                    env_refs=["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL"], heartbeat_secs=1.0,
                    allow_remote_control=["telegram:42"])
        rt = start_runtime(limits={"startup_grace_secs": 15.0})
        assert wait_until(lambda: fake.polls_begun >= 1, 20), rt.log("tg-main")
        fake.push_message(42, "/model@ugent_test_bot other")
        assert fake.wait_sent(1, timeout=30), rt.log("tg-main")
        assert fake.texts()[0].startswith("Your model is now other")
        assert Actor.objects.get(key="telegram:42").model_choice == "other" and not Turn.objects.exists()
        fake.push_message(42, "/models@some_other_bot")  # not ours: a message to the model, as before
        assert wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).exists(), 30), rt.log("tg-main")
        assert Turn.objects.get().receipt.content_hash and len(answers()) == 1
    finally:
        fake.stop()
