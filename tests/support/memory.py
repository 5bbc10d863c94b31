"""Memory's test helpers: point ugent.toml's [memory] at a backend for one test."""
from __future__ import annotations

from pathlib import Path

import pytest

BACKENDS = ["sqlite_fts", "lance_embedded"]


class MemoryConfig:
    def __init__(self, path: Path, settings):
        self.path, self.settings = path, settings

    def write(self, text: str) -> None:
        from plugins_app.agent.memory import conf
        from ugent_common import config
        self.path.write_text(text)
        self.settings.UGENT_CONFIG = str(self.path)
        config.reset_caches()
        conf.reset()

    def backend(self, name: str, **extra) -> None:
        lines = [f'backend = "{name}"'] + [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
        self.write("[memory]\n" + "\n".join(lines) + "\n")


@pytest.fixture
def memory_config(tmp_path, settings):
    """Writes <tmp>/ugent.toml and makes it the one in force (re-read at once)."""
    from plugins_app.agent.memory import conf
    from ugent_common import config
    settings.UGENT_CONFIG_RECHECK_SECS = 0
    settings.UGENT_MEMORY_SETTINGS_RECHECK_SECS = 0
    settings.UGENT_MEMORY_LANCE_DIR = tmp_path / "memory.lance"  # each test its own LanceDB dataset
    cfg = MemoryConfig(tmp_path / "ugent.toml", settings)
    cfg.write("")
    yield cfg
    config.reset_caches()
    conf.reset()
