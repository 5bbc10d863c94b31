"""The turn runner: composes the agent from its profile's engine, streams the answer as events.

A turn's run is a `TurnRun`: claim, compose, the engine's steps with the stop/steering/time checks
between them, and its end (or, for a turn a hook gave a native action, that action in place of
the engine: `TurnRun.native_action_run`). Every end state (completed, refused, failed, cancelled,
interrupted, abandoned) is written by one function, `turn_end`, from the table `END_STATES`: the
turn, the receipt, the answer message, the events and the after-turn hook, in one transaction.

Runs inside the `run_turn` Celery task in both run modes. Deltas are coalesced into events a few
milliseconds apart, so a fast engine does not turn every token into a database write; the first
delta is written at once. A turn's liveness is its lease (`Turn.lease_expires_at`), which this
process's `LeaseKeeper` renews; the sweep ends only turns whose lease has lapsed (docs/turns.md).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Q
from django.utils import timezone

from channels_app import (artifacts as artifacts_mod, citations as citations_mod, compaction, file_parts, hooks,
                          statements, tools as turn_tools_mod)

from ugent_common import rows
# The log's lock (see channels_app.events): under it a state read and an append are one step, so no
# event of a turn is written after another process's terminal event.
from channels_app.dispatch import turn_thread_write_off
from channels_app.events import _lock_log as log_lock
from channels_app.events import events_append
from channels_app.models import (Event, Message, Receipt, Steering,
                                 SteeringState, Turn, TurnState)
from plugins_app.agent.engines.base import (ANSWER, ANSWER_RESET, CITATIONS, ERROR, THINKING, TOOL, USAGE,
                                            EngineError, count_tokens, stream_items, usage_of)
from ugent_common import metrics

log = logging.getLogger("ugent.turns")
COALESCE_SECONDS = 0.015
STOP_CHECK_SECONDS = 0.1

INTERRUPTED_REASON = "the process running it stopped"
TIME_LIMIT_REASON = "The turn ran out of time."
QUEUE_TIMEOUT_REASON = "It waited in the queue past its deadline and was never started."
PROFILE_REMOVED_REASON = "Its agent profile was removed before it started."


class TurnEnded(Exception):
    """The turn was ended elsewhere (the sweep, the lease keeper): its runner stops and writes nothing."""


# --- the end states ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EndState:
    """How one end state is recorded. A later state (a tool call or a question waiting) is one more row."""

    state: str  # the turn's and the receipt's state
    event: str  # the terminal event
    code: str = ""  # the event's code when the caller names none
    reason: str = ""  # the receipt's reason when the caller gives none
    drops_steering: bool = True  # pending steering is dropped, and the stream told so
    keeps_empty_answer: bool = False  # an assistant message is written even for an empty answer
    partial: bool = False  # the event says the answer was cut short


END_STATES = {s.state: s for s in (
    EndState(TurnState.COMPLETED, "turn.completed", drops_steering=False, keeps_empty_answer=True),
    EndState(TurnState.REFUSED, "turn.completed", drops_steering=False, keeps_empty_answer=True),
    EndState(TurnState.FAILED, "turn.failed", code="turn_failed"),
    EndState(TurnState.CANCELLED, "turn.cancelled", reason="stopped", partial=True),
    EndState(TurnState.INTERRUPTED, "turn.failed", code="interrupted", reason=INTERRUPTED_REASON),
    EndState(TurnState.ABANDONED, "turn.failed", code="abandoned"),
)}


class EndOutcome(enum.Enum):
    ENDED = "ended"  # this call recorded the end
    ALREADY_ENDED = "already_ended"  # another process ended it first: nothing was written
    STEERING_WAITS = "steering_waits"  # completion only: a steering waits, which the runner runs


class DeltaWriter:
    """Buffers answer/thinking text and writes it as turn.delta events, only while the turn runs."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.segment = None
        self.buffer: list[str] = []
        self.last_flush = 0.0

    def add(self, segment: str, text: str) -> None:
        if self.segment not in (None, segment):
            self.flush()
        self.segment = segment
        self.buffer.append(text)
        if time.monotonic() - self.last_flush >= COALESCE_SECONDS:
            self.flush()

    def pending(self) -> list[tuple[str, dict, list]]:
        if not self.buffer:
            return []
        item = ("turn.delta", {"turn_id": self.turn.turn_id, "segment": self.segment,
                               "text": "".join(self.buffer)}, [])
        self.buffer, self.segment = [], None
        return [item]

    def flush(self, extra: list | None = None) -> None:
        """Write what is buffered; TurnEnded (and nothing written) when the turn no longer runs."""
        items = self.pending() + (extra or [])
        if items:
            turn = self.turn

            def still_running(state):
                if state != TurnState.RUNNING:
                    raise TurnEnded(turn.turn_id)  # the append's transaction rolls back: nothing written
            # The state is read under the log's lock, in the append's one round trip.
            events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, items=items,
                          guard=(statements.turn_state_step(turn.pk), still_running))
        self.last_flush = time.monotonic()


def _steerings_drop(turn: Turn) -> list:
    """A turn that ends otherwise than completed drops its pending steering, and says so."""
    ids = list(Steering.objects.filter(turn_id=turn.pk, state=SteeringState.PENDING).values_list("pk", flat=True))
    if not ids:
        return []
    Steering.objects.filter(pk__in=ids, state=SteeringState.PENDING).update(state=SteeringState.DROPPED)
    return [("turn.steering_dropped", {"turn_id": turn.turn_id, "steering_ids": ids}, [])]


