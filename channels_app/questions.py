"""Questions the agent asks mid-turn, and the replies that answer them (seed 000, "Questions").

`question_ask` is called from a turn's runner thread (by the `ask_user` tool): it records the
question, announces it as `interaction.requested` on the event and activity streams (addressed to
the user it asks), and blocks until a reply is applied, the deadline passes, the turn stops
(`should_stop`), or the user dismisses it. It waits on the turn's wake-up topic
(channels_app.notify: in-process, and Redis pub/sub in servers mode, where the reply arrives on
another process), reading the row again after each wake-up and every POLL_SECONDS at most. The
turn keeps its lease meanwhile: the runner's LeaseKeeper renews it off this thread.

`question_reply` applies a chat request's `ugent_interaction_reply`: only to the question it names,
only while it waits, only when it fits, and only for the user it asked (anyone else gets the 404 of
a missing question). A reply that does not fit is refused and the question keeps waiting; every
other case is refused with how the question stands. The move out of `waiting` is one conditional
UPDATE, so of concurrent replies exactly one applies. A reply never runs as a turn.

A secret's value lives in `Question.answer` only until its asker takes it (then it is blanked); it
is never written to a Message row, an event or a log line.

Chat channels: `question_open` hands each question to the question-asked hooks (channels_app.hooks),
where a channel plugin queues it as a delivery (`question_channel_text`, `question_channel_options`);
`question_reply_from_channel` takes the user's next channel message as the reply, by a button's
reply token or by its text, and records the message's receipt so a repeat of it runs nothing.
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import IntegrityError, close_old_connections, transaction
from django.utils import timezone

from channels_app import hooks, notify, statements
from channels_app.errors import NO_RETRY, ApplicationError
from channels_app.events import event_append, turn_topic
from channels_app.models import (LIVE_TURN_STATES, Actor, Conversation, Message, Question, QuestionKind,
                                 QuestionState, Receipt, ReceiptState, Turn, TurnState)
from ugent_common import bounded

log = logging.getLogger("ugent.questions")

#: The longest a waiting asker goes without reading its row, whatever the wake-ups do.
POLL_SECONDS = 1.0
#: How often the asker asks `should_stop` (the runner's own check reads the database every 0.1 s).
STOP_CHECK_SECONDS = 0.2

NO_SUCH_QUESTION = "No such question."
ALREADY_ANSWERED = "This question was already answered."
EXPIRED = "This question has expired."
CANCELLED = "This question was cancelled: its turn stopped."
ABORTED = "This question was dismissed."
REFUSALS = {  # how a question that no longer waits stands, as the seed words it
    QuestionState.ANSWERED: (ALREADY_ANSWERED, "question_answered"),
    QuestionState.EXPIRED: (EXPIRED, "question_expired"),
    QuestionState.CANCELLED: (CANCELLED, "question_cancelled"),
    QuestionState.ABORTED: (ABORTED, "question_dismissed"),
}
#: A reply the engine reading it (the option matcher, the yes/no engine) did not read within
#: UGENT_QUESTION_FIT_TIMEOUT, or was not given to it (UGENT_TURN_STUCK_MAX of its reads still run past that
#: limit): it does not fit, and the question keeps waiting (`_read_bounded`).
FIT_TIMED_OUT = "The {engine} did not read the reply within {seconds:g} s."
FIT_OVERRUN = ("{count} earlier replies are still being read by the {engine} past its time limit: it is not asked "
               "again until they end.")
#: A reply the engine reading it failed on (it raised): a 502 of the engine's, never the request's 500; nothing
#: is applied and the question keeps waiting (on a chat channel, as a reply that does not fit).
FIT_FAILED = "The {engine} failed reading the reply ({why})."
READER_FAILED = "reply_reader_failed"
#: The refusals after which the question keeps waiting (any other says how it stands).
KEEPS_WAITING_CODES = ("reply_does_not_fit", READER_FAILED)
OPTION_MATCHER, YESNO_ENGINE = "option matcher", "yes/no engine"
CHOICE_KINDS = (QuestionKind.CHOICE, QuestionKind.FORM)
VALUE_KINDS = (QuestionKind.TEXT, QuestionKind.SECRET, QuestionKind.CONFIRM)
SPEC_KEYS = ("id", "prompt", "options", "questions")


@dataclass
class QuestionResult:
    """What the asker gets back: `state` answered, expired, cancelled or aborted; for an answered
    choice or form `answers` ({question_id: option_id}); for text, secret and confirm `value`
    (a confirm's is True or False)."""

    request_id: str
    state: str
    answers: dict = field(default_factory=dict)
    value: object = None

    @property
    def answered(self) -> bool:
        return self.state == QuestionState.ANSWERED


# --- the question's shape ------------------------------------------------------------------------

def _bad_spec(message: str) -> ApplicationError:
    return ApplicationError(f"The question is malformed: {message}", status=400, code="invalid_question")


def _options_clean(options, where: str) -> list[dict]:
    if not isinstance(options, list) or not options:
        raise _bad_spec(f"{where} needs options, a list of {{id, label}}.")
    out, seen = [], set()
    for i, opt in enumerate(options):
        if not isinstance(opt, dict) or not isinstance(opt.get("id"), str) or not opt["id"].strip():
            raise _bad_spec(f"{where}: option {i} needs an id (a string).")
        if opt["id"] in seen:
            raise _bad_spec(f"{where}: option id {opt['id']!r} is repeated.")
        seen.add(opt["id"])
        label = opt.get("label", opt["id"])
        aliases = opt.get("aliases") or []
        if not isinstance(label, str) or not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise _bad_spec(f"{where}: option {opt['id']!r} has a label that is not a string, or bad aliases.")
        out.append({"id": opt["id"], "label": label, **({"aliases": aliases} if aliases else {})})
    return out


def spec_clean(spec: dict) -> tuple[str, dict]:
    """The kind and the stored shape of a question an agent asks; 400 invalid_question when it is malformed.

    choice: {"kind": "choice", "id"?, "prompt", "options": [{id, label, aliases?}]}
    form:   {"kind": "form", "prompt"?, "questions": [{"id", "prompt", "options": [...]}, ...]}
    text, secret, confirm: {"kind": ..., "id"?, "prompt"}
    """
    if not isinstance(spec, dict):
        raise _bad_spec("it must be an object.")
    kind = spec.get("kind")
    if kind not in QuestionKind.values:
        raise _bad_spec(f"kind must be one of {', '.join(QuestionKind.values)}.")
    prompt = spec.get("prompt", "")
    if not isinstance(prompt, str):
        raise _bad_spec("prompt must be a string.")
    qid = spec.get("id") or kind
    if not isinstance(qid, str):
        raise _bad_spec("id must be a string.")
    clean = {"id": qid, "prompt": prompt}
    if kind == QuestionKind.CHOICE:
        if not prompt:
            raise _bad_spec("a choice needs a prompt.")
        clean["options"] = _options_clean(spec.get("options"), "the choice")
    elif kind == QuestionKind.FORM:
        questions = spec.get("questions")
        if not isinstance(questions, list) or not questions:
            raise _bad_spec("a form needs questions, a list of {id, prompt, options}.")
        clean["questions"], seen = [], set()
        for i, q in enumerate(questions):
            if not isinstance(q, dict) or not isinstance(q.get("id"), str) or not q["id"]:
                raise _bad_spec(f"question {i} of the form needs an id (a string).")
            if q["id"] in seen:
                raise _bad_spec(f"question id {q['id']!r} is repeated.")
            seen.add(q["id"])
            clean["questions"].append({"id": q["id"], "prompt": str(q.get("prompt", "")),
                                       "options": _options_clean(q.get("options"), f"question {q['id']!r}")})
    elif not prompt:
        raise _bad_spec(f"a {kind} question needs a prompt.")
    return kind, clean


def _choice_questions(question: Question) -> list[dict]:
    """A choice or form as its list of {id, prompt, options}."""
    if question.kind == QuestionKind.CHOICE:
        return [{"id": question.spec["id"], "prompt": question.spec.get("prompt", ""),
                 "options": question.spec["options"]}]
    return question.spec.get("questions", [])


def question_payload(question: Question) -> dict:
    """The question as interaction.requested and the snapshot show it to the user it asks."""
    out = {"request_id": question.request_id, "turn_id": question.turn.turn_id, "kind": question.kind,
           "state": question.state, "timeout_at": _iso(question.timeout_at), **question.spec}
    return out


def _iso(dt) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


# --- asking --------------------------------------------------------------------------------------

def question_open(*, turn: Turn, spec: dict, timeout_s: float) -> Question:
    """Record a waiting question and announce it (interaction.requested, to the user it asks)."""
    kind, clean = spec_clean(spec)
    limit = settings.UGENT_QUESTION_MAX_TIMEOUT
    timeout_s = min(max(float(timeout_s), 1.0), limit)
    with transaction.atomic():
        question = Question.objects.create(
            request_id=f"q-{uuid.uuid4().hex}", turn=turn, conversation_id=turn.conversation_id,
            actor_id=turn.actor_id, kind=kind, spec=clean,
            timeout_at=timezone.now() + timedelta(seconds=timeout_s))
        question.turn = turn
        event_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, type="interaction.requested",
                     data=question_payload(question), audience=[turn.actor.key])
        hooks.run_question_asked(question=question)  # a channel's conversation: its delivery commits with it
    log.info("question asked (turn=%s, question=%s, kind=%s)", turn.turn_id, question.request_id, kind)
    return question


