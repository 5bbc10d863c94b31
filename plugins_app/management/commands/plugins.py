"""Channel plugin registrations: plugins.toml in and out, status, setup and migrate.

    python manage.py plugins import FILE [--prune]
    python manage.py plugins export [--output FILE]
    python manage.py plugins status
    python manage.py plugins setup [--no-input] [--global-file F] [--workspace DIR]
    python manage.py plugins migrate [--global-file F] [--workspace DIR]

`setup` on a terminal is a wizard (which installed channel kinds to enable, the
environment each needs, checked); `--no-input` does the same from the global
file (~/.ugent/plugins.toml) and the environment. Both write the rows and the
workspace's plugins.toml. `migrate` regenerates the rows from the global file
(rows it does not name are disabled).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from plugins_app.channel import conf, services, tomlio
from plugins_app.channel.models import Plugin, PluginSecret


class Command(BaseCommand):
    help = "Import, export, show and set up channel plugins (plugins.toml)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        imp = sub.add_parser("import", help="Create or update plugins from a plugins.toml.")
        imp.add_argument("file")
        imp.add_argument("--prune", action="store_true", help="Disable plugins the file does not name.")
        exp = sub.add_parser("export", help="Print (or write) the plugins as plugins.toml.")
        exp.add_argument("--output", "-o")
        sub.add_parser("status", help="Each plugin's state, reason and queue.")
        for name in ("setup", "migrate"):
            p = sub.add_parser(name)
            p.add_argument("--global-file", default=None, help=f"Default {conf.global_plugins_toml()}")
            p.add_argument("--workspace", default=None, help="Where plugins.toml is written "
                                                             "(default: UGENT_WORKSPACE).")
            if name == "setup":
                p.add_argument("--no-input", action="store_true", help="No questions: from the global file.")

    def handle(self, *args, **opts):
        from ugent_common.dbconn import tables_required
        tables_required(Plugin, PluginSecret)
        return getattr(self, f"do_{opts['action']}")(opts)

    # --- import / export / status ---------------------------------------------------------

    def do_import(self, opts):
        path = Path(opts["file"])
        if not path.exists():
            raise CommandError(f"{path}: no such file")
        try:
            counts = tomlio.plugins_import(text=path.read_text(), source=str(path), prune=opts["prune"])
        except tomlio.PluginsFileError as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"Imported {path}: {counts['created']} created, {counts['updated']} updated"
                          + (f", {counts['disabled']} disabled" if opts["prune"] else ""))

    def do_export(self, opts):
        if opts["output"]:
            self.stdout.write(f"Wrote {tomlio.plugins_write(Path(opts['output']))}")
        else:
            self.stdout.write(tomlio.plugins_export(), ending="")

    def do_status(self, opts):
        from plugins_app.channel.selectors import plugins_status
        rows = plugins_status()["plugins"]
        if not rows:
            self.stdout.write("No plugins registered.")
        for r in rows:
            flag = "enabled" if r["enabled"] else "disabled"
            self.stdout.write(f"{r['plugin_id']:<24} {r['kind']:<20} {flag:<8} {r['state']:<9} "
                              f"pending={r['pending']} in_flight={r['in_flight']} "
                              f"dead_letters={r['dead_letters']}  {r['disabled_reason'] or r['state_reason']}")

    # --- setup / migrate ------------------------------------------------------------------

    def _workspace_file(self, opts) -> Path:
        return Path(opts["workspace"]) / "plugins.toml" if opts.get("workspace") else conf.workspace_plugins_toml()

    def _global_rows(self, opts) -> tuple[Path, list[dict]]:
        path = Path(opts["global_file"]) if opts.get("global_file") else conf.global_plugins_toml()
        if not path.exists():
            raise CommandError(f"No global plugins file at {path}: run `plugins setup` on a terminal, "
                               f"or write one (schema_version = 1).")
        try:
            return path, tomlio.plugins_parse(path.read_text(), source=str(path))
        except tomlio.PluginsFileError as exc:
            raise CommandError(str(exc))

    def _apply(self, rows: list[dict], *, prune: bool = False) -> list[Plugin]:
        """Write the rows; a plugin whose environment is not set is written disabled, saying so."""
        written = []
        with transaction.atomic():
            for row in rows:
                fields = dict(row)
                plugin_id = fields.pop("plugin_id")
                plugin, _ = Plugin.objects.get_or_create(plugin_id=plugin_id, defaults=fields)
                for k, v in fields.items():
                    setattr(plugin, k, v)
                plugin.disabled_reason = ""
                plugin.save()
                stored = set(PluginSecret.objects.filter(plugin=plugin).values_list("name", flat=True))
                for name in plugin.secret_env_refs:
                    if name in os.environ:  # the secret goes to the vault, never to a file
                        services.plugin_secret_set(plugin=plugin, name=name, value=os.environ[name])
                        stored.add(name)
                missing = [n for n in plugin.env_refs if n not in os.environ] + \
                          [n for n in plugin.secret_env_refs if n not in stored]
                if missing and plugin.enabled:
                    plugin.enabled = False
                    plugin.disabled_reason = f"environment not set: {', '.join(missing)}"
                    plugin.save(update_fields=["enabled", "disabled_reason", "updated_at"])
                    self.stdout.write(f"  {plugin_id}: disabled, environment not set: {', '.join(missing)}")
                written.append(plugin)
            if prune:
                Plugin.objects.exclude(plugin_id__in=[r["plugin_id"] for r in rows]).update(enabled=False)
        return written

    def _finish(self, opts, written: list[Plugin]):
        path = tomlio.plugins_write(self._workspace_file(opts), written)
        enabled = sum(p.enabled for p in written)
        self.stdout.write(f"Wrote {len(written)} plugin(s) ({enabled} enabled) and {path}")

    def do_migrate(self, opts):
        path, rows = self._global_rows(opts)
        written = self._apply(rows, prune=True)
        self.stdout.write(f"Regenerated the plugins from {path}")
        self._finish(opts, written)

    def do_setup(self, opts):
        if opts["no_input"]:
            path, rows = self._global_rows(opts)
            self.stdout.write(f"Setting up plugins from {path}")
            self._finish(opts, self._apply(rows))
            return
        if not sys.stdin.isatty():
            raise CommandError("plugins setup asks questions on a terminal; use --no-input to set up "
                               "from the global file.")
        self._finish(opts, self._apply(self._wizard()))

    # --- the wizard -----------------------------------------------------------------------

    def _ask(self, prompt: str, default: str = "") -> str:
        shown = f"{prompt} [{default}]: " if default else f"{prompt}: "
        self.stdout.write(shown, ending="")
        self.stdout.flush()
        answer = sys.stdin.readline()
        if not answer:
            raise CommandError("setup cancelled (end of input)")
        return answer.strip() or default

    def _yes(self, prompt: str, default: bool = False) -> bool:
        answer = self._ask(f"{prompt} ({'Y/n' if default else 'y/N'})", "").lower()
        return default if not answer else answer in ("y", "yes")

    def _wizard(self) -> list[dict]:
        from plugins_app.channel.workers import installed_kinds
        kinds = installed_kinds()
        if not kinds:
            raise CommandError("No channel kinds are installed.")
        self.stdout.write("Channel kinds installed:")
        for kind in kinds.values():
            self.stdout.write(f"  {kind.kind:<20} {kind.description}")
        rows = []
        for kind in kinds.values():
            if not self._yes(f"Enable {kind.kind}?"):
                continue
            plugin_id = self._ask("  Plugin id", f"{kind.kind.removeprefix('channel-')}-main")
            refs = [n.strip() for n in self._ask("  Environment variables it needs (comma-separated)",
                                                 ",".join(kind.env_refs)).split(",") if n.strip()]
            missing = [n for n in refs if n not in os.environ]
            for name in refs:
                self.stdout.write(f"    {name}: {'NOT SET' if name in missing else 'set'}")
            if missing:
                self.stdout.write("    It is written disabled until they are set (then run setup again).")
            senders = [s.strip() for s in self._ask("  Allowed senders (channel:sender_id, comma-separated; "
                                                    "empty lets everyone in)").split(",") if s.strip()]
            entry = {"id": plugin_id, "kind": kind.kind, "enabled": True, "env_refs": refs, "routing": {"allowed_senders": senders}}
            try:
                rows.extend(tomlio.plugins_parse(tomlio.tomli_w.dumps({"schema_version": 1,
                                                                       "plugins": [entry]})))
            except tomlio.PluginsFileError as exc:
                raise CommandError(str(exc))
        if not rows:
            self.stdout.write("Nothing enabled.")
        return rows
