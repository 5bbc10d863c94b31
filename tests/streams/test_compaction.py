"""Compaction (channels_app/compaction.py): /compress, the automatic trigger, the summarisers, the activity
event, a stop that arrives meanwhile, and every compacted message still readable through history."""
from __future__ import annotations

import threading
import tomllib
from pathlib import Path

import pytest
from django.db import connection
from ovos_plugin_manager.templates.agents import ChatSummarizerEngine

from channels_app import compaction
from channels_app.models import Caller, Conversation, Event, Message, Turn
from plugins_app.agent.engines import registry
from plugins_app.agent.engines.summarizers import (ExtractiveChatSummarizer, OpenAICompatibleChatSummarizer,
                                                   SUMMARY_PROMPT)
from plugins_app.agent.models import AgentProfile
from tests.fakes.upstream import Script, run_stub_upstream
from tests.streams.conftest import get, post, stream, wait_for
from tests.support.http import chat
from tests.support import blocking, scripted

pytestmark = pytest.mark.django_db(transaction=True)

PADDING = " ".join(f"pad{i}" for i in range(12))


def talk(who, n: int, conversation_id: str = "ca", start: int = 0, **extra) -> None:
    for i in range(start, start + n):
        resp = chat(who, f"question {i}. {PADDING}", conversation_id=conversation_id, **extra)
        assert resp.status_code == 200, resp.content


def compress(who, conversation_id: str | None = "ca", **extra):
    body = {"command": "/compress", **extra}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return post("/v1/ugent/commands", who, **body)


def history_all(who, conversation_id: str = "ca", limit: int = 3) -> list[dict]:
    """Every hidden message, paged back with before/limit, oldest first."""
    out, before = [], None
    while True:
        params = {"conversation_id": conversation_id, "limit": limit}
        if before is not None:
            params["before"] = before
        page = get("/v1/ugent/history", who, **params).json()
        assert len(page["data"]) <= limit
        out = page["data"] + out
        if not page["has_more"]:
            return out
        before = page["next_before"]


def summary_row() -> Message:
    return Message.objects.filter(role="system", hidden=False).order_by("-id").first()


def set_profile(profile, **fields) -> None:
    AgentProfile.objects.filter(pk=profile.pk).update(**fields)


# --- /compress ---------------------------------------------------------------------------------

