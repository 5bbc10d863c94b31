"""Questions through real channel workers (issue #13, item 2): the supervisor runs the worker, the bridge
carries its messages, the turn runs in a thread of its own and its engine calls ask_user, and the
question comes out as a delivery the worker renders; the user's next message answers it.

The echo worker renders options as `buttons` beside the numbered text; the Telegram worker as an
inline keyboard, against the fake Bot API on loopback (tests/fakes/telegram.py).
"""
from __future__ import annotations

import json
import sys

import pytest

from channels_app.models import Question, Receipt, Turn
from plugins_app.channel.models import OutboundDelivery
from tests.fakes.telegram import FakeTelegram
from tests.plugins_app.conftest import make_plugin, wait_until
from tests.streams.conftest import threaded_turns  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

ASK = {"kind": "choice", "prompt": "Which priority?",
       "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High"}]}
SCRIPT = f"script:call=ask_user{json.dumps(ASK)}|result|answer= noted"
QUESTION_TEXT = "Which priority?\n1. Low\n2. High"


def finished(timeout=30):
    return wait_until(lambda: Turn.objects.filter(finished_at__isnull=False).first(), timeout)


def question_sent(echo, rt, timeout=30):
    sent = wait_until(lambda: [s for s in echo.sends() if s.get("buttons")], timeout)
    assert sent, rt.log("echo-main")
    return sent[0]


# --- echo -----------------------------------------------------------------------------------------

def test_echo_shows_the_question_with_its_buttons_and_a_press_answers_it(tcast, echo, start_runtime,
                                                                         threaded_turns):
    make_plugin()
    rt = start_runtime()
    echo.say("m-1", SCRIPT)
    shown = question_sent(echo, rt)
    q = Question.objects.get()
    assert shown["text"] == QUESTION_TEXT
    assert shown["buttons"] == [{"label": "Low", "value": f"{q.request_id}:1"},
                                {"label": "High", "value": f"{q.request_id}:2"}]
    assert shown["delivery_id"] == f"d_{q.request_id}"
    with echo.inbox.open("a") as fh:  # the user presses "High"
        fh.write(json.dumps({"conversation_id": "chat-1", "message_id": "m-2", "sender_id": "42", "text": "High",
                             "option": shown["buttons"][1]["value"]}) + "\n")
    turn = finished()
    assert turn and turn.state == "completed", rt.log("echo-main")
    assert '"option_id": "high"' in turn.receipt.answer and turn.receipt.answer.endswith("noted")
    assert wait_until(lambda: len(echo.sends()) == 2, 15), rt.log("echo-main")
    assert echo.sends()[1]["text"] == turn.receipt.answer  # the answer's own delivery came too
    assert Turn.objects.count() == 1 and Question.objects.get().state == "answered"


def test_echo_free_text_the_second_one_answers_and_a_misfit_is_hinted_first(tcast, echo, start_runtime,
                                                                            threaded_turns):
    make_plugin()
    rt = start_runtime()
    echo.say("m-1", SCRIPT)
    question_sent(echo, rt)
    echo.say("m-2", "purple")
    assert wait_until(lambda: len(echo.sends()) == 2, 20), rt.log("echo-main")
    assert echo.sends()[1]["text"] == ("That does not answer the question: reply with one of 1. Low, 2. High. "
                                       "The question keeps waiting.")
    assert Question.objects.get().state == "waiting" and Turn.objects.count() == 1
    echo.say("m-2", "purple")  # the same message again: nothing doubled
    echo.say("m-3", "the second one")
    turn = finished()
    assert turn and turn.state == "completed", rt.log("echo-main")
    assert '"option_id": "high"' in turn.receipt.answer
    assert wait_until(lambda: len(echo.sends()) == 3, 15), rt.log("echo-main")
    assert [s["text"] for s in echo.sends()].count(echo.sends()[1]["text"]) == 1
    assert Turn.objects.count() == 1
    assert Receipt.objects.filter(client_message_id="m-2").count() == 1


def test_echo_a_press_after_the_question_expired_is_told_so_and_starts_no_turn(tcast, echo, start_runtime,
                                                                                threaded_turns):
    make_plugin()
    rt = start_runtime()
    ask = dict(ASK, timeout_s=1)
    echo.say("m-1", f"script:call=ask_user{json.dumps(ask)}|result|answer= gave up")
    shown = question_sent(echo, rt)
    turn = finished()
    assert turn and Question.objects.get().state == "expired", rt.log("echo-main")
    assert wait_until(lambda: len(echo.sends()) == 2, 15)  # the turn's answer, after the question expired
    with echo.inbox.open("a") as fh:
        fh.write(json.dumps({"conversation_id": "chat-1", "message_id": "m-2", "sender_id": "42", "text": "Low",
                             "option": shown["buttons"][0]["value"]}) + "\n")
    assert wait_until(lambda: len(echo.sends()) == 3, 20), rt.log("echo-main")
    assert echo.sends()[2]["text"] == "This question has expired."
    assert Turn.objects.count() == 1


