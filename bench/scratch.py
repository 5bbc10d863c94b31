"""An in-process bench's scratch install: a var dir of its own, its own ugent.toml, embedded mode.

Call `scratch_install(prefix, toml)` before Django is set up (bench/tool_loop.py, bench/memory.py)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def scratch_install(prefix: str, toml: str = "", *, keep_database_url: bool = False) -> Path:
    """A fresh var dir and ugent.toml (returned) for this process; Redis off, the scratch SQLite unless
    keep_database_url (the caller then names its own database)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("UGENT_VAR_DIR", str(tmp))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
    os.environ.setdefault("UGENT_LOG_LEVEL", "WARNING")
    os.environ.pop("REDIS_URL", None)
    if not keep_database_url:
        os.environ.pop("DATABASE_URL", None)
    config = tmp / "ugent.toml"
    config.write_text(toml)
    os.environ["UGENT_CONFIG"] = str(config)
    return config