def _answer_step(turn: Turn, end, answer: str) -> rows.Step | None:
    """The answer's message row, when the end keeps one."""
    if answer or end.keeps_empty_answer:
        return rows.table(Message).insert_step(conversation_id=turn.conversation_id, role=Message.Role.ASSISTANT,
                                               content=answer, turn_id=turn.pk)
    return None


def turn_end(*, turn: Turn, state: str, answer: str = "", reason: str = "", code: str = "",
             citations: list[str] | None = None, writer: DeltaWriter | None = None,
             pending: list | None = None, from_state: str = TurnState.RUNNING,
             where: Q | None = None, started_at=None, never_started: bool = False, decided_by: str | None = None,
             unless_steering_waits: bool = False, answer_streamed: bool = False,
             usage: dict | None = None, ttft_ms: float | None = None,
             artifacts: list | None = None, drops_steering: bool | None = None) -> EndOutcome:
    """End a turn in `state` (a key of END_STATES): turn, receipt, answer message, events and the
    after-turn hook in one transaction. Only one end wins: a turn no longer in `from_state` (or not
    matching `where`) is left as it is and nothing is written.

    `writer`: a runner's, whose buffered deltas go before the terminal event; `pending`: other such
    events (a hook's answer). `started_at`:
    the turn starts and ends here (a hook's answer). `never_started`: the claim is undone (abandoned).
    `answer_streamed`: the answer is what the turn's events streamed, read under the log's lock once
    the turn has ended, so no delta its runner commits is missing (the sweep, the lease keeper).
    `unless_steering_waits`: completion yields to a steering that waits (ordered by the turn's row
    lock against streams.turn_steer, so a steering is either applied or refused, never lost).
    `usage`: {"prompt_tokens", "completion_tokens", "total_tokens", "source"} (stored on the turn and
    carried by the terminal event); `ttft_ms`: time to the first answer token; `artifacts`: the files
    its tools returned, for the turn and the receipt (their ugent.artifacts / ugent.artifacts_pending
    events were written as the tools returned them, channels_app.artifacts). `drops_steering`: overrides
    the end state's (a native action's completion, which never hands a steering on). The end is logged
    (`turn ended (...)`) and counted in the metrics once it commits.
    """
    end = END_STATES[state]
    citations = list(citations or [])
    now = timezone.now()
    turn_fields = {"state": state, "finished_at": now, "lease_expires_at": None}
    receipt_fields = {"state": state, "reason": reason or end.reason, "finished_at": now}
    if end.event == "turn.failed":
        turn_fields["error"] = reason or end.reason
    if state == TurnState.COMPLETED:
        # Before this function's transaction, so an NLI engine's seconds hold no lock; a turn ended inside a
        # transaction of its caller's (a hook's answer, in the message's) gets the lexical check alone
        # (channels_app.citations).
        citations = citations_mod.citations_verify(requested=list(turn.citation_ids or []), claimed=citations,
                                                   answer=answer, prompt=(turn.context or {}).get("text", ""))
        receipt_fields["citations"] = citations
    if started_at is not None:
        turn_fields["started_at"] = receipt_fields["started_at"] = started_at
    if never_started:
        turn_fields["started_at"] = receipt_fields["started_at"] = None
    if usage is not None:
        turn_fields.update(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                           total_tokens=usage["total_tokens"], usage_source=usage.get("source", ""))
    if ttft_ms is not None:
        turn_fields["ttft_ms"] = ttft_ms
    artifacts = list(artifacts or [])
    # The common end (no sweep's conditions, no files, the answer in hand) writes the turn, the answer and
    # the receipt in the lock's own round trip, and rolls them back when the lock's batch says it must
    # not end: a steering waits, or another end won. Each other end reads first, then writes.
    merged = where is None and not artifacts and not answer_streamed
    with transaction.atomic():
        steps = [statements.turn_lock_step(turn.pk),
                 statements.steering_pending_step(turn.pk) if unless_steering_waits else None]
        probes = {}
        if merged:
            receipt_fields["answer"] = answer
            probes = hooks.after_turn_probes(turn=turn, state=state)
            steps += [rows.table(Turn).update_step({"id": turn.pk, "state": from_state}, **turn_fields),
                      _answer_step(turn, end, answer),
                      rows.table(Receipt).update_step({"id": turn.receipt_id}, **receipt_fields)]
        probes_at = len(steps)
        steps += [step for _hook, step in probes.values()]
        found = rows.batch(steps)
        probed = {name: (hook, result) for (name, (hook, _step)), result in zip(probes.items(), found[probes_at:])}
        steering_waits = found[1]
        if steering_waits:
            if merged:
                transaction.set_rollback(True)
            return EndOutcome.STEERING_WAITS
        if merged:
            moved = found[2]
        else:
            if artifacts:  # under the turn's lock: a pending one finished meanwhile is listed finished
                artifacts = artifacts_mod.artifacts_at_end(turn, artifacts)
                turn_fields["artifacts"] = artifacts
                receipt_fields["files"] = artifacts
            if where is None:
                moved = rows.table(Turn).update({"id": turn.pk, "state": from_state}, **turn_fields)
            else:  # the sweep's conditions (a lapsed lease, an age): off the hot path, through the ORM
                moved = Turn.objects.filter(where, pk=turn.pk, state=from_state).update(
                    updated_at=now, **turn_fields)
        if moved != 1:
            if merged:
                transaction.set_rollback(True)
            return EndOutcome.ALREADY_ENDED
        # Steering rows before the log's lock, as steerings_take takes them: no deadlock between the two.
        drops = end.drops_steering if drops_steering is None else drops_steering
        dropped = _steerings_drop(turn) if drops else []
        if not merged:
            if answer_streamed:
                log_lock()
                answer = streamed_answer(turn.pk)
            receipt_fields["answer"] = answer
            # the answer and the receipt in one round trip
            rows.batch([_answer_step(turn, end, answer),
                        rows.table(Receipt).update_step({"id": turn.receipt_id}, **receipt_fields)])
        items = (writer.pending() if writer is not None else []) + list(pending or []) + dropped
        if citations and state == TurnState.COMPLETED:
            items.append(("ugent.citations", {"turn_id": turn.turn_id, "citations": citations}, []))
        turn.state = state
        hooks.run_after_turn(turn=turn, state=state, answer=answer, probed=probed)
        data = {"turn_id": turn.turn_id, "state": state, "answer": answer}
        if end.event == "turn.completed":
            data["citations"] = citations
            if decided_by is not None:
                data["decided_by"] = decided_by
        if end.event == "turn.failed":
            data.update(reason=reason or end.reason, code=code or end.code)
        if end.partial:
            data["partial"] = True
        if usage is not None:
            data["usage"] = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        items.append((end.event, data, [turn.actor.key]))
        events_append(conversation_id=turn.conversation_id, turn_pk=turn.pk, items=items)
    turn_end_report(turn=turn, state=state, now=now, started_at=started_at, never_started=never_started,
                    usage=usage, ttft_ms=ttft_ms)
    return EndOutcome.ENDED


