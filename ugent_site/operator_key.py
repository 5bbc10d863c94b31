"""The operator key's file (UGENT_WEB_API_KEY_FILE): made once, with a random key, readable by its owner alone.

`rundaemon` makes it on an embedded install's first start; servers mode never runs rundaemon, so its
operator runs `manage.py createoperatorkey` once (docs/deploy.md). Both go through `operator_key_create`,
which never overwrites a file and says what is wrong with the path in one line.
"""
from __future__ import annotations

import os
import secrets
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
    and one whose directory does not."""
    path = Path(path)
    key = "ugk_" + secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if _holds_a_key(path):
            raise OperatorKeyError(f"{path} already holds an operator key: nothing was changed "
                                   f"(remove the file first to replace the key)") from None
        raise OperatorKeyError(f"the operator key file {path} (UGENT_WEB_API_KEY_FILE) is empty: put a key in "
                               f"it, or remove it to have one generated") from None
    except FileNotFoundError:
        raise OperatorKeyError(f"cannot create the operator key file {path} (UGENT_WEB_API_KEY_FILE): its "
                               f"directory {path.parent} does not exist (create it, or name another "
                               f"file)") from None
    except OSError as exc:
        raise OperatorKeyError(f"cannot create the operator key file {path} (UGENT_WEB_API_KEY_FILE): "
                               f"{exc.strerror}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key


def _holds_a_key(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return True  # (not ours to judge: never overwrite it)