# --- Telegram -------------------------------------------------------------------------------------

TG = "telegram-main"


@pytest.fixture
def fake(monkeypatch):
    fake = FakeTelegram().start()
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", fake.token)
    monkeypatch.setenv("TELEGRAM_API_BASE_URL", fake.base_url)
    yield fake
    fake.stop()


def test_telegram_shows_the_question_as_an_inline_keyboard_and_a_press_answers_it_once(
        tcast, fake, start_runtime, threaded_turns):
    make_plugin(TG, kind="channel-telegram", command="",
                args=["--mode", "polling", "--poll-timeout", "2", "--per-chat-secs", "0", "--group-secs", "0"],
                env_refs=["TELEGRAM_BOT_TOKEN", "TELEGRAM_API_BASE_URL"], heartbeat_secs=1.0)
    rt = start_runtime(limits={"startup_grace_secs": 15.0})
    assert wait_until(lambda: fake.polls_begun >= 1, 20), rt.log(TG)
    fake.push_message(42, SCRIPT)
    sent = fake.wait_sent(1, timeout=30)
    assert sent, rt.log(TG)
    q = Question.objects.get()
    assert sent[0].params["text"] == "Which priority?\n1\\. Low\n2\\. High"
    assert sent[0].params["reply_markup"] == {"inline_keyboard": [
        [{"text": "Low", "callback_data": f"{q.request_id}:1"}],
        [{"text": "High", "callback_data": f"{q.request_id}:2"}]]}
    press = fake.push_callback(42, f"{q.request_id}:1", message=fake.message(42, "Which priority?"))
    turn = finished()
    assert turn and turn.state == "completed", rt.log(TG)
    assert '"option_id": "low"' in turn.receipt.answer
    assert len(fake.wait_sent(2)) == 2, rt.log(TG)
    fake.redeliver(press)  # Telegram sends the press again: nothing doubled
    fake.push_message(42, "script:answer=after")  # a later message shows the redelivery was read
    assert len(fake.wait_sent(3)) == 3, rt.log(TG)
    wait_until(lambda: False, 0.5)
    assert fake.texts()[2:] == ["after"]
    assert fake.count("answerCallbackQuery") == 1
    assert Turn.objects.count() == 2 and Question.objects.get().answer == {"answers": {"choice": "low"}}
    assert OutboundDelivery.objects.filter(delivery_id=f"d_{q.request_id}", state="delivered").exists()


# --- Slack (Socket Mode) --------------------------------------------------------------------------

@pytest.fixture
def socket_slack(monkeypatch):
    from tests.fakes.slack import FakeSlack
    fake = FakeSlack(mode="socket").start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def test_slack_shows_the_question_as_buttons_and_a_press_answers_it_once(tcast, socket_slack, start_runtime,
                                                                         threaded_turns):
    make_plugin("slack-main", kind="channel-slack", command="", args=["--mode", "socket"],
                env_refs=list(socket_slack.env()), heartbeat_secs=1.0)
    rt = start_runtime(limits={"startup_grace_secs": 15.0})
    assert wait_until(lambda: socket_slack.sockets(), 30), rt.log("slack-main")
    socket_slack.say(SCRIPT)
    assert wait_until(lambda: socket_slack.posts(), 30), rt.log("slack-main")
    shown = socket_slack.posts()[0]
    q = Question.objects.get()
    section, actions = shown["blocks"]
    assert section["text"]["text"].startswith("Which priority?")
    assert [(b["text"]["text"], b["value"]) for b in actions["elements"]] == [
        ("Low", f"{q.request_id}:1"), ("High", f"{q.request_id}:2")]
    press = socket_slack.press(f"{q.request_id}:2", message=shown, action_id="ugent_option_1")
    turn = finished()
    assert turn and turn.state == "completed", rt.log("slack-main")
    assert '"option_id": "high"' in turn.receipt.answer
    assert wait_until(lambda: len(socket_slack.posts()) == 2, 15), rt.log("slack-main")
    socket_slack.repress(press)  # the same press again: nothing doubled
    socket_slack.say("script:answer=after")
    assert wait_until(lambda: len(socket_slack.posts()) == 3, 30), rt.log("slack-main")
    wait_until(lambda: False, 0.5)
    assert socket_slack.texts()[2:] == ["after"] and "blocks" not in socket_slack.posts()[1]
    assert Turn.objects.count() == 2 and Question.objects.get().answer == {"answers": {"choice": "high"}}
