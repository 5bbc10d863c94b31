"""UGENT_HOME (ugent_common.config.ugent_home): the directory whose .ugent/ holds the operator's own rules.toml,
routing.toml and plugins.toml. A `~` in it is the user's home, as a shell would make it: an env file or a unit
that sets UGENT_HOME=~/ugent gets no shell to expand it, and a literal `~` directory under the process's working
directory would be searched instead."""
from __future__ import annotations

from pathlib import Path

from ugent_common.config import ugent_home


def test_a_tilde_in_ugent_home_is_the_users_home(settings, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    settings.UGENT_HOME = "~/ugent"
    assert ugent_home() == tmp_path / "ugent"
    settings.UGENT_HOME = "~"
    assert ugent_home() == tmp_path
    settings.UGENT_HOME = ""  # unset: the user's home
    assert ugent_home() == Path.home() == tmp_path


def test_every_file_under_ugent_home_follows_the_expanded_path(settings, tmp_path, monkeypatch):
    from plugins_app.channel.conf import global_plugins_toml
    from rules_app import conf as rules_conf
    from rules_app.discovery import candidate_paths
    monkeypatch.setenv("HOME", str(tmp_path))
    settings.UGENT_HOME, settings.UGENT_GLOBAL_PLUGINS_TOML = "~/ugent", ""
    mine = tmp_path / "ugent" / ".ugent"
    assert global_plugins_toml() == mine / "plugins.toml"
    for name in ("rules.toml", "routing.toml"):
        assert candidate_paths(tmp_path / "ws", rules_conf.home(), name)[-1] == mine / name
