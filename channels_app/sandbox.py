"""What a turn's sandbox allows, and where it is: the workspace root, writable paths, network, and each
conversation's working directory inside the workspace.

One description for the operator's GET /v1/ugent/sandbox and the /sandbox command, and the one check
of a working directory (PUT /v1/ugent/directory): inside the workspace, no `..`, no symlink out, an
existing directory. The workspace toolboxes confine themselves to the same root and directory.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.utils.module_loading import import_string

from channels_app.errors import ApplicationError
from channels_app.models import Conversation

DOTDOT = "The directory may not contain '..': name it from the workspace root."
OUTSIDE = "The directory must be inside the workspace ({root})."
SYMLINK_OUT = "The directory leads outside the workspace through a symbolic link."
MISSING = "No such directory in the workspace: {path}."
NOT_A_DIRECTORY = "{path} is a file, not a directory."
BAD_TEXT = "The directory holds a NUL character, which no path can hold."


# --- a conversation's workspace ------------------------------------------------------------
# The directory a conversation's turns work in: their workspace tools' root, the sandbox's, and what code
# context indexes. UGENT_WORKSPACE unless a resolver named in settings (UGENT_WORKSPACE_RESOLVERS, by dotted
# path, as the hooks are: the hub imports no room) gives another: a channel plugin's `[plugins.routing]
# workspace` for the conversations it serves. fn(conversation) -> str: a path, or "" for nothing to say.
_resolvers: list = []
_resolvers_lock = threading.Lock()
_resolvers_loaded = False


def _workspace_resolvers() -> list:
    global _resolvers_loaded
    if not _resolvers_loaded:
        with _resolvers_lock:
            if not _resolvers_loaded:
                _resolvers[:] = [import_string(path)
                                 for path in getattr(settings, "UGENT_WORKSPACE_RESOLVERS", {}).values()]
                _resolvers_loaded = True
    return _resolvers


def conversation_workspace(conversation: Conversation | None) -> str:
    """The workspace directory of `conversation`'s turns, as configured (not resolved): the first resolver's
    answer, else UGENT_WORKSPACE. Kept on the row object, so a turn asks once."""
    if conversation is None:
        return str(settings.UGENT_WORKSPACE)
    known = getattr(conversation, "_ugent_workspace", None)
    if known is not None:
        return known
    found = ""
    for resolve in _workspace_resolvers():
        found = resolve(conversation) or ""
        if found:
            break
    conversation._ugent_workspace = found or str(settings.UGENT_WORKSPACE)
    return conversation._ugent_workspace


def workspace_root(conversation: Conversation | None = None) -> Path:
    """The workspace root (of `conversation`'s turns: a channel plugin may give its own, see
    conversation_workspace), with its symbolic links resolved (every check compares real paths)."""
    return Path(conversation_workspace(conversation)).resolve()


def writable_paths(conversation: Conversation | None = None) -> list[str]:
    """The paths the sandbox lets tools write (UGENT_SANDBOX_WRITABLE), relative ones from the workspace root."""
    root = workspace_root(conversation)
    return [str((root / p).resolve()) if not os.path.isabs(p) else str(Path(p).resolve())
            for p in settings.UGENT_SANDBOX_WRITABLE]


def directory_path(conversation: Conversation) -> Path:
    """The conversation's working directory as an absolute path (the root when it has none)."""
    root = workspace_root(conversation)
    return root / conversation.working_directory if conversation.working_directory else root


def directory_confined(conversation: Conversation) -> Path | None:
    """The conversation's working directory as a real path, or None when it is no directory inside the
    workspace now (a symbolic link changed since it was set): what code context may index."""
    root = workspace_root(conversation)
    try:
        real = directory_path(conversation).resolve()
    except (OSError, RuntimeError):
        return None
    if (real != root and root not in real.parents) or not real.is_dir():
        return None
    return real


