"""The operator key's file (ugent_site/operator_key.py): `rundaemon` makes it on a first start and says in one
line why it cannot; `manage.py createoperatorkey` makes it for servers mode, which never runs rundaemon; a
servers-mode process with no operator key says so."""
from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

# Each test names its run mode itself: its processes' environment (REDIS_URL and DATABASE_URL removed, or
# servers mode's pointing at nothing), or settings.UGENT_MODE.
pytestmark = pytest.mark.mode_free

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
    # (it stops before migrate: a key file it cannot use is the first thing it says; with --no-migrate, after the
    # tables, which this fresh var/ has none of)
    out = manage(tmp_path, "rundaemon", "--port", "1", UGENT_WEB_API_KEY_FILE=str(key_file))
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"CommandError: the operator key file {key_file} (UGENT_WEB_API_KEY_FILE) is "
                                   f"empty: put a key in it, or remove it to have one generated")
    assert key_file.read_text() == content


def test_rundaemon_names_a_key_file_whose_directory_is_missing(tmp_path):
    key_file = tmp_path / "etc-ugent" / "web_api_key"
    out = manage(tmp_path, "rundaemon", "--port", "1", UGENT_WEB_API_KEY_FILE=str(key_file))
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


def test_createoperatorkey_writes_a_key_its_owner_alone_reads_and_never_overwrites_one(settings, tmp_path):
    from django.core.management import CommandError, call_command
    key_file = settings.UGENT_WEB_API_KEY_FILE = tmp_path / "web_api_key"
    settings.UGENT_WEB_API_KEY = ""
    out = io.StringIO()
    call_command("createoperatorkey", stdout=out)
    key = key_file.read_text().strip()
    assert key.startswith("ugk_") and out.getvalue() == f"Wrote a new operator API key to {key_file} (mode 0600):\n  {key}\n"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(CommandError) as err:
        call_command("createoperatorkey", stdout=out)
    assert str(err.value) == (f"{key_file} already holds an operator key: nothing was changed "
                              f"(remove the file first to replace the key)")
    assert key_file.read_text().strip() == key


# Servers mode's settings, pointing at no server: these commands only load the settings (port 1 answers nobody).
SERVERS = {"REDIS_URL": "redis://127.0.0.1:1/0", "DATABASE_URL": "postgres://nobody@127.0.0.1:1/ugent_nowhere"}


def test_servers_mode_without_an_operator_key_says_so_at_check_and_in_the_web_log(tmp_path):
    """Servers mode never runs rundaemon: a deployment that skipped createoperatorkey has no operator key."""
    key_file = tmp_path / "web_api_key"
    out = manage(tmp_path, "check", UGENT_WEB_API_KEY_FILE=str(key_file), **SERVERS)
    assert out.returncode == 0, out.stderr
    assert ("(ugent.W001) no operator key is configured (UGENT_WEB_API_KEY is unset, or not of role operator, and "
            f"UGENT_WEB_API_KEY_FILE {key_file} is missing or empty; no [[web.auth.keys]] entry of role operator in "
            "ugent.toml has its key set; keys the admin issued to an operator caller are not checked)") in out.stderr
    assert "`python manage.py createoperatorkey`" in out.stderr
    web = manage(tmp_path, "shell", "-c", "import ugent_site.asgi", UGENT_WEB_API_KEY_FILE=str(key_file), **SERVERS)
    assert web.returncode == 0, web.stderr
    assert "WARNING ugent.web no operator key is configured" in web.stderr


def test_servers_mode_with_an_operator_key_says_nothing(settings):
    from ugent_site.apps import operator_key_check
    settings.UGENT_MODE, settings.UGENT_WEB_API_KEY = "servers", ""
    assert [w.id for w in operator_key_check()] == ["ugent.W001"]
    settings.UGENT_WEB_API_KEY = "ugk_set"
    assert operator_key_check() == []


OPERATOR_IN_TOML = '[[web.auth.keys]]\nname = "ops"\nkey_env = "OPS_KEY"\nrole = "{role}"\n'


