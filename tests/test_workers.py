"""tests/support/workers.py: what each pytest-xdist worker keeps to itself."""
from __future__ import annotations

import os

import pytest

from tests.support.workers import PASS, WORKER, redis_url_for_worker, static_root


def test_each_worker_gets_its_own_redis_database():
    assert redis_url_for_worker("redis://127.0.0.1:6379/15", 0) == "redis://127.0.0.1:6379/15"
    assert redis_url_for_worker("redis://127.0.0.1:6379/15", 2) == "redis://127.0.0.1:6379/13"
    assert redis_url_for_worker("redis://:pw@h:1/4", 1) == "redis://:pw@h:1/3"
    with pytest.raises(RuntimeError, match="leaves no Redis database"):
        redis_url_for_worker("redis://127.0.0.1:6379", 1)


@pytest.mark.skipif(not WORKER, reason="runs on a pytest-xdist worker (make test)")
def test_this_worker_keeps_its_queue_and_var_dir(settings):
    """Named by the pass too: make test runs its two passes at once, each with its own gw0, gw1, ..."""
    assert settings.CELERY_TASK_DEFAULT_QUEUE.endswith(f"-{WORKER}")
    assert PASS == ("servers" if settings.UGENT_MODE == "servers" else "embedded")
    assert str(settings.VAR_DIR).endswith(f"test-{PASS}-{WORKER}")
    assert static_root().name == f"test-static-{PASS}-{WORKER}"
    if settings.UGENT_MODE == "servers":
        assert os.environ["REDIS_URL"] == settings.REDIS_URL


def test_a_daemons_port_is_taken_below_the_ephemeral_range_and_is_free():
    """bind(0)'s ports are the ones outgoing connections get too: another test process's connection could
    take one before the daemon binds it (three processes start daemons at once under make test)."""
    import socket
    from tests.support.daemon import _ephemeral_low, free_port
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        assert 1024 <= port < _ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_slowest_files_are_handed_out_first_each_keeping_its_tests_order():
    """tests/support/schedule.py: xdist hands files out in the collection's order (--no-loadscope-reorder)."""
    from types import SimpleNamespace

    from tests.support import schedule
    slow, slower = sorted(schedule.SECONDS, key=schedule.SECONDS.get)[-2:]
    items = [SimpleNamespace(nodeid=n) for n in (
        "tests/test_small.py::a", f"{slow}::x", "tests/test_many.py::a", f"{slower}::y", "tests/test_many.py::b",
        f"{slow}::w", "tests/test_small.py::b", "tests/test_many.py::c")]
    schedule.slowest_first(items)
    assert [i.nodeid for i in items] == [
        f"{slower}::y", f"{slow}::x", f"{slow}::w", "tests/test_many.py::a", "tests/test_many.py::b",
        "tests/test_many.py::c", "tests/test_small.py::a", "tests/test_small.py::b"]


def test_every_file_the_schedule_names_is_there():
    from tests.support.schedule import SECONDS
    from tests.support.workers import ROOT
    assert SECONDS and [name for name in SECONDS if not (ROOT / name).is_file()] == []
