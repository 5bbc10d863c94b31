"""Media uploaded through the bridge expires: a beat job deletes it."""
import datetime as dt

from django.utils import timezone

from plugins_app.channel.models import Plugin, PluginMedia


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


def test_beat_start_schedules_the_media_prune(transactional_db):
    from django_celery_beat.models import PeriodicTask

    from plugins_app.tasks import _media_prune_schedule
    _media_prune_schedule()
    _media_prune_schedule()  # a second beat start updates, never duplicates
    tasks = PeriodicTask.objects.filter(task="plugins_app.tasks.prune_media", enabled=True)
    assert tasks.count() == 1
    assert tasks.get().interval.every == 3600
