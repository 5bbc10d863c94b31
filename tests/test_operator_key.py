"""The operator key's file (ugent_site/operator_key.py): `rundaemon` makes it on a first start and says in one
line why it cannot."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def manage(tmp_path, *args, **env):
    """`manage.py ARGS` in a process of its own, embedded mode, its var/ under tmp_path."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    base.update({"UGENT_VAR_DIR": str(tmp_path / "var"), "UGENT_HOME": str(tmp_path / "home"), **env})
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=base, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("content", ["", "\n"], ids=["empty", "blank-line"])
def test_rundaemon_refuses_an_empty_key_file_in_one_line(tmp_path, content):
    key_file = tmp_path / "web_api_key"
    key_file.write_text(content)
    out = manage(tmp_path, "rundaemon", "--no-migrate", "--port", "1", UGENT_WEB_API_KEY_FILE=str(key_file))
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"CommandError: the operator key file {key_file} (UGENT_WEB_API_KEY_FILE) is "
                                   f"empty: put a key in it, or remove it to have one generated")
    assert key_file.read_text() == content


def test_rundaemon_names_a_key_file_whose_directory_is_missing(tmp_path):
    key_file = tmp_path / "etc-ugent" / "web_api_key"
    out = manage(tmp_path, "rundaemon", "--no-migrate", "--port", "1", UGENT_WEB_API_KEY_FILE=str(key_file))
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"CommandError: cannot create the operator key file {key_file} "
                                  f"(UGENT_WEB_API_KEY_FILE): its directory {key_file.parent} does not exist "
                                  f"(create it, or name another file)")


def test_rundaemon_generates_a_key_into_a_missing_file_readable_by_its_owner_alone(settings, tmp_path):
    from ugent_site.management.commands.rundaemon import Command
    settings.UGENT_WEB_API_KEY = ""
    settings.UGENT_WEB_API_KEY_FILE = tmp_path / "web_api_key"
    Command().ensure_operator_key()
    key = (tmp_path / "web_api_key").read_text().strip()
    assert key.startswith("ugk_") and settings.UGENT_WEB_API_KEY == key
    assert stat.S_IMODE((tmp_path / "web_api_key").stat().st_mode) == 0o600