def turn_end_report(*, turn: Turn, state: str, now, started_at=None, never_started: bool = False,
                    usage: dict | None = None, ttft_ms: float | None = None) -> None:
    """The turn's end line in the log, and its figures in the metrics: never breaks the end itself."""
    try:
        started = None if never_started else (started_at or turn.started_at)
        ms = round((now - started).total_seconds() * 1000, 1) if started else None
        tokens = usage["total_tokens"] if usage else None
        log.info("turn ended (turn=%s, model=%s, state=%s, ms=%s, ttft_ms=%s, tokens=%s)",
                 turn.turn_id, turn.model or "-", state, "-" if ms is None else ms,
                 "-" if ttft_ms is None else round(ttft_ms, 1), "-" if tokens is None else tokens,
                 extra={"turn": turn.turn_id, "model": turn.model, "state": state, "ms": ms,
                        "ttft_ms": ttft_ms, "tokens": tokens,
                        "prompt_tokens": usage["prompt_tokens"] if usage else None,
                        "completion_tokens": usage["completion_tokens"] if usage else None})
        metrics.turn_ended(state=state, seconds=None if ms is None else ms / 1000,
                           ttft_seconds=None if ttft_ms is None else ttft_ms / 1000,
                           prompt_tokens=usage["prompt_tokens"] if usage else None,
                           completion_tokens=usage["completion_tokens"] if usage else None)
    except Exception:
        log.exception("could not report the end of turn %s", turn.turn_id)


def turn_complete(*, turn: Turn, writer: DeltaWriter, answer: str, citations: list[str],
                  usage: dict | None = None, ttft_ms: float | None = None, artifacts: list | None = None) -> bool:
    """Complete the turn; False (and nothing written) when steering waits, which the runner then runs."""
    outcome = turn_end(turn=turn, state=TurnState.COMPLETED, answer=answer, citations=citations,
                       writer=writer, unless_steering_waits=True, usage=usage, ttft_ms=ttft_ms,
                       artifacts=artifacts)
    return outcome is not EndOutcome.STEERING_WAITS


def streamed_answer(turn_pk: int) -> str:
    """What a turn's events streamed as its answer (honouring answer resets): a cut-off turn keeps it."""
    answer: list[str] = []
    for data in Event.objects.filter(turn_id=turn_pk, type="turn.delta").order_by("id").values_list("data", flat=True):
        if data.get("segment") == ANSWER:
            answer.append(data.get("text", ""))
        elif data.get("segment") == ANSWER_RESET:
            answer.clear()
    return "".join(answer)


# --- the run -----------------------------------------------------------------------------------

HISTORY_TURNS = 20  # the history a turn without a profile is shown


