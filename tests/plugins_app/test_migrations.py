"""Migrations that move data: a registration starting a built-in worker by its old module path."""
import importlib

from django.apps import apps

from plugins_app.models import Plugin

moved = importlib.import_module("plugins_app.migrations.0003_workers_moved_to_channel")


def test_a_worker_started_by_its_old_module_path_is_rewritten_and_others_are_left(db):
    old = Plugin.objects.create(plugin_id="echo-old", kind="channel-echo", command="python",
                                args=["-m", "plugins_app.workers.echo", "--flag"])
    own = Plugin.objects.create(plugin_id="mine", kind="channel-mine", command="/opt/worker",
                                args=["--name", "plugins_app.workers.echo is in the text, not the path"])
    moved._rewrite(apps, None)
    assert Plugin.objects.get(pk=old.pk).args == ["-m", "plugins_app.channel.workers.echo", "--flag"]
    assert Plugin.objects.get(pk=own.pk).args == own.args
    moved._back(apps, None)
    assert Plugin.objects.get(pk=old.pk).args == ["-m", "plugins_app.workers.echo", "--flag"]


def test_the_module_the_rewritten_path_names_exists():
    importlib.import_module("plugins_app.channel.workers.echo")
