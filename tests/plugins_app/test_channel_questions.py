"""A question a channel turn asks, as the plugins room sees it: its delivery, and the sender's next
message taken as the reply (issue #13, item 2; seed 000, "Questions").

The real services on the real database, the turn a row in `running` that no runner holds, so nothing
here waits on a clock: `question_open` is what the ask_user tool calls, `inbound_submit` what the
bridge calls for each message a worker sends. The workers themselves (echo, Telegram against the
fake Bot API) are in test_channel_questions_workers.py. Both run modes run this file; the duplicate
and concurrent-reply tests are the ones the database's locking decides.
"""
from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from channels_app import hooks, questions
from channels_app.models import Message, Question, Receipt, Turn
from channels_app.services import channel_actor_resolve, conversation_resolve
from plugins_app.channel import services
from plugins_app.channel.models import OutboundDelivery
from plugins_app.channel.sdk import InboundMessage
from tests.plugins_app.conftest import make_plugin
from tests.support import blocking

pytestmark = pytest.mark.django_db(transaction=True)

PID = "echo-main"
CHOICE = {"kind": "choice", "id": "priority", "prompt": "Which priority?",
          "options": [{"id": "low", "label": "Low"}, {"id": "high", "label": "High", "aliases": ["urgent"]}]}


def running_turn(sender="42", chat="chat-1"):
    """A turn of the echo plugin's conversation, running (as the runner holds it while it asks)."""
    actor = channel_actor_resolve(channel="echo", user_id=sender)
    conv, _ = conversation_resolve(channel="echo", client_id=PID, external_id=chat, actor=actor, caller=None)
    receipt = Receipt.objects.create(conversation=conv, actor=actor, client_message_id=f"m-{uuid.uuid4().hex[:8]}",
                                     content_hash="x", state="running")
    return Turn.objects.create(turn_id=f"turn-{uuid.uuid4().hex}", conversation=conv, actor=actor, receipt=receipt,
                               state="running", started_at=timezone.now())


@pytest.fixture
def plugin(tcast):
    return make_plugin(PID)


def say(message_id, text="", *, sender="42", chat="chat-1", option=None):
    msg = InboundMessage(channel="echo", conversation_id=chat, message_id=message_id, sender_id=sender, text=text,
                         source_type="user", metadata={"option": option} if option else {})
    return services.inbound_submit(plugin_id=PID, message=msg)


def notices():
    return list(OutboundDelivery.objects.filter(payload__metadata__kind="question_notice")
                .order_by("id").values_list("text", flat=True))


# --- the question's delivery ----------------------------------------------------------------------

def test_a_question_is_delivered_with_its_text_and_options_beside_the_turns_own_slot(plugin):
    turn = running_turn()
    q = questions.question_open(turn=turn, spec=CHOICE, timeout_s=60)
    d = OutboundDelivery.objects.get()
    assert d.delivery_id == f"d_{q.request_id}" and d.turn is None and d.plugin == plugin
    assert d.text == "Which priority?\n1. Low\n2. High"
    meta = d.payload["metadata"]
    assert meta["kind"] == "question" and meta["request_id"] == q.request_id and meta["turn_id"] == turn.turn_id
    assert meta["question_kind"] == "choice" and meta["question_id"] == "priority"
    assert meta["options"] == [{"id": "low", "label": "Low", "value": f"{q.request_id}:1"},
                               {"id": "high", "label": "High", "value": f"{q.request_id}:2"}]
    assert d.payload["reply_to_message_id"] == turn.receipt.client_message_id
    # the turn's answer still gets its one delivery
    services.delivery_create_for_turn(turn=turn, state="completed", answer="done")
    assert OutboundDelivery.objects.filter(turn=turn).get().text == "done"
    assert OutboundDelivery.objects.count() == 2


@pytest.mark.parametrize("state,notice", [("interrupted", "The answer to this message was interrupted."),
                                          ("cancelled", "The answer to this message was stopped."),
                                          ("failed", "Sorry, the agent could not answer this message.")])