def _close(question: Question, state: str, *, reason: str) -> bool:
    """waiting → expired/cancelled by the asker, with its event; False if a reply won first."""
    now = timezone.now()
    with transaction.atomic():
        if Question.objects.filter(pk=question.pk, state=QuestionState.WAITING).update(
                state=state, resolved_at=now, updated_at=now) != 1:
            return False
        event_append(conversation_id=question.conversation_id, turn_pk=question.turn_id,
                     type="interaction.resolved",
                     data={"request_id": question.request_id, "turn_id": question.turn.turn_id,
                           "state": state, "reason": reason},
                     audience=[question.turn.actor.key])
    return True


def _result(question: Question) -> QuestionResult:
    """The reply as the asker takes it; a secret's value is blanked in the row as it is taken."""
    answer = question.answer or {}
    result = QuestionResult(request_id=question.request_id, state=question.state,
                            answers=dict(answer.get("answers") or {}), value=answer.get("value"))
    if question.kind == QuestionKind.SECRET and "value" in answer:
        Question.objects.filter(pk=question.pk).update(answer={"taken": True}, updated_at=timezone.now())
    return result


def question_ask(*, turn: Turn, spec: dict, timeout_s: float,
                 should_stop: Callable[[], bool] = lambda: False) -> QuestionResult:
    """Ask the turn's user a question and wait for its end: answered, expired, cancelled or aborted.

    Blocking, on the turn's runner thread. `should_stop` is the runner's stop check: when it holds
    (the turn was stopped, or ran out of time) the question is cancelled. Raises ApplicationError
    (invalid_question) for a malformed spec, having asked nothing."""
    question = question_open(turn=turn, spec=spec, timeout_s=timeout_s)
    waiter = notify.register_blocking(turn_topic(turn.pk))
    try:
        next_read = 0.0
        while True:
            now = time.monotonic()
            if now >= next_read:
                row = Question.objects.filter(pk=question.pk).values("state", "answer").first()
                next_read = now + POLL_SECONDS
                if row is None:  # its turn was deleted under it
                    return QuestionResult(request_id=question.request_id, state=QuestionState.CANCELLED)
                if row["state"] != QuestionState.WAITING:
                    question.state, question.answer = row["state"], row["answer"]
                    return _result(question)
            if should_stop():
                if _close(question, QuestionState.CANCELLED, reason="its turn stopped"):
                    return QuestionResult(request_id=question.request_id, state=QuestionState.CANCELLED)
                next_read = 0.0
                continue
            remaining = (question.timeout_at - timezone.now()).total_seconds()
            if remaining <= 0:
                if _close(question, QuestionState.EXPIRED, reason="its deadline passed"):
                    return QuestionResult(request_id=question.request_id, state=QuestionState.EXPIRED)
                next_read = 0.0
                continue
            if waiter.wait(min(STOP_CHECK_SECONDS, remaining, max(next_read - time.monotonic(), 0.0))):
                next_read = 0.0  # woken: something was committed for this turn, read the row
    finally:
        waiter.close()
        close_old_connections()


