"""An empty TOML file (blank, whitespace or comments alone) is refused wherever rows follow a file, in one
wording, from one home (ugent_common.config.toml_refuse_empty). Each path's own tests check the rows kept:
tests/cron_app/test_cron_command.py, test_cron_file_watch.py, tests/rules_app/test_django_commands.py,
tests/channels_app/test_identity_config.py, tests/rules_app/test_django_routing.py (routing.toml's reload)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from ugent_common import config

ROOT = Path(__file__).resolve().parents[2]
EMPTIES = ["", "  \n\t\n", "# nothing yet\n"]
REFUSAL = re.compile(r"^(?P<source>.+): the file is empty; nothing was changed "
                     r"\(to (?P<remove>[^,()]+), import a file that says `(?P<says>[^`]+)` alone\)$")


@pytest.mark.django_db
@pytest.mark.parametrize("empty", EMPTIES, ids=["nothing", "whitespace", "comments-alone"])
@pytest.mark.parametrize("command, says", [(["cron", "import"], "enabled = true"),
                                           (["rules", "import"], "rules = []"),
                                           (["identity", "import"], "[web.auth]")])
def test_every_import_refuses_an_empty_file_in_one_wording(tmp_path, command, says, empty):
    path = tmp_path / "empty.toml"
    path.write_text(empty)
    with pytest.raises(CommandError) as info:
        call_command(*command, str(path))
    found = REFUSAL.match(str(info.value))
    assert found, str(info.value)
    assert found["source"] == str(path) and found["says"] == says


@pytest.mark.parametrize("empty", EMPTIES, ids=["nothing", "whitespace", "comments-alone"])
def test_ugent_toml_is_read_in_one_place_which_names_the_file_and_says_why_it_cannot_stand(tmp_path, empty):
    """The start-up check (ugent.E001) and the running process's reread (which keeps the last good file) read it
    through config._read_why, in the same words: the process's said "ugent.toml", the check the path."""
    path = tmp_path / "ugent.toml"
    path.write_text(empty)
    assert config._read_why(path) == (
        {}, f"{path} is empty (blank or comments alone; `[web.auth]` alone says there are no issuers or caller "
            "defaults)")
    path.write_text("[web")
    data, why = config._read_why(path)
    assert data == {} and why.startswith(f"{path} does not parse: ")
    path.write_text("[web.auth]\n")
    assert config._read_why(path) == ({"web": {"auth": {}}}, "")
    assert config._read_why(tmp_path / "none.toml") == ({}, "")


def test_the_rule_has_one_home():
    """No path that imports a file tests for emptiness in words of its own."""
    homes = [p.relative_to(ROOT).as_posix() for d in ("cron_app", "rules_app", "channels_app", "ugent_common")
             for p in (ROOT / d).rglob("*.py") if "the file is empty" in p.read_text(encoding="utf-8")]
    assert homes == ["ugent_common/config.py"]
    assert "startswith(\"ugent.toml is empty" not in (ROOT / "ugent_common/config.py").read_text()
