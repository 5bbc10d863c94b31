"""What each pytest-xdist worker keeps to itself, so `make test` can run the suite on several workers.

Loaded early (`-p tests.support.workers` in pytest.ini), before pytest-django reads the settings, since
they read the environment this sets. Without xdist (PYTEST_XDIST_WORKER unset) it changes nothing.

Per worker (gw0, gw1, ...):
  * its own Redis database: REDIS_URL's database number minus the worker's number (15, 14, 13 ... for
    `make test`'s redis://.../15), so keys, rate limits and queues never cross;
  * its own pub/sub prefix: Redis's pub/sub channels ignore the database number, and stream wake-ups are
    published on `ugent:n:<queue>:...` (channels_app/notify.py), so each worker gets its own
    UGENT_CELERY_QUEUE;
  * its own var/ directory (SQLite files, file locks, stored files, memory datasets) under
    var/test-<pass>-<worker>;
  * its own collected static files for the daemons its tests start (`static_root()`).
`make test` runs its embedded and its servers pass at the same time (scripts/test-passes.sh), so what a
worker keeps on disk is named by its pass too (`PASS`): gw0 of one pass never shares a directory with gw0
of the other. Redis databases need no such care: the embedded pass has no REDIS_URL.
pytest-django gives each worker its own test database already (test_ugent_gw0, ...).

Files are handed out whole (`--dist loadfile`): a module's fixtures (a daemon, the several-process layout
of tests/e2e/test_layout.py with its own PostgreSQL and Redis ports) are set up once, on one worker.
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[2]
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "" when the suite runs in one process
#: The pass of `make test` this process belongs to (servers mode is REDIS_URL set, as in the settings)
PASS = "servers" if os.environ.get("REDIS_URL") else "embedded"


def worker_number() -> int:
    return int(WORKER[2:]) if WORKER.startswith("gw") else 0


def redis_url_for_worker(url: str, number: int) -> str:
    """`url` with its database number lowered by `number` (redis://host:6379/15 -> .../13 for gw2)."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    db = base - number
    if db < 0:
        raise RuntimeError(f"REDIS_URL {url!r} leaves no Redis database for xdist worker {number}: "
                           "give a higher database number, or fewer workers")
    return urlunsplit(parts._replace(path=f"/{db}"))


def static_root() -> Path:
    """The collected static files of the daemons this process's tests start (one collect per worker:
    two daemons collecting into one directory at once could trip over each other's files)."""
    return ROOT / "var" / (f"test-static-{PASS}-{WORKER}" if WORKER else f"test-static-{PASS}")


if WORKER:
    number = worker_number()
    if os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = redis_url_for_worker(os.environ["REDIS_URL"], number)
    os.environ["UGENT_CELERY_QUEUE"] = f"{os.environ.get('UGENT_CELERY_QUEUE', 'ugent')}-{WORKER}"
    os.environ["UGENT_VAR_DIR"] = str(ROOT / "var" / f"test-{PASS}-{WORKER}")
