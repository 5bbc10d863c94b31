"""A kind UGENT ships needs no `command` in plugins.toml: the supervisor runs its own worker."""
import sys

import pytest

from plugins_app.channel import selectors, tomlio
from plugins_app.channel.models import Plugin

pytestmark = pytest.mark.django_db

ECHO_ONLY = '''schema_version = 1
[[plugins]]
id = "echo-main"
kind = "channel-echo"
args = ["--flag", "x"]
env_refs = ["ECHO_INBOX"]
'''


def test_a_builtin_kind_with_env_refs_is_a_complete_entry():
    tomlio.plugins_import(text=ECHO_ONLY)
    plugin = Plugin.objects.get(plugin_id="echo-main")
    assert plugin.command == ""
    assert selectors.plugin_argv(plugin) == (sys.executable, ["-m", "plugins_app.channel.workers.echo",
                                                              "--flag", "x"])


def test_an_unknown_kind_without_a_command_is_refused_and_nothing_is_written():
    text = ECHO_ONLY.replace("channel-echo", "channel-nowhere")
    with pytest.raises(tomlio.PluginsFileError) as err:
        tomlio.plugins_import(text=text)
    assert str(err.value) == ("plugins.toml: plugins[0] (echo-main).command: must be set: 'channel-nowhere' "
                              "is not a kind UGENT ships or an installed package registers")
    assert not Plugin.objects.exists()


def test_an_explicit_command_still_wins_and_python_means_the_daemons_interpreter():
    tomlio.plugins_import(text=ECHO_ONLY.replace('args = ["--flag", "x"]',
                                                 'command = "python"\nargs = ["-m", "my.worker"]'))
    plugin = Plugin.objects.get()
    assert selectors.plugin_argv(plugin) == (sys.executable, ["-m", "my.worker"])


def test_a_plugin_whose_kind_is_gone_is_not_started():
    plugin = Plugin.objects.create(plugin_id="ghost", kind="channel-gone", command="")
    assert selectors.plugin_argv(plugin) is None


def test_the_export_of_a_builtin_entry_has_no_command_and_reimports_the_same():
    tomlio.plugins_import(text=ECHO_ONLY)
    text = tomlio.plugins_export()
    assert "command" not in text
    before = Plugin.objects.values().get()
    tomlio.plugins_import(text=text)
    after = Plugin.objects.values().get()
    assert {k: v for k, v in before.items() if k != "updated_at"} == {k: v for k, v in after.items()
                                                                    if k != "updated_at"}


def _install(site, name: str, module: str) -> None:
    """What pip leaves for a package that declares a channel worker: a dist-info with its entry point."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    _install_entry_points(info, name, module)


def _install_entry_points(info, name: str, module: str) -> None:
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[ugent.channel_workers]\nchannel-{name} = {module}\n")


def test_the_installed_kinds_are_read_once_and_again_when_a_package_comes_or_goes(tmp_path, monkeypatch):
    import shutil

    from plugins_app.channel import workers
    reads = []
    real = workers.entry_points

    def counted(**kw):
        reads.append(kw)
        return real(**kw)
    monkeypatch.setattr(workers, "entry_points", counted)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    first = workers.kind_modules()
    assert "channel-foo" not in first and first["channel-telegram"] == "plugins_app.channel.workers.telegram"
    for _ in range(5):  # the supervisor's steps: nothing installed since, nothing read
        assert workers.kind_module("channel-telegram") == "plugins_app.channel.workers.telegram"
    assert len(reads) == 1
    _install(site, "foo", "foo_plugin.worker")
    assert workers.kind_module("channel-foo") == "foo_plugin.worker"
    assert len(reads) == 2
    shutil.rmtree(site / "foo-1.0.dist-info")
    assert workers.kind_module("channel-foo") is None
    workers.kind_modules()["channel-bar"] = "changed by a caller"  # a copy: what is kept stays
    assert "channel-bar" not in workers.kind_modules()
    # entry points written into a metadata directory already there change no directory on the path: read
    # again once the answer is old
    (site / "late-1.0.dist-info").mkdir()
    workers.kind_modules()
    reads.clear()
    _install_entry_points(site / "late-1.0.dist-info", "late", "late_plugin.worker")
    assert workers.kind_module("channel-late") is None and reads == []
    monkeypatch.setattr(workers, "_FOUND_MAX_AGE_SECS", 0.0)
    assert workers.kind_module("channel-late") == "late_plugin.worker"