# --- replying ------------------------------------------------------------------------------------

def _refused(question: Question) -> ApplicationError:
    message, code = REFUSALS[question.state]
    return ApplicationError(message, status=409, code=code, param="ugent_interaction_reply.request_id",
                            extra={"request_id": question.request_id, "state": question.state},
                            headers=NO_RETRY)


def _does_not_fit(message: str, param: str = "ugent_interaction_reply") -> ApplicationError:
    return ApplicationError(f"{message} The question keeps waiting.", status=400, code="reply_does_not_fit",
                            param=param)


def _option_label(option: dict) -> str:
    return option.get("label") or option["id"]


def _read_bounded(read: Callable[[], object], *, engine: str, owner: str) -> object:
    """read(), a call of the option matcher or the yes/no engine (a plugin's code), on a thread of its own
    (ugent_common.bounded): one that never returns would otherwise keep the thread the reply came on (the
    web loop's executor, a channel plugin's bridge lane). Past UGENT_QUESTION_FIT_TIMEOUT, or while
    UGENT_TURN_STUCK_MAX of this engine's reads still run past it, the reply does not fit (400
    reply_does_not_fit: the question keeps waiting). When read() raises, 502 reply_reader_failed (logged with
    its traceback): the engine's failure, not the request's, and the question keeps waiting."""
    timeout = settings.UGENT_QUESTION_FIT_TIMEOUT
    done = bounded.call_bounded(read, timeout=timeout, owner=owner, limit=settings.UGENT_TURN_STUCK_MAX,
                                name="ugent-fit")
    if done.refused:
        raise _does_not_fit(FIT_OVERRUN.format(count=done.refused, engine=engine), "ugent_interaction_reply.value")
    if done.timed_out:
        log.warning("the %s %s did not read a reply within %g s: it does not fit", engine, owner, timeout)
        raise _does_not_fit(FIT_TIMED_OUT.format(engine=engine, seconds=timeout), "ugent_interaction_reply.value")
    if done.error is not None:
        exc = done.error
        if isinstance(exc, ApplicationError) or not isinstance(exc, Exception):
            raise exc
        log.error("the %s %s failed reading a reply: the question keeps waiting", engine, owner,
                  exc_info=(type(exc), exc, exc.__traceback__))
        raise ApplicationError(f"{FIT_FAILED.format(engine=engine, why=f'{type(exc).__name__}: {exc}')} "
                               f"The question keeps waiting.", status=502, code=READER_FAILED,
                               param="ugent_interaction_reply.value")
    return done.value


