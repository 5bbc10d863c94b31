"""A plugin's media not yet expired are capped (UGENT_PLUGIN_MEDIA_QUOTA_BYTES), not only each file: one
plugin stored 192 MiB in 3.2 s, 8 MiB at a time, all kept for a day. Over the quota media.put answers
-32005 (`Media too large`), with the room left as `max_bytes`, and stores nothing."""
from __future__ import annotations

import asyncio

import pytest
from django.utils import timezone

from plugins_app.channel import conf
from plugins_app.channel.bridge import MediaTooLarge
from plugins_app.channel.hub import DjangoHub
from plugins_app.channel.models import PluginMedia
from plugins_app.channel.sdk.jsonrpc import MEDIA_TOO_LARGE
from plugins_app.channel.sdk.messages import Media
from tests.plugins_app.conftest import make_plugin


def put(hub, plugin_id, size):
    return asyncio.run(hub.media_put(plugin_id, Media(b"x" * size, "application/octet-stream", "f.bin")))


def test_media_over_the_plugins_quota_is_refused_and_nothing_is_stored(tcast, monkeypatch):
    monkeypatch.setattr(conf, "MEDIA_QUOTA_BYTES", 1000)
    make_plugin()
    make_plugin("other-main")
    hub = DjangoHub()
    put(hub, "echo-main", 600)
    with pytest.raises(MediaTooLarge) as refused:
        put(hub, "echo-main", 600)
    assert refused.value.code == MEDIA_TOO_LARGE
    assert refused.value.data == {"size": 600, "max_bytes": 400, "quota_bytes": 1000, "stored_bytes": 600}
    assert list(PluginMedia.objects.values_list("size", flat=True)) == [600]
    put(hub, "echo-main", 400)  # exactly the room left
    put(hub, "other-main", 1000)  # each plugin has its own
    with pytest.raises(MediaTooLarge):
        put(hub, "echo-main", 1)
    assert PluginMedia.objects.filter(plugin__plugin_id="echo-main").count() == 2


def test_expired_media_no_longer_count_against_the_quota(tcast, monkeypatch):
    monkeypatch.setattr(conf, "MEDIA_QUOTA_BYTES", 1000)
    make_plugin()
    hub = DjangoHub()
    put(hub, "echo-main", 1000)
    PluginMedia.objects.update(expires_at=timezone.now() - timezone.timedelta(seconds=1))  # not yet pruned
    put(hub, "echo-main", 1000)
    assert PluginMedia.objects.count() == 2


def test_a_file_over_the_per_file_limit_says_only_that_limit(tcast, monkeypatch):
    monkeypatch.setattr(conf, "MEDIA_MAX_BYTES", 100)
    make_plugin()
    with pytest.raises(MediaTooLarge) as refused:
        put(DjangoHub(), "echo-main", 101)
    assert refused.value.data == {"size": 101, "max_bytes": 100}
    assert not PluginMedia.objects.exists()


def test_the_quota_sum_reads_its_covering_index_not_the_stored_files(tcast):
    """SQLite keeps each file's bytes before its size and expiry in the row: summing from the rows would
    read every stored byte of the plugin at each put."""
    from django.db import connection

    from tests.support.plans import statements_on
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")
    from plugins_app.channel import services
    make_plugin()
    found = statements_on("plugins_app_pluginmedia", lambda: services.media_store(
        plugin_id="echo-main", data=b"x" * 10, content_type="application/octet-stream"))
    [(sql, params)] = [(s, p) for s, p in found if "SUM(" in s.upper()]
    with connection.cursor() as cur:
        cur.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = [row[3] for row in cur.fetchall()]
    assert any("USING COVERING INDEX pluginmedia_quota" in step for step in plan), plan
