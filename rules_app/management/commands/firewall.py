"""Workspace trust for the injection firewall.

    python manage.py firewall workspace approve [--workspace PATH]
    python manage.py firewall workspace revoke [--workspace PATH]
    python manage.py firewall workspace status [--workspace PATH]

A rules.toml or routing.toml inside the workspace loads only once the workspace is trusted. Trust is
a row in the database: every process picks it up at its next look (within a few seconds).
"""
from __future__ import annotations

import getpass

from django.core.management.base import BaseCommand

from rules_app import conf


class Command(BaseCommand):
    help = "Trust (or stop trusting) the workspace, so rules files inside it load."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="area", required=True)
        ws = sub.add_parser("workspace", help="Workspace trust.")
        ws.add_argument("verb", choices=["approve", "revoke", "status"])
        ws.add_argument("--workspace", help="The workspace (default: UGENT_WORKSPACE).")

    def handle(self, *args, **opts):
        from rules_app import selectors, services
        from rules_app.models import WorkspaceTrust
        from ugent_common.dbconn import tables_required
        tables_required(WorkspaceTrust)
        workspace = opts["workspace"] or str(conf.workspace())
        key = selectors.workspace_key(workspace)
        verb = opts["verb"]
        if verb == "approve":
            try:
                who = getpass.getuser()
            except Exception:
                who = ""
            services.workspace_trust_approve(path=workspace, approved_by=who)
            self.stdout.write(f"Workspace {key} is trusted: a rules.toml or routing.toml inside it loads.")
        elif verb == "revoke":
            if services.workspace_trust_revoke(path=workspace):
                self.stdout.write(f"Workspace {key} is no longer trusted: rules files inside it are skipped.")
            else:
                self.stdout.write(f"Workspace {key} was not trusted.")
        else:
            trust = selectors.workspace_trust_get(workspace)
            if trust is not None and trust.trusted:
                self.stdout.write(f"Workspace {key} is trusted (approved {trust.updated_at.isoformat()}"
                                  + (f" by {trust.approved_by}" if trust.approved_by else "") + ").")
            else:
                self.stdout.write(f"Workspace {key} is not trusted: approve it with "
                                  "`python manage.py firewall workspace approve`.")