def option_match(text: str, options: list[dict], *, lang: str | None = None) -> dict | None:
    """The option a free-text reply picks ("the second one", a label, an alias), by the option matcher
    engine (UGENT_OPTION_MATCHER_ENGINE); None when nothing fits. Bounded (`_read_bounded`): 400
    reply_does_not_fit when the matcher does not answer in time."""
    from plugins_app.agent.engines.registry import BUILTIN_OPTION_MATCHER, option_matcher

    def read() -> dict | None:
        matcher = option_matcher()
        labels = [_option_label(o) for o in options]
        picked = matcher.match_option(text, labels, lang=lang)
        if picked is not None and picked in labels:
            return options[labels.index(picked)]
        others = {}  # ids and aliases, for a reply that names an option by them
        for o in options:
            for name in [o["id"], *o.get("aliases", [])]:
                others.setdefault(name, o)
        picked = matcher.match_option(text, list(others), lang=lang)
        return others.get(picked) if picked is not None else None
    name = settings.UGENT_OPTION_MATCHER_ENGINE or BUILTIN_OPTION_MATCHER
    return _read_bounded(read, engine=OPTION_MATCHER, owner=f"matcher:{name}")


def yes_no(question_text: str, text: str, *, lang: str | None = None) -> bool | None:
    """True, False, or None (neither) for a reply to a yes/no question, by the yes/no engine
    (UGENT_YESNO_ENGINE). Bounded as option_match is."""
    from plugins_app.agent.engines.registry import BUILTIN_YESNO, yesno_engine
    name = settings.UGENT_YESNO_ENGINE or BUILTIN_YESNO
    return _read_bounded(lambda: yesno_engine().yes_or_no(question_text, text, lang=lang),
                         engine=YESNO_ENGINE, owner=f"yesno:{name}")


def _fit(question: Question, reply: dict) -> dict:
    """The answer a submit stores, or 400 reply_does_not_fit (the question keeps waiting). It may ask the
    option matcher or the yes/no engine (bounded): never call it inside a transaction (in embedded mode one
    holds the single SQLite writer turn while the engine reads), see reply_fitted."""
    if question.kind in CHOICE_KINDS:
        questions = _choice_questions(question)
        by_id = {q["id"]: q for q in questions}
        answers = reply.get("answers")
        if not answers and isinstance(reply.get("value"), str) and len(questions) == 1:
            opt = option_match(reply["value"], questions[0]["options"])
            if opt is None:
                raise _does_not_fit(f"{reply['value']!r} matches none of the options of {questions[0]['id']}.",
                                    "ugent_interaction_reply.value")
            return {"answers": {questions[0]["id"]: opt["id"]}}
        if not answers:
            raise _does_not_fit("A submit to this question needs answers: [{question_id, option_id}].",
                                "ugent_interaction_reply.answers")
        chosen: dict[str, str] = {}
        for a in answers:
            qid, oid = a.get("question_id"), a.get("option_id")
            if qid not in by_id:
                raise _does_not_fit(f"{qid!r} is not a question here: answer {', '.join(by_id)}.",
                                    "ugent_interaction_reply.answers")
            if qid in chosen:
                raise _does_not_fit(f"{qid} is answered twice.", "ugent_interaction_reply.answers")
            ids = [o["id"] for o in by_id[qid]["options"]]
            if oid not in ids:
                raise _does_not_fit(f"{oid!r} is not an option of {qid}: choose one of {', '.join(ids)}.",
                                    "ugent_interaction_reply.answers")
            chosen[qid] = oid
        missing = [q for q in by_id if q not in chosen]
        if missing:
            raise _does_not_fit(f"Answer every question: {', '.join(missing)} has no answer.",
                                "ugent_interaction_reply.answers")
        return {"answers": chosen}
    value = reply.get("value")
    if not isinstance(value, str) or not value.strip():
        raise _does_not_fit(f"A {question.kind} question is answered with value, a non-empty string.",
                            "ugent_interaction_reply.value")
    if question.kind == QuestionKind.CONFIRM:
        # A button's press ("yes"/"no", the confirm's option ids; a JSON true/false is sent as one) is decided
        # here: a yes/no engine that hangs or fails must not make the buttons useless.
        decided = CONFIRM_PRESSES.get(value.strip().lower())
        if decided is None:
            decided = yes_no(question.spec.get("prompt", ""), value)
        if decided is None:
            raise _does_not_fit("Answer yes or no.", "ugent_interaction_reply.value")
        return {"value": decided}
    return {"value": value}


@dataclass(frozen=True)
class FittedReply:
    """A submit read against its question before the transaction that applies it (reply_fitted): the
    answer to store, or the refusal that keeps the question waiting (400 reply_does_not_fit, or 502
    reply_reader_failed when the engine reading it failed)."""

    answer: dict | None = None
    refusal: ApplicationError | None = None

    def take(self) -> dict:
        if self.refusal is not None:
            raise self.refusal
        return self.answer


