"""Code context's test helpers: a workspace of source files, and ugent.toml's [code_context] for one test."""
from __future__ import annotations

import os

import pytest

BILLING = '''"""Billing."""


def parse_invoice(total):
    """Read an invoice's total."""
    return total * 2


class PaymentGateway:
    """Charges cards."""

    def charge(self, amount):
        return amount
'''
MAILER = "export function sendEmail(recipient) {\n  return smtp.deliver(recipient);\n}\n"
OUTSIDE = "def zebra_secret_token():\n    return 'the secret outside the workspace'\n"


class CodeWorkspace:
    """<tmp>/ws as UGENT_WORKSPACE (with pkg/billing.py, web/mailer.js and a link out to <tmp>/outside),
    and <tmp>/ugent.toml as the config in force."""

    def __init__(self, tmp_path, settings):
        from plugins_app.agent import code_context
        self.ws, self.outside, self.settings = tmp_path / "ws", tmp_path / "outside", settings
        (self.ws / "pkg").mkdir(parents=True, exist_ok=True)
        (self.ws / "web").mkdir(exist_ok=True)
        self.outside.mkdir(exist_ok=True)
        (self.ws / "pkg" / "billing.py").write_text(BILLING)
        (self.ws / "web" / "mailer.js").write_text(MAILER)
        (self.outside / "vault.py").write_text(OUTSIDE)
        os.symlink(self.outside / "vault.py", self.ws / "pkg" / "vault.py")
        os.symlink(self.outside, self.ws / "linked")
        self.config_path = tmp_path / "ugent.toml"
        settings.UGENT_WORKSPACE = str(self.ws)
        settings.UGENT_CONFIG_RECHECK_SECS = 0
        code_context.reset()
        self.config("enabled = true\nrescan_interval_secs = 0.0\n")

    def config(self, code_context_table: str, more: str = "") -> None:
        """Write ugent.toml with this [code_context] body ("" leaves the table out) and `more` after it; with
        neither, `[web.auth]` alone (an empty file is refused, ugent.E001)."""
        from ugent_common import config
        text = (f"[code_context]\n{code_context_table}\n" if code_context_table else "") + more or "[web.auth]\n"
        self.config_path.write_text(text)
        self.settings.UGENT_CONFIG = str(self.config_path)
        config.reset_caches()


@pytest.fixture
def code_ws(tmp_path, settings):
    from plugins_app.agent import code_context
    from ugent_common import config
    ws = CodeWorkspace(tmp_path, settings)
    yield ws
    config.reset_caches()
    code_context.reset()


def code_blocks(calls) -> list[str]:
    """The code-context system messages of the scripted engine's recorded calls, one list per call."""
    from plugins_app.agent.code_context import CODE_CONTEXT_HEADER
    return [[c for r, c in call["messages"] if r == "system" and c.startswith(CODE_CONTEXT_HEADER)]
            for call in calls]
