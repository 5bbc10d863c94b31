"""Make the operator key's file: a random key, mode 0600, never over an existing file.

    python manage.py createoperatorkey [--file PATH]     # PATH defaults to UGENT_WEB_API_KEY_FILE

`rundaemon` does this itself on an embedded install's first start; servers mode never runs it, so an
operator runs this once before the first start (docs/deploy.md).
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Write a new random operator API key to UGENT_WEB_API_KEY_FILE (mode 0600), unless it exists."
    # (the checks would warn ugent.W001, "no operator key", right as this makes one)
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("--file", default=None, help="Where to write it (default: UGENT_WEB_API_KEY_FILE).")

    def handle(self, *args, **opts):
        from ugent_site.operator_key import OperatorKeyError, operator_key_create
        path = Path(opts["file"]) if opts["file"] else settings.UGENT_WEB_API_KEY_FILE
        try:
            key = operator_key_create(path=path)
        except OperatorKeyError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Wrote a new operator API key to {path} (mode 0600):\n  {key}")
        if path != settings.UGENT_WEB_API_KEY_FILE:
            self.stderr.write(f"note: the processes read the file UGENT_WEB_API_KEY_FILE names "
                              f"({settings.UGENT_WEB_API_KEY_FILE}), not this one")
        elif settings.UGENT_WEB_API_KEY:
            self.stderr.write("note: UGENT_WEB_API_KEY is set, and wins over the file")