@pytest.mark.parametrize("toml, env, warns", [
    (OPERATOR_IN_TOML.format(role="operator"), {"OPS_KEY": "ugk_fromtoml_0123456789"}, False),
    (OPERATOR_IN_TOML.format(role="operator"), {}, True),  # (its variable unset: no key)
    (OPERATOR_IN_TOML.format(role="application"), {"OPS_KEY": "ugk_fromtoml_0123456789"}, True),
    ('[web.auth]\napi_key_role = "application"\n', {"UGENT_WEB_API_KEY": "ugk_env_0123456789"}, True),
    ("[web.auth]\n", {"UGENT_WEB_API_KEY": "ugk_env_0123456789"}, False),  # (an empty file is ugent.E001)
], ids=["toml-operator", "toml-operator-unset", "toml-application", "env-key-application", "env-key"])
def test_w001_counts_every_configured_operator_key(tmp_path, toml, env, warns):
    """An operator key in ugent.toml's [[web.auth.keys]] is one: W001 said there was none."""
    config = tmp_path / "ugent.toml"
    config.write_text(toml)
    out = manage(tmp_path, "check", UGENT_WEB_API_KEY_FILE=str(tmp_path / "no_key_file"), UGENT_CONFIG=str(config),
                 **env, **SERVERS)
    assert out.returncode == 0, out.stderr
    assert ("ugent.W001" in out.stderr) == warns, out.stderr


def test_createoperatorkey_does_not_warn_that_there_is_no_operator_key(tmp_path):
    """It ran the system checks, so W001 ("no operator key") came out right as it made one."""
    key_file = tmp_path / "web_api_key"
    out = manage(tmp_path, "createoperatorkey", UGENT_WEB_API_KEY_FILE=str(key_file), **SERVERS)
    assert out.returncode == 0, out.stderr
    assert key_file.read_text().startswith("ugk_") and "W001" not in out.stderr + out.stdout, out.stderr


def test_embedded_mode_says_nothing_before_rundaemon_makes_the_key(tmp_path):
    out = manage(tmp_path, "check", UGENT_WEB_API_KEY_FILE=str(tmp_path / "web_api_key"))
    assert out.returncode == 0 and "ugent.W001" not in out.stderr, out.stderr


def test_two_runs_at_once_never_call_the_winners_file_empty(tmp_path):
    """Init containers on one volume: the loser read the winner's file before its write and said "is empty:
    put a key in it, or remove it", advice that would destroy the winner's key."""
    import threading
    from ugent_site.operator_key import OperatorKeyError, operator_key_create
    refusals = set()
    for round_ in range(200):
        path = tmp_path / f"r{round_}" / "web_api_key"
        path.parent.mkdir()
        made, lock = [], threading.Lock()

        def run():
            try:
                key = operator_key_create(path=path)
                with lock:
                    made.append(key)
            except OperatorKeyError as exc:
                with lock:
                    refusals.add(str(exc).replace(str(path), "PATH"))
        threads = [threading.Thread(target=run) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(made) == 1 and path.read_text().strip() == made[0]
        assert [p.name for p in path.parent.iterdir()] == ["web_api_key"]  # (no temporary file left)
    assert refusals == {"PATH already holds an operator key: nothing was changed (remove the file first to "
                        "replace the key)"}


def test_a_dangling_symlink_or_a_directory_is_named_for_what_it_is(tmp_path):
    """Both were reported as "already holds an operator key"."""
    from ugent_site.operator_key import OperatorKeyError, operator_key_create
    link = tmp_path / "web_api_key"
    link.symlink_to(tmp_path / "secrets" / "key")
    with pytest.raises(OperatorKeyError) as err:
        operator_key_create(path=link)
    assert str(err.value) == (f"the operator key file {link} (UGENT_WEB_API_KEY_FILE) is a symbolic link to "
                              f"{tmp_path / 'secrets' / 'key'}, which does not exist: nothing was changed (remove "
                              f"the link, or make the file it points to)")
    folder = tmp_path / "key_dir"
    folder.mkdir()
    with pytest.raises(OperatorKeyError) as err:
        operator_key_create(path=folder)
    assert str(err.value) == (f"the operator key file {folder} (UGENT_WEB_API_KEY_FILE) is a directory: nothing "
                              f"was changed (name a file, not a directory)")
    assert list(tmp_path.iterdir()) and not (tmp_path / "secrets").exists() and not list(folder.iterdir())
