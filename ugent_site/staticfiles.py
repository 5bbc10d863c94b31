"""The admin's static files: WhiteNoise's compressed, hashed storage, and when to collect it.

`rundaemon` collects into STATIC_ROOT at start when the app's files changed since the last collect
(a stamp of their names, sizes and times), so `make run` serves hashed, compressed files with no
step for the operator. Servers mode runs `manage.py collectstatic --noinput` once per release.
A checkout that never collected (a test run, `manage.py shell`) still renders: a name missing from
the manifest resolves to the app's own file, which WhiteNoise serves from the finders.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from django.conf import settings
from whitenoise.storage import CompressedManifestStaticFilesStorage

from ugent_common.filelock import file_locked

STAMP_NAME = ".ugent-collected"
LOCK_NAME = ".ugent-collect.lock"


class StaticStorage(CompressedManifestStaticFilesStorage):
    manifest_strict = False

    def stored_name(self, name):
        try:
            return super().stored_name(name)
        except ValueError:  # not collected yet: the finders' file under its own name
            return name


def sources_stamp() -> str:
    """A fingerprint of every file the finders would collect: its path, size and mtime."""
    from django.contrib.staticfiles import finders
    digest = hashlib.sha256()
    for finder in finders.get_finders():
        for path, storage in finder.list(None):
            st = Path(storage.path(path)).stat()
            digest.update(f"{getattr(storage, 'prefix', '') or ''}/{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def static_collect_if_changed() -> bool:
    """Run collectstatic when the sources changed since the last collect (or none happened). True if it ran."""
    from django.core.management import call_command
    root = Path(settings.STATIC_ROOT)
    stamp_file = root / STAMP_NAME
    stamp = sources_stamp()

    def current() -> bool:
        return (root / "staticfiles.json").exists() and stamp_file.exists() and stamp_file.read_text() == stamp
    if current():  # (no lock needed to find nothing to do: a read-only STATIC_ROOT collected once still starts)
        return False
    # Two daemons sharing a STATIC_ROOT (one checkout, two embedded daemons) starting at once: the second
    # waits for the first's collect and finds it done, instead of writing the same files beside it.
    with file_locked(str(root / LOCK_NAME)):
        if current():
            return False
        call_command("collectstatic", interactive=False, verbosity=0)
        tmp = stamp_file.with_name(f"{STAMP_NAME}.{os.getpid()}")
        tmp.write_text(stamp)
        tmp.replace(stamp_file)  # atomic: a reader never sees half a stamp
        return True
