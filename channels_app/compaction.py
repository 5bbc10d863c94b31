"""Compaction: a conversation's older messages summarised, hidden from the model, and kept.

One home for the three ways it starts: the rule action compact_conversation (rules_app.hooks,
run by the turn runner as the message's own turn once its receipt has committed: runner.TurnRun.
native_action_run), the /compress command (channels_app.commands) and the turn runner, before a
turn's first engine call, when the history the engine would see passes UGENT_COMPACT_THRESHOLD of
its profile's context_tokens (not for a turn with ugent_disable_memory_write: "no compaction summary").

The profile's ChatSummarizerEngine (AgentProfile.summarizer_engine, an opm.agents.summarizer.chat
entry point; the offline ugent-extractive by default) summarises every visible message older than
the last UGENT_COMPACT_KEEP_EXCHANGES exchanges, earlier summaries included. Those messages are
hidden (Message.hidden), never deleted: GET /v1/ugent/history pages them back. One system message
holds the summary, which the runner puts before the history it shows the engine. Each compaction
appends compaction.completed to the conversation's activity stream.

Once started a compaction is not stopped by a stop request: nothing here asks whether one came
(the seed: a compaction dropped midway would be worse than one that finishes). The summariser runs
outside any lock and any transaction, on all three paths (none of them calls it inside one); the
hiding commits under the conversation's row lock and only if every message it summarised is still
visible, so two compactions that overlap, or one run again, never hide the same messages twice.

The summariser is a plugin's code, asked on a thread of its own (ugent_common.bounded) for at most
UGENT_COMMAND_ENGINE_TIMEOUT (a turn's compaction: no longer than the turn has left): one that never
returns would otherwise keep the thread that asked (the API's request thread for /compress, a Celery
worker's for a channel's /compress, a turn's). Past that, or while UGENT_TURN_STUCK_MAX of its summaries
still run past their limit, the compaction fails (CompactionFailed) and hides nothing.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from channels_app.events import events_append
from channels_app.models import Conversation, Message, Turn
from plugins_app.agent.engines.base import count_tokens
from ugent_common import bounded

log = logging.getLogger("ugent.compaction")

COMPACT_NOTHING_YET = "There is nothing to compact yet."
COMPACT_FAILED = "Compacting the conversation failed; the agent's log says why."
#: Why a compaction failed when its summariser did not answer in time, or was not asked (`_summarise`).
SUMMARIZER_TIMED_OUT = "The summariser {name!r} did not answer within {seconds:g} s."
SUMMARIZER_OVERRUN = ("{count} earlier summaries by the summariser {name!r} are still running past their time "
                      "limit: it is not asked again until they end.")
COMPLETED_EVENT = "compaction.completed"
#: How compaction started: the rule action, the /compress command, the runner's budget check.
RULE, COMMAND, AUTO = "rule", "command", "auto"
_ATTEMPTS = 3
_HEADER_COUNT = re.compile(r"\((\d+) messages? compacted\)")


class CompactionFailed(Exception):
    """The summariser failed (or is not installed): nothing was hidden."""


@dataclass(frozen=True)
class Compaction:
    """What one compaction did. `hidden`: the messages it summarised (earlier summaries not counted)."""

    compacted: bool
    hidden: int = 0
    kept: int = 0
    summary_id: int | None = None
    summarizer: str = ""

    @property
    def text(self) -> str:
        """What /compress and compact_conversation answer."""
        return compact_report(self.hidden, self.kept) if self.compacted else COMPACT_NOTHING_YET


NOTHING = Compaction(compacted=False)


def compact_report(hidden: int, kept: int) -> str:
    """What compact_conversation (and /compress) reports."""
    msgs = "message" if hidden == 1 else "messages"
    ex = "exchange" if kept == 1 else "exchanges"
    return f"Compacted the conversation: {hidden} earlier {msgs} summarised; the last {kept} {ex} kept as they are."


def keep_exchanges() -> int:
    """Exchanges (a user message and what followed it) a compaction keeps as they are."""
    return max(0, int(settings.UGENT_COMPACT_KEEP_EXCHANGES))


def profile_of(conversation: Conversation):
    """The profile the conversation talks to: its latest turn's, else the default one (None if none)."""
    turn = (Turn.objects.filter(conversation=conversation, profile__isnull=False).select_related("profile")
            .order_by("-id").first())
    if turn is not None:
        return turn.profile
    from plugins_app.agent.profiles import profile_choose
    try:
        return profile_choose(requested=None)[0]
    except Exception:
        return None


