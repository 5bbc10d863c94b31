"""Media uploaded through the bridge expires: a beat job deletes it."""
import datetime as dt

import pytest
from django.db import connection
from django.utils import timezone

from plugins_app.channel.models import Plugin, PluginMedia
from tests.support.plans import statements_on, table_scans


def _plugin():
    return Plugin.objects.create(plugin_id="media-test", kind="channel-telegram", command="python")


def test_prune_media_deletes_only_expired_media(transactional_db):
    plugin = _plugin()
    now = timezone.now()
    PluginMedia.objects.create(media_id="m_old", plugin=plugin, content_type="image/png", size=1, data=b"x",
                               expires_at=now - dt.timedelta(seconds=1))
    PluginMedia.objects.create(media_id="m_new", plugin=plugin, content_type="image/png", size=1, data=b"y",
                               expires_at=now + dt.timedelta(hours=1))
    from plugins_app.tasks import prune_media
    assert prune_media() == 1
    assert list(PluginMedia.objects.values_list("media_id", flat=True)) == ["m_new"]


def test_beat_start_schedules_the_media_and_delivery_prunes(transactional_db):
    from django_celery_beat.models import PeriodicTask

    from plugins_app.tasks import _retention_schedules
    _retention_schedules()
    _retention_schedules()  # a second beat start updates, never duplicates
    for task in ("plugins_app.tasks.prune_media", "plugins_app.tasks.prune_deliveries"):
        tasks = PeriodicTask.objects.filter(task=task, enabled=True)
        assert tasks.count() == 1, task
        assert tasks.get().interval.every == 3600


def test_the_prune_reads_the_expiry_index_not_every_stored_file(transactional_db):
    """SQLite keeps each file's bytes before its expiry in the row: a scan would read all of them."""
    if connection.vendor != "sqlite":
        pytest.skip("the plans are SQLite's")
    plugin = _plugin()
    now = timezone.now()
    PluginMedia.objects.bulk_create([
        PluginMedia(media_id=f"m_{i}", plugin=plugin, content_type="image/png", size=5000, data=b"z" * 5000,
                    expires_at=now + dt.timedelta(seconds=-1 if i % 10 == 0 else 3600)) for i in range(100)])
    from plugins_app.channel import services
    counted = []
    found = statements_on("plugins_app_pluginmedia", lambda: counted.append(services.media_prune()))
    assert counted == [10]
    assert found and table_scans("plugins_app_pluginmedia", found) == []
    assert PluginMedia.objects.count() == 90