def directory_check(raw: str, conversation: Conversation | None = None) -> str:
    """The working directory `raw` names, relative to the workspace root (`conversation`'s: see
    workspace_root; "" for the root itself), or a 400 that says why not. An absolute path is taken as it is,
    and must lie inside the workspace."""
    if "\x00" in raw:
        raise ApplicationError(BAD_TEXT, status=400, code="invalid_directory", param="directory")
    text = raw.strip()
    if ".." in PurePosixPath(text.replace("\\", "/")).parts:
        raise ApplicationError(DOTDOT, status=400, code="invalid_directory", param="directory")
    root = workspace_root(conversation)
    candidate = Path(text) if os.path.isabs(text) else root / text
    # Without following links: is the name itself inside the workspace?
    lexical = Path(os.path.normpath(candidate))
    if lexical != root and root not in lexical.parents:
        raise ApplicationError(OUTSIDE.format(root=root), status=400, code="directory_outside_workspace",
                               param="directory")
    try:
        real = candidate.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise ApplicationError(SYMLINK_OUT, status=400, code="directory_outside_workspace", param="directory")
    if real != root and root not in real.parents:
        raise ApplicationError(SYMLINK_OUT, status=400, code="directory_outside_workspace", param="directory")
    shown = text or "."
    if not real.exists():
        raise ApplicationError(MISSING.format(path=shown), status=400, code="directory_not_found",
                               param="directory")
    if not real.is_dir():
        raise ApplicationError(NOT_A_DIRECTORY.format(path=shown), status=400, code="not_a_directory",
                               param="directory")
    relative = real.relative_to(root)
    return "" if str(relative) == "." else relative.as_posix()


#: How a writable path outside the workspace is named to someone who may not see the host's paths.
OUTSIDE_THE_WORKSPACE = "(outside the workspace)"


def conversation_directory(conversation: Conversation, *, host_paths: bool = True) -> dict:
    """One conversation's working directory, as the sandbox description lists it (`path`: on the host, or
    without `host_paths` the directory again, relative to the workspace root)."""
    directory = conversation.working_directory or "."
    return {"conversation_id": conversation.external_id, "client_id": conversation.client_id,
            "channel": conversation.channel, "directory": directory,
            "path": str(directory_path(conversation)) if host_paths else directory}


def _relative_to(root: Path, path: str) -> str:
    real = Path(path)
    if real == root:
        return "."
    return real.relative_to(root).as_posix() if root in real.parents else OUTSIDE_THE_WORKSPACE


def sandbox_describe(*, conversation: Conversation | None = None, every_conversation: bool = False,
                     host_paths: bool = True) -> dict:
    """What the sandbox allows and where it is. `conversation`: that one's working directory;
    `every_conversation` (the operator): every conversation that has one set. Without `host_paths` (anyone
    but an operator key: access.host_paths_readable) the same report names no path on the host: the
    workspace root is null, and the writable paths and the working directory are named from the root."""
    root = workspace_root(conversation)
    writable = writable_paths(conversation)
    if not host_paths:
        writable = [_relative_to(root, p) for p in writable]
    out = {"object": "ugent.sandbox", "workspace_root": str(root) if host_paths else None,
           "workspace_exists": root.is_dir(), "writable_paths": writable,
           "network": bool(settings.UGENT_SANDBOX_NETWORK),
           "working_directory": (conversation_directory(conversation, host_paths=host_paths)
                                 if conversation is not None else None)}
    if every_conversation:
        conversations = list(Conversation.objects.exclude(working_directory="").order_by("id")[:1000])
        asked: dict[tuple, str] = {}  # one resolver question per (channel, client id), not per conversation
        for c in conversations:
            key = (c.channel, c.client_id)
            if key in asked:
                c._ugent_workspace = asked[key]
            else:
                asked[key] = conversation_workspace(c)
        out["working_directories"] = [conversation_directory(c) for c in conversations]
    return out


HOST_PATHS_HIDDEN = "its path on the host is shown to operator keys only; the paths below are relative to it"


def sandbox_text(description: dict) -> str:
    """The description in words, for a chat channel."""
    writable = ", ".join(description["writable_paths"]) or "nothing (the workspace is read-only)"
    root = description["workspace_root"]
    lines = [f"Workspace: {root if root is not None else HOST_PATHS_HIDDEN}", f"Writable: {writable}",
             f"Network: {'allowed' if description['network'] else 'none'}"]
    wd = description.get("working_directory")
    if wd is not None:
        where = f" ({wd['path']})" if wd["path"] != wd["directory"] else ""
        lines.append(f"This conversation's working directory: {wd['directory']}{where}")
    return "\n".join(lines)


def conversation_directory_set(*, conversation: Conversation, directory: str) -> dict:
    """Set the conversation's working directory (checked by directory_check; nothing changes on a 400)."""
    relative = directory_check(directory, conversation)
    Conversation.objects.filter(pk=conversation.pk).update(working_directory=relative)
    conversation.working_directory = relative
    return {"object": "ugent.directory", **conversation_directory(conversation)}
