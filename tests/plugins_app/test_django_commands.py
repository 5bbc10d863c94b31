"""plugins import/export/status/setup/migrate, the setup wizard on a terminal, and startplugin."""
from __future__ import annotations

import os
import subprocess
import textwrap
import tomllib
from io import StringIO
from pathlib import Path

import pexpect
import yaml
import pytest
from django.core.management import CommandError, call_command

from plugins_app.channel.models import Plugin, PluginSecret
from plugins_app.channel.secrets import secret_decrypt
from tests.plugins_app.conftest import PY, database_url, make_plugin

REPO = Path(__file__).resolve().parents[2]

SEED_EXAMPLE = textwrap.dedent("""
    schema_version = 1

    [[plugins]]
    id = "telegram-main"
    kind = "channel-telegram"
    enabled = true
    command = "./target/release/channel-telegram-worker"
    args = ["--mode", "polling"]
    env_refs = ["TELEGRAM_BOT_TOKEN"]

    [plugins.limits]
    max_in_flight = 64
    max_retries = 5
    heartbeat_secs = 30

    [plugins.routing]
    workspace = "/path/to/workspace"
    allowed_senders = ["telegram:123456789"]
""")


def cmd(*args) -> str:
    out = StringIO()
    call_command("plugins", *args, stdout=out)
    return out.getvalue()


def test_the_seeds_plugins_toml_imports_and_exports_back(db, tmp_path):
    path = tmp_path / "plugins.toml"
    path.write_text(SEED_EXAMPLE)
    assert "1 created" in cmd("import", str(path))
    p = Plugin.objects.get()
    assert (p.plugin_id, p.kind, p.channel, p.command, p.args, p.env_refs) == (
        "telegram-main", "channel-telegram", "telegram", "./target/release/channel-telegram-worker",
        ["--mode", "polling"], ["TELEGRAM_BOT_TOKEN"])
    assert (p.max_in_flight, p.max_retries, p.heartbeat_secs) == (64, 5, 30)
    assert (p.workspace, p.allowed_senders) == ("/path/to/workspace", ["telegram:123456789"])
    assert tomllib.loads(cmd("export")) == tomllib.loads(SEED_EXAMPLE)
    assert "1 updated" in cmd("import", str(path))
    assert "telegram-main" in cmd("status")


@pytest.mark.parametrize("change, message", [
    (("schema_version = 1", "schema_version = 2"), "unknown schema_version 2"),
    (("max_in_flight = 64", "max_in_flight = 0"),
     "plugins[0] (telegram-main).limits.max_in_flight: must be a positive integer"),
    (('kind = "channel-telegram"', 'kind = "telegram"'), "plugins[0] (telegram-main).kind:"),
    (('env_refs = ["TELEGRAM_BOT_TOKEN"]', 'env_refs = "TELEGRAM_BOT_TOKEN"'),
     "plugins[0] (telegram-main).env_refs: expected an array of strings, found string"),
    (('allowed_senders = ["telegram:123456789"]', 'allowed_senders = ["123456789"]'),
     "plugins[0] (telegram-main).routing.allowed_senders: '123456789' is not channel:sender_id"),
    (("enabled = true", "enabled = true\ncolour = 1"), "plugins[0] (telegram-main).colour: unknown field"),
    (("heartbeat_secs = 30", "heartbeat_secs = 30\nmemory_max_mb = -1"),
     "plugins[0] (telegram-main).limits.memory_max_mb: must be a whole number of MiB from 0 (no cap) to 2147483647"),
    (("heartbeat_secs = 30", 'heartbeat_secs = 30\nmemory_max_mb = "512"'),
     "plugins[0] (telegram-main).limits.memory_max_mb: expected an integer, found string"),
])
def test_a_bad_file_is_a_clear_error_naming_the_plugin_and_field_and_changes_nothing(db, tmp_path, change,
                                                                                        message):
    make_plugin("telegram-main", kind="channel-telegram", max_in_flight=3)
    path = tmp_path / "plugins.toml"
    path.write_text(SEED_EXAMPLE.replace(*change))
    with pytest.raises(CommandError) as err:
        cmd("import", str(path))
    assert message in str(err.value)
    assert Plugin.objects.get().max_in_flight == 3