def test_compress_summarises_the_older_messages_and_history_pages_every_one_back(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 2
    talk(tcast.alice, 5)
    body = compress(tcast.alice).json()
    assert body["ok"] and body["changed"] and body["command"] == "/compress"
    assert body["text"] == ("Compacted the conversation: 6 earlier messages summarised; "
                            "the last 2 exchanges kept as they are.")
    assert body["data"]["hidden"] == 6 and body["data"]["kept"] == 2
    assert body["data"]["summarizer"] == "ugent-extractive"
    hidden = list(Message.objects.filter(hidden=True).order_by("id"))
    assert len(hidden) == 6 and hidden[0].content.startswith("question 0.")
    paged = history_all(tcast.alice, limit=4)
    assert [m["id"] for m in paged] == [m.id for m in hidden]
    assert [m["content"] for m in paged] == [m.content for m in hidden]
    summary = summary_row()
    assert summary.pk == body["data"]["summary_message_id"]
    assert summary.content.splitlines()[0] == "Summary of the earlier conversation (6 messages compacted):"
    assert "- user: question 0." in summary.content and "- assistant: echo: question 2." in summary.content
    # nothing older than the last two exchanges is left: a second /compress has nothing to do
    again = compress(tcast.alice).json()
    assert again["text"] == "There is nothing to compact yet." and again["changed"] is False
    assert Message.objects.filter(hidden=True).count() == 6


def test_the_engine_sees_the_summary_and_not_the_hidden_messages(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 4)
    compress(tcast.alice)
    chat(tcast.alice, "after", conversation_id="ca")
    seen = scripted.CALLS[-1]["messages"]
    assert seen[0] == ("system", summary_row().content)
    hidden = set(Message.objects.filter(hidden=True).values_list("content", flat=True))
    assert hidden and not hidden & {content for _role, content in seen[1:]}
    assert [c for r, c in seen if r == "user"] == [f"question 3. {PADDING}", "after"]


def test_compress_with_too_little_history_or_on_a_fresh_conversation_has_nothing_to_compact(tcast):
    talk(tcast.alice, 1)
    body = compress(tcast.alice).json()
    assert body["text"] == "There is nothing to compact yet." and body["ok"] and not body["changed"]
    assert not Message.objects.filter(hidden=True).exists()
    assert not Event.objects.filter(type="compaction.completed").exists()


def test_compress_needs_a_conversation(tcast):
    resp = compress(tcast.alice, conversation_id=None)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "/compress needs a conversation_id: the conversation it acts on."


def test_compress_changes_things_so_it_needs_allow_remote_control(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.carol, 3, conversation_id="cc")
    resp = compress(tcast.carol, conversation_id="cc")
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "remote_control_not_allowed"
    assert resp.json()["error"]["message"].startswith("/compress changes things, which needs allow_remote_control")
    assert not Message.objects.filter(hidden=True).exists()
    Caller.objects.filter(pk=tcast.app.pk).update(allow_remote_control=True)
    body = compress(tcast.carol, conversation_id="cc").json()
    assert body["changed"] and Message.objects.filter(hidden=True).count() == 4


def test_nobody_compresses_another_users_conversation(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 3)
    for who in (tcast.bob, tcast.carol, {"key": tcast.keys["outsider"]}, {"key": tcast.keys["app"]}):
        resp = compress(who)
        assert resp.status_code == 403, who
        assert resp.json()["error"]["message"] == "This conversation belongs to another user.", who
    assert compress({"key": tcast.keys["outsider"]}, conversation_id="nope").status_code == 404
    assert compress({"key": "ugk_nope"}).status_code == 401
    assert not Message.objects.filter(hidden=True).exists()
    # the operator speaking as itself is another user too, as a message into it would be; its owner may
    assert compress({"key": tcast.keys["operator"]}).status_code == 403
    assert compress(tcast.alice).json()["changed"] is True


def test_unsupported_commands_name_compress_among_the_supported(tcast):
    body = post("/v1/ugent/commands", tcast.alice, command="/nope").json()
    assert body["unsupported"] and "/compress" in body["data"]["supported"]
    assert body["text"].endswith("/refine, /sandbox, /compress.")


# --- the activity stream -----------------------------------------------------------------------

def test_a_compaction_appears_on_the_activity_stream_with_its_counts(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 2
    talk(tcast.alice, 4)
    compress(tcast.alice)
    frames = stream("/v1/ugent/activity", tcast.alice, cursor="0", conversation_id="ca")
    done = [f for f in frames if f["event"] == "compaction.completed"]
    assert len(done) == 1
    data = done[0]["data"]["data"]
    assert data["hidden"] == 4 and data["kept"] == 2 and data["trigger"] == "command"
    assert data["summary_message_id"] == summary_row().pk and data["conversation_id"] == "ca"


# --- the automatic trigger -----------------------------------------------------------------------

def test_a_turn_whose_history_passes_the_budget_is_compacted_before_the_engine_call(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    settings.UGENT_COMPACT_THRESHOLD = 0.5
    set_profile(tcast.profile, context_tokens=100)  # 50 tokens: about two exchanges of these
    compacted_at = None
    for i in range(6):
        talk(tcast.alice, 1, start=i)
        if Event.objects.filter(type="compaction.completed").exists():
            compacted_at, seen = i, scripted.CALLS[-1]["messages"]
            break
    assert compacted_at is not None and compacted_at >= 2
    event = Event.objects.filter(type="compaction.completed").order_by("id").first()
    assert event.data["trigger"] == "auto"
    turn = Turn.objects.get(turn_id=event.data["turn_id"])
    assert turn.receipt.answer.startswith(f"echo: question {compacted_at}.")
    # that turn's one engine call already saw the summary, not what it hid
    assert seen[0][0] == "system" and seen[0][1].startswith("Summary of the earlier conversation")
    assert "question 0." not in " ".join(c for r, c in seen if r != "system")
    # the running turn's own message is never compacted
    assert Message.objects.get(turn=turn, role="user").hidden is False


def test_repeated_compactions_lose_nothing(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    settings.UGENT_COMPACT_THRESHOLD = 0.5
    set_profile(tcast.profile, context_tokens=60)
    talk(tcast.alice, 8)
    compress(tcast.alice)
    assert Event.objects.filter(type="compaction.completed").count() >= 3
    every = list(Message.objects.order_by("id").values_list("id", "content"))
    visible = get("/v1/ugent/snapshot", tcast.alice, conversation_id="ca", limit=200).json()["messages"]
    paged = history_all(tcast.alice)
    assert sorted([m["id"] for m in paged] + [m["id"] for m in visible]) == [pk for pk, _ in every]
    users = [m["content"] for m in paged + visible if m["role"] == "user"]
    assert sorted(users) == sorted(f"question {i}. {PADDING}" for i in range(8))
    # the newest summary stands for every user and assistant message hidden so far
    hidden_talk = Message.objects.filter(hidden=True).exclude(role="system").count()
    assert summary_row().content.splitlines()[0] == (
        f"Summary of the earlier conversation ({hidden_talk} messages compacted):")
    assert Message.objects.filter(role="system", hidden=False).count() == 1


def test_no_automatic_compaction_within_the_budget_or_for_a_turn_kept_out_of_memory(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 5)  # the default budget, 8192 tokens, is far away
    set_profile(tcast.profile, context_tokens=0)  # 0: never
    talk(tcast.alice, 2, start=5)
    set_profile(tcast.profile, context_tokens=40)
    talk(tcast.alice, 2, start=7, ugent_disable_memory_write=True)  # "no compaction summary"
    assert not Message.objects.filter(hidden=True).exists()
    assert not Event.objects.filter(type="compaction.completed").exists()
    talk(tcast.alice, 1, start=9)
    assert Event.objects.filter(type="compaction.completed", data__trigger="auto").count() == 1


class SlowSummarizer(ChatSummarizerEngine):
    started = threading.Event()
    release = threading.Event()

    def summarize(self, messages, lang=None):
        SlowSummarizer.started.set()
        assert SlowSummarizer.release.wait(20)
        return "- a slow summary"


def test_a_stop_during_compaction_does_not_cut_it_short(tcast, settings, threaded_turns):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 3)
    SlowSummarizer.started.clear()
    SlowSummarizer.release.clear()
    registry.register_summarizer("test-slow", SlowSummarizer)
    set_profile(tcast.profile, context_tokens=40, summarizer_engine="test-slow")
    resp = chat(tcast.alice, "script:answer=never reached", conversation_id="ca", stream=True)
    assert resp.status_code == 200
    turn = Turn.objects.get(turn_id=resp["x-ugent-turn-id"])
    assert SlowSummarizer.started.wait(20)
    assert post("/v1/ugent/stop", tcast.alice, conversation_id="ca").status_code == 202
    wait_for(lambda: Turn.objects.filter(pk=turn.pk, cancel_requested=True).exists())
    SlowSummarizer.release.set()
    done = wait_for(lambda: Turn.objects.filter(pk=turn.pk, finished_at__isnull=False).first())
    assert done.state == "cancelled"
    assert summary_row().content.endswith("- a slow summary")
    assert Message.objects.filter(hidden=True).count() == 4
    stop = Event.objects.get(turn=turn, type="turn.stop_requested")
    event = Event.objects.get(type="compaction.completed")
    assert stop.pk < event.pk and event.data["turn_id"] == turn.turn_id
    assert event.pk < Event.objects.get(turn=turn, type="turn.cancelled").pk
    # the stop it heard after the compaction kept the engine from being called at all
    assert not [c for c in scripted.CALLS if c["messages"][-1][1] == "script:answer=never reached"]


# --- overlapping compactions -----------------------------------------------------------------

def test_two_compactions_that_overlap_hide_each_message_once(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 5)
    conv = Conversation.objects.get(external_id="ca")
    calls = []

    class Overtaken(ChatSummarizerEngine):
        def summarize(self, messages, lang=None):
            calls.append(len(messages))
            if len(calls) == 1:  # another compaction runs and commits while this one summarises
                def other():
                    try:
                        compaction.conversation_compact(conversation=conv)
                    finally:
                        connection.close()
                t = threading.Thread(target=other)
                t.start()
                t.join(30)
            return f"- summary {len(calls)}"

    registry.register_summarizer("test-overtaken", Overtaken)
    set_profile(tcast.profile, summarizer_engine="test-overtaken")
    chat(tcast.alice, "one turn names the profile", conversation_id="ca")
    done = compaction.conversation_compact(conversation=conv)
    assert calls[:2] == [calls[0], calls[0]]  # both planned the same messages
    assert done.compacted is False  # the other one won; what it left has nothing older to compact
    summaries = list(Message.objects.filter(role="system").values_list("content", flat=True))
    assert len(summaries) == 1 and summaries[0].endswith("- summary 2")
    assert Message.objects.filter(hidden=True).count() == 10
    assert Event.objects.filter(type="compaction.completed").count() == 1


def test_a_failing_summariser_hides_nothing_and_says_so(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 3)
    set_profile(tcast.profile, summarizer_engine="not-installed")
    body = compress(tcast.alice).json()
    assert body["ok"] is False and body["changed"] is False
    assert body["text"] == "Compacting the conversation failed; the agent's log says why."
    assert "no chat summariser named 'not-installed' is installed" in body["data"]["error"]
    assert not Message.objects.filter(hidden=True).exists()
    # and a turn over its budget runs anyway, uncompacted
    set_profile(tcast.profile, context_tokens=20)
    talk(tcast.alice, 1, start=3)
    assert not Message.objects.filter(hidden=True).exists()
    assert Turn.objects.order_by("-id").first().state == "completed"


def test_a_summariser_that_never_returns_fails_the_compaction_in_time_and_holds_no_thread(tcast, settings):
    # It was asked on the request's thread (the API's for /compress, a turn's for the automatic compaction),
    # unbounded: one that never returned kept that thread for ever.
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    settings.UGENT_COMMAND_ENGINE_TIMEOUT = 0.5
    settings.UGENT_TURN_STUCK_MAX = 1
    talk(tcast.alice, 3)
    with blocking.blocked_summarizer("test-blocked") as gate:
        set_profile(tcast.profile, summarizer_engine="test-blocked")
        body = blocking.within(lambda: compress(tcast.alice).json(), gate)
        assert body["ok"] is False and body["changed"] is False
        assert body["text"] == "Compacting the conversation failed; the agent's log says why."
        assert body["data"]["error"] == "The summariser 'test-blocked' did not answer within 0.5 s."
        assert not Message.objects.filter(hidden=True).exists()
        # while that summary runs past its limit, the summariser is not asked again (UGENT_TURN_STUCK_MAX)
        body = blocking.within(lambda: compress(tcast.alice).json(), gate)
        assert body["data"]["error"] == ("1 earlier summaries by the summariser 'test-blocked' are still running "
                                         "past their time limit: it is not asked again until they end.")
        assert gate.calls == 1
        gate.release.set()
        blocking.wait_no_overrun("summarizer:")
        assert compress(tcast.alice).json()["changed"] is True


def test_a_turns_compaction_whose_summariser_never_returns_leaves_the_turn_to_run_uncompacted(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    settings.UGENT_COMMAND_ENGINE_TIMEOUT = 0.5
    talk(tcast.alice, 3)
    with blocking.blocked_summarizer("test-blocked") as gate:
        set_profile(tcast.profile, summarizer_engine="test-blocked", context_tokens=20)
        blocking.within(lambda: talk(tcast.alice, 1, start=3), gate)
        assert gate.calls == 1
        assert Turn.objects.order_by("-id").first().state == "completed"
        assert not Message.objects.filter(hidden=True).exists()


# --- the summarisers ---------------------------------------------------------------------------

def test_the_openai_compatible_summariser_asks_the_configured_upstream(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 3)
    with run_stub_upstream(Script(answer="- the user asked three questions")) as url:
        set_profile(tcast.profile, summarizer_engine="ugent-openai-compatible",
                    config={"base_url": url, "model": "stub-model"})
        body = compress(tcast.alice).json()
        sent = url.requests[-1].json
    assert body["changed"] and body["data"]["summarizer"] == "ugent-openai-compatible"
    assert summary_row().content == ("Summary of the earlier conversation (4 messages compacted):\n"
                                     "- the user asked three questions")
    assert sent["model"] == "stub-model"
    assert sent["messages"][0] == {"role": "system", "content": SUMMARY_PROMPT}
    assert f"user: question 0. {PADDING}" in sent["messages"][1]["content"]
    assert "question 2." not in sent["messages"][1]["content"]  # the kept exchange is not summarised


def test_an_upstream_failure_of_the_openai_compatible_summariser_hides_nothing(tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 1
    talk(tcast.alice, 3)
    with run_stub_upstream(Script(status=500)) as url:
        set_profile(tcast.profile, summarizer_engine="ugent-openai-compatible", config={"base_url": url})
        body = compress(tcast.alice).json()
    assert body["ok"] is False and body["text"] == compaction.COMPACT_FAILED
    assert not Message.objects.filter(hidden=True).exists()


def test_the_summarisers_are_registered_as_chat_summariser_entry_points():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    group = project["project"]["entry-points"]["opm.agents.summarizer.chat"]
    assert set(group) == {"ugent-extractive", "ugent-openai-compatible"}
    for name, target in group.items():
        module, _, attr = target.partition(":")
        cls = getattr(__import__(module, fromlist=[attr]), attr)
        assert issubclass(cls, ChatSummarizerEngine) and registry.summarizer_class(name) is cls
    assert registry.summarizer_class("") is ExtractiveChatSummarizer
    assert group["ugent-openai-compatible"].endswith(OpenAICompatibleChatSummarizer.__name__)