def reply_fitted(question: Question, reply: dict) -> FittedReply:
    """`_fit` ahead of the transaction that applies the reply (question_reply's `fitted`): the engines it may
    ask are plugins, and no plugin call is made inside a transaction."""
    try:
        return FittedReply(answer=_fit(question, reply))
    except ApplicationError as exc:
        if exc.code not in KEEPS_WAITING_CODES:
            raise
        return FittedReply(refusal=exc)


def _question_for(*, actor: Actor, request_id: str, conversation: Conversation | None) -> Question:
    question = (Question.objects.select_related("turn", "turn__actor", "conversation")
                .filter(request_id=request_id).first())
    if question is None or question.actor_id != actor.id or (
            conversation is not None and question.conversation_id != conversation.pk):
        raise ApplicationError(NO_SUCH_QUESTION, status=404, code="question_not_found",
                               param="ugent_interaction_reply.request_id")
    return question


def _still_live(question: Question) -> None:
    """The 409 of a question whose turn stopped or whose deadline passed (closed so by the reply); else nothing.
    The conditional UPDATE that applies a reply checks the deadline again, not the turn: asked again after
    an engine's read."""
    turn = Turn.objects.filter(pk=question.turn_id).values("state", "cancel_requested").first()
    if turn is None or turn["state"] not in (TurnState.ACCEPTED, TurnState.RUNNING) or turn["cancel_requested"]:
        _close(question, QuestionState.CANCELLED, reason="its turn stopped")
        question.refresh_from_db(fields=["state"])
        raise _refused(question)
    if question.timeout_at <= timezone.now():
        _close(question, QuestionState.EXPIRED, reason="its deadline passed")
        question.refresh_from_db(fields=["state"])
        raise _refused(question)


def question_reply(*, actor: Actor, reply: dict, content: str = "",
                   conversation: Conversation | None = None, receipt=None,
                   fitted: FittedReply | None = None) -> dict:
    """Apply a reply to the question it names, for the user it asked; never a turn.

    A submit is read against the question (`_fit`: the option matcher, the yes/no engine, bounded) after
    the checks below and before the transaction that applies it. `fitted`: that reading done already
    (reply_fitted), for a caller that applies the reply inside a transaction of its own: no engine is asked
    here then. Under the conditional UPDATE the question must still wait, whenever it was read.

    `receipt`: the reply's message receipt when it came with a client_message_id (services.ReplyReceipt):
    `receipt.check(question)` once the question is found to be the sender's, before anything else (a repeat
    is refused as one), and `receipt.record(question)` in the transaction that applies the reply, before it.

    Raises ApplicationError: 404 (not theirs, or no such question), 409 (it no longer waits: the
    seed's words for how it stands; or a repeat of a message), 400 (it does not fit: the question keeps
    waiting), 502 (the engine reading it failed: the question keeps waiting)."""
    question = _question_for(actor=actor, request_id=reply.get("request_id", ""), conversation=conversation)
    if receipt is not None:
        receipt.check(question)
    if question.state != QuestionState.WAITING:
        raise _refused(question)
    _still_live(question)
    if reply.get("action") == "abort":
        state, answer = QuestionState.ABORTED, {}
    elif fitted is not None:
        state, answer = QuestionState.ANSWERED, fitted.take()
    else:
        state, answer = QuestionState.ANSWERED, _fit(question, reply)
        # the engine may have read for seconds: its turn may have ended, its deadline passed meanwhile
        _still_live(question)
    now = timezone.now()
    with transaction.atomic():
        if receipt is not None:  # first: of two copies of one message, the second waits here and is a repeat
            receipt.record(question)
        moved = Question.objects.filter(pk=question.pk, state=QuestionState.WAITING, timeout_at__gt=now).update(
            state=state, answer=answer, resolved_at=now, updated_at=now)
        if moved != 1:
            transaction.set_rollback(True)  # the receipt of a reply that was not applied
        else:
            data = {"request_id": question.request_id, "turn_id": question.turn.turn_id, "state": state}
            if question.kind != QuestionKind.SECRET and state == QuestionState.ANSWERED:
                data.update(answer)
            if content and question.kind != QuestionKind.SECRET:
                Message.objects.create(conversation_id=question.conversation_id, role=Message.Role.USER,
                                       content=content, actor=actor, turn_id=question.turn_id)
            event_append(conversation_id=question.conversation_id, turn_pk=question.turn_id,
                         type="interaction.resolved", data=data, audience=[question.turn.actor.key])
    if moved != 1:
        question.refresh_from_db(fields=["state"])
        if question.state == QuestionState.WAITING:  # its deadline passed between the checks
            _close(question, QuestionState.EXPIRED, reason="its deadline passed")
            question.refresh_from_db(fields=["state"])
        raise _refused(question)
    log.info("question %s (question=%s, turn=%s)", state, question.request_id, question.turn.turn_id)
    return {"object": "ugent.interaction_reply", "request_id": question.request_id,
            "conversation_id": question.conversation.external_id, "turn_id": question.turn.turn_id,
            "state": state}


