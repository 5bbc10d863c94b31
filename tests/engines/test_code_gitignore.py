"""The code-context walk (plugins_app/agent/engines/code.py's folder_files) sees what git sees: the
root's and every nested .gitignore, and .git/info/exclude, with git's precedence; an ignored folder is
not walked; an edited .gitignore changes the index at the next refresh; a bad ignore file never
breaks the walk."""
from __future__ import annotations

import logging
import os

import pytest

from plugins_app.agent.engines.code import CodeRetrievalEngine, folder_files

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode


def listing(ws) -> set:
    return set(folder_files(ws, max_file_bytes=256 * 1024, max_files=5000))


def engine(ws) -> CodeRetrievalEngine:
    return CodeRetrievalEngine({"root": str(ws), "rescan_interval": 0})


def found_paths(e: CodeRetrievalEngine, query: str) -> set:
    return {h.chunk.path for h in e.query_chunks(query, k=20)}


def write(ws, relative: str, text: str) -> None:
    path = ws / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_ignored_files_and_folders_are_neither_listed_nor_found(tmp_path):
    write(tmp_path, ".gitignore", "# build output\n*.log\ngenerated/\ndumps/**/*.sql\n")
    write(tmp_path, "app.py", "def handle_zebra_request():\n    return 1\n")
    write(tmp_path, "server.log", "zebra request failed at 12:00\n")
    write(tmp_path, "generated/schema.py", "def zebra_schema():\n    return 2\n")
    write(tmp_path, "dumps/2024/users.sql", "INSERT INTO zebra VALUES (1);\n")
    write(tmp_path, "dumps/readme.txt", "zebra dumps go here\n")
    assert listing(tmp_path) == {"app.py", "dumps/readme.txt"}
    assert found_paths(engine(tmp_path), "zebra") == {"app.py", "dumps/readme.txt"}


def test_a_negated_pattern_brings_a_file_back(tmp_path):
    write(tmp_path, ".gitignore", "*.log\n!keep.log\n")
    write(tmp_path, "keep.log", "quokka kept\n")
    write(tmp_path, "drop.log", "quokka dropped\n")
    assert listing(tmp_path) == {"keep.log"}
    assert found_paths(engine(tmp_path), "quokka") == {"keep.log"}


def test_a_nested_gitignore_applies_only_below_its_folder_and_overrides_its_parent(tmp_path):
    write(tmp_path, ".gitignore", "*.tmp\n")
    write(tmp_path, "web/.gitignore", "*.js\n!vendored.tmp\n")
    write(tmp_path, "web/app.js", "a\n")
    write(tmp_path, "web/vendored.tmp", "b\n")
    write(tmp_path, "web/scratch.tmp", "c\n")
    write(tmp_path, "web/lib/deep.js", "d\n")       # below web/: its rules reach here too
    write(tmp_path, "tools/build.js", "e\n")        # beside web/: they do not
    write(tmp_path, "tools/scratch.tmp", "f\n")
    assert listing(tmp_path) == {"web/vendored.tmp", "tools/build.js"}


def test_git_info_exclude_is_honoured_below_the_gitignore_files(tmp_path):
    write(tmp_path, ".git/info/exclude", "local-notes/\n*.secret.py\n")
    write(tmp_path, ".gitignore", "!allowed.secret.py\n")  # a .gitignore outranks info/exclude, as in git
    write(tmp_path, "local-notes/todo.py", "x = 1\n")
    write(tmp_path, "keys.secret.py", "KEY = 'k'\n")
    write(tmp_path, "allowed.secret.py", "KEY = 'public'\n")
    write(tmp_path, "main.py", "y = 2\n")
    assert listing(tmp_path) == {"allowed.secret.py", "main.py"}


def test_a_directory_only_pattern_ignores_folders_of_that_name_not_files(tmp_path):
    write(tmp_path, ".gitignore", "cache/\n")
    write(tmp_path, "cache/blob.py", "a\n")
    write(tmp_path, "pkg/cache/blob.py", "b\n")
    write(tmp_path, "docs/cache", "a file named cache\n")
    assert listing(tmp_path) == {"docs/cache"}


def test_an_anchored_pattern_ignores_only_at_its_own_folder(tmp_path):
    write(tmp_path, ".gitignore", "/config.py\n")
    write(tmp_path, "pkg/.gitignore", "/local/\n")
    write(tmp_path, "config.py", "a\n")
    write(tmp_path, "pkg/config.py", "b\n")
    write(tmp_path, "pkg/local/x.py", "c\n")
    write(tmp_path, "pkg/sub/local/y.py", "d\n")
    assert listing(tmp_path) == {"pkg/config.py", "pkg/sub/local/y.py"}


def test_an_ignored_folder_is_never_walked(tmp_path, monkeypatch):
    write(tmp_path, ".gitignore", "big_data/\n")
    write(tmp_path, "main.py", "a\n")
    for i in range(3):
        write(tmp_path, f"big_data/part{i}/rows.py", "b\n")
    scanned = []
    real_scandir = os.scandir

    def recording_scandir(path="."):
        scanned.append(os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)  # os.walk lists each folder it walks with it
    assert listing(tmp_path) == {"main.py"}
    assert scanned and not [p for p in scanned if "big_data" in p]


def test_editing_the_gitignore_changes_the_results_at_the_next_refresh_both_ways(tmp_path):
    write(tmp_path, "report.py", "def render_walrus_report():\n    return 1\n")
    write(tmp_path, "notes.py", "def walrus_notes():\n    return 2\n")
    e = engine(tmp_path)
    assert found_paths(e, "walrus") == {"report.py", "notes.py"}
    write(tmp_path, ".gitignore", "report.py\n")
    e.refresh()
    assert found_paths(e, "walrus") == {"notes.py"}
    write(tmp_path, ".gitignore", "report.py\n!report.py\n")
    e.refresh()
    assert found_paths(e, "walrus") == {"report.py", "notes.py"}


def test_a_malformed_gitignore_does_not_crash_and_keeps_its_good_lines(tmp_path, caplog):
    (tmp_path / ".gitignore").write_bytes(b"\xef\xbb\xbf*.log\n!\n\\\n[z-a]\n\xff\xfe\x00junk\nout/\n")
    write(tmp_path, "app.py", "a\n")
    write(tmp_path, "run.log", "b\n")
    write(tmp_path, "out/x.py", "c\n")
    with caplog.at_level(logging.WARNING, logger="ugent.code_context"):
        assert listing(tmp_path) == {"app.py"}
    bad = [r for r in caplog.records if r.levelno == logging.WARNING and ".gitignore:" in r.getMessage()]
    assert {r.getMessage().split(":")[1] for r in bad} >= {"2", "3", "4"}  # the lines, named


def test_an_unreadable_ignore_file_is_skipped_with_a_warning(tmp_path, caplog):
    write(tmp_path, "rules.txt", "app.py\n")
    os.symlink(tmp_path / "rules.txt", tmp_path / ".gitignore")   # git does not follow it either
    (tmp_path / ".git" / "info" / "exclude").mkdir(parents=True)  # a folder where a file should be
    write(tmp_path, "lib/.gitignore", "*.tmp\n")
    write(tmp_path, "app.py", "a\n")
    write(tmp_path, "lib/x.tmp", "b\n")
    with caplog.at_level(logging.WARNING, logger="ugent.code_context"):
        assert listing(tmp_path) == {"app.py", "rules.txt"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith(f"{tmp_path / '.gitignore'}: cannot be read") for m in warned)
    assert any(m.startswith(f"{tmp_path / '.git' / 'info' / 'exclude'}: cannot be read") for m in warned)
