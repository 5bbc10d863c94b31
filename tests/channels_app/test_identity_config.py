"""[web.auth] in ugent.toml: strict at start, issuers and caller defaults ⇄ rows, keys rotated without a
restart (the environment, the vault, the admin), and the admin showing whose key is whose."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client

from channels_app.models import ApiKey, CallerDefaults, Issuer
from ugent_common import config

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]

ISSUERS_TOML = '''
[web.auth]
require_verified_identity = true

[[web.auth.issuers]]
issuer = "https://idp.example.test"
jwks_url = "https://idp.example.test/.well-known/jwks.json"
audience = "ugent"
actor_prefix = "idp:"
algorithms = ["ES256"]
leeway_secs = 10

[[web.auth.caller_defaults]]
issuer = "https://idp.example.test"
model = "scripted"
disable_memory_write = true
'''


@pytest.fixture
def toml_config(tmp_path, settings):
    settings.UGENT_CONFIG_RECHECK_SECS = 0

    def write(text: str):
        path = tmp_path / "ugent.toml"
        path.write_text(text)
        settings.UGENT_CONFIG = str(path)
        config.reset_caches()
        return path
    yield write
    config.reset_caches()


def chat(key, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


# --- strict at start -------------------------------------------------------------------------

@pytest.mark.parametrize("text, named", [
    ('[web.auth]\nrequire_verifed_identity = true\n', "web.auth.require_verifed_identity: unknown field"),
    ('[[web.auth.issuers]]\nissuer = "a"\njwks_url = "https://a/j"\naudience = "u"\nactor_prefix = "a:"\n'
     'jwks_uri = "https://a/j"\n', "web.auth.issuers[0] (a).jwks_uri: unknown field"),
    ('[[web.auth.keys]]\nname = "crm"\nkey_env = "K"\nissuer = ["x"]\n', "web.auth.keys[0] (crm).issuer: unknown field"),
    ('[[web.auth.issuers]]\nissuer = "a"\njwks_url = "https://a/j"\naudience = "u"\nactor_prefix = "a:"\n'
     'algorithms = ["HS256"]\n', "web.auth.issuers[0] (a).algorithms: 'HS256' is not allowed"),
    ('[[web.auth.issuers]]\nissuer = "a"\njwks_url = "https://a/j"\naudience = "u"\nactor_prefix = "web:"\n',
     "web.auth.issuers[0] (a).actor_prefix: 'web:' would let a token's subject pose as a 'web:' actor"),
    ('[[web.auth.issuers]]\nissuer = "a"\njwks_url = "https://a/j"\naudience = "u"\n',
     "web.auth.issuers[0] (a): missing field `actor_prefix`"),
    ('[[web.auth.caller_defaults]]\nissuer = "a"\ndisable_memory = true\n',
     "web.auth.caller_defaults[0] (a).disable_memory: unknown field"),
])
def test_a_web_auth_the_daemon_does_not_understand_is_an_error_naming_the_key(toml_config, text, named):
    toml_config(text)
    with pytest.raises(config.ConfigError) as info:
        config.web_auth_check()
    assert named in str(info.value)


def test_the_start_up_check_reports_an_ugent_toml_that_does_not_parse_naming_the_file_and_line(toml_config):
    """It passed: the file was read as no file at all, and the daemon ran with no [web.auth] (its issuers,
    keys and require_verified_identity ignored) saying so only in a log line."""
    from django.core import checks
    path = toml_config('[web.auth]\nrequire_verified_identity = true\n[[web.auth.issuers]\nissuer = "a"\n')
    # (servers mode may add ugent.W001, no operator key: not this check's)
    found = [m for m in checks.run_checks(tags=[checks.Tags.security]) if m.id.startswith("ugent.E")]
    assert [(m.id, m.level) for m in found] == [("ugent.E001", checks.ERROR)]
    assert found[0].msg.startswith(f"{path} does not parse: ") and "(at line 3, column " in found[0].msg
    toml_config("[web.auth]\n")  # [web.auth] alone is no issuers, keys or defaults: it passes
    assert [m.id for m in checks.run_checks(tags=[checks.Tags.security]) if m.id.startswith("ugent.E")] == []


@pytest.mark.parametrize("empty", ["", "  \n", "# nothing yet\n"], ids=["nothing", "whitespace", "comments-alone"])
def test_the_start_up_check_refuses_an_empty_ugent_toml_as_it_refuses_one_that_does_not_parse(toml_config, empty):
    """It passed, and the process ran with no [web.auth] (require_verified_identity, issuers, keys all off): a
    file caught half-way through a write, which the running daemon's reload refuses and keeps the last good for."""
    from django.core import checks
    path = toml_config(empty)
    found = [m for m in checks.run_checks(tags=[checks.Tags.security]) if m.id.startswith("ugent.E")]
    assert [(m.id, m.msg) for m in found] == [
        ("ugent.E001", f"{path} is empty (blank or comments alone; `[web.auth]` alone says there are no issuers "
                       "or caller defaults)")]
    assert found[0].hint.startswith("Fix it, or write `[web.auth]` alone (or remove the file) to run with none")


