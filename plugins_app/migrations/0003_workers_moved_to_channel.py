"""The built-in channel workers moved from plugins_app.workers to plugins_app.channel.workers: a
registration that starts one by module path (`python -m plugins_app.workers.echo`) is rewritten."""
from django.db import migrations

OLD, NEW = "plugins_app.workers.", "plugins_app.channel.workers."


def _rewrite(apps, schema_editor, old=OLD, new=NEW):
    Plugin = apps.get_model("plugins_app", "Plugin")
    for plugin in Plugin.objects.all():
        args = [a.replace(old, new, 1) if isinstance(a, str) and a.startswith(old) else a
                for a in (plugin.args or [])]
        command = plugin.command.replace(old, new, 1) if plugin.command.startswith(old) else plugin.command
        if args != plugin.args or command != plugin.command:
            plugin.args, plugin.command = args, command
            plugin.save(update_fields=["args", "command"])


def _back(apps, schema_editor):
    _rewrite(apps, schema_editor, old=NEW, new=OLD)


class Migration(migrations.Migration):

    dependencies = [("plugins_app", "0002_plugins")]

    operations = [migrations.RunPython(_rewrite, _back)]