def question_waiting_for(*, actor: Actor, conversation: Conversation) -> Question | None:
    """The conversation's question waiting for this user, if its turn is still live (the snapshot)."""
    return (Question.objects.select_related("turn")
            .filter(conversation=conversation, actor=actor, state=QuestionState.WAITING,
                    turn__state__in=(TurnState.ACCEPTED, TurnState.RUNNING))
            .order_by("-id").first())


def _text_reply(question: Question, text: str) -> dict:
    """A plain message as a submit to `question`. A secret or a form never takes its value from one
    (a secret would sit in the channel's transcript): their empty value does not fit."""
    value = "" if question.kind in (QuestionKind.SECRET, QuestionKind.FORM) else text
    return {"request_id": question.request_id, "action": "submit", "value": value}


def question_reply_from_text(*, actor: Actor, conversation: Conversation, text: str) -> dict | None:
    """A channel without buttons: a plain message answers the conversation's waiting choice, text or
    confirm question when it fits (an option by the matcher, yes/no by the yes/no engine, any text for
    a text question); None when nothing waits or it does not fit. A secret is never taken from a plain
    message: it would sit in the channel's transcript."""
    question = question_waiting_for(actor=actor, conversation=conversation)
    if question is None or question.kind in (QuestionKind.SECRET, QuestionKind.FORM):
        return None
    try:
        return question_reply(actor=actor, conversation=conversation, content=text,
                              reply=_text_reply(question, text))
    except ApplicationError:
        return None


# --- chat channels -------------------------------------------------------------------------------

#: A button's reply token, `<request_id>:<option number>`: what a press sends back (Telegram's
#: callback_data holds 64 bytes, so it names the option by its number, never by its id).
OPTION_TOKEN = re.compile(r"^(q-[0-9a-f]{32}):([0-9]{1,3})$")
CONFIRM_OPTIONS = ({"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"})
CONFIRM_PRESSES = {"yes": True, "no": False}  # the options' ids: what a press sends, read without an engine
KEEPS_WAITING = "The question keeps waiting."
SECRET_IN_CHAT = ("This question asks for a secret, and a chat message would keep it in the chat's history: "
                  f"answer it in the web app. {KEEPS_WAITING}")
FORM_IN_CHAT = f"This question is a form of several choices: answer it in the web app. {KEEPS_WAITING}"


def question_channel_options(question: Question) -> list[dict]:
    """The options a chat channel offers as buttons, in order: {id, label, value}, where value is the
    reply token a press sends back. A confirm offers Yes and No; text, secret and form offer none."""
    if question.kind == QuestionKind.CHOICE:
        options = question.spec["options"]
    elif question.kind == QuestionKind.CONFIRM:
        options = CONFIRM_OPTIONS
    else:
        return []
    return [{"id": o["id"], "label": _option_label(o), "value": f"{question.request_id}:{n}"}
            for n, o in enumerate(options, 1)]


def _numbered(options: list[dict]) -> list[str]:
    return [f"{n}. {_option_label(o)}" for n, o in enumerate(options, 1)]


def question_channel_text(question: Question) -> str:
    """The question as plain text, for a channel that shows no buttons (and above the ones that do):
    the prompt, then the options numbered. Nothing a reply holds: a secret's is the prompt alone."""
    prompt = question.spec.get("prompt", "")
    if question.kind == QuestionKind.CHOICE:
        return "\n".join([prompt, *_numbered(question.spec["options"])])
    if question.kind == QuestionKind.CONFIRM:
        return f"{prompt} (yes or no)"
    if question.kind == QuestionKind.FORM:
        parts = [prompt] if prompt else []
        for q in question.spec.get("questions", []):
            parts += [q.get("prompt") or q["id"], *_numbered(q["options"])]
        return "\n".join([*parts, FORM_IN_CHAT.removesuffix(" " + KEEPS_WAITING)])
    if question.kind == QuestionKind.SECRET:
        return f"{prompt}\n(A secret is not taken from a chat message: answer it in the web app.)"
    return prompt


def question_channel_hint(question: Question) -> str:
    """What a channel user is told when a message does not answer the question waiting for them."""
    if question.kind == QuestionKind.SECRET:
        return SECRET_IN_CHAT
    if question.kind == QuestionKind.FORM:
        return FORM_IN_CHAT
    if question.kind == QuestionKind.CHOICE:
        choices = ", ".join(_numbered(question.spec["options"]))
        return f"That does not answer the question: reply with one of {choices}. {KEEPS_WAITING}"
    if question.kind == QuestionKind.CONFIRM:
        return f"That does not answer the question: reply yes or no. {KEEPS_WAITING}"
    return f"That does not answer the question: reply with some text. {KEEPS_WAITING}"


@dataclass
class ChannelReply:
    """A channel message taken as a question's reply. `outcome`: applied, does_not_fit (the question
    keeps waiting) or refused (it no longer waits, or is not this user's); `state` the question's state
    after it ("" for none); `notice` what to tell the user ("" when applied: the turn's answer follows)."""

    request_id: str
    outcome: str
    state: str
    notice: str

    @property
    def applied(self) -> bool:
        return self.outcome == "applied"