def test_a_plugins_memory_cap_imports_and_exports_back_and_leaving_it_out_means_the_default(db, tmp_path):
    path = tmp_path / "plugins.toml"
    capped = SEED_EXAMPLE.replace("heartbeat_secs = 30", "heartbeat_secs = 30\nmemory_max_mb = 512")
    path.write_text(capped)
    cmd("import", str(path))
    assert Plugin.objects.get().memory_max_mb == 512
    assert tomllib.loads(cmd("export")) == tomllib.loads(capped)
    path.write_text(SEED_EXAMPLE)  # no memory_max_mb: UGENT_PLUGIN_MEMORY_MAX_MB again
    cmd("import", str(path))
    assert Plugin.objects.get().memory_max_mb is None
    assert tomllib.loads(cmd("export")) == tomllib.loads(SEED_EXAMPLE)


def test_setup_no_input_writes_rows_and_the_workspace_file_from_the_global_file(db, tmp_path, monkeypatch):
    global_file = tmp_path / "home" / "plugins.toml"
    global_file.parent.mkdir()
    global_file.write_text(SEED_EXAMPLE.replace('env_refs = ["TELEGRAM_BOT_TOKEN"]',
                                                'env_refs = ["TELEGRAM_BOT_TOKEN"]\n'
                                                'secret_env_refs = ["TELEGRAM_WEBHOOK_SECRET"]')
                           + SEED_EXAMPLE.split("\n", 2)[2].replace("telegram-main", "telegram-second")
                           .replace("TELEGRAM_BOT_TOKEN", "TELEGRAM_SECOND_TOKEN"))
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "t0k")
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "s3cret")
    monkeypatch.delenv("TELEGRAM_SECOND_TOKEN", raising=False)
    out = cmd("setup", "--no-input", "--global-file", str(global_file), "--workspace", str(tmp_path / "ws"))
    assert "telegram-second: disabled, environment not set: TELEGRAM_SECOND_TOKEN" in out
    main, second = Plugin.objects.order_by("plugin_id")
    assert main.enabled and not second.enabled
    assert second.disabled_reason == "environment not set: TELEGRAM_SECOND_TOKEN"
    secret = PluginSecret.objects.get(plugin=main, name="TELEGRAM_WEBHOOK_SECRET")
    assert "s3cret" not in secret.ciphertext and secret_decrypt(secret.ciphertext) == "s3cret"
    written = tomllib.loads((tmp_path / "ws" / "plugins.toml").read_text())
    assert [p["id"] for p in written["plugins"]] == ["telegram-main", "telegram-second"]
    assert "s3cret" not in (tmp_path / "ws" / "plugins.toml").read_text()


def test_setup_no_input_without_a_global_file_says_where_it_looked(db, tmp_path):
    with pytest.raises(CommandError, match="No global plugins file at"):
        cmd("setup", "--no-input", "--global-file", str(tmp_path / "none.toml"))


def test_migrate_regenerates_the_rows_from_the_global_file(db, tmp_path, monkeypatch):
    make_plugin("old-one")
    make_plugin("telegram-main", kind="channel-telegram", max_in_flight=3)
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "t0k")
    global_file = tmp_path / "plugins.toml"
    global_file.write_text(SEED_EXAMPLE)
    cmd("migrate", "--global-file", str(global_file), "--workspace", str(tmp_path / "ws"))
    old, tg = Plugin.objects.order_by("plugin_id")
    assert not old.enabled and tg.enabled and tg.max_in_flight == 64


