"""daphne is in INSTALLED_APPS for its `runserver` only: a process's start (every manage.py command, worker and
web process) does not import its Twisted server, and `manage.py runserver` still serves through daphne on
Twisted's asyncio reactor (ugent_site.daphne_runserver)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.daemon import ROOT

pytestmark = pytest.mark.mode_free

CODE = """
import os, sys, django
os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'ugent_site.settings')
django.setup()
print(sorted(m for m in ('daphne.server', 'twisted.internet.reactor') if m in sys.modules))
from django.core.management import get_commands, load_command_class
app = get_commands()['runserver']
command = load_command_class(app, 'runserver')
from twisted.internet import reactor
print(app, type(command).__module__, type(reactor).__name__)
"""


def test_a_process_start_imports_no_twisted_and_runserver_is_daphnes_on_the_asyncio_reactor():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines() == [
        "[]", "daphne daphne.management.commands.runserver AsyncioSelectorReactor"], out.stderr[-2000:]
