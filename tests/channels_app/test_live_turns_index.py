"""The reads of live turns (the sweep, every few seconds; each metrics scrape; the health board; start-up's
re-queue) go through the partial index `turn_live`, never over every turn ever run.

SQLite takes a partial index only for a query whose WHERE holds the index's condition, decided before any
parameter is bound: `state = %s` alone scanned the whole table on every sweep. `Turn.objects.live()` puts
the condition in as the index's own SQL. The plans are SQLite's (PostgreSQL proves the index from bound
values); what the reads return is checked in both modes."""
from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone

from channels_app import runner, selectors, services
from channels_app.models import LIVE_TURN_STATES, Turn
from tests.support.plans import statements_on
from ugent_site.metrics import DatabaseCollector

pytestmark = pytest.mark.django_db(transaction=True)


def submitted(tcast, text: str) -> Turn:
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        result = services.message_submit(inbound=services.Submission(actor=actor, caller=tcast.operator, text=text))
    return result.turn


def turns_made(tcast) -> dict[str, Turn]:
    """Forty ended turns, one running with a fresh lease, one accepted a moment ago."""
    made = {}
    for i in range(40):
        made[f"done-{i}"] = submitted(tcast, f"done {i}")
    Turn.objects.filter(pk__in=[t.pk for t in made.values()]).update(state="completed")
    running = made["running"] = submitted(tcast, "running")
    now = timezone.now()
    Turn.objects.filter(pk=running.pk).update(state="running", started_at=now,
                                              lease_expires_at=now + timedelta(seconds=60))
    made["accepted"] = submitted(tcast, "waiting")
    return made


def live_reads():
    runner.turns_sweep_stale()
    list(DatabaseCollector().collect())
    selectors.turns_live_overview()
    with mock.patch("channels_app.dispatch.turn_dispatch"):
        runner.turns_requeue_accepted()


def test_live_turn_reads_use_the_partial_index_on_sqlite(tcast):
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's; PostgreSQL proves the partial index from bound values")
    turns_made(tcast)
    found = statements_on("channels_app_turn", live_reads)
    assert len(found) >= 5, found  # the sweep's two reads, the scrape's, the board's two, the re-queue's
    with connection.cursor() as cur:
        for sql, params in found:
            cur.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[3] for row in cur.fetchall()]
            on_turns = [p for p in plan if "channels_app_turn" in p]
            assert on_turns and all("INDEX turn_live" in p for p in on_turns), (sql, plan)


def test_the_live_turns_are_exactly_the_accepted_and_running_ones(tcast):
    made = turns_made(tcast)
    assert set(Turn.objects.live().values_list("pk", flat=True)) == {made["running"].pk, made["accepted"].pk}
    assert set(Turn.objects.live().values_list("state", flat=True)) == set(LIVE_TURN_STATES)
    overview = selectors.turns_live_overview()
    assert (overview["running"]["count"], overview["queued"]["count"]) == (1, 1)
    assert [t["pk"] for t in overview["oldest_running"]] == [made["running"].pk]
    gauges = {m.name: m.samples[0].value for m in DatabaseCollector().collect()
              if m.name in ("ugent_turn_queue_depth", "ugent_turns_running")}
    assert gauges == {"ugent_turn_queue_depth": 1, "ugent_turns_running": 1}
    with mock.patch("channels_app.dispatch.turn_dispatch") as dispatched:
        assert runner.turns_requeue_accepted() == 1
    assert [c.args[0] for c in dispatched.call_args_list] == [made["accepted"].pk]
    assert runner.turns_sweep_stale() == 0  # a fresh lease and a fresh queue wait: nothing ends
    assert Turn.objects.get(pk=made["running"].pk).state == "running"


def test_a_stop_or_steer_by_conversation_reads_the_live_turns_not_every_turn_of_it(tcast):
    """`turn_for_action` without a turn_id (a stop or a steer by conversation, a channel's /stop) and the
    conversation repair's reads of live turns look for the conversation's live turns through `turn_live_conv`
    (turn_live's condition, by conversation): a conversation of many ended turns and none live is not walked
    turn by turn, as it was through the conversation's own index."""
    from channels_app import repair, streams
    from channels_app.errors import ApplicationError
    from tests.support.plans import table_scans
    actor = services.actor_resolve(caller=tcast.operator, user="alice")
    viewer = services.viewer_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        for i in range(5):
            turn = services.message_submit(inbound=services.Submission(
                actor=actor, caller=tcast.operator, text=f"m {i}", conversation_id="long")).turn
    Turn.objects.filter(conversation=turn.conversation).update(state="completed")

    def by_conversation():
        with pytest.raises(ApplicationError) as refused:
            streams.turn_for_action(viewer=viewer, conversation_id="long")
        assert refused.value.status == 409  # nothing live: no_running_turn
    def repair_reads():
        repair._live_turns_with_an_end(turn.conversation)
        repair._lapsed_and_expired(turn.conversation)
    live = statements_on("channels_app_turn", by_conversation) + statements_on("channels_app_turn", repair_reads)
    assert len(live) == 4, live
    if connection.vendor == "sqlite":
        assert table_scans("channels_app_turn", live) == []
        with connection.cursor() as cur:
            for sql, params in live:
                cur.execute("EXPLAIN QUERY PLAN " + sql, params)
                plan = [row[3] for row in cur.fetchall() if "channels_app_turn" in row[3]]
                assert plan and all("INDEX turn_live" in p for p in plan), (sql, plan)  # turn_live or turn_live_conv
    # and they still find the live one
    Turn.objects.filter(pk=turn.pk).update(state="running")
    assert streams.turn_for_action(viewer=viewer, conversation_id="long").pk == turn.pk
