"""Three reads that walked a whole conversation, and one that sorted all of a user's facts, now read an index
that holds only what they look for, whatever the conversation's or the user's size.

* "Did this conversation ever have a spoken turn?" (memory under `[voice] memory_write = false`, asked at a
  turn's end, and the rules' SaveMemory) walked every turn of the conversation through its own index: now the
  partial index `turn_spoken_conv`, of spoken turns only (`Turn.objects.spoken()`).
* A keyed steering's resend (`streams.steering_repeat`) was looked for through every turn of the conversation:
  now by its key (`steering_key`).
* The session tail's `hidden_count` counted the conversation's hidden messages at every page load: compaction
  now keeps the count on the conversation (`Conversation.hidden_messages`), under its lock.
* The memory_control tool's list sorted all of the user's facts to put the pinned ones first: now two reads
  down the user's indexes, each stopping at the limit.

SQLite's instruction counts (`vm_steps`) are the same for the same data on any machine; the plans are the
databases' own (the ORM's statements go to PostgreSQL with their values in the SQL)."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

from channels_app import compaction, services, streams
from channels_app.models import Conversation, Message, Receipt, Steering, Turn
from tests.support.plans import statements_on, vm_steps

pytestmark = pytest.mark.django_db


def conversation_of(cast, n: int, *, name: str, spoken: bool = False) -> Turn:
    """A conversation of `n` typed turns (one submitted, the rest copied), and a spoken one first if asked;
    returns its newest turn."""
    actor = services.actor_resolve(caller=cast.operator, user=f"u-{name}")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        turn = services.message_submit(inbound=services.Submission(
            actor=actor, caller=cast.operator, text="first", conversation_id=f"c-{name}")).turn
    Turn.objects.filter(pk=turn.pk).update(state="completed", input_mode="voice" if spoken else "")
    receipt = Receipt.objects.get(pk=turn.receipt_id)
    receipts = Receipt.objects.bulk_create([Receipt(**{
        **{f.attname: getattr(receipt, f.attname) for f in Receipt._meta.concrete_fields if f.attname != "id"},
        "client_message_id": f"{name}-{i}"}) for i in range(n)])
    Turn.objects.bulk_create([Turn(**{
        **{f.attname: getattr(turn, f.attname) for f in Turn._meta.concrete_fields if f.attname != "id"},
        "turn_id": f"{name}-{i}", "receipt_id": r.pk, "input_mode": "", "state": "completed"})
        for i, r in enumerate(receipts)])
    return Turn.objects.filter(conversation__external_id=f"c-{name}").order_by("-id").first()


def has_spoken(turn: Turn) -> bool:
    """The memory hook's answer under `[voice] memory_write = false`: whether the turn's message may go into memory
    is whether its conversation never had a spoken turn (for an identified sender's typed turn)."""
    from plugins_app.agent.memory.hooks import turn_may_write
    with mock.patch("plugins_app.agent.memory.hooks.voice_keeps_out_of_memory", return_value=True):
        return not turn_may_write(turn)


def spoken_checks(turn: Turn) -> list[tuple[str, tuple]]:
    """The statements of the memory hook and of the rules' extract_memory that ask whether the turn's
    conversation had a spoken turn."""
    from rules_app.services import memory_extract

    def both():
        has_spoken(turn)
        with mock.patch("plugins_app.agent.memory.hooks.voice_keeps_out_of_memory", return_value=True):
            memory_extract(turn=turn)
    return [(sql, params) for sql, params in statements_on("channels_app_turn", both) if "input_mode" in sql]


def pg_plan(sql: str, params) -> str:
    with connection.cursor() as cur:
        cur.execute("SET enable_seqscan = off")  # whether the index can be used at all, whatever the statistics
        try:
            cur.execute("EXPLAIN " + sql, params)
            return "\n".join(r[0] for r in cur.fetchall())
        finally:
            cur.execute("RESET enable_seqscan")


def plan_of(sql: str, params) -> str:
    if connection.vendor == "postgresql":
        return pg_plan(sql, params)
    with connection.cursor() as cur:
        cur.execute("EXPLAIN QUERY PLAN " + sql, params)
        return "\n".join(r[3] for r in cur.fetchall())


def test_whether_a_conversation_had_a_spoken_turn_does_not_grow_with_its_turns(cast):
    short, long = conversation_of(cast, 10, name="short"), conversation_of(cast, 1500, name="long")
    spoken_long = conversation_of(cast, 1500, name="spoken", spoken=True)
    assert (has_spoken(short), has_spoken(long), has_spoken(spoken_long)) == (False, False, True)
    found = spoken_checks(long)
    assert len(found) == 2, found
    for sql, params in found:
        assert "turn_spoken_conv" in plan_of(sql, params), sql
    if connection.vendor == "sqlite":
        # through the conversation's own index the long one costs about 150× the short one
        steps = {name: vm_steps(lambda t=t: has_spoken(t), every=10) for name, t in (("short", short), ("long", long))}
        assert steps["long"] <= steps["short"] + 2, steps


def test_the_memory_hook_and_the_rules_keep_a_conversation_that_had_voice_out_of_memory(cast, settings, tmp_path):
    from plugins_app.agent.memory.hooks import turn_may_write
    typed, spoken = conversation_of(cast, 3, name="typed"), conversation_of(cast, 3, name="voiced", spoken=True)
    with mock.patch("plugins_app.agent.memory.hooks.voice_keeps_out_of_memory", return_value=True):
        assert turn_may_write(typed) and not turn_may_write(spoken)
    with mock.patch("plugins_app.agent.memory.hooks.voice_keeps_out_of_memory", return_value=False):
        assert turn_may_write(spoken)  # the setting's default: only the spoken turn itself stays out
        Turn.objects.filter(pk=spoken.pk).update(input_mode="live")
        spoken.refresh_from_db()
        assert not turn_may_write(spoken)


def test_a_keyed_steerings_resend_is_found_by_its_key_not_by_the_conversations_turns(cast):
    short, long = conversation_of(cast, 10, name="s-short"), conversation_of(cast, 1500, name="s-long")
    actor = services.actor_resolve(caller=cast.operator, user="u-s-long")
    first = Steering.objects.create(turn=long, actor=actor, text="go left", client_message_id="k-1")
    Steering.objects.create(turn=short, actor=actor, text="go right", client_message_id="k-1")  # another conversation's
    found = streams.steering_repeat(conversation=long.conversation, client_message_id="k-1", message="go left")
    assert found.pk == first.pk
    assert streams.steering_repeat(conversation=long.conversation, client_message_id="k-2", message="x") is None
    with pytest.raises(Exception) as reused:
        streams.steering_repeat(conversation=long.conversation, client_message_id="k-1", message="go up")
    assert getattr(reused.value, "status", None) == 409
    [(sql, params)] = statements_on("channels_app_steering", lambda: streams.steering_repeat(
        conversation=long.conversation, client_message_id="k-2", message="x"))
    assert "steering_key" in plan_of(sql, params)
    if connection.vendor == "sqlite":
        steps = {name: vm_steps(lambda t=t: streams.steering_repeat(
            conversation=t.conversation, client_message_id="k-3", message="x"), every=10)
            for name, t in (("short", short), ("long", long))}
        assert steps["long"] <= steps["short"] + 2, steps


def compacted(cast, *, name: str, hide: int, keep: int = 4) -> Conversation:
    """A conversation of hide + keep messages, compacted by the compaction's own commit (hiding the first `hide`)."""
    turn = conversation_of(cast, 0, name=name)
    conv = turn.conversation
    Message.objects.bulk_create([Message(conversation=conv, role=("user", "assistant")[i % 2], content=f"m {i}",
                                         turn=turn) for i in range(hide + keep)])
    older = list(Message.objects.filter(conversation=conv).order_by("id"))[:hide]
    with mock.patch("plugins_app.agent.engines.summarizers.SUMMARY_HEADER", "[summary of {count}]"):
        assert compaction._commit(conversation=conv, older=older, kept=keep, body="the gist", summarizer="test",
                                  trigger="manual", turn=None) is not None
    return conv


def test_the_session_tails_hidden_count_is_kept_by_compaction_not_counted_at_each_load(cast):
    viewer = services.viewer_resolve(caller=cast.operator, user="u-tail")
    conv = compacted(cast, name="tail", hide=30)
    assert Conversation.objects.get(pk=conv.pk).hidden_messages == 30
    # a second compaction hides the first's summary and more: the count goes on from the first
    second = list(Message.objects.filter(conversation=conv, hidden=False).order_by("id"))[:3]
    with mock.patch("plugins_app.agent.engines.summarizers.SUMMARY_HEADER", "[summary of {count}]"):
        compaction._commit(conversation=conv, older=second, kept=2, body="more", summarizer="test",
                           trigger="manual", turn=None)
    hidden = Message.objects.filter(conversation=conv, hidden=True).count()
    assert hidden == 33
    tail = {}
    on_messages = statements_on("channels_app_message", lambda: tail.update(
        streams.session_tail(viewer=viewer, conversation=conv)))
    assert tail["hidden_count"] == hidden
    # the page and whether there is an older one; no COUNT over the conversation's messages
    assert len(on_messages) == 2 and not any("COUNT(" in sql.upper() for sql, _ in on_messages), on_messages


def test_a_compaction_that_lost_its_race_counts_nothing(cast):
    conv = compacted(cast, name="race", hide=5)
    older = list(Message.objects.filter(conversation=conv, hidden=True))[:2]  # already hidden: the race is lost
    with mock.patch("plugins_app.agent.engines.summarizers.SUMMARY_HEADER", "[summary of {count}]"):
        assert compaction._commit(conversation=conv, older=older, kept=4, body="late", summarizer="test",
                                  trigger="manual", turn=None) is None
    assert Conversation.objects.get(pk=conv.pk).hidden_messages == 5


def test_the_migration_counts_what_was_hidden_before_the_count_was_kept(cast):
    import importlib

    from django.apps import apps
    migration = importlib.import_module("channels_app.migrations.0019_count_hidden_messages")
    a, b = compacted(cast, name="mig-a", hide=7), compacted(cast, name="mig-b", hide=2)
    untouched = conversation_of(cast, 0, name="mig-c").conversation
    Conversation.objects.update(hidden_messages=0)  # as the column's default left them
    migration.count_hidden(apps, None)
    got = dict(Conversation.objects.filter(pk__in=[a.pk, b.pk, untouched.pk]).values_list("pk", "hidden_messages"))
    assert got == {a.pk: 7, b.pk: 2, untouched.pk: 0}
