"""The workspace files toolbox: list, read and search files, read-only, confined to its roots.

A path is always relative to a root. An absolute path, a ``..`` component, or a path whose real
location (symlinks followed) leaves its root is refused with a ``WorkspaceRefusal`` naming why;
nothing outside a root is listed, read or searched. No Django here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from ovos_plugin_manager.templates.agent_tools import AgentTool, ToolArguments, ToolBox, ToolOutput
from pydantic import Field

MAX_READ_BYTES = 256 * 1024
MAX_LIST = 500
MAX_MATCHES = 200
MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024

REFUSED_ABSOLUTE = "absolute paths are refused: give a path relative to the workspace"
REFUSED_PARENT = "'..' is refused: the workspace's files only"
REFUSED_OUTSIDE = "that path leads outside the workspace"
NOT_FOUND = "no such file or folder in the workspace"


class WorkspaceRefusal(ValueError):
    """A path the toolbox will not touch."""


class ListArgs(ToolArguments):
    path: str = Field(default=".", description="A folder, relative to the workspace root.")
    root: Optional[str] = Field(default=None, description="Which root: 'workspace' or 'conversation'.")


class ListOutput(ToolOutput):
    root: str
    path: str
    entries: List[dict]
    truncated: bool = False


class ReadArgs(ToolArguments):
    path: str = Field(description="A file, relative to the workspace root.")
    root: Optional[str] = None
    max_bytes: int = Field(default=64 * 1024, ge=1, le=MAX_READ_BYTES)


class ReadOutput(ToolOutput):
    root: str
    path: str
    content: str
    bytes: int
    truncated: bool = False


class SearchArgs(ToolArguments):
    query: str = Field(min_length=1, description="Text to find (case-insensitive).")
    path: str = Field(default=".", description="A folder to search under, relative to the root.")
    root: Optional[str] = None


class SearchOutput(ToolOutput):
    root: str
    matches: List[dict]
    truncated: bool = False


def confine(root: Path, relative: str) -> Path:
    """``relative`` under ``root``, its real path inside root's real path; WorkspaceRefusal otherwise."""
    text = (relative or ".").strip()
    if os.path.isabs(text) or text.startswith("~"):
        raise WorkspaceRefusal(REFUSED_ABSOLUTE)
    parts = Path(text).parts
    if ".." in parts:
        raise WorkspaceRefusal(REFUSED_PARENT)
    real_root = root.resolve()
    target = (real_root / text).resolve()
    if target != real_root and real_root not in target.parents:
        raise WorkspaceRefusal(REFUSED_OUTSIDE)
    return target


class WorkspaceToolBox(ToolBox):
    """``workspace_list``, ``workspace_read``, ``workspace_search`` over config ``roots``:
    ``{"workspace": "/srv/ws", "conversation": "/srv/ws/conv-1"}`` (the first is the default)."""

    def __init__(self, config: Optional[dict] = None, toolbox_id: str = "workspace"):
        super().__init__(toolbox_id=toolbox_id, config=config)

    # -- roots --
    def roots(self) -> dict:
        return {name: Path(p) for name, p in (self.config.get("roots") or {}).items() if p}

    def root(self, name: Optional[str]) -> tuple[str, Path]:
        roots = self.roots()
        if not roots:
            raise WorkspaceRefusal("no workspace is configured")
        if name is None:
            name = next(iter(roots))
        if name not in roots:
            raise WorkspaceRefusal(f"unknown root {name!r}: one of {', '.join(roots)}")
        return name, roots[name]

    def _rel(self, root: Path, target: Path) -> str:
        rel = target.relative_to(root.resolve()).as_posix()
        return rel or "."

    # -- tools --
    def list_files(self, args: ListArgs) -> ListOutput:
        name, root = self.root(args.root)
        target = confine(root, args.path)
        if not target.is_dir():
            raise WorkspaceRefusal(NOT_FOUND)
        entries = []
        for child in sorted(target.iterdir(), key=lambda p: p.name):
            if child.is_symlink():
                try:
                    confine(root, self._rel(root, target) + "/" + child.name)
                except WorkspaceRefusal:
                    continue  # a link out of the workspace is not shown
            kind = "dir" if child.is_dir() else "file"
            entries.append({"name": child.name, "type": kind,
                            "bytes": child.stat().st_size if kind == "file" else None})
            if len(entries) >= MAX_LIST:
                return ListOutput(root=name, path=self._rel(root, target), entries=entries, truncated=True)
        return ListOutput(root=name, path=self._rel(root, target), entries=entries)

    def read_file(self, args: ReadArgs) -> ReadOutput:
        name, root = self.root(args.root)
        target = confine(root, args.path)
        if not target.is_file():
            raise WorkspaceRefusal(NOT_FOUND)
        size = target.stat().st_size
        with open(target, "rb") as fh:
            data = fh.read(args.max_bytes)
        return ReadOutput(root=name, path=self._rel(root, target), content=data.decode("utf-8", "replace"),
                          bytes=size, truncated=size > len(data))

    def search_files(self, args: SearchArgs) -> SearchOutput:
        name, root = self.root(args.root)
        base = confine(root, args.path)
        if not base.is_dir():
            raise WorkspaceRefusal(NOT_FOUND)
        needle = args.query.lower()
        matches: list[dict] = []
        real_root = root.resolve()
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fname in sorted(filenames):
                path = Path(dirpath) / fname
                real = path.resolve()
                if real_root not in real.parents or not real.is_file():
                    continue  # a symlink out of the workspace
                if real.stat().st_size > MAX_SEARCH_FILE_BYTES:
                    continue
                try:
                    lines = real.read_text("utf-8", errors="replace").splitlines()
                except OSError:
                    continue
                for no, line in enumerate(lines, 1):
                    if needle in line.lower():
                        matches.append({"path": path.relative_to(real_root).as_posix(), "line": no,
                                        "text": line[:300]})
                        if len(matches) >= MAX_MATCHES:
                            return SearchOutput(root=name, matches=matches, truncated=True)
        return SearchOutput(root=name, matches=matches)

    def discover_tools(self) -> List[AgentTool]:
        return [
            AgentTool(name="workspace_list", description="List the files in a workspace folder (read-only).",
                      argument_schema=ListArgs, output_schema=ListOutput, tool_call=self.list_files),
            AgentTool(name="workspace_read", description="Read a text file of the workspace (read-only).",
                      argument_schema=ReadArgs, output_schema=ReadOutput, tool_call=self.read_file),
            AgentTool(name="workspace_search", description="Find lines containing a text in the workspace's files.",
                      argument_schema=SearchArgs, output_schema=SearchOutput, tool_call=self.search_files),
        ]
