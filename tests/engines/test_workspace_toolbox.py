"""The workspace toolbox (plugins_app/agent/tools/workspace.py): list, read and search, read-only and
confined to its roots: no absolute paths, no '..', no symlink out, on a real directory tree."""
from __future__ import annotations

import os

import pytest

from plugins_app.agent.tools.workspace import (REFUSED_ABSOLUTE, REFUSED_OUTSIDE, REFUSED_PARENT, ListArgs,
                                               ReadArgs, SearchArgs, WorkspaceRefusal, WorkspaceToolBox)

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode


@pytest.fixture
def tree(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "docs").mkdir(parents=True)
    outside.mkdir()
    (ws / "docs" / "ports.md").write_text("The daemon listens on port 8787.\n")
    (ws / "readme.txt").write_text("hello workspace\n")
    (outside / "secret.txt").write_text("port 8787 secret outside\n")
    os.symlink(outside, ws / "link-out")                       # a folder link out
    os.symlink(outside / "secret.txt", ws / "docs" / "s.txt")  # a file link out
    os.symlink(ws / "readme.txt", ws / "docs" / "inside.txt")  # a link that stays inside
    return ws, outside


def box(ws, **roots):
    return WorkspaceToolBox({"roots": {"workspace": str(ws), **roots}})


def test_reading_listing_and_searching_inside_the_workspace(tree):
    ws, _ = tree
    b = box(ws)
    assert b.read_file(ReadArgs(path="docs/ports.md")).content.startswith("The daemon listens")
    assert b.read_file(ReadArgs(path="docs/inside.txt")).content == "hello workspace\n"
    names = {e["name"] for e in b.list_files(ListArgs(path="docs")).entries}
    assert names == {"ports.md", "inside.txt"}  # the link out is not shown
    assert "link-out" not in {e["name"] for e in b.list_files(ListArgs()).entries}
    matches = b.search_files(SearchArgs(query="8787")).matches
    assert [m["path"] for m in matches] == ["docs/ports.md"]  # the linked secret outside is not searched


@pytest.mark.parametrize("path,why", [
    ("/etc/passwd", REFUSED_ABSOLUTE), ("~/.ssh/id_rsa", REFUSED_ABSOLUTE), ("../outside/secret.txt", REFUSED_PARENT),
    ("docs/../../outside/secret.txt", REFUSED_PARENT), ("docs/s.txt", REFUSED_OUTSIDE),
    ("link-out/secret.txt", REFUSED_OUTSIDE)])
def test_every_way_out_is_refused(tree, path, why):
    ws, _ = tree
    with pytest.raises(WorkspaceRefusal) as err:
        box(ws).read_file(ReadArgs(path=path))
    assert str(err.value) == why
    with pytest.raises(WorkspaceRefusal):
        box(ws).list_files(ListArgs(path=path))


def test_the_conversation_root_is_confined_too(tree):
    ws, _ = tree
    b = box(ws, conversation=str(ws / "docs"))
    assert b.read_file(ReadArgs(path="ports.md", root="conversation")).path == "ports.md"
    with pytest.raises(WorkspaceRefusal):
        b.read_file(ReadArgs(path="../readme.txt", root="conversation"))
    with pytest.raises(WorkspaceRefusal, match="unknown root"):
        b.read_file(ReadArgs(path="x", root="elsewhere"))