def _channel_question(*, actor: Actor, conversation: Conversation, text: str,
                      option: str | None) -> tuple[Question | None, int | None, bool]:
    """The question a channel message replies to: (question, the option number a button names, whether
    it is a reply at all). A button's token names its question; a plain message replies to the newest
    question this user's live turn asked here, while it waits or once it expired."""
    token = OPTION_TOKEN.match((option or "").strip()) or OPTION_TOKEN.match(text.strip())
    rows = Question.objects.select_related("turn", "turn__actor", "conversation")
    if token:
        question = rows.filter(request_id=token[1], actor=actor, conversation=conversation).first()
        return question, int(token[2]), True
    if not text.strip() or text.lstrip().startswith("/"):  # a slash command stays a command
        return None, None, False
    question = (rows.filter(conversation=conversation, actor=actor, turn__state__in=LIVE_TURN_STATES)
                .order_by("-id").first())
    if question is None or question.state not in (QuestionState.WAITING, QuestionState.EXPIRED):
        return None, None, False
    return question, None, True


def _channel_reply(question: Question, text: str, number: int | None) -> tuple[dict, str]:
    """The submit a channel message makes to `question`, and the content kept of it (a press: its label)."""
    if number is None:
        return _text_reply(question, text), text
    options = question_channel_options(question)
    if not 1 <= number <= len(options):
        return {"request_id": question.request_id, "action": "submit", "value": ""}, ""
    picked = options[number - 1]
    reply = {"request_id": question.request_id, "action": "submit"}
    if question.kind == QuestionKind.CONFIRM:
        reply["value"] = picked["id"]
    else:
        reply["answers"] = [{"question_id": question.spec["id"], "option_id": picked["id"]}]
    return reply, picked["label"]


def _channel_apply(*, question: Question, actor: Actor, conversation: Conversation, reply: dict, content: str,
                   fitted: FittedReply | None) -> tuple[str, str, str]:
    try:
        result = question_reply(actor=actor, conversation=conversation, reply=reply, content=content,
                                fitted=fitted)
    except ApplicationError as exc:
        if exc.code in KEEPS_WAITING_CODES:  # (an engine that failed reading it: as one that did not answer)
            return "does_not_fit", QuestionState.WAITING, question_channel_hint(question)
        return "refused", (exc.extra or {}).get("state", ""), exc.message
    return "applied", result["state"], ""


def question_reply_from_channel(*, actor: Actor, conversation: Conversation | None, client_message_id: str,
                                content_hash: str, text: str, option: str | None = None,
                                on_taken: Callable[[ChannelReply], None] | None = None) -> ChannelReply | None:
    """A chat channel's inbound message as the reply to the question waiting for its sender; None when it
    is no reply (nothing waits, a slash command, a repeat of a message already received), and the
    message goes on as a message.

    A message taken as a reply never runs as a turn (seed 000, "Questions"): it applies when it fits
    (a button by its option number, text by the option matcher or the yes/no engine), and otherwise
    is refused with how the question stands, or a hint when it does not fit (the question keeps
    waiting). Its receipt is recorded in the same transaction, first: of two copies of one message
    the second finds it and goes on as the duplicate it is. `on_taken(reply)` runs inside that
    transaction (a channel's notice commits with the reply).

    The text is read against the question (the engines are plugins, bounded: one that does not answer in
    time is a reply that does not fit) before that transaction opens, never inside it: in embedded mode
    a transaction holds the one SQLite writer turn, and every write in the daemon would wait on the
    engine. Must not be called inside a transaction for the same reason."""
    if conversation is None:
        return None
    question, number, is_reply = _channel_question(actor=actor, conversation=conversation, text=text, option=option)
    if not is_reply:
        return None
    if statements.receipt_exists(conversation.pk, client_message_id):
        return None  # a copy of this message came first: no engine reads it again
    reply, content, fitted = {}, "", None
    if question is not None:
        reply, content = _channel_reply(question, text, number)
        if question.state == QuestionState.WAITING:  # (a question that no longer waits never does again)
            fitted = reply_fitted(question, reply)
    now = timezone.now()
    with transaction.atomic():
        try:
            with transaction.atomic():
                receipt = Receipt.objects.create(conversation=conversation, client_message_id=client_message_id,
                                                 content_hash=content_hash, actor=actor, started_at=now)
        except IntegrityError:
            return None  # a copy of this message came first
        if question is None:
            outcome, state, notice, request_id = "refused", "", NO_SUCH_QUESTION, ""
        else:
            request_id = question.request_id
            outcome, state, notice = _channel_apply(question=question, actor=actor, conversation=conversation,
                                                    reply=reply, content=content, fitted=fitted)
        Receipt.objects.filter(pk=receipt.pk).update(
            state=ReceiptState.COMPLETED if outcome == "applied" else ReceiptState.REFUSED,
            answer=notice, reason=f"a reply to question {request_id or '-'}: {outcome}",
            finished_at=timezone.now(), updated_at=timezone.now())
        taken = ChannelReply(request_id=request_id, outcome=outcome, state=state, notice=notice)
        if on_taken is not None:
            on_taken(taken)
    log.info("channel reply (question=%s, message=%s, outcome=%s, state=%s)", request_id or "-",
             client_message_id, outcome, state)
    return taken


