"""Each built-in channel worker's page (docs/channels/<channel>.md) names every argument its parser takes."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from plugins_app.channel.workers import BUILTIN

pytestmark = pytest.mark.mode_free  # no database, Redis, Django or run mode: the channel worker SDK and workers

DOCS = Path(__file__).resolve().parents[2] / "docs" / "channels"


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser | None:
    """The parser the worker's parse_args builds (caught as it parses)."""
    for name in (module, module + ".worker"):
        try:
            parse_args = importlib.import_module(name).parse_args
        except (ImportError, AttributeError):
            continue
        caught = []

        def catch(self, *args, **kwargs):
            caught.append(self)
            raise SystemExit(0)
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(SystemExit):
            parse_args([])
        monkeypatch.undo()
        return caught[0]
    return None


@pytest.mark.parametrize("kind", [k for k in BUILTIN if (DOCS / f"{k.removeprefix('channel-')}.md").exists()])
def test_the_channel_page_names_every_argument(kind, monkeypatch):
    parser = parser_of(BUILTIN[kind], monkeypatch)
    if parser is None:
        pytest.skip(f"{kind} has no parse_args")
    page = (DOCS / f"{kind.removeprefix('channel-')}.md").read_text()
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert options and [o for o in options if f"`{o}" not in page] == []
