"""UGENT_MEMSTATS: off by default; on, SIGUSR2 makes the process write a memory report (ugent_site/memstats.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ugent_site import memstats

ROOT = Path(__file__).resolve().parents[1]
class _Kept:
    pass


linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


@linux_only
def test_a_report_names_rss_malloc_sqlite_and_the_objects_by_type(tmp_path):
    import sqlite3
    conn = sqlite3.connect(tmp_path / "x.sqlite3")  # SQLite's library is loaded and allocating
    conn.execute("CREATE TABLE t (x)")
    keep = [_Kept() for _ in range(5000)]
    rep = memstats.report()
    assert rep["rss_kb"] > 10_000
    assert rep["malloc"]["in_use_kb"] > 0 and rep["malloc"]["free_kb"] >= 0
    assert rep["sqlite"]["memory_used_kb"] > 0
    assert rep["python"]["allocated_blocks"] > 0
    assert rep["gc_objects"] >= sum(rep["gc_types"].values())
    assert rep["gc_frozen"] == __import__("gc").get_freeze_count()
    assert rep["gc_types"].get("tests.test_memstats._Kept", 0) >= 5000
    assert "rss_after_trim_kb" not in rep
    assert memstats.report(trim=True)["rss_after_trim_kb"] > 0
    conn.close()
    del keep


def test_a_report_counts_weak_references_by_what_they_point_at_and_finds_who_holds_the_dead_ones():
    import weakref
    kept = [_Kept() for _ in range(50)]
    live = [weakref.ref(k) for k in kept]
    gone = [_Kept() for _ in range(30)]
    holder = {"dead refs of this test": [weakref.ref(g) for g in gone]}
    del gone  # their weak references stay in the list, dead
    rep = memstats.report()
    assert rep["weakref_referents"].get("tests.test_memstats._Kept", 0) >= 50
    assert rep["weakref_referents"].get("(dead)", 0) >= 30
    found = memstats.report(referrers=memstats.DEAD_WEAKREF)["referrers"]
    assert found and all("dead" in obj for obj, _ in found)
    assert any(label == "list" for _, holders in found for label, _ in holders)  # held by the test's list
    del live, holder, kept


def test_off_by_default_and_when_false(tmp_path):
    assert memstats.start("", tmp_path / "a") is False
    assert memstats.start("false", tmp_path / "b") is False
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


PROBE = r"""
import sys, time, tracemalloc
sys.path.insert(0, {root!r})
from pathlib import Path
from ugent_site import memstats
assert memstats.start({mode!r}, Path({directory!r}))
print("ready", flush=True)
sys.stdin.readline()
"""


def _probe(mode: str, directory: Path, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", PROBE.format(root=str(ROOT), mode=mode, directory=str(directory))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert p.stdout.readline().strip() == "ready"
    return p


def _wait_for(path: Path, timeout: float = 120) -> dict:  # a bound, not a figure: a loaded machine is slow
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no report at {path}"
        time.sleep(0.05)
    return json.loads(path.read_text())


@linux_only
def test_sigusr2_writes_numbered_reports_and_a_request_file_asks_for_a_trim(tmp_path):
    p = _probe("true", tmp_path)
    try:
        os.kill(p.pid, signal.SIGUSR2)
        first = _wait_for(tmp_path / f"{p.pid}-1.json")
        assert first["pid"] == p.pid and "rss_after_trim_kb" not in first
        assert "tracemalloc_snapshot" not in first  # not tracing
        (tmp_path / "request.json").write_text(json.dumps({"trim": True}))
        os.kill(p.pid, signal.SIGUSR2)
        second = _wait_for(tmp_path / f"{p.pid}-2.json")
        assert second["rss_after_trim_kb"] > 0
        assert not (tmp_path / "request.json").exists()  # one request, one report
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)


@linux_only
def test_with_tracemalloc_tracing_a_report_carries_a_snapshot_that_loads(tmp_path):
    # Tracing is started by the request, after the first report has imported what a report reads: a process
    # traced from its start (PYTHONTRACEMALLOC) spent 10-100 s of the suite on those imports, traced.
    import tracemalloc
    p = _probe("true", tmp_path)
    try:
        os.kill(p.pid, signal.SIGUSR2)
        assert "tracemalloc_snapshot" not in _wait_for(tmp_path / f"{p.pid}-1.json")  # not tracing yet
        (tmp_path / "request.json").write_text(json.dumps({"tracemalloc": 1}))
        os.kill(p.pid, signal.SIGUSR2)
        rep = _wait_for(tmp_path / f"{p.pid}-2.json")
        assert rep["python"]["traced_kb"] > 0
        snapshot = tracemalloc.Snapshot.load(rep["tracemalloc_snapshot"])
        assert snapshot.statistics("filename")
        (tmp_path / "request.json").write_text(json.dumps({"snapshot": False}))
        os.kill(p.pid, signal.SIGUSR2)
        assert "tracemalloc_snapshot" not in _wait_for(tmp_path / f"{p.pid}-3.json")
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)


# --- SQLite's page caches: bounded by UGENT_SQLITE_CACHE_KIB, and the report reads that bound ---------------

embedded_only = pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="SQLite's pragma (embedded mode)")


@embedded_only
@pytest.mark.django_db(transaction=True)
def test_each_new_sqlite_connection_has_the_configured_cache_size_and_the_report_says_so():
    import threading
    from django.conf import settings
    from django.db import connection
    seen = []

    def in_a_thread():  # a thread of its own opens a connection of its own, as the daemon's threads do
        try:
            with connection.cursor() as cur:
                cur.execute("PRAGMA cache_size")
                seen.append(cur.fetchone()[0])
                cur.execute("PRAGMA cache_spill")  # pages: SQLite's default threshold, 2,000 KiB, kept
                seen.append(cur.fetchone()[0])
        finally:
            connection.close()

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join(30)
    assert seen[0] == -settings.UGENT_SQLITE_CACHE_KIB  # negative: KiB
    assert seen[1] * 4 >= 1900
    if "UGENT_SQLITE_CACHE_KIB" not in os.environ:
        assert settings.UGENT_SQLITE_CACHE_KIB == 128  # below SQLite's 2,000, which kept filling for 10,000 turns
    sqlite = memstats.report()["sqlite"]
    assert sqlite["cache_size_kb"] == settings.UGENT_SQLITE_CACHE_KIB
    assert sqlite["page_cache_bound_kb"] == sqlite["connections"] * settings.UGENT_SQLITE_CACHE_KIB
    assert 0 <= sqlite["page_cache_kb"] <= sqlite["memory_used_kb"]
    with connection.cursor() as cur:  # this thread's connection, with the schema read
        cur.execute("SELECT count(*) FROM django_migrations")
    from django.utils.functional import SimpleLazyObject
    lazy = SimpleLazyObject(lambda: 1 / 0)  # a lazy object the report must not evaluate (a request's user)
    by_connection = memstats.report(by_connection=True)["sqlite"]["by_connection"]
    assert isinstance(by_connection, list), by_connection
    mine = [c for c in by_connection if c["thread"] == threading.current_thread().name]
    del lazy
    assert len(mine) == 1 and mine[0]["schema_kb"] > 0 and mine[0]["stmt_kb"] >= 0
    assert mine[0]["cache_kb"] <= settings.UGENT_SQLITE_CACHE_KIB + 16  # page headers beside the pages


SETTINGS_PROBE = r"""
import os, sys
sys.path.insert(0, {root!r})
os.environ["DJANGO_SETTINGS_MODULE"] = "ugent_site.settings"
import django
django.setup()
from django.db import connection
from ugent_site import memstats
with connection.cursor() as cur:
    cur.execute("PRAGMA cache_size")
    print(cur.fetchone()[0], memstats.configured_cache_kib())
