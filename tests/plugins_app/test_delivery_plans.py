"""A plugin's deliveries are taken, requeued and acknowledged through their indexes, not by reading every
delivery ever made (delivered ones stay on record). The plans are SQLite's; what a take hands out is
checked in both modes."""
from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

from channels_app import services as hub
from plugins_app.channel import services
from plugins_app.channel.models import OutboundDelivery, Plugin
from tests.support.plans import statements_on, table_scans

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def deliveries(tcast):
    actor = hub.actor_resolve(caller=tcast.operator, user="alice")
    with mock.patch("channels_app.tasks.run_turn.delay"):
        conv = hub.message_submit(inbound=hub.Submission(actor=actor, caller=tcast.operator, text="hi")).conversation
    tg, other = (Plugin.objects.create(plugin_id=p, kind="channel-telegram") for p in ("tg", "other"))
    OutboundDelivery.objects.bulk_create(
        [OutboundDelivery(delivery_id=f"old-{i}", plugin=tg if i % 2 else other, state="delivered",
                          conversation=conv, text="done") for i in range(50)] +
        [OutboundDelivery(delivery_id=f"new-{i}", plugin=tg, state="pending", conversation=conv, text=f"m{i}")
         for i in range(3)] +
        [OutboundDelivery(delivery_id="theirs", plugin=other, state="pending", conversation=conv, text="x")])
    return tg


def test_a_take_hands_out_the_plugins_pending_deliveries_in_order(deliveries):
    taken = services.deliveries_claim(plugin_id="tg", max_items=10)
    assert [d.delivery_id for d in taken] == ["new-0", "new-1", "new-2"]
    assert services.deliveries_claim(plugin_id="tg", max_items=10) == []
    assert services.deliveries_requeue(plugin_id="tg") == 3
    assert [d.delivery_id for d in services.deliveries_claim(plugin_id="tg", max_items=2)] == ["new-0", "new-1"]


def test_take_requeue_and_ack_use_indexes_on_sqlite(deliveries):
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")

    def work():
        taken = services.deliveries_claim(plugin_id="tg", max_items=2)
        services.delivery_ack(plugin_id="tg", delivery_id=taken[0].delivery_id, status="delivered",
                              claim=taken[0].claim)
        services.deliveries_requeue(plugin_id="tg")
    found = statements_on("plugins_app_outbounddelivery", work)
    assert len(found) >= 5, found
    assert table_scans("plugins_app_outbounddelivery", found) == []