def _plan(conversation: Conversation, keep: int, turn: Turn | None) -> tuple[list[Message], int] | None:
    """The visible messages to summarise and the exchanges kept; None when there is nothing older."""
    from plugins_app.agent.engines.summarizers import is_summary  # OPM's templates load only when needed
    qs = Message.objects.filter(conversation=conversation, hidden=False)
    if turn is not None:  # the running turn's own message is this exchange, never compacted
        qs = qs.exclude(turn_id=turn.pk)
    visible = list(qs.only("id", "role", "content").order_by("id"))
    user_ids = [m.id for m in visible if m.role == Message.Role.USER]
    if keep and len(user_ids) <= keep:
        return None
    cutoff = user_ids[-keep] if keep else None
    # an earlier summary is written after the exchanges it kept, so it may be newer than the cutoff:
    # it always goes into the new one, first, as it stands for the oldest messages
    summaries = [m for m in visible if m.role == Message.Role.SYSTEM and is_summary(m.content)]
    summary_ids = {m.id for m in summaries}
    older = [m for m in visible if (cutoff is None or m.id < cutoff) and m.id not in summary_ids]
    if not any(m.role != Message.Role.SYSTEM for m in older):
        return None
    return summaries + older, min(keep, len(user_ids))


def _summarised_count(older: list[Message]) -> int:
    """The messages the new summary stands for: those hidden now and those earlier summaries stood for."""
    from plugins_app.agent.engines.summarizers import is_summary
    count = 0
    for m in older:
        if m.role != Message.Role.SYSTEM:
            count += 1
        elif is_summary(m.content):
            found = _HEADER_COUNT.search(m.content.splitlines()[0])
            count += int(found.group(1)) if found else 0
    return count