# --- the ask_user tool ---------------------------------------------------------------------------

def _toolbox_classes():
    """Built on first use: pydantic models and OPM's ToolBox are imported only where a turn uses tools."""
    from typing import List, Literal, Optional, Union

    from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput
    from pydantic import BaseModel, Field

    class OptionArg(BaseModel):
        id: str = Field(description="The option's id, returned when it is picked.")
        label: str = Field(description="What the user sees.")
        aliases: List[str] = Field(default_factory=list, description="Other words a free-text reply may use.")

    class FormQuestionArg(BaseModel):
        id: str
        prompt: str
        options: List[OptionArg]

    class AskUserArgs(ToolArguments):
        kind: Literal["choice", "form", "text", "secret", "confirm"] = Field(
            description="choice: pick one option; form: several choices at once; text: free text; "
                        "secret: a value kept out of every transcript; confirm: yes or no.")
        prompt: str = Field(default="", description="The question as the user reads it.")
        options: Optional[List[OptionArg]] = Field(default=None, description="For a choice.")
        questions: Optional[List[FormQuestionArg]] = Field(default=None, description="For a form.")
        timeout_s: Optional[float] = Field(default=None, description="How long to wait for the answer, seconds.")

    class AskUserOutput(ToolOutput):
        request_id: str
        state: str = Field(description="answered, expired, cancelled (the turn stopped) or aborted (dismissed).")
        answers: List[dict] = Field(default_factory=list, description="[{question_id, option_id}] for a choice/form.")
        value: Optional[Union[str, bool]] = Field(default=None, description="A text answer, or a confirm's yes (true)/no.")
        secret_ref: Optional[str] = Field(default=None, description="A secret is never shown: pass this reference "
                                                                    "to the tool that needs it.")

    class AskUserToolBox(ToolBox):
        """`ask_user`: ask the turn's user a question and wait for the answer (channels_app.questions).

        `context` is the turn's tool context: `.turn` (the Turn) and `.should_stop` (the runner's stop
        check). A secret answer is kept on `context.secrets[request_id]`, never returned to the model."""

        def __init__(self, context, config: dict | None = None):
            self.context = context
            super().__init__("ugent-ask-user", config)

        def discover_tools(self):
            return [AgentTool(name="ask_user", description=(
                "Ask the user a question mid-turn and wait for the answer: a choice among options, a form of "
                "several choices, free text, a secret (kept out of every transcript), or a yes/no confirmation."),
                argument_schema=AskUserArgs, output_schema=AskUserOutput, tool_call=self.ask)]

        def call_timeout(self, name: str, args: dict) -> float:
            """The call waits for its user: as long as its question (question_open's clamp), and a margin to
            see the answer, not the per-tool timeout (channels_app.tools.tool_call_run)."""
            try:
                wanted = float((args or {}).get("timeout_s") or settings.UGENT_QUESTION_DEFAULT_TIMEOUT)
            except (TypeError, ValueError):
                wanted = settings.UGENT_QUESTION_DEFAULT_TIMEOUT
            return min(max(wanted, 1.0), settings.UGENT_QUESTION_MAX_TIMEOUT) + ANSWER_MARGIN_SECS

        def ask(self, args: AskUserArgs) -> AskUserOutput:
            spec = args.model_dump(exclude_none=True, exclude={"timeout_s"})
            timeout = args.timeout_s or settings.UGENT_QUESTION_DEFAULT_TIMEOUT
            result = question_ask(turn=self.context.turn, spec=spec, timeout_s=timeout,
                                  should_stop=getattr(self.context, "should_stop", lambda: False))
            out = AskUserOutput(request_id=result.request_id, state=result.state,
                                answers=[{"question_id": q, "option_id": o} for q, o in result.answers.items()])
            if result.answered and self.context.turn and spec["kind"] == QuestionKind.SECRET:
                secrets = getattr(self.context, "secrets", None)
                if secrets is None:
                    secrets = {}
                    try:
                        self.context.secrets = secrets
                    except AttributeError:
                        pass
                secrets[result.request_id] = result.value
                out.secret_ref = result.request_id
            elif result.answered:
                out.value = result.value
            return out

    return AskUserToolBox


_ask_user_cls = None
#: Seconds past its question's deadline an ask_user call may take to see how it ended.
ANSWER_MARGIN_SECS = 10.0


def __getattr__(name):  # AskUserToolBox, built lazily (see _toolbox_classes)
    global _ask_user_cls
    if name == "AskUserToolBox":
        if _ask_user_cls is None:
            _ask_user_cls = _toolbox_classes()
        return _ask_user_cls
    raise AttributeError(name)