def build_messages(turn: Turn, read: tuple | None = None):
    """The engine's view: the conversation's recent history, injected context, then this turn's text.
    `read`: the history and the summary as the claim read them (TurnRun.claim), else read here."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
    if read is None:
        profile = turn.profile
        limit = profile.history_turns if profile else HISTORY_TURNS
        # the history and the summary a compaction left, in one round trip
        read = rows.batch([statements.history_tail_step(turn.conversation_id, turn.pk, limit),
                           statements.summary_latest_step(turn.conversation_id)])
    past, summary = read
    messages = [AgentMessage(role=MessageRole(role), content=content) for role, content in past]
    # The summary a compaction left stands for the history it hid.
    if summary:
        messages.insert(0, AgentMessage(role=MessageRole.SYSTEM, content=summary))
    for block in (turn.context or {}).get("injected_context", []):
        messages.append(AgentMessage(role=MessageRole.SYSTEM, content=block))
    tags = (turn.context or {}).get("tags") or []
    if tags:  # routing's tags reach the engine as context, and stay on the turn's record
        messages.append(AgentMessage(role=MessageRole.SYSTEM, content="Routing tags: " + ", ".join(tags)))
    messages.append(AgentMessage(role=MessageRole.USER, content=(turn.context or {}).get("text", "")))
    return messages


# The turn with its conversation, actor and profile, and whether steering waits: one statement.
turn_fetch = statements.turn_fetch


class TurnRun:
    """One run of one accepted turn. Each step is a method a test can call:

    claim → compose → (take_steering → engine_step)* → complete | fail | cancel

    or, for a turn that runs a native action a hook asked for (hooks.NativeAction, in the turn's
    context["native_action"]): claim → native_action_run → its end.

    Between engine items the runner looks (every STOP_CHECK_SECONDS) for a stop, for steering and
    for its turn having been ended elsewhere; it also ends the turn as failed past its run limit. A
    stop ends the turn keeping what it answered; steering cuts the engine's step short and runs it
    again with the answer so far and the steered message(s) appended as the newest user turn.
    """

    def __init__(self, turn_pk: int):
        self.turn_pk = turn_pk
        self.turn: Turn | None = None
        self.writer: DeltaWriter | None = None
        self.engine = None
        self.messages: list = []
        self.answer: list[str] = []
        self.segment: list[str] = []  # the answer since the last steering, handed back to the engine with it
        self.thinking: list[str] = []
        self.citations: list[str] = []
        self.cancelled = False  # a stop was asked
        self.steered = False  # a steering waits: the engine's step is cut short
        self.timed_out = False  # past the run limit
        self.ended_elsewhere = False  # the turn is no longer running (swept, or ended by the lease keeper)
        self.steering_waits = False
        self.last_check = 0.0
        self.deadline = 0.0
        self.started = 0.0  # monotonic, at the claim
        self.first_token: float | None = None  # monotonic, at the first answer token
        self.upstream_usage: dict | None = None  # summed over the engine's steps, where it reports it
        self.recall = None  # memory's recall for this turn (memory_recall), made at the first engine call
        self.code = None  # code context for this turn (code_context), fetched at the first engine call
        self.tools = None  # channels_app.tools.TurnTools: what the engine is offered (None: no tools)
        self.tool_ctx = None
        self.tool_steps = 0  # tool steps run so far (each: the calls of one engine step)
        self.offered = False  # this engine step was offered tools: its TOOL items are calls to run
        self.pending_calls: dict[str, dict] = {}  # call id -> {"id", "name", "arguments"}
        self.artifacts: list = []
        self.history_read: tuple | None = None  # the history and summary the claim read (build_messages)

    # -- steps --
    def claim(self) -> bool:
        """accepted → running, with its lease, and the receipt's running: one commit. False when the
        turn has moved on (a redelivered task) or was abandoned here instead of started."""
        now = timezone.now()
        lease = now + timedelta(seconds=settings.UGENT_TURN_LEASE_SECONDS)
        with transaction.atomic():
            # One round trip: the claim, and the turn as it now stands. Its commit does not wait for
            # the disk: nothing outside the database acts on a claim before a later commit of the
            # turn that does (the first event any reader gets, a tool's start, the end) makes it
            # durable too, so a database crash that loses it loses nothing anyone saw; the turn is
            # then accepted again, as if this worker had never taken it (docs/performance.md).
            # The receipt's running goes in the same trip (it names the turn's receipt through the claimed row).
            # On PostgreSQL, also what compose() shows the engine first, the history and the summary: no
            # trip of their own. SQLite runs a batch one statement at a time, and this transaction holds
            # the daemon's write lock: there compose() reads them after it.
            ahead = connection.vendor == "postgresql"
            _unflushed, claimed, _receipt, turn, past, summary = rows.batch([
                statements.commit_unflushed_step(),
                rows.table(Turn).update_step({"id": self.turn_pk, "state": TurnState.ACCEPTED},
                                             state=TurnState.RUNNING, started_at=now, lease_expires_at=lease),
                statements.receipt_running_step(self.turn_pk, now),
                statements.turn_fetch_step(self.turn_pk),
                statements.turn_history_step(self.turn_pk, HISTORY_TURNS) if ahead else None,
                statements.turn_summary_step(self.turn_pk) if ahead else None])
            if claimed != 1:
                # not ours: the receipt step matched our claim only, and nothing of this transaction stays
                transaction.set_rollback(True)
                return False
            self.turn, self.history_read = turn, ((past, summary) if ahead else None)
            reason = self.abandon_reason(now)
            if reason:
                statements.commit_flushed()  # an end is answered: it waits for the disk, as every end does
                turn_end(turn=turn, state=TurnState.ABANDONED, reason=reason, never_started=True)
                return False
        self.writer = DeltaWriter(turn)
        if (turn.context or {}).get("answer_whole"):
            # Nobody waits for its first token (a non-stream request): that delta is coalesced like
            # every later one, written with a token that comes COALESCE_SECONDS after it or with the
            # end, so a fast answer is one transaction (one WAL flush in servers mode), not two.
            self.writer.last_flush = time.monotonic()
        # What the claim read stands for the first check: a stop or steering sent before the turn
        # started is seen at once, and the next look at the database is one interval away.
        self.last_check = self.started = time.monotonic()
        self.deadline = self.last_check + settings.UGENT_TURN_RUN_LIMIT
        self.cancelled = turn.cancel_requested
        self.steering_waits = turn.pending_steering
        return True

    def abandon_reason(self, now) -> str:
        """Why a claimed turn must not start: its queue deadline passed, or its profile is gone."""
        turn = self.turn
        if turn.created_at and (now - turn.created_at).total_seconds() > settings.UGENT_TURN_QUEUE_TIMEOUT:
            return QUEUE_TIMEOUT_REASON
        if turn.profile is None and not (turn.context or {}).get("native_action"):  # an action needs no engine
            return PROFILE_REMOVED_REASON
        return ""

    def native_action_run(self, spec: dict) -> None:
        """A native action as the turn: no engine; the action (hooks.native_action) runs outside any
        transaction and holds no lock, then the turn ends completed with its answer, recorded as a
        hook's answer is (services.turn_finish_without_agent: the same reason, decided_by, delta and
        messages). Once started it is not stopped: nothing asks for a stop while it runs (the seed:
        neither action stops for a stop request). A stop that came before the claim means it never
        starts. Its failure texts are the action's own; a missing action fails the turn."""
        turn = self.turn
        if self.cancelled:
            self.cancel()
            return
        name = str(spec.get("action", ""))
        run = hooks.native_action(name)
        if run is None:
            raise EngineError(f"No native action named {name!r} is installed here.",
                              code="native_action_not_installed")
        answer = run(turn=turn, first_message=bool(spec.get("first_message")))
        turn_end(turn=turn, state=TurnState.COMPLETED, answer=answer, reason=str(spec.get("reason", "")),
                 decided_by=str(spec.get("decided_by", "")), drops_steering=True,
                 pending=[("turn.delta", {"turn_id": turn.turn_id, "segment": ANSWER, "text": answer}, [])])

    def compose(self) -> None:
        """The engine from the turn's profile, and the messages it is shown."""
        from plugins_app.agent.engines.registry import engine_for_profile
        try:
            self.engine = engine_for_profile(self.turn.profile)
        except LookupError as exc:
            raise EngineError(str(exc), code="engine_not_installed")
        self.messages = build_messages(self.turn, self.history_read)
        self.history_read = None  # what the claim read: a compaction below hides some of it
        if self.compact_first():
            self.messages = build_messages(self.turn)
        # the turn's uploaded files: bytes for a multimodal engine, their text for any other (docs/files.md)
        self.messages = file_parts.messages_with_files(self.turn, self.messages, self.engine)
        if getattr(self.engine, "supports_tools", False):
            self.compose_tools()

    def compact_first(self) -> bool:
        """Compact the conversation when the history the engine would see passes the profile's budget
        (channels_app.compaction). It runs to its end: no stop check happens while it runs, and a stop
        that came meanwhile is seen at the first check after it. Its summariser is given
        UGENT_COMMAND_ENGINE_TIMEOUT, and never more than the turn has left: one that does not answer by
        then fails the compaction, not the turn. True when it hid messages."""
        if self.cancelled or not compaction.compaction_due(turn=self.turn, messages=self.messages):
            return False
        left = self.deadline - time.monotonic()
        done = compaction.turn_compact(turn=self.turn, timeout=min(settings.UGENT_COMMAND_ENGINE_TIMEOUT, left))
        self.last_check = 0.0  # it may have taken a while: the next check looks for a stop at once
        return done.compacted

    def compose_tools(self) -> None:
        """The turn's toolboxes, narrowed by its limits; routing's delegate-research runs here."""
        turn = self.turn
        self.tool_ctx = turn_tools_mod.ToolContext(
            turn=turn, actor=turn.actor, conversation=turn.conversation, should_stop=self.stop_asked,
            emit=self.writer.flush, allowed=turn.allowed_tools, denied=list(turn.denied_tools or []),
            profile=turn.profile, messages=self.messages)
        self.tools = turn_tools_mod.turn_tools(self.tool_ctx)
        task = (turn.context or {}).get("delegate_research")
        if task:
            self.research_first(task)

    def research_first(self, task: str) -> None:
        """Routing's delegate-research: a delegated task runs before the engine, its answer becomes context."""
        from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
        box = turn_tools_mod.DelegationToolBox(self.tool_ctx)
        only = turn_tools_mod.TurnTools([box], allowed=None, denied=None)
        outcome = turn_tools_mod.tool_call_run(tools=only, ctx=self.tool_ctx, step=0, call={
            "id": "route-research", "name": "delegate_research", "arguments": {"task": task}})
        self.artifacts.extend(outcome.artifacts)
        if not outcome.error and isinstance(outcome.result, dict):
            self.messages.insert(len(self.messages) - 1, AgentMessage(
                role=MessageRole.SYSTEM, content="Research notes: " + str(outcome.result.get("answer", ""))))

    def should_stop(self) -> bool:
        """The engine's and the runner's question between items: stop, steering, time, ended elsewhere."""
        if self.cancelled or self.steered or self.timed_out or self.ended_elsewhere:
            return True
        now = time.monotonic()
        if now >= self.deadline:
            self.timed_out = True
            return True
        if now - self.last_check >= STOP_CHECK_SECONDS:
            self.last_check = now
            row = statements.turn_stop_check(self.turn_pk)
            self.cancelled, self.steered = bool(row and row[0]), bool(row and row[2])
            self.ended_elsewhere = not row or row[1] != TurnState.RUNNING
        return self.cancelled or self.steered or self.ended_elsewhere

    def stop_asked(self) -> bool:
        """should_stop for a running tool: a stop, the time limit or an end elsewhere (steering waits)."""
        self.should_stop()
        return self.cancelled or self.timed_out or self.ended_elsewhere

    def take_steering(self) -> bool:
        """Hand pending steering to the engine: the answer so far, then each steered message."""
        from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole
        taken = steerings_take(turn=self.turn, writer=self.writer) if self.steering_waits else []
        self.steering_waits = True  # after the first step, only a steering brings us back here
        if taken:
            if "".join(self.segment):
                self.messages.append(AgentMessage(role=MessageRole.ASSISTANT, content="".join(self.segment)))
            self.messages.extend(AgentMessage(role=MessageRole.USER, content=s.text) for s in taken)
            self.segment.clear()
        return bool(taken)

    def engine_step(self) -> None:
        """One pass of the engine over the messages, until it ends or the runner must stop."""
        self.steered = False
        self.pending_calls = {}
        offered = None
        if self.tools and self.tool_steps <= settings.UGENT_TOOL_STEP_LIMIT:
            offered = self.tools.specs
        self.offered = offered is not None
        messages = self.profile_context(self.memory_recall(self.code_context(list(self.messages))))
        # the conversation's own key, as a memory engine gets it: external ids repeat across channels and clients
        for item in stream_items(self.engine, messages, session_id=f"conv-{self.turn.conversation_id}",
                                 tools=offered, should_stop=self.should_stop):
            self.handle(item)
            if self.should_stop():
                break

    def memory_recall(self, messages: list) -> list:
        """Memory (plugins_app.agent.memory): the user's recalled facts put before the newest user
        message, at memory's recall cadence; a turn with disable_memory_recall recalls nothing."""
        if self.recall is None:
            from plugins_app.agent.memory import turn_recall
            self.recall = turn_recall(actor_key=self.turn.actor.key, disabled=self.turn.disable_memory_recall,
                                      session_id=self.turn.conversation.external_id)
        return self.recall.messages(messages)

    def profile_context(self, messages: list) -> list:
        """The profile's own memory engine (AgentProfile.memory_engine), where it names one, builds the
        context the engine sees from the turn's history (plugins_app.agent.memory.profile_context)."""
        if not self.turn.profile or not self.turn.profile.memory_engine:
            return messages
        from plugins_app.agent.memory import profile_context
        # the conversation's own key: external ids are unique only within a channel and client
        return profile_context(profile=self.turn.profile, messages=messages,
                               session_id=f"conv-{self.turn.conversation_id}")

    def code_context(self, messages: list) -> list:
        """Code context (plugins_app.agent.code_context): the working directory's chunks most relevant to
        the turn's text, put before the newest user message; a turn with disable_code_context gets none."""
        if self.code is None:
            from channels_app.sandbox import directory_confined
            from plugins_app.agent.code_context import TurnCodeContext, code_context_conf
            # off in ugent.toml (the default): no working-directory lookup either, on every turn
            disabled = self.turn.disable_code_context or not code_context_conf().enabled
            self.code = TurnCodeContext(root=None if disabled else directory_confined(self.turn.conversation),
                                        text=(self.turn.context or {}).get("text", ""), disabled=disabled)
        return self.code.messages(messages)

    def handle(self, item) -> None:
        turn, writer = self.turn, self.writer
        if item.kind == ANSWER:
            if self.first_token is None and item.text:
                self.first_token = time.monotonic()
            self.answer.append(item.text)
            self.segment.append(item.text)
            writer.add(ANSWER, item.text)
        elif item.kind == THINKING:
            self.thinking.append(item.text)
            if turn.include_thinking:
                writer.add(THINKING, item.text)
        elif item.kind == ANSWER_RESET:
            self.answer.clear()
            self.segment.clear()
            writer.flush([("turn.delta", {"turn_id": turn.turn_id, "segment": ANSWER_RESET, "text": ""}, [])])
        elif item.kind == TOOL and self.offered and not (item.data or {}).get("executed"):
            data = item.data or {}  # a call the turn runs once the step ends (the same id supersedes)
            self.pending_calls[str(data.get("id") or len(self.pending_calls))] = data
        elif item.kind == TOOL:  # a tool the engine ran itself: reported as it was
            writer.flush([("turn.delta", {"turn_id": turn.turn_id, "segment": TOOL, "text": item.text,
                                          "tool": item.data or {}}, [])])
        elif item.kind == CITATIONS:
            self.citations.extend(i for i in (item.data or {}).get("ids", []) if i not in self.citations)
        elif item.kind == USAGE:
            usage = usage_of(item.data)
            if usage is not None:
                if self.upstream_usage is not None:  # another step (steering): the turn's usage is their sum
                    usage = {k: usage[k] + self.upstream_usage[k] for k in usage}
                self.upstream_usage = usage
        elif item.kind == ERROR:
            raise EngineError(item.text or "The engine reported an error.")

    def run_calls(self) -> None:
        """The calls the engine's step asked for, each recorded; their results become TOOL messages.
        Past the step limit they are answered with an error and the engine is offered no more tools."""
        limit = settings.UGENT_TOOL_STEP_LIMIT
        refuse = turn_tools_mod.STEP_LIMIT_ERROR.format(limit=limit) if self.tool_steps >= limit else ""
        calls = list(self.pending_calls.values())
        self.pending_calls = {}
        self.writer.flush()
        outcomes = []
        for call in calls:
            outcome = turn_tools_mod.tool_call_run(tools=self.tools, ctx=self.tool_ctx, call=call,
                                                   step=self.tool_steps, refuse=refuse)
            outcomes.append(outcome)
            self.artifacts.extend(outcome.artifacts)
        self.messages.extend(turn_tools_mod.tool_messages("".join(self.segment), outcomes, calls))
        self.segment.clear()
        self.tool_steps += 1

    def usage(self) -> dict:
        """OpenAI's usage for this turn: the upstream's where it reported it, else counted here."""
        if self.upstream_usage is not None:
            return {**self.upstream_usage, "source": "upstream"}
        prompt = sum(count_tokens(getattr(m, "content", "") or "") for m in self.messages)
        completion = count_tokens("".join(self.answer)) + count_tokens("".join(self.thinking))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "source": "counted"}

    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else round((self.first_token - self.started) * 1000, 1)

    def complete(self) -> bool:
        """Completed; False when a steering committed meanwhile (the runner runs one more step)."""
        return turn_complete(turn=self.turn, writer=self.writer, answer="".join(self.answer),
                             citations=self.citations, usage=self.usage(), ttft_ms=self.ttft_ms(),
                             artifacts=self.artifacts)

    def fail(self, reason: str, code: str) -> EndOutcome:
        return turn_end(turn=self.turn, state=TurnState.FAILED, answer="".join(self.answer), reason=reason,
                        code=code, writer=self.writer, usage=self.usage(), ttft_ms=self.ttft_ms(),
                        artifacts=self.artifacts)

    def cancel(self) -> EndOutcome:
        """A stopped turn keeps what it already answered, marked as cut short."""
        return turn_end(turn=self.turn, state=TurnState.CANCELLED, answer="".join(self.answer),
                        writer=self.writer, usage=self.usage(), ttft_ms=self.ttft_ms(), artifacts=self.artifacts)

    # -- the whole run --
    def run(self) -> None:
        """Run the turn to its end. A redelivered task finds the turn moved on and does nothing."""
        if not self.claim():
            return
        lease_keeper.hold(self.turn_pk)
        try:
            self._run_claimed()
        except TurnEnded:
            log.warning("turn ended elsewhere; its runner stops (turn=%s)", self.turn.turn_id)
        finally:
            lease_keeper.release(self.turn_pk)

    def _run_claimed(self) -> None:
        try:
            action = (self.turn.context or {}).get("native_action")
            if action:
                self.native_action_run(action)
                return
            self.compose()
            while True:
                self.steered = False
                if self.should_stop() and not self.steered:
                    break
                self.take_steering()
                self.engine_step()
                if self.ended_elsewhere:
                    raise TurnEnded(self.turn.turn_id)
                if self.cancelled or self.timed_out:
                    break
                if self.steered:
                    continue
                if self.pending_calls:
                    self.run_calls()
                    if self.ended_elsewhere:
                        raise TurnEnded(self.turn.turn_id)
                    if self.cancelled or self.timed_out:
                        break
                    continue
                if self.complete():
                    return
                # steering committed between the engine's last step and completion: run it
        except (EngineError, TurnEnded) as exc:
            if isinstance(exc, TurnEnded):
                raise
            if exc.code.startswith("upstream") or exc.code == "engine_misconfigured":
                log.warning("upstream failed (turn=%s, model=%s, code=%s, reason=%s)", self.turn.turn_id,
                            self.turn.model or "-", exc.code, exc.message,
                            extra={"turn": self.turn.turn_id, "model": self.turn.model, "code": exc.code,
                                   "reason": exc.message})
            else:
                log.warning("turn failed (turn=%s, model=%s, code=%s, reason=%s)", self.turn.turn_id,
                            self.turn.model or "-", exc.code, exc.message,
                            extra={"turn": self.turn.turn_id, "model": self.turn.model, "code": exc.code,
                                   "reason": exc.message})
            self.fail(exc.message, exc.code)
            return
        except Exception as exc:  # a plugin bug fails its turn, never the worker
            log.exception("turn failed (turn=%s, model=%s, code=engine_crashed, reason=%s: %s)", self.turn.turn_id,
                          self.turn.model or "-", type(exc).__name__, exc)
            self.fail(f"The agent failed: {type(exc).__name__}: {exc}", "engine_crashed")
            return
        if self.ended_elsewhere:
            raise TurnEnded(self.turn.turn_id)
        if self.timed_out:
            self.fail(TIME_LIMIT_REASON, "time_limit")
        else:
            self.cancel()