"""


def test_the_environment_variable_sets_the_cache_size_of_the_daemons_connections(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    env.update(UGENT_VAR_DIR=str(tmp_path), UGENT_SQLITE_CACHE_KIB="300")
    out = subprocess.run([sys.executable, "-c", SETTINGS_PROBE.format(root=str(ROOT))], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-300", "300"]


FROZEN_PROBE = r"""
import gc, os, sys, threading
sys.path.insert(0, {root!r})
os.environ["DJANGO_SETTINGS_MODULE"] = "ugent_site.settings"
import django
django.setup()
from pathlib import Path
from django.db import connection
from ugent_site import memstats
memstats.start("true", Path({var!r}) / "memstats")
opened, done = threading.Event(), threading.Event()

def hold():  # a thread opens its connection before start-up's freeze and keeps it, as a turn thread does
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS probe (x)")
    opened.set()
    done.wait(30)

t = threading.Thread(target=hold, name="holder")
t.start()
opened.wait(30)
gc.collect()
gc.freeze()
print(sorted(c["thread"] for c in memstats.report(by_connection=True)["sqlite"]["by_connection"]))
done.set()
"""


def test_the_by_connection_report_finds_connections_opened_before_the_gc_freeze(tmp_path):
    """gc.get_objects() leaves out what gc.freeze() moved away: the report also knows every connection
    opened since memstats started (the daemon's turn threads open theirs before the freeze)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    env.update(UGENT_VAR_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", FROZEN_PROBE.format(root=str(ROOT), var=str(tmp_path))], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['holder']"


class _HeldByATraceback:
    pass


def test_referrers_name_the_frame_that_holds_an_object_and_what_holds_that_frame():
    """A frame that no thread runs any more, kept by a stored exception's traceback, is named, with
    the traceback above it: the report of tests/streams/test_memory_held.py names such holders."""
    def work():
        obj = _HeldByATraceback()  # noqa: F841 (the frame's local is the point)
        raise ValueError("kept")

    try:
        work()
    except ValueError as exc:
        kept = exc  # as Django's connection.rollback_exc kept one
    found = memstats._referrers(f"{__name__}._HeldByATraceback")
    assert len(found) == 1
    (frame_label, above), = [r for r in found[0][1] if r[0].startswith("frame ")]
    assert frame_label.startswith("frame work ") and frame_label.endswith(f"{__file__}:{work.__code__.co_firstlineno + 2}")
    assert above[0] == "no thread runs it (a traceback, generator or coroutine holds it)"
    assert any(r[0] == "traceback" for r in above[1:]), above
    del kept


class _HeldByManyFrames:
    pass


def test_frames_count_toward_the_six_holders_a_level_lists():
    """A level lists at most 6 holders, frames among them: an object held by 8 frames (kept by 8 stored
    exceptions' tracebacks) lists 6 of them, not all 8."""
    def work(obj):
        raise ValueError("kept")

    held_obj, kept = _HeldByManyFrames(), []
    for _ in range(8):
        try:
            work(held_obj)
        except ValueError as exc:
            kept.append(exc)
    found = memstats._referrers(f"{__name__}._HeldByManyFrames")
    assert len(found) == 1
    holders = found[0][1]
    assert len(holders) == 6, [h[0] for h in holders]
    assert all(h[0].startswith("frame work ") for h in holders), [h[0] for h in holders]
    del kept, held_obj


def test_the_mappings_split_rss_by_kind_and_an_anonymous_block_shows_under_anon():
    import mmap
    before = memstats.mappings()
    block = mmap.mmap(-1, 32 * 1024 * 1024, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps, 32 MiB
    try:
        block.write(b"x" * len(block))  # every page touched: resident
        after = memstats.mappings()
        rss = memstats._status()["VmRSS"]
    finally:
        block.close()
    # (the kernel may merge the block with a neighbour: with one of malloc's arenas, it is counted there)
    kinds = ("anon", "malloc arenas")
    grown = sum(after.get(k, {}).get("rss", 0) - before.get(k, {}).get("rss", 0) for k in kinds)
    assert 31 * 1024 <= grown <= 34 * 1024, (before, after)
    assert sum(after.get(k, {}).get("anonymous", 0) - before.get(k, {}).get("anonymous", 0) for k in kinds) >= 31 * 1024
    assert after["python"]["rss"] > 0 and after["libc"]["rss"] > 0  # the interpreter and libc are mapped files
    total = sum(k["rss"] for k in after.values())
    assert abs(total - rss) <= rss * 0.05, (total, rss)  # every mapping is in one kind


def test_a_trim_with_maps_reports_the_mappings_and_the_anonymous_rss_after_it():
    rep = memstats.report(trim=True, maps=True)
    assert rep["rss_after_trim_anon_kb"] > 0
    assert rep["rss_after_trim_anon_kb"] <= rep["rss_after_trim_kb"]
    assert {"heap", "anon", "python", "libc"} <= set(rep["mappings"])
    assert "mappings" not in memstats.report()


def test_a_report_survives_a_dead_weak_proxy_such_as_the_api_schemas():
    """drf_spectacular leaves weakref.proxy(schema) on each view it described, dead once the document is made;
    isinstance() on a dead proxy raises ReferenceError, and the report must not (a review's probe)."""
    import weakref
    thing = _Kept()
    proxy = weakref.proxy(thing)
    del thing
    assert "weakref_referents" in memstats.report()
    assert isinstance(memstats.report(referrers=memstats.DEAD_WEAKREF)["referrers"], list)
    del proxy


def test_a_report_after_the_openapi_document_was_served(client, db):
    import gc
    assert client.get("/v1/openapi.json").status_code == 200
    gc.collect()
    assert "weakref_referents" in memstats.report()
