"""Federated identity from the command line (docs/identity.md).

    python manage.py identity import [FILE]   # [[web.auth.issuers]], [[web.auth.caller_defaults]] -> rows
    python manage.py identity export          # rows -> the same tables, to paste into ugent.toml
                                              # (or `> ugent.toml`: it runs no system check)

The daemon imports ugent.toml by itself whenever the file changes; `import` does it now, from FILE
(default: the ugent.toml the daemon reads).
"""
from __future__ import annotations

import tomllib

from django.core.management.base import BaseCommand, CommandError

from channels_app import federation
from ugent_common import config


class Command(BaseCommand):
    help = "Import and export the identity issuers and per-caller defaults of ugent.toml."
    # No system check: `identity export > ugent.toml` runs once the shell has emptied the file, which the
    # check refuses (ugent.E001), so nothing was written and the file was left empty. `import` reads and
    # refuses the file itself (empty, unparseable or invalid), and export reads the database alone.
    requires_system_checks = []

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        imp = sub.add_parser("import", help="Load [web.auth] issuers and caller defaults into the database.")
        imp.add_argument("file", nargs="?", default=None)
        sub.add_parser("export", help="Write the issuers and caller defaults out as ugent.toml tables.")

    def handle(self, *args, **opts):
        from ugent_common.dbconn import tables_required
        from channels_app.models import CallerDefaults, Issuer
        tables_required(Issuer, CallerDefaults)
        if opts["action"] == "export":
            self.stdout.write(federation.identity_toml_render(federation.identity_config_export()), ending="")
            return
        path = opts["file"] or config.config_path()
        if not path:
            raise CommandError("Name the ugent.toml to import (or set UGENT_CONFIG).")
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}")
        try:
            config.toml_refuse_empty(data, source=str(path), says="[web.auth]",
                                     remove="remove the issuers and caller defaults it imported")
            auth = config.web_auth_parse(data)
        except config.EmptyFileError as exc:
            raise CommandError(str(exc))
        except config.ConfigError as exc:
            raise CommandError(f"{exc}; nothing was changed")
        counts = federation.identity_config_import(auth=auth)
        self.stdout.write(f"Imported {counts['issuers']} issuer(s) and {counts['caller_defaults']} caller "
                          f"default(s) from {path}.")