def turn_run(turn_pk: int) -> None:
    """Run one accepted turn to its end (the `run_turn` task's body)."""
    TurnRun(turn_pk).run()


def steerings_take(*, turn: Turn, writer: DeltaWriter) -> list[Steering]:
    """Apply the turn's pending steering: each becomes a user message of the turn and a turn.steered event."""
    with transaction.atomic():
        taken = list(Steering.objects.select_for_update().filter(turn_id=turn.pk, state=SteeringState.PENDING)
                     .select_related("actor").order_by("id"))
        if not taken:
            return []
        now = timezone.now()
        Steering.objects.filter(pk__in=[r.pk for r in taken]).update(state=SteeringState.APPLIED, applied_at=now)
        for r in taken:
            Message.objects.create(conversation_id=turn.conversation_id, role=Message.Role.USER, content=r.text,
                                   actor=r.actor, turn=turn)
        writer.flush([("turn.steered", {"turn_id": turn.turn_id, "steering_id": r.pk, "message": r.text,
                                        "actor": r.actor.key}, []) for r in taken])
    return taken


# --- the lease ---------------------------------------------------------------------------------

class LeaseKeeper:
    """Renews the lease of every turn this process runs, every UGENT_TURN_LEASE_RENEW_SECONDS, off the
    turns' own threads (an engine that blocks keeps its turn alive; a dead process lets it lapse).

    It also ends as failed a turn past its run limit whose engine has not come back to the runner
    for a grace of two renewals (a blocked call): the runner then stops at its next step, and the turn
    thread it is stuck on is written off and replaced (dispatch.TurnThreads), so an engine that never
    returns costs one thread, not a turn slot for ever. The thread runs only while the process holds turns.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}  # turn pk -> monotonic deadline
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def hold(self, turn_pk: int) -> None:
        with self._lock:
            self._held[turn_pk] = time.monotonic() + settings.UGENT_TURN_RUN_LIMIT
            if self._thread is None or not self._thread.is_alive():  # (a keeper that died is replaced)
                self._thread = threading.Thread(target=self._loop, name="ugent-turn-lease", daemon=True)
                self._thread.start()

    def release(self, turn_pk: int) -> None:
        with self._lock:
            self._held.pop(turn_pk, None)

    def held(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def tick(self) -> int:
        """Renew the held turns' leases, end the overdue ones; the number of leases renewed."""
        with self._lock:
            held = dict(self._held)
        if not held:
            return 0
        now = timezone.now()
        renewed = Turn.objects.filter(pk__in=list(held), state=TurnState.RUNNING).update(
            lease_expires_at=now + timedelta(seconds=settings.UGENT_TURN_LEASE_SECONDS))
        grace = 2 * settings.UGENT_TURN_LEASE_RENEW_SECONDS
        for pk, deadline in held.items():
            if time.monotonic() > deadline + grace:
                try:
                    turn = Turn.objects.select_related("actor").filter(pk=pk, state=TurnState.RUNNING).first()
                    if turn is not None:
                        turn_end(turn=turn, state=TurnState.FAILED, answer_streamed=True,
                                 reason=TIME_LIMIT_REASON, code="time_limit")
                except Exception:  # this one is tried again next tick; the others' ends go on
                    log.exception("ending an overdue turn failed (turn pk=%s)", pk)
                    continue
                self.release(pk)
                # Its runner has not come back for two renewals past its limit: the thread is stuck in an
                # engine or a call that never returns. Written off, the next turn gets a thread of its own.
                turn_thread_write_off(pk)
        return renewed

    def _loop(self) -> None:
        try:
            while True:
                self._wake.wait(settings.UGENT_TURN_LEASE_RENEW_SECONDS)
                with self._lock:
                    if not self._held:
                        self._thread = None
                        return
                try:
                    self.tick()
                    close_old_connections()
                except Exception:  # a database hiccup: the next tick tries again, well inside the lease
                    log.exception("turn lease renewal failed")
                    try:
                        close_old_connections()  # a connection the hiccup broke is not used again
                    except Exception:
                        log.exception("closing the lease keeper's connection failed")
        finally:
            connection.close()