def _summarise(profile, older: list[Message], *, left: float, timeout: float) -> tuple[str, str]:
    """(summary body, summariser name): the profile's ChatSummarizerEngine over the messages, on a thread of
    its own for the `left` seconds of the compaction's `timeout` (the module says why). CompactionFailed
    when it fails, does not answer in time, or is not asked (UGENT_TURN_STUCK_MAX of its summaries still run
    past their limit)."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

    from plugins_app.agent.engines.registry import BUILTIN_SUMMARIZER, summarizer_for_profile
    name = (getattr(profile, "summarizer_engine", "") or BUILTIN_SUMMARIZER) if profile is not None \
        else BUILTIN_SUMMARIZER
    messages = [AgentMessage(role=MessageRole(m.role), content=m.content) for m in older]
    if left <= 0:  # no time left: the summariser is not started only to be left running
        raise CompactionFailed(SUMMARIZER_TIMED_OUT.format(name=name, seconds=round(timeout, 1)))
    done = bounded.call_bounded(lambda: summarizer_for_profile(profile).summarize(messages), timeout=left,
                                owner=f"summarizer:{name}", limit=settings.UGENT_TURN_STUCK_MAX,
                                name="ugent-summarize")
    if done.refused or done.timed_out:
        why = (SUMMARIZER_OVERRUN.format(count=done.refused, name=name) if done.refused
               else SUMMARIZER_TIMED_OUT.format(name=name, seconds=round(timeout, 1)))
        log.warning("compaction failed (summarizer=%s): %s", name, why)
        raise CompactionFailed(why)
    if done.error is not None:
        exc = done.error
        log.error("compaction failed (summarizer=%s)", name, exc_info=(type(exc), exc, exc.__traceback__))
        raise CompactionFailed(f"{type(exc).__name__}: {exc}") from exc
    return str(done.value or "").strip(), name


class _Raced(Exception):
    """Another compaction hid some of these messages first."""


def _commit(*, conversation: Conversation, older: list[Message], kept: int, body: str, summarizer: str,
            trigger: str, turn: Turn | None) -> Compaction | None:
    from plugins_app.agent.engines.summarizers import SUMMARY_HEADER
    ids = [m.id for m in older]
    hidden = sum(1 for m in older if m.role != Message.Role.SYSTEM)
    header = SUMMARY_HEADER.format(count=_summarised_count(older))
    try:
        with transaction.atomic():
            # NO KEY UPDATE: an event append holds KEY SHARE on the conversation (channels_app.events)
            Conversation.objects.select_for_update(no_key=True).filter(pk=conversation.pk).first()
            moved = Message.objects.filter(id__in=ids, hidden=False).update(hidden=True, updated_at=timezone.now())
            if moved != len(ids):
                raise _Raced
            # the session tail's hidden_count, kept here under the conversation's lock: no page load counts them
            Conversation.objects.filter(pk=conversation.pk).update(hidden_messages=F("hidden_messages") + moved)
            summary = Message.objects.create(conversation=conversation, role=Message.Role.SYSTEM,
                                             content="\n".join(filter(None, [header, body])))
            events_append(conversation_id=conversation.pk, turn_pk=None, items=[(COMPLETED_EVENT, {
                "conversation_id": conversation.external_id, "trigger": trigger, "hidden": hidden,
                "kept": kept, "summary_message_id": summary.pk, "summarizer": summarizer,
                "turn_id": turn.turn_id if turn is not None else None}, [])])
    except _Raced:
        return None
    log.info("conversation compacted (conversation=%s, trigger=%s, hidden=%d, kept=%d, summarizer=%s)",
             conversation.external_id, trigger, hidden, kept, summarizer)
    return Compaction(compacted=True, hidden=hidden, kept=kept, summary_id=summary.pk, summarizer=summarizer)


def conversation_compact(*, conversation: Conversation, trigger: str = COMMAND, profile=None,
                         turn: Turn | None = None, first_message: bool = False,
                         keep: int | None = None, timeout: float | None = None) -> Compaction:
    """Compact a conversation now (see the module's docstring) and say what was done.

    `profile`: whose summariser (None: the conversation's, profile_of); `turn`: the running turn whose
    own message stays out of it (AUTO, RULE); `first_message`: the conversation's first message is being
    handled, so there is nothing to compact yet; `timeout`: seconds the summariser may take, in all (None:
    UGENT_COMMAND_ENGINE_TIMEOUT). Raises CompactionFailed when the summariser fails or does not answer
    in time.
    """
    if first_message:
        return NOTHING
    keep = keep_exchanges() if keep is None else keep
    # one time limit for the whole compaction: a plan made again after another compaction won has what is left
    timeout = settings.UGENT_COMMAND_ENGINE_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    if profile is None:
        profile = profile_of(conversation)
    for _ in range(_ATTEMPTS):
        plan = _plan(conversation, keep, turn)
        if plan is None:
            return NOTHING
        older, kept = plan
        # slow perhaps; no lock is held, no stop is heard
        body, summarizer = _summarise(profile, older, left=deadline - time.monotonic(), timeout=timeout)
        done = _commit(conversation=conversation, older=older, kept=kept, body=body, summarizer=summarizer,
                       trigger=trigger, turn=turn)
        if done is not None:
            return done
    return NOTHING  # other compactions kept winning: what they left stands


# --- the runner's budget check ----------------------------------------------------------------

def tokens_estimate(messages) -> int:
    """The estimated tokens of the messages an engine would be shown (engines.base.count_tokens)."""
    return sum(count_tokens(getattr(m, "content", "") or "") for m in messages)


def compaction_due(*, turn: Turn, messages) -> bool:
    """Whether the turn's history passes UGENT_COMPACT_THRESHOLD of its profile's context_tokens (never
    for a turn kept out of memory, nor for a profile whose context_tokens is 0)."""
    profile = turn.profile
    budget = getattr(profile, "context_tokens", 0) if profile is not None else 0
    if not budget or turn.disable_memory_write:
        return False
    limit = float(settings.UGENT_COMPACT_THRESHOLD) * budget
    # every counted token is at least one character: a history with fewer characters than the limit
    # cannot pass it, and most turns' histories are that short (no tokenising on every turn)
    if sum(len(getattr(m, "content", "") or "") for m in messages) <= limit:
        return False
    return tokens_estimate(messages) > limit


def turn_compact(*, turn: Turn, timeout: float | None = None) -> Compaction:
    """The runner's compaction before a turn's first engine call; a failure is logged, never the turn's.
    `timeout`: as conversation_compact's (the runner gives no more than its turn has left)."""
    try:
        return conversation_compact(conversation=turn.conversation, trigger=AUTO, profile=turn.profile, turn=turn,
                                    timeout=timeout)
    except CompactionFailed:
        return NOTHING
