"""A file's signature, to tell whether it changed since a look. No Django here."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def file_signature(path: Path) -> Optional[tuple[int, int, int, int]]:
    """(mtime, size, inode, ctime) of `path`, through a symlink (the file it names now); None when it is not
    there. The inode tells a file replaced by a rename with the same size and mtime (`cp -p`, `rsync -a`);
    the ctime a chmod that makes an unreadable file readable."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns
