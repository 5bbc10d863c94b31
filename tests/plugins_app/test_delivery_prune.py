"""Settled outbound deliveries (each keeps the answer's text) are deleted after their retention; the
ones still to be sent, and dead letters waiting for the operator, never are."""
import datetime as dt

import pytest
from django.db import connection
from django.utils import timezone

from plugins_app.channel import conf, services
from plugins_app.channel.models import DeliveryState, OutboundDelivery
from tests.support.plans import statements_on, table_scans

from .conftest import make_plugin

pytestmark = pytest.mark.django_db(transaction=True)


def _deliveries(n: int) -> list[str]:
    from channels_app.services import channel_actor_resolve, conversation_resolve
    plugin = make_plugin("prune-test")
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id=plugin.plugin_id, external_id="chat-1",
                                   actor=actor, caller=None)
    return [services.delivery_enqueue(plugin=plugin, conversation=conv, text=f"out-{i}").delivery_id
            for i in range(n)]


def _settle(delivery_id: str, status: str) -> None:
    """Through the worker's own path: claimed, then acked."""
    claimed = services.deliveries_claim(plugin_id="prune-test", max_items=8)
    held = {d.delivery_id: d.claim for d in claimed}
    services.delivery_ack(plugin_id="prune-test", delivery_id=delivery_id, status=status,
                          retryable=False, reason="blocked by the user", claim=held[delivery_id])
    services.deliveries_requeue(plugin_id="prune-test")


def _age(delivery_ids, seconds: float) -> None:
    OutboundDelivery.objects.filter(delivery_id__in=delivery_ids).update(
        updated_at=timezone.now() - dt.timedelta(seconds=seconds))


def test_only_deliveries_settled_longer_than_the_retention_are_deleted():
    ids = _deliveries(7)
    pending, in_flight, old_sent, young_sent, dead, discarded, old_pending = ids
    for d in (old_sent, young_sent):
        _settle(d, "delivered")
    for d in (dead, discarded):
        _settle(d, "failed")
    assert services.delivery_discard(delivery=OutboundDelivery.objects.get(delivery_id=discarded))
    held = {d.delivery_id for d in services.deliveries_claim(plugin_id="prune-test", max_items=1)}
    assert held == {pending}  # the first pending one is the one in flight now
    in_flight, pending = pending, in_flight
    old = conf.DELIVERY_RETENTION_SECS + 60
    _age([old_sent, dead, discarded, old_pending, in_flight], old)
    _age([young_sent], conf.DELIVERY_RETENTION_SECS - 60)
    states = dict(OutboundDelivery.objects.values_list("delivery_id", "state"))
    assert (states[old_sent], states[dead], states[discarded], states[in_flight]) == (
        DeliveryState.DELIVERED, DeliveryState.DEAD_LETTER, DeliveryState.DISCARDED, DeliveryState.IN_FLIGHT)

    from plugins_app.tasks import prune_deliveries
    assert prune_deliveries.delay().get() == 2  # the beat task, run eagerly
    left = set(OutboundDelivery.objects.values_list("delivery_id", flat=True))
    assert left == {pending, in_flight, young_sent, dead, old_pending}
    assert services.deliveries_prune() == 0  # nothing else is old enough


def test_a_large_prune_goes_in_batches(monkeypatch):
    ids = _deliveries(25)
    OutboundDelivery.objects.filter(delivery_id__in=ids).update(state=DeliveryState.DELIVERED)
    _age(ids[:23], conf.DELIVERY_RETENTION_SECS + 1)
    monkeypatch.setattr(services, "PRUNE_BATCH", 5)
    batches = statements_on("plugins_app_outbounddelivery", services.deliveries_prune)
    assert sum(sql.lstrip().upper().startswith("DELETE") for sql, _ in batches) == 5
    assert set(OutboundDelivery.objects.values_list("delivery_id", flat=True)) == set(ids[23:])


def test_the_prune_reads_the_settled_index_not_every_delivery():
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")
    ids = _deliveries(40)
    OutboundDelivery.objects.filter(delivery_id__in=ids[::4]).update(state=DeliveryState.DELIVERED)
    _age(ids, conf.DELIVERY_RETENTION_SECS + 1)
    counted = []
    found = statements_on("plugins_app_outbounddelivery", lambda: counted.append(services.deliveries_prune()))
    assert counted == [10]
    assert found and table_scans("plugins_app_outbounddelivery", found) == []