def test_the_global_file_follows_ugent_home_as_the_rules_files_do_unless_it_is_named(db, tmp_path, settings,
                                                                                     monkeypatch):
    """UGENT_HOME moved ~/.ugent/rules.toml and routing.toml but left plugins.toml in the user's home."""
    from rules_app import conf as rules_conf
    from rules_app.discovery import candidate_paths
    settings.UGENT_HOME, settings.UGENT_GLOBAL_PLUGINS_TOML = str(tmp_path / "home"), ""
    global_file = tmp_path / "home" / ".ugent" / "plugins.toml"
    global_file.parent.mkdir(parents=True)
    global_file.write_text(SEED_EXAMPLE)
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "t0k")
    assert f"Regenerated the plugins from {global_file}\n" in cmd("migrate", "--workspace", str(tmp_path / "ws"))
    assert Plugin.objects.get().plugin_id == "telegram-main"
    assert candidate_paths(tmp_path / "ws", rules_conf.home(), "rules.toml")[-1].parent == global_file.parent
    settings.UGENT_GLOBAL_PLUGINS_TOML = str(tmp_path / "named.toml")  # the setting, when given, still wins
    with pytest.raises(CommandError, match=f"No global plugins file at {tmp_path / 'named.toml'}:"):
        cmd("setup", "--no-input")


def test_the_setup_wizard_on_a_terminal(transactional_db, tmp_path):
    env = dict(os.environ, DATABASE_URL=database_url(), ECHO_INBOX="/tmp/in.jsonl")
    env.pop("ECHO_SENT", None)
    child = pexpect.spawn(PY, ["manage.py", "plugins", "--skip-checks", "setup", "--workspace", str(tmp_path)],
                          cwd=str(REPO), env=env, encoding="utf-8", timeout=30)
    try:
        child.expect("Channel kinds installed:")
        child.expect("channel-echo")
        # the other built-in kinds are declined, wherever they sort
        while child.expect([r"Enable channel-echo\? \(y/N\)", r"Enable channel-[\w-]+\? \(y/N\)"]) == 1:
            child.sendline("n")
        child.sendline("y")
        child.expect(r"Plugin id \[echo-main\]")
        child.sendline("echo-test")
        child.expect(r"Environment variables it needs \(comma-separated\) \[ECHO_INBOX,ECHO_SENT\]")
        child.sendline("")
        child.expect("ECHO_INBOX: set")
        child.expect("ECHO_SENT: NOT SET")
        child.expect("Allowed senders")
        child.sendline("echo:42, echo:43")
        # the other built-in kinds (channel-telegram, …) are offered after it: this run declines them
        while child.expect([r"Enable channel-[\w-]+\? \(y/N\)", r"Wrote 1 plugin\(s\) \(0 enabled\)"]) == 0:
            child.sendline("")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    p = Plugin.objects.get()
    # A built-in kind is written with no command: the supervisor knows how to start its own worker.
    assert (p.plugin_id, p.kind, p.command, p.args) == ("echo-test", "channel-echo", "", [])
    assert p.allowed_senders == ["echo:42", "echo:43"] and p.env_refs == ["ECHO_INBOX", "ECHO_SENT"]
    assert (p.enabled, p.disabled_reason) == (False, "environment not set: ECHO_SENT")
    assert tomllib.loads((tmp_path / "plugins.toml").read_text())["plugins"][0]["id"] == "echo-test"


def test_setup_without_a_terminal_asks_for_no_input(db):
    with pytest.raises(CommandError, match="--no-input"):
        cmd("setup")


def test_startplugin_generates_a_skeleton_whose_own_test_passes(db, tmp_path):
    target = tmp_path / "matrix"
    call_command("startplugin", "matrix", "--directory", str(target), stdout=StringIO())
    assert {p.name for p in target.iterdir()} == {"matrix_worker.py", "test_matrix_worker.py", "plugins.toml",
                                                  "README.md", ".github"}
    workflow = yaml.safe_load((target / ".github/workflows/ci.yml").read_text())
    steps = [step.get("run", "") for step in workflow["jobs"]["test"]["steps"]]
    assert "ruff format --check ." in steps and "ruff check ." in steps and "pytest -q" in steps
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_"))}
    run = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:django", "-p", "no:cacheprovider",
                          "--rootdir", str(target), str(target)], cwd=str(target), env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    # the round trip, and the crash-recovery outbox under kill -9 (nothing lost, nothing doubled)
    assert "2 passed" in run.stdout
    cmd("import", str(target / "plugins.toml"))
    assert Plugin.objects.get().kind == "channel-matrix"
    with pytest.raises(CommandError, match="not empty"):
        call_command("startplugin", "matrix", "--directory", str(target), stdout=StringIO())