lease_keeper = LeaseKeeper()


# --- the sweep and the start-up --------------------------------------------------------------

def turns_recover_interrupted(*, lapsed_before=None) -> int:
    """Turns whose process stopped become interrupted, keeping what they streamed, with an event.

    At start-up of the embedded daemon every running turn is such a turn; the sweep passes
    `lapsed_before` (now): only a turn whose lease lapsed before it has lost its process.
    """
    qs = Turn.objects.live().filter(state=TurnState.RUNNING).select_related("actor")
    where = None
    if lapsed_before is not None:
        # a turn claimed before leases existed has none: its start stands for one
        where = Q(lease_expires_at__lt=lapsed_before) | Q(
            lease_expires_at__isnull=True,
            started_at__lt=lapsed_before - timedelta(seconds=settings.UGENT_TURN_LEASE_SECONDS))
        qs = qs.filter(where)
    count = 0
    for turn in qs:
        outcome = turn_end(turn=turn, state=TurnState.INTERRUPTED, answer_streamed=True, where=where)
        count += outcome is EndOutcome.ENDED
    return count


def turns_abandon_expired(*, now=None) -> int:
    """Accepted turns never started within UGENT_TURN_QUEUE_TIMEOUT end as abandoned."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.UGENT_TURN_QUEUE_TIMEOUT)
    count = 0
    waiting = Turn.objects.live().filter(state=TurnState.ACCEPTED, created_at__lt=cutoff).select_related("actor")
    for turn in waiting:
        outcome = turn_end(turn=turn, state=TurnState.ABANDONED, reason=QUEUE_TIMEOUT_REASON,
                           from_state=TurnState.ACCEPTED)
        count += outcome is EndOutcome.ENDED
    return count


def turns_requeue_lost(*, now=None) -> int:
    """Accepted turns whose task the broker lost (it was down, or restarted empty) are dispatched again.

    Only when the broker's queue holds fewer messages than there are such turns: a backlog is
    waiting its turn, not lost. The claim in TurnRun keeps a duplicate task from running it twice."""
    from channels_app import dispatch as tasks
    if tasks.local_turn_pool_active():
        return 0  # embedded: turns never leave the process; start-up re-queues what a stop left
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.UGENT_TURN_REQUEUE_SECONDS)
    pks = list(Turn.objects.live().filter(state=TurnState.ACCEPTED, created_at__lt=cutoff)
               .values_list("pk", flat=True))
    if not pks:
        return 0
    backlog = tasks.broker_backlog()
    if backlog is None or backlog >= len(pks):
        return 0
    dispatched = sum(tasks.turn_dispatch(pk) for pk in pks)
    log.warning("dispatched %d accepted turn(s) again: their tasks were lost by the broker", dispatched)
    return dispatched


def turns_sweep_stale() -> int:
    """Beat, every UGENT_TURN_SWEEP_SECONDS: lapsed leases end interrupted, expired queue waits end
    abandoned, lost tasks are dispatched again. The number of turns it ended."""
    now = timezone.now()
    ended = turns_recover_interrupted(lapsed_before=now) + turns_abandon_expired(now=now)
    turns_requeue_lost(now=now)
    return ended


def turns_requeue_accepted() -> int:
    """At start-up: accepted turns whose task was lost with an in-process broker run now."""
    from channels_app.dispatch import turn_dispatch
    pks = list(Turn.objects.live().filter(state=TurnState.ACCEPTED).values_list("pk", flat=True))
    for pk in pks:
        turn_dispatch(pk)
    return len(pks)
