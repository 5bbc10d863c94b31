"""An exclusive lock on a file, across the processes of one host (flock). No Django here."""
from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def file_locked(path: str, *, wait: bool = True):
    """Hold an exclusive flock on `path` (created, its folder too, when missing) and yield True; with
    wait=False, yield False at once when another holder has it. Closing the file releases the lock, so a
    holder killed with kill -9 holds nothing. Raises OSError when the file cannot be made."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