def test_a_process_whose_first_read_finds_ugent_toml_empty_says_so_as_for_one_that_does_not_parse(toml_config, caplog):
    """A process that did not run the start-up check (a Celery worker), or a file emptied since: no [web.auth] to
    keep, so none is used, and the status says why (it said nothing: the empty file was taken as no [web.auth])."""
    caplog.set_level(logging.ERROR, logger="ugent.config")
    path = toml_config("# being written\n")
    assert config.web_auth() == config.WebAuthSpec()
    why = (f"{path} is empty (blank or comments alone; `[web.auth]` alone says there are no issuers or caller "
           "defaults)")
    assert config.web_auth_error() == config.config_held() == why
    assert [r.getMessage() for r in caplog.records if r.name == "ugent.config"] == [f"{why}; none of it is used"]


def test_a_file_emptied_between_the_start_up_check_and_the_first_read_keeps_what_the_check_passed(toml_config,
                                                                                                   caplog):
    """The check read the file and kept nothing of it: emptied (a write caught half-way) before the process's
    first real read, it then ran with no [web.auth] at all (verified identity off) until the file was whole."""
    caplog.set_level(logging.ERROR, logger="ugent.config")
    path = toml_config('[web.auth]\nrequire_verified_identity = true\n')
    config.web_auth_check()  # the daemon starts on it
    path.write_text("")
    os.utime(path, ns=(1, 1))
    assert config.web_auth().require_verified_identity is True
    why = (f"{path} is empty (blank or comments alone; `[web.auth]` alone says there are no issuers or caller "
           "defaults)")
    assert config.config_held() == why
    assert [r.getMessage() for r in caplog.records if r.name == "ugent.config"] == [f"{why}; the last good file is kept"]


def test_a_reload_that_cannot_read_ugent_toml_logs_it_once(toml_config, caplog):
    """_refresh logged the parse failure twice: "could not be read (path=…, error=…)", then the same error again
    with what it did about it."""
    caplog.set_level(logging.ERROR, logger="ugent.config")
    path = toml_config('[web.auth]\nrequire_verified_identity = true\n')
    assert config.web_auth().require_verified_identity is True
    path.write_text('[web.auth]\nrequire_verified_identity = ')
    os.utime(path, ns=(1, 1))
    assert config.web_auth().require_verified_identity is True
    lines = [r.getMessage() for r in caplog.records if r.name == "ugent.config"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path} does not parse: ") and lines[0].endswith("; the last good file is kept")


def test_a_failure_after_a_good_read_is_logged_again_whatever_the_repeat_filter_saw(toml_config):
    """The daemon's log handler lets a line through once per five minutes: a file emptied, fixed, then emptied
    again (an editor's second save) said nothing the second time, though the last good file was another one."""
    from ugent_common import logs
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RepeatFilter())  # as the daemon's console handler has (logs.logging_config)
    logger = logging.getLogger("ugent.config")
    logger.addHandler(handler)
    try:
        path = toml_config("[web.auth]\n")
        config.web_auth()
        for stamp, text in enumerate(["", "[web.auth]\nrequire_verified_identity = true\n", "", "# still empty\n"]):
            path.write_text(text)
            os.utime(path, ns=(stamp + 1, stamp + 1))
            config.web_auth()
    finally:
        logger.removeHandler(handler)
    why = f"{path} is empty (blank or comments alone; `[web.auth]` alone says there are no issuers or caller defaults)"
    assert out.getvalue().splitlines() == [f"{why}; the last good file is kept"] * 2  # not a third: no good read
    assert config.web_auth().require_verified_identity is True