def test_a_turn_that_ended_otherwise_after_part_of_its_answer_delivers_that_part_and_says_so(plugin, state, notice):
    """A chat has no turn.failed to read: the part that streamed before the turn broke off is sent with the notice
    after it, never as if it were the whole answer; with nothing streamed, the notice alone."""
    turn = running_turn()
    services.delivery_create_for_turn(turn=turn, state=state, answer="The first half of")
    assert OutboundDelivery.objects.get(turn=turn).text == f"The first half of\n\n{notice}"
    other = running_turn()
    services.delivery_create_for_turn(turn=other, state=state, answer="")
    assert OutboundDelivery.objects.get(turn=other).text == notice
    done = running_turn()
    services.delivery_create_for_turn(turn=done, state="completed", answer="All of it.")
    assert OutboundDelivery.objects.get(turn=done).text == "All of it."


def test_the_hook_run_twice_for_one_question_delivers_it_once(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    hooks.run_question_asked(question=q)
    services.delivery_create_for_question(question=Question.objects.get(pk=q.pk))
    assert OutboundDelivery.objects.count() == 1


def test_a_secret_questions_delivery_holds_its_prompt_alone(plugin):
    q = questions.question_open(turn=running_turn(), spec={"kind": "secret", "prompt": "Your API token?"},
                                timeout_s=60)
    d = OutboundDelivery.objects.get()
    assert d.text.startswith("Your API token?\n") and d.payload["metadata"]["options"] == []
    # the user types the secret into the chat: it is not taken, kept nowhere, and runs no turn
    out = say("m-s", "sk-live-123456")
    assert out["reply"] == "does_not_fit" and out["question_state"] == "waiting"
    assert Question.objects.get(pk=q.pk).state == "waiting"
    assert notices() == [questions.SECRET_IN_CHAT]
    assert not Message.objects.filter(content__contains="sk-live").exists()
    assert "sk-live" not in str(list(OutboundDelivery.objects.values_list("text", "payload")))
    assert Turn.objects.count() == 1


def test_a_confirm_is_delivered_with_yes_and_no(plugin):
    q = questions.question_open(turn=running_turn(), spec={"kind": "confirm", "prompt": "Deploy now?"},
                                timeout_s=60)
    d = OutboundDelivery.objects.get()
    assert d.text == "Deploy now? (yes or no)"
    assert [(o["id"], o["label"]) for o in d.payload["metadata"]["options"]] == [("yes", "Yes"), ("no", "No")]
    say("m-1", "No", option=f"{q.request_id}:2")
    q.refresh_from_db()
    assert q.state == "answered" and q.answer == {"value": False}


def test_a_conversation_of_no_plugin_gets_no_delivery(tcast):
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id="", external_id="c", actor=actor, caller=None)
    receipt = Receipt.objects.create(conversation=conv, actor=actor, client_message_id="m", content_hash="x")
    turn = Turn.objects.create(turn_id="turn-x", conversation=conv, actor=actor, receipt=receipt, state="running")
    questions.question_open(turn=turn, spec=CHOICE, timeout_s=60)
    assert not OutboundDelivery.objects.exists()


# --- the reply ------------------------------------------------------------------------------------

