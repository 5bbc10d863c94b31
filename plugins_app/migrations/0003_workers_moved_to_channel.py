"""The built-in channel workers moved from plugins_app.workers to plugins_app.channel.workers: a
registration that starts one by module path (`python -m plugins_app.workers.echo`) is rewritten."""
import re

from django.db import migrations

OLD, NEW = "plugins_app.workers.", "plugins_app.channel.workers."


def _rewrite(apps, schema_editor, old=OLD, new=NEW):
    Plugin = apps.get_model("plugins_app", "Plugin")
    module = re.compile(re.escape(old) + r"[A-Za-z_][\w.]*")  # a whole dotted module path, nothing else

    def moved(value):
        return new + value[len(old):] if isinstance(value, str) and module.fullmatch(value) else value

    for plugin in Plugin.objects.all():
        args = [moved(a) for a in (plugin.args or [])]
        command = moved(plugin.command)
        if args != plugin.args or command != plugin.command:
            plugin.args, plugin.command = args, command
            plugin.save(update_fields=["args", "command"])


def _back(apps, schema_editor):
    _rewrite(apps, schema_editor, old=NEW, new=OLD)


class Migration(migrations.Migration):

    dependencies = [("plugins_app", "0002_plugins")]

    operations = [migrations.RunPython(_rewrite, _back)]
