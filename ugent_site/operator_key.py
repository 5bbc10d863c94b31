"""The operator key's file (UGENT_WEB_API_KEY_FILE): made once, with a random key, readable by its owner alone.

`rundaemon` makes it on an embedded install's first start; servers mode never runs rundaemon, so its
operator runs `manage.py createoperatorkey` once (docs/deploy.md). Both go through `operator_key_create`,
which never overwrites a file and says what is wrong with the path in one line.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

#: What a web process and `manage.py check` say when no operator key is configured (servers mode).
NO_OPERATOR_KEY = ("no operator key is configured (UGENT_WEB_API_KEY is unset, or not of role operator, and "
                   "UGENT_WEB_API_KEY_FILE {path} is missing or empty; no [[web.auth.keys]] entry of role "
                   "operator in ugent.toml has its key set; keys the admin issued to an operator caller are "
                   "not checked): without one the operator endpoints answer nobody; create one with "
                   "`python manage.py createoperatorkey`")


class OperatorKeyError(Exception):
    """The key file cannot be made; the message names the file and what to do."""


def operator_key_create(*, path: Path) -> str:
    """Write a new random operator key to `path` (mode 0600) and return it. Refuses a path that exists,
    empty or not (an empty key file is more likely a mount or a write gone wrong than a wish for a new key),
    and one whose directory does not.

    The key is written whole to a temporary file beside `path`, then hard-linked to `path` (a link fails
    where anything exists): `path` is never seen empty, so of two runs at once (init containers on one
    volume) the loser says the winner's file already holds a key, never that it is empty."""
    path = Path(path)
    key = "ugk_" + secrets.token_urlsafe(32)
    if os.path.lexists(path):
        raise OperatorKeyError(_what_is_there(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # (mode 0600)
    except FileNotFoundError:
        raise OperatorKeyError(f"cannot create the operator key file {path} (UGENT_WEB_API_KEY_FILE): its "
                               f"directory {path.parent} does not exist (create it, or name another "
                               f"file)") from None
    except OSError as exc:
        raise OperatorKeyError(f"cannot create the operator key file {path} (UGENT_WEB_API_KEY_FILE): "
                               f"{exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(key + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise OperatorKeyError(_what_is_there(path)) from None
        except OSError as exc:
            raise OperatorKeyError(f"cannot create the operator key file {path} (UGENT_WEB_API_KEY_FILE): "
                                   f"{exc.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return key


def _what_is_there(path: Path) -> str:
    """Why `path` is not made: what is there, in the words an operator acts on."""
    if path.is_symlink() and not path.exists():
        return (f"the operator key file {path} (UGENT_WEB_API_KEY_FILE) is a symbolic link to "
                f"{os.readlink(path)}, which does not exist: nothing was changed (remove the link, or make the "
                f"file it points to)")
    if path.is_dir():
        return (f"the operator key file {path} (UGENT_WEB_API_KEY_FILE) is a directory: nothing was changed "
                f"(name a file, not a directory)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        text = "?"  # (something is there: not ours to judge, never overwrite it)
    except OSError as exc:
        return (f"the operator key file {path} (UGENT_WEB_API_KEY_FILE) exists but cannot be read "
                f"({exc.strerror}): nothing was changed")
    if not text.strip():
        return (f"the operator key file {path} (UGENT_WEB_API_KEY_FILE) is empty: put a key in it, or remove "
                f"it to have one generated")
    return f"{path} already holds an operator key: nothing was changed (remove the file first to replace the key)"