def test_rundaemon_refuses_to_start_on_an_unknown_web_auth_key(tmp_path):
    path = tmp_path / "ugent.toml"
    path.write_text('[web.auth]\napi_key_role = "operator"\nrequire_verified = true\n')
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_CONFIG=str(path), UGENT_VAR_DIR=str(tmp_path / "var"), UGENT_WEB_PORT="0")
    proc = subprocess.run([sys.executable, "manage.py", "rundaemon"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "web.auth.require_verified: unknown field" in proc.stderr
    assert "UGENT daemon" not in proc.stdout  # it never started serving


def test_a_web_process_refuses_to_start_on_an_unknown_web_auth_key(tmp_path):
    path = tmp_path / "ugent.toml"
    path.write_text('[web.auth]\nissuers_list = []\n')
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_CONFIG=str(path), UGENT_VAR_DIR=str(tmp_path / "var"))
    proc = subprocess.run([sys.executable, "-c", "import ugent_site.asgi"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr and "web.auth.issuers_list: unknown field" in proc.stderr


def test_an_edit_that_breaks_web_auth_while_running_keeps_the_last_good_one(tcast, toml_config, caplog):
    path = toml_config('[web.auth]\nrequire_verified_identity = true\n')
    assert config.web_auth().require_verified_identity is True
    path.write_text('[web.auth]\nrequire_verified_identity = false\ntypo = 1\n')
    os.utime(path, ns=(1, 1))  # a different mtime, whatever the clock's resolution
    assert config.web_auth().require_verified_identity is True
    assert "web.auth.typo: unknown field; the last good [web.auth] is kept" in caplog.text


# --- issuers and caller defaults ⇄ rows -----------------------------------------------------

def test_issuers_and_caller_defaults_in_ugent_toml_become_rows_on_the_next_request(tcast, toml_config):
    toml_config(ISSUERS_TOML)
    assert chat(tcast.keys["operator"]).status_code == 200
    issuer = Issuer.objects.get()
    assert (issuer.issuer, issuer.audience, issuer.actor_prefix, issuer.algorithms, issuer.leeway_secs,
            issuer.from_config) == ("https://idp.example.test", "ugent", "idp:", ["ES256"], 10, True)
    d = CallerDefaults.objects.get()
    assert (d.issuer, d.model, d.disable_memory_write, d.disable_memory_recall, d.from_config) == (
        "https://idp.example.test", "scripted", True, False, True)


def test_an_issuer_removed_from_the_file_goes_and_one_made_in_the_admin_stays(tcast, toml_config):
    path = toml_config(ISSUERS_TOML)
    chat(tcast.keys["operator"])
    Issuer.objects.create(issuer="admin-made", jwks_url="https://a.example/j", audience="u", actor_prefix="am:")
    path.write_text("[web.auth]\n")
    os.utime(path, ns=(2, 2))
    chat(tcast.keys["operator"])
    assert list(Issuer.objects.values_list("issuer", flat=True)) == ["admin-made"]
    assert not CallerDefaults.objects.exists()


@pytest.mark.parametrize("fresh_process", [False, True], ids=["same-process", "new-process"])
@pytest.mark.parametrize("broken, why", [("", "is empty"), ("# ugent.toml\n", "is empty"),
                                         ('[[web.auth.issuers]]\nissuer = "https://idp.exa', "does not parse: ")],
                         ids=["empty", "comments-alone", "half-written"])
def test_an_empty_or_unparseable_file_keeps_the_rows_on_the_request_path(tcast, toml_config, broken, why,
                                                                          fresh_process, tmp_path):
    """`identity import` refuses these; the first request after the change deleted every row the file made."""
    import logging
    lines = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ugent.identity").addHandler(handler)
    try:
        _rows_kept(tcast, toml_config, broken, fresh_process)
    finally:
        logging.getLogger("ugent.identity").removeHandler(handler)
    kept = [line for line in lines if "kept as they were" in line]
    assert len(kept) == 1 and kept[0].startswith(
        f"[web.auth] issuers and caller defaults in the database are kept as they were: {tmp_path / 'ugent.toml'} {why}")
    if why == "is empty":
        assert kept[0].endswith(" (blank or comments alone; `[web.auth]` alone says there are no issuers or caller "
                                "defaults)")


def _rows_kept(tcast, toml_config, broken, fresh_process):
    path = toml_config(ISSUERS_TOML)
    chat(tcast.keys["operator"])
    assert Issuer.objects.count() == 1 and CallerDefaults.objects.count() == 1
    path.write_text(broken)
    os.utime(path, ns=(3, 3))
    if fresh_process:  # a process that never saw the good file (a web process started meanwhile)
        config.reset_caches()
    assert chat(tcast.keys["operator"]).status_code == 200
    assert Issuer.objects.count() == 1 and CallerDefaults.objects.count() == 1
    if not fresh_process:
        assert config.web_auth().require_verified_identity is True  # the last good [web.auth], in this process
    path.write_text("[web.auth]\n")  # a deliberate removal still removes
    os.utime(path, ns=(4, 4))
    chat(tcast.keys["operator"])
    assert not Issuer.objects.exists() and not CallerDefaults.objects.exists()


def test_export_into_the_file_the_daemon_reads_writes_it(tcast, toml_config):
    """`manage.py identity export > ugent.toml`: the shell empties the file before the command runs, and the
    command's system check refused the empty file (ugent.E001), so nothing was written and the file stayed
    empty. `identity import` of that file refuses it itself, naming it, and changes no row. Run as manage.py
    runs a command (call_command skips the checks)."""
    from django.core.management import execute_from_command_line
    path = toml_config(ISSUERS_TOML)
    call_command("identity", "import", stdout=io.StringIO())
    with open(path, "w") as out, contextlib.redirect_stdout(out):  # as the shell's `>`, before the command
        execute_from_command_line(["manage.py", "identity", "export"])
    written = config.web_auth_parse(tomllib.loads(path.read_text()))
    original = config.web_auth_parse(tomllib.loads(ISSUERS_TOML))
    assert (written.issuers, written.caller_defaults) == (original.issuers, original.caller_defaults)
    config.web_auth_check()  # the daemon starts on it
    path.write_text("")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        execute_from_command_line(["manage.py", "identity", "import"])
    assert err.getvalue().startswith(f"CommandError: {path}: the file is empty; nothing was changed")
    assert Issuer.objects.count() == 1 and CallerDefaults.objects.count() == 1


def test_export_writes_what_import_reads(tcast, toml_config, tmp_path, capsys):
    path = toml_config(ISSUERS_TOML)
    call_command("identity", "import", str(path))
    assert "Imported 1 issuer(s) and 1 caller default(s)" in capsys.readouterr().out
    call_command("identity", "export")
    exported = capsys.readouterr().out
    again = config.web_auth_parse(tomllib.loads(exported))
    original = config.web_auth_parse(tomllib.loads(ISSUERS_TOML))
    assert again.issuers == original.issuers and again.caller_defaults == original.caller_defaults


def test_an_export_of_no_rows_imports_back_as_none(tcast, toml_config, tmp_path, capsys):
    """It printed nothing, which import refuses as a file caught half-way through a write."""
    call_command("identity", "export")
    exported = capsys.readouterr().out
    assert config.web_auth_parse(tomllib.loads(exported)) == config.web_auth_parse({})
    path = toml_config(ISSUERS_TOML)
    call_command("identity", "import", str(path))
    none = tmp_path / "none.toml"
    none.write_text(exported)
    call_command("identity", "import", str(none))
    assert "Imported 0 issuer(s) and 0 caller default(s)" in capsys.readouterr().out
    assert not Issuer.objects.exists() and not CallerDefaults.objects.exists()


def test_import_of_a_broken_file_changes_nothing(tcast, tmp_path):
    from django.core.management.base import CommandError
    path = tmp_path / "bad.toml"
    path.write_text(ISSUERS_TOML.replace('algorithms = ["ES256"]', 'algorithms = ["none"]'))
    with pytest.raises(CommandError) as info:
        call_command("identity", "import", str(path))
    assert "'none' is not allowed" in str(info.value) and "nothing was changed" in str(info.value)
    assert not Issuer.objects.exists()


@pytest.mark.parametrize("empty", ["", "# identity\n"], ids=["nothing", "comments-alone"])
def test_import_of_an_empty_file_changes_nothing(tcast, tmp_path, empty):
    """A file caught half-way through a write must not remove every issuer the file made."""
    from django.core.management.base import CommandError
    path = tmp_path / "ugent.toml"
    path.write_text(ISSUERS_TOML)
    call_command("identity", "import", str(path))
    path.write_text(empty)
    with pytest.raises(CommandError) as info:
        call_command("identity", "import", str(path))
    assert "the file is empty; nothing was changed" in str(info.value)
    assert Issuer.objects.count() == 1 and CallerDefaults.objects.count() == 1


# --- keys rotated without a restart ----------------------------------------------------------

KEYS_TOML = '[[web.auth.keys]]\nname = "partner"\nkey_env = "{env}"\nrole = "application"\nissuers = ["p"]\n'


def test_a_changed_key_variable_takes_effect_at_once(tcast, toml_config, monkeypatch):
    toml_config(KEYS_TOML.format(env="UGENT_WEB_API_KEY_PARTNER"))
    monkeypatch.setenv("UGENT_WEB_API_KEY_PARTNER", "old-secret")
    assert chat("old-secret").status_code == 200
    monkeypatch.setenv("UGENT_WEB_API_KEY_PARTNER", "new-secret")
    assert chat("new-secret").status_code == 200
    assert chat("old-secret").status_code == 401


def test_a_key_env_edited_in_ugent_toml_takes_effect_without_a_restart(tcast, toml_config, monkeypatch):
    path = toml_config(KEYS_TOML.format(env="K_ONE"))
    monkeypatch.setenv("K_ONE", "one-secret")
    monkeypatch.setenv("K_TWO", "two-secret")
    assert chat("one-secret").status_code == 200
    path.write_text(KEYS_TOML.format(env="K_TWO"))
    os.utime(path, ns=(3, 3))
    assert chat("two-secret").status_code == 200
    assert chat("one-secret").status_code == 401


def test_a_key_env_can_be_filled_from_a_plugins_vault_and_rotated_there(tcast, toml_config, monkeypatch):
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.services import plugin_secret_set
    monkeypatch.setattr(config, "VAULT_CACHE_SECS", 0)
    monkeypatch.delenv("UGENT_WEB_API_KEY_VAULTED", raising=False)
    toml_config(KEYS_TOML.format(env="UGENT_WEB_API_KEY_VAULTED"))
    plugin = Plugin.objects.create(plugin_id="crm-bridge", kind="channel-webhook", command="python")
    assert chat("vaulted-secret").status_code == 401
    plugin_secret_set(plugin=plugin, name="UGENT_WEB_API_KEY_VAULTED", value="vaulted-secret")
    assert chat("vaulted-secret").status_code == 200
    plugin_secret_set(plugin=plugin, name="UGENT_WEB_API_KEY_VAULTED", value="rotated-secret")
    assert chat("rotated-secret").status_code == 200
    assert chat("vaulted-secret").status_code == 401


def test_an_admin_key_deactivated_stops_working_at_once(tcast):
    assert chat(tcast.keys["app"]).status_code == 200
    ApiKey.objects.filter(caller=tcast.app).update(active=False)
    assert chat(tcast.keys["app"]).status_code == 401


# --- the admin --------------------------------------------------------------------------------

@pytest.fixture
def admin_client(tcast):
    from django.contrib.auth.models import User
    User.objects.create_superuser("root", "root@example.test", "pw")
    c = Client()
    c.login(username="root", password="pw")
    return c


def test_the_admin_shows_whose_key_each_is_and_never_the_key(admin_client, tcast, toml_config, monkeypatch):
    toml_config(KEYS_TOML.format(env="UGENT_WEB_API_KEY_PARTNER"))
    monkeypatch.setenv("UGENT_WEB_API_KEY_PARTNER", "partner-raw-secret")
    assert chat("partner-raw-secret").status_code == 200  # the configured caller's row exists now
    callers = admin_client.get("/admin/channels_app/caller/").content.decode()
    assert "UGENT_WEB_API_KEY_PARTNER" in callers and "partner-raw-secret" not in callers
    keys = admin_client.get("/admin/channels_app/apikey/").content.decode()
    assert "crm" in keys and "workspace" in keys
    from tests.conftest import APP_KEY, OPERATOR_KEY
    assert APP_KEY not in keys and OPERATOR_KEY not in keys


def test_the_admin_refuses_an_issuer_with_hmac_or_a_reserved_prefix(admin_client):
    form = {"issuer": "x", "jwks_url": "https://x.example/jwks", "audience": "u", "actor_prefix": "x:",
            "algorithms": '["HS256"]', "leeway_secs": "30"}
    resp = admin_client.post("/admin/channels_app/issuer/add/", form)
    assert resp.status_code == 200 and "&#x27;HS256&#x27; is not allowed" in resp.content.decode()
    resp = admin_client.post("/admin/channels_app/issuer/add/", {**form, "algorithms": '["RS256"]',
                                                                 "actor_prefix": "operator@"})
    assert resp.status_code == 200 and "would let a token" in resp.content.decode()
    assert not Issuer.objects.exists()
    resp = admin_client.post("/admin/channels_app/issuer/add/", {**form, "algorithms": '["RS256"]'})
    assert resp.status_code == 302
    assert Issuer.objects.get().algorithms == ["RS256"]


def test_the_admin_edits_caller_defaults(admin_client):
    resp = admin_client.post("/admin/channels_app/callerdefaults/add/", {
        "issuer": "example-crm", "model": "", "disable_memory_recall": "on"})
    assert resp.status_code == 302
    d = CallerDefaults.objects.get()
    assert d.disable_memory_recall and not d.disable_memory_write and not d.from_config


def test_the_status_shows_the_identity_rules_and_a_refused_edit(tcast, toml_config):
    path = toml_config(ISSUERS_TOML)
    status = lambda: Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]
    section = status()["identity"]
    assert section["require_verified_identity"] is True and section["config_error"] is None
    assert [i["issuer"] for i in section["issuers"]] == ["https://idp.example.test"]
    path.write_text(ISSUERS_TOML + "\n[web.auth.extra]\n")
    os.utime(path, ns=(4, 4))
    section = status()["identity"]
    assert "web.auth.extra: unknown field" in section["config_error"]
    assert section["require_verified_identity"] is True  # the last good file still runs


def test_a_broken_edit_the_rules_watcher_sees_first_keeps_the_last_good_identity_rules(db, toml_config):
    """The rules watcher looks at ugent.toml too. It used to forget every cache when the file changed, so a
    broken edit it saw first ran with no [web.auth] at all: require_verified_identity off."""
    from rules_app.runtime import DjangoRuleEngineHolder
    path = toml_config(ISSUERS_TOML)
    assert config.web_auth().require_verified_identity is True
    holder = DjangoRuleEngineHolder.from_settings()
    try:
        path.write_text(ISSUERS_TOML + "\n[web.auth.extra]\n")
        os.utime(path, ns=(4, 4))
        holder.check_config_once()  # the watcher's look, before any request's
        auth = config.web_auth()
        assert auth.require_verified_identity is True  # the last good file still runs
        assert [i.issuer for i in auth.issuers] == ["https://idp.example.test"]
        assert "web.auth.extra: unknown field" in config.web_auth_error()
    finally:
        holder.stop()


def test_a_file_replaced_with_the_same_size_and_mtime_is_read_again_once_the_watcher_sees_it(db, toml_config,
                                                                                               settings):
    """`cp -p`, `rsync -a`, `install -p` keep the mtime: only the rules watcher's signature (the inode) tells
    the new file apart, and its look must make the next read read it, not keep the old one."""
    from rules_app.runtime import DjangoRuleEngineHolder
    path = toml_config(ISSUERS_TOML)
    settings.UGENT_CONFIG_RECHECK_SECS = 2.0
    assert config.web_auth().issuers[0].audience == "ugent"
    holder = DjangoRuleEngineHolder.from_settings()
    try:
        st = path.stat()
        new = path.with_name("ugent.toml.new")
        new.write_text(ISSUERS_TOML.replace('audience = "ugent"', 'audience = "other"'))
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(new, path)  # a new inode, the same size and mtime
        holder.check_config_once()
        assert config.web_auth().issuers[0].audience == "other"
    finally:
        holder.stop()