def test_a_button_press_answers_by_the_option_it_names_and_starts_no_turn(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    out = say("m-2", f"{q.request_id}:2", option=f"{q.request_id}:2")
    assert out == {"accepted": True, "duplicate": False, "question": q.request_id, "reply": "applied",
                   "question_state": "answered"}
    q.refresh_from_db()
    assert q.state == "answered" and q.answer == {"answers": {"priority": "high"}}
    assert Turn.objects.count() == 1 and notices() == []
    assert Message.objects.get(turn=q.turn).content == "High"  # the transcript shows the label, not the token
    assert Receipt.objects.get(client_message_id="m-2").state == "completed"


@pytest.mark.parametrize("text, picked", [("the second one", "high"), ("low", "low"), ("urgent", "high"),
                                          ("2", "high")])
def test_free_text_is_read_by_the_option_matcher(plugin, text, picked):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    assert say("m-2", text)["reply"] == "applied"
    q.refresh_from_db()
    assert q.answer == {"answers": {"priority": picked}} and Turn.objects.count() == 1


def test_a_reply_that_does_not_fit_leaves_the_question_waiting_and_says_so(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    out = say("m-2", "purple, please")
    assert out["reply"] == "does_not_fit" and out["question_state"] == "waiting" and out["accepted"] is True
    assert Question.objects.get(pk=q.pk).state == "waiting"
    assert notices() == ["That does not answer the question: reply with one of 1. Low, 2. High. "
                         "The question keeps waiting."]
    assert Turn.objects.count() == 1  # seed 000: a reply that does not fit never runs as a turn
    assert Receipt.objects.get(client_message_id="m-2").state == "refused"
    assert say("m-3", "low")["reply"] == "applied"


def test_a_reply_after_the_deadline_is_refused_as_expired_and_starts_no_turn(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    Question.objects.filter(pk=q.pk).update(timeout_at=timezone.now() - timedelta(seconds=1))
    assert say("m-2", "low") == {"accepted": True, "duplicate": False, "question": q.request_id,
                                 "reply": "refused", "question_state": "expired"}
    assert notices() == ["This question has expired."]
    assert Question.objects.get(pk=q.pk).state == "expired"
    # its turn still runs: the next message is still a late reply, and a button press always is
    assert say("m-3", "high")["question_state"] == "expired"
    assert say("m-4", "", option=f"{q.request_id}:1")["question_state"] == "expired"
    assert notices() == ["This question has expired."] * 3
    assert Turn.objects.count() == 1


def test_once_the_turn_ended_a_message_is_a_message_again(plugin):
    turn = running_turn()
    questions.question_open(turn=turn, spec=CHOICE, timeout_s=60)
    Turn.objects.filter(pk=turn.pk).update(state="completed")
    out = say("m-2", "script:answer=a new turn")
    assert "question" not in out and out["turn_id"] != turn.turn_id
    assert Turn.objects.count() == 2


def test_a_slash_command_is_not_taken_as_a_reply(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    out = say("m-2", "/models")
    assert "question" not in out
    assert Question.objects.get(pk=q.pk).state == "waiting"


def test_someone_else_in_the_chat_neither_answers_nor_is_held_by_the_question(plugin):
    q = questions.question_open(turn=running_turn(sender="42", chat="group-1"), spec=CHOICE, timeout_s=60)
    out = say("m-2", "low", sender="43", chat="group-1")
    assert "question" not in out  # an ordinary message of someone else's
    pressed = say("m-3", "", sender="43", chat="group-1", option=f"{q.request_id}:1")
    assert pressed["reply"] == "refused" and notices() == ["No such question."]
    assert Question.objects.get(pk=q.pk).state == "waiting"


# --- duplicates and races (both run modes) --------------------------------------------------------

def test_the_same_reply_delivered_twice_is_applied_once(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    first = say("m-2", "the second one")
    again = say("m-2", "the second one")
    assert first["reply"] == "applied"
    assert again["duplicate"] is True and "question" not in again
    assert Turn.objects.count() == 1 and Receipt.objects.filter(client_message_id="m-2").count() == 1
    assert Message.objects.filter(turn=q.turn, content="the second one").count() == 1


def test_the_same_misfit_delivered_twice_is_hinted_once(plugin):
    questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    say("m-2", "purple")
    assert say("m-2", "purple")["duplicate"] is True
    assert len(notices()) == 1 and Turn.objects.count() == 1


def _together(n, fn):
    gate = threading.Barrier(n)
    results = [None] * n

    def run(i):
        try:
            gate.wait()
            results[i] = fn(i)
        finally:
            connection.close()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_eight_copies_of_one_reply_at_once_apply_it_once(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    results = _together(8, lambda i: say("m-2", "the second one"))
    applied = [r for r in results if r and r.get("reply") == "applied"]
    assert len(applied) == 1, results
    assert all(r["duplicate"] for r in results if r is not applied[0]), results
    assert Question.objects.get(pk=q.pk).answer == {"answers": {"priority": "high"}}
    assert Turn.objects.count() == 1 and Receipt.objects.filter(client_message_id="m-2").count() == 1
    assert Message.objects.filter(turn=q.turn, content="the second one").count() == 1 and notices() == []


def test_two_buttons_pressed_at_once_one_applies_and_the_other_is_told(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    results = _together(2, lambda i: say(f"m-{i}", "", option=f"{q.request_id}:{i + 1}"))
    assert sorted(r["reply"] for r in results) == ["applied", "refused"], results
    assert notices() == ["This question was already answered."]
    assert Question.objects.get(pk=q.pk).state == "answered" and Turn.objects.count() == 1


def test_a_plain_message_after_the_answer_is_a_message(plugin):
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    assert say("m-1", "low")["reply"] == "applied"
    out = say("m-2", "script:answer=next")  # queued behind the turn, as any message is
    assert "question" not in out and Turn.objects.count() == 2
    assert Question.objects.get(pk=q.pk).answer == {"answers": {"priority": "low"}}


# --- a reply reader that never returns (the option matcher, the yes/no engine: plugins) -------------------

@pytest.fixture
def hung_matcher(settings):
    settings.UGENT_OPTION_MATCHER_ENGINE = "test-blocked-matcher"
    with blocking.blocked_engine(blocking.BlockedOptionMatcher, "test-blocked-matcher") as gate:
        yield gate


def test_while_the_matcher_reads_a_reply_no_transaction_is_open_and_other_writes_go_on(plugin, settings,
                                                                                       hung_matcher):
    # The reply was read inside the transaction that records it: in embedded mode that transaction holds the
    # one SQLite writer turn, so every write in the daemon (here: another chat's question) waited on the matcher.
    settings.UGENT_QUESTION_FIT_TIMEOUT = blocking.BOUND
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    other = running_turn(chat="chat-2")
    out = {}
    replying = threading.Thread(target=lambda: (out.update(say("m-2", "the second one")), connection.close()))
    replying.start()
    try:
        assert hung_matcher.entered.wait(10)
        blocking.within(lambda: questions.question_open(turn=other, spec=CHOICE, timeout_s=60), hung_matcher)
    finally:
        hung_matcher.release.set()
        replying.join(blocking.BOUND + 5)
    assert out["reply"] == "applied"  # let go, the matcher picked the last option
    assert Question.objects.get(pk=q.pk).answer == {"answers": {"priority": "high"}}


def test_a_matcher_that_never_returns_is_a_reply_that_does_not_fit_and_writes_nothing_of_it(plugin, settings,
                                                                                          hung_matcher):
    # It kept the bridge's lane (the worker's inbound.submit) for as long as it hung.
    settings.UGENT_QUESTION_FIT_TIMEOUT = 0.5
    settings.UGENT_TURN_STUCK_MAX = 1
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    hint = "That does not answer the question: reply with one of 1. Low, 2. High. The question keeps waiting."
    out = blocking.within(lambda: say("m-2", "the second one"), hung_matcher)
    assert out == {"accepted": True, "duplicate": False, "question": q.request_id, "reply": "does_not_fit",
                   "question_state": "waiting"}
    assert Question.objects.get(pk=q.pk).state == "waiting" and notices() == [hint]
    assert Receipt.objects.get(client_message_id="m-2").state == "refused"
    assert not Message.objects.filter(content="the second one").exists() and Turn.objects.count() == 1
    # its read still runs: at UGENT_TURN_STUCK_MAX such reads the matcher is not asked again until they end
    assert blocking.within(lambda: say("m-3", "low"), hung_matcher)["reply"] == "does_not_fit"
    assert hung_matcher.calls == 1 and notices() == [hint, hint]
    # a button press needs no matcher
    assert say("m-4", "", option=f"{q.request_id}:1")["reply"] == "applied"
    assert Question.objects.get(pk=q.pk).answer == {"answers": {"priority": "low"}}


def test_a_yes_no_engine_that_never_returns_leaves_the_confirm_waiting(plugin, settings):
    settings.UGENT_QUESTION_FIT_TIMEOUT = 0.5
    settings.UGENT_YESNO_ENGINE = "test-blocked-yesno"
    with blocking.blocked_engine(blocking.BlockedYesNo, "test-blocked-yesno") as gate:
        q = questions.question_open(turn=running_turn(), spec={"kind": "confirm", "prompt": "Deploy now?"},
                                    timeout_s=60)
        out = blocking.within(lambda: say("m-2", "yes please"), gate)
        assert out["reply"] == "does_not_fit" and gate.calls == 1
        assert notices() == ["That does not answer the question: reply yes or no. The question keeps waiting."]
        assert Question.objects.get(pk=q.pk).state == "waiting"


def test_a_matcher_that_raises_is_a_reply_that_does_not_fit_and_holds_nothing(plugin, settings):
    # The engine's exception went up through inbound.submit: the worker got -32603 and sent the message again and
    # again (HOLD_ATTEMPTS), holding its chat's later messages behind it, and the sender was told nothing.
    settings.UGENT_OPTION_MATCHER_ENGINE = "test-failing-matcher"
    with blocking.blocked_engine(blocking.FailingOptionMatcher, "test-failing-matcher"):
        q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
        out = say("m-2", "the second one")
    assert out == {"accepted": True, "duplicate": False, "question": q.request_id, "reply": "does_not_fit",
                   "question_state": "waiting"}
    assert notices() == ["That does not answer the question: reply with one of 1. Low, 2. High. "
                         "The question keeps waiting."]
    assert Receipt.objects.get(client_message_id="m-2").state == "refused"
    assert Question.objects.get(pk=q.pk).state == "waiting" and Turn.objects.count() == 1
    assert say("m-2", "the second one")["duplicate"] is True  # a resend is the duplicate it is


# --- what changes while the matcher reads (outside the transaction that applies the reply) ----------------

def _in_background(fn):
    """fn() on a thread of its own; the returned join() gives its value (or raises what it raised)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again by join()
            box["error"] = exc
        finally:
            connection.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(blocking.BOUND + 5)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
        return box["value"]
    return join


@pytest.mark.parametrize("meanwhile", ["answered", "expired", "cancelled"])
def test_a_question_that_stopped_waiting_while_the_matcher_read_is_refused_as_it_stands(plugin, settings,
                                                                                       hung_matcher, meanwhile):
    settings.UGENT_QUESTION_FIT_TIMEOUT = blocking.BOUND
    turn = running_turn()
    q = questions.question_open(turn=turn, spec=CHOICE, timeout_s=60)
    join = _in_background(lambda: say("m-2", "the second one"))
    assert hung_matcher.entered.wait(10)
    if meanwhile == "answered":
        assert say("m-3", "", option=f"{q.request_id}:1")["reply"] == "applied"  # a press needs no matcher
    elif meanwhile == "expired":
        Question.objects.filter(pk=q.pk).update(timeout_at=timezone.now() - timedelta(seconds=1))
    else:
        Turn.objects.filter(pk=turn.pk).update(cancel_requested=True)
    hung_matcher.release.set()
    out = join()
    assert out["reply"] == "refused" and out["question_state"] == meanwhile, out
    assert Receipt.objects.get(client_message_id="m-2").state == "refused"
    assert not Message.objects.filter(content="the second one").exists() and Turn.objects.count() == 1
    assert notices()[-1] == questions.REFUSALS[meanwhile][0]
    assert Question.objects.get(pk=q.pk).answer == ({"answers": {"priority": "low"}} if meanwhile == "answered"
                                                    else {})


@pytest.mark.parametrize("ids", [("m-2", "m-2"), ("m-2", "m-3")], ids=["two copies", "two messages"])
def test_two_replies_read_by_the_matcher_at_once_apply_once(plugin, settings, hung_matcher, ids):
    settings.UGENT_QUESTION_FIT_TIMEOUT = blocking.BOUND
    q = questions.question_open(turn=running_turn(), spec=CHOICE, timeout_s=60)
    joins = [_in_background(lambda mid=mid: say(mid, "the second one")) for mid in ids]
    blocking.wait_calls(hung_matcher, 2)  # both read before either applies
    hung_matcher.release.set()
    outs = [join() for join in joins]
    assert sorted(str(o.get("reply")) for o in outs) == (["None", "applied"] if ids[0] == ids[1]
                                                         else ["applied", "refused"]), outs
    if ids[0] == ids[1]:
        assert [o["duplicate"] for o in outs].count(True) == 1 and notices() == []
    else:
        assert notices() == [questions.ALREADY_ANSWERED]
    assert Receipt.objects.filter(client_message_id__in=ids).count() == len(set(ids))
    assert Message.objects.filter(content="the second one").count() == 1 and Turn.objects.count() == 1
    assert Question.objects.get(pk=q.pk).answer == {"answers": {"priority": "high"}}
