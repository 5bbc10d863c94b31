"""What the daemon's memory holds, on request: a debug hook, off unless UGENT_MEMSTATS is set.

With `UGENT_MEMSTATS=true` (read once, when rundaemon starts) the daemon writes a report each time it
gets SIGUSR2 (`kill -USR2 <pid>`), to `<UGENT_VAR_DIR>/memstats/<pid>-<n>.json`:

* `rss_kb`: the process's resident set (VmRSS);
* `malloc`: glibc's mallinfo2 — bytes malloc holds from the system (`arena` + `mmapped`), bytes in
  use (`in_use`) and bytes free but kept (`free`); RSS that is `free` here is the allocator's, not
  a leak;
* `sqlite`: the bytes SQLite's library has allocated (`sqlite3_memory_used`: page caches,
  statements, schemas of every connection in the process), their high-water mark, the connections
  open, the bytes their page caches hold now (`page_cache_kb`; the rest is schemas and prepared
  statements), the `cache_size` each connection has (`cache_size_kb`: the one the settings'
  init_command gives, UGENT_SQLITE_CACHE_KIB, else SQLite's default) and what their page caches
  may hold at most (connections x `cache_size_kb`);
* `rss_anon_kb` / `rss_file_kb`: RSS in anonymous pages (heaps, arenas, stacks) and in mapped files
  (code, shared libraries): only the first can grow with use;
* `pymalloc`: Python's small-object allocator (its arenas are mapped directly, outside malloc's
  figures): bytes its arenas hold, bytes in blocks in use, and bytes free inside its arenas
  (available blocks and unused pools), from `sys._debugmallocstats()`;
* `python`: pymalloc's allocated blocks, and with tracemalloc tracing (start the daemon with
  `PYTHONTRACEMALLOC=<frames>`) the bytes Python code holds (`traced_kb`) and their peak;
* `gc_types`: the objects the garbage collector tracks, counted by type (`module.Class`), most first;
  `gc_frozen`: those it no longer walks (frozen once the process started, ugent_common/gcfreeze.py);
  `malloc_trims`: how many periodic malloc_trim(0) ran and their time (ugent_common/malloctrim.py);
* `held`: what the hub keeps per turn, stream or database file while it works, which must go back
  to its idle size when the work is done: notify's topics and waiters, the fan-out's readers and
  their subscribers, the turns whose leases this process renews, writers queued for SQLite, turns
  queued for the turn threads;
* `caches`: the sizes of the process's caches keyed by a thing, not by a turn (a statement's SQL, an
  API key, a toolbox class, a profile version): they stop growing once every such thing was seen;
* `tracemalloc_snapshot`: when tracing, a snapshot dumped beside the report
  (`tracemalloc.Snapshot.load(path)`; diff two with `compare_to(old, "lineno")`).

A file `request.json` in that directory, when the signal comes, changes the next report (and is then
removed): `{"tracemalloc": <frames>}` starts tracing first (so a daemon started without
PYTHONTRACEMALLOC traces from then on, start-up and imports aside), `{"snapshot": false}` skips the
snapshot (a large one holds the GIL for seconds), and
`{"trim": true}` calls `malloc_trim(0)` after it and records `rss_after_trim_kb`: what RSS falls to
once the allocator gives back the free pages it holds (`rss_after_trim_anon_kb`: of it anonymous),
`{"maps": true}` adds `mappings`: resident KiB by kind of mapping (`mappings()`), after the trim if
there is one; `{"collect": true}` runs a full garbage
collection first (so the counts are of live objects, not of garbage not yet collected), and
`{"referrers": "module.Class"}` adds what holds up to five objects of that type, four levels up, and
`{"cache_keys": true}` adds `cache_keys`: the keys of the caches that have them (the SQL of
`rows_sql`), and `{"connections": true}` adds `sqlite.by_connection`: each Django connection to SQLite, by thread, with
the bytes of its page cache, schema and prepared statements and how many statements it holds
(`sqlite_connections()`), and `{"statements": true}` with it their SQL.
bench/memory_rss.py and tests/streams/test_memory_held.py use them.

The signal handler only wakes a thread, which writes the report (no work in the handler).
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
import tracemalloc
from pathlib import Path

log = logging.getLogger("ugent.memstats")
_started = False


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _libc():
    from ugent_common.malloctrim import libc as loaded
    try:
        libc = loaded()
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): the report goes without malloc's figures
        return None


def _libsqlite():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("sqlite3") or "libsqlite3.so.0")  # the one _sqlite3 loaded
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.argtypes = [ctypes.c_int]
        lib.sqlite3_status64.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                         ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        return lib
    except (OSError, AttributeError):  # SQLite linked into Python statically: no figure
        return None


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def rss_kb() -> int:
    return _status().get("VmRSS", 0)


def mappings() -> dict[str, dict[str, int]]:
    """Resident KiB by kind of mapping (/proc/self/smaps): `heap` (malloc's main arena), `stack` (the main
    thread's), `malloc arenas` (malloc's other arenas: anonymous mappings aligned to its 64 MiB heap size),
    `anon` (every other anonymous mapping: pymalloc's arenas, malloc's large blocks, the threads' stacks; the
    kernel merges neighbours, so they cannot be told apart here), `python`, `sqlite`, `libc` and `other
    files` (code and data of mapped files), each with its `rss`, its `anonymous` part (a file's written
    pages, an anonymous mapping's all) and `count` (mappings). Which of them grows tells a leak from
    fragmentation and from code touched for the first time."""
    out: dict[str, dict[str, int]] = {}
    kind = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else ""
            if name == "[heap]":
                kind = "heap"
            elif name == "[stack]":
                kind = "stack"
            elif not name and int(head[0].partition("-")[0], 16) % (64 << 20) == 0:
                kind = "malloc arenas"
            elif not name or name.startswith("["):
                kind = "anon"
            elif "python" in name:
                kind = "python"
            elif "sqlite" in name:
                kind = "sqlite"
            elif "libc." in name or "libc-" in name:
                kind = "libc"
            else:
                kind = "other files"
            out.setdefault(kind, {"rss": 0, "anonymous": 0, "count": 0})["count"] += 1
        elif kind and line.startswith(("Rss:", "Anonymous:")):
            out[kind]["rss" if line.startswith("Rss:") else "anonymous"] += int(line.split()[1])
    return out


def pymalloc() -> dict:
    """pymalloc's arenas, from `sys._debugmallocstats()` (it writes to fd 2: taken from there, briefly)."""
    if not hasattr(sys, "_debugmallocstats"):
        return {}
    import tempfile
    with tempfile.TemporaryFile("w+") as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    figures = {}
    for line in text.splitlines():
        left, _, right = line.partition("=")
        left = left.strip()
        try:
            value = int(right.strip().replace(",", ""))
        except ValueError:
            continue
        if "bytes/arena" in left:
            figures["arenas_kb"] = value // 1024
        elif left == "# bytes in allocated blocks":
            figures["in_use_kb"] = value // 1024
        elif left == "# bytes in available blocks":
            figures["free_kb"] = figures.get("free_kb", 0) + value // 1024
        elif "unused pools" in left:
            figures["free_kb"] = figures.get("free_kb", 0) + value // 1024
    return figures


def _type_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


DEAD_WEAKREF = "(dead) weakref"


def _weakref_referent(ref: weakref.ReferenceType) -> str:
    target = ref()
    return "(dead)" if target is None else _type_name(type(target))


def _frame_thread(frame) -> str:
    """Which thread runs a frame, and that thread's stack (innermost last); or that none does."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, top in sys._current_frames().items():
        stack, f = [], top
        while f is not None:
            stack.append(f"{f.f_code.co_name}:{f.f_lineno}")
            if f is frame:
                return f"thread {names.get(ident, ident)}: " + " < ".join(stack)
            f = f.f_back
    return "no thread runs it (a traceback, generator or coroutine holds it)"


def _referrers(type_name: str, depth: int = 4) -> list:
    """What holds the objects of one type: for each (at most 5), its referrers' types, `depth` levels up.
    `(dead) weakref`: weak references whose object is gone, which a registry that never lets go keeps."""
    if type_name == DEAD_WEAKREF:
        found = [o for o in gc.get_objects() if issubclass(type(o), weakref.ReferenceType) and o() is None][:5]
    else:
        found = [o for o in gc.get_objects() if _type_name(type(o)) == type_name][:5]

    def up(obj, level, seen):
        if level == 0:
            return []
        out = []
        for ref in gc.get_referrers(obj):
            if id(ref) in seen or ref is found:
                continue
            seen.add(id(ref))
            if isinstance(ref, type(sys._getframe())):  # a running (or traceback-held) frame: name it and its thread
                code = ref.f_code
                if code.co_filename == __file__:
                    continue  # this search's own
                # a frame costs no level: what holds it (a callee's frame, a traceback) is the answer
                out.append([f"frame {code.co_name} {code.co_filename}:{ref.f_lineno}",
                            [_frame_thread(ref)] + up(ref, level, seen)])
            else:
                label = _type_name(type(ref))
                if isinstance(ref, dict):
                    label += f" keys={list(ref)[:6]}"
                out.append([label, up(ref, level - 1, seen)])
            if len(out) >= 6:  # a frame is a holder like any other: at most 6 a level
                break
        return out

    return [[repr(o)[:120], up(o, depth, {id(found)})] for o in found]


def held() -> dict:
    """The sizes of the hub's per-turn and per-stream structures (each 0 when nothing runs)."""
    from channels_app import dispatch, fanout, notify
    from channels_app.runner import lease_keeper
    from ugent_site.db import base as sqlite_backend

    with notify._lock:
        topics = len(notify._waiters)
        waiters = sum(len(w) for w in notify._waiters.values())
    readers = fanout.hub().readers()
    threads = dispatch.turn_threads_counts()
    with sqlite_backend._queues_lock:
        queued_writers = sum(q.waiting for q in sqlite_backend._queues.values())
    return {"notify_topics": topics, "notify_waiters": waiters, "fanout_readers": len(readers),
            "fanout_subscribers": sum(len(r.taps) for r in readers), "leases_held": len(lease_keeper.held()),
            "sqlite_writers_queued": queued_writers,
            "turns_queued": threads["queued"], "turn_threads_stuck": threads["stuck"]}


def caches() -> dict:
    from channels_app import auth, tools
    from plugins_app.agent.engines import registry
    from ugent_common import rows
    return {"rows_sql": len(rows._qmark_sql), "rows_tables": len(rows._tables), "auth_keys_marked": len(auth._key_marked),
            "auth_digests": len(auth._digests), "tool_specs": len(tools._spec_cache),
            "engine_instances": len(registry._instances)}


def _db_status(lib, db: int, op: int) -> int:
    cur, high = ctypes.c_int(), ctypes.c_int()
    return cur.value if lib.sqlite3_db_status(ctypes.c_void_p(db), op, ctypes.byref(cur), ctypes.byref(high), 0) == 0 \
        else -1


def sqlite_connections(*, statements: bool = False) -> list[dict]:
    """Each Django connection open to SQLite in this process: its thread, and the bytes its page cache,
    schema and prepared statements hold (sqlite3_db_status), largest first, with how many statements it
    holds prepared (`stmts`: Python's sqlite3 keeps up to `cached_statements` a connection, 128 unless
    set) and, with `statements`, their SQL (`sql`, sqlite3_next_stmt / sqlite3_sql).

    Python's sqlite3 does not expose the `sqlite3 *` of a connection: it is read from the object itself,
    the first field after PyObject_HEAD in CPython (3.8 to 3.13, at least), and checked against the
    file the connection has open before it is used. A connection closed by its thread meanwhile
    could be freed under the reading: a debug hook's risk, on request only (`{"connections": true}`)."""
    import sqlite3
    from django.db.backends.base.base import BaseDatabaseWrapper
    lib = _libsqlite()
    if lib is None or sys.implementation.name != "cpython":
        return []
    lib.sqlite3_db_status.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.sqlite3_db_filename.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.sqlite3_db_filename.restype = ctypes.c_char_p
    lib.sqlite3_next_stmt.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.sqlite3_next_stmt.restype = ctypes.c_void_p
    lib.sqlite3_sql.argtypes = [ctypes.c_void_p]
    lib.sqlite3_sql.restype = ctypes.c_char_p
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    # by type(), not isinstance(): isinstance asks an object its __class__, which evaluates a lazy object
    # (a request's SimpleLazyObject user, say) and runs whatever it wraps, or raises. gc.get_objects()
    # does not list what gc.freeze() moved out of its reach (a connection opened before start-up's
    # freeze, such as the turn threads' own): those come from the connections opened since start().
    found = {id(o): o for o in gc.get_objects() if issubclass(type(o), BaseDatabaseWrapper)}
    found.update(_opened.items())
    for wrapper in found.values():
        conn = wrapper.connection
        if type(conn) is not sqlite3.Connection:
            continue
        db = ctypes.c_void_p.from_address(id(conn) + object.__basicsize__).value
        if not db:
            continue
        filename = (lib.sqlite3_db_filename(ctypes.c_void_p(db), b"main") or b"").decode(errors="replace")
        if os.path.realpath(filename) != os.path.realpath(str(wrapper.settings_dict["NAME"])):
            continue  # not the layout expected: read nothing through it
        sql, stmt = [], lib.sqlite3_next_stmt(ctypes.c_void_p(db), None)
        while stmt:
            sql.append((lib.sqlite3_sql(ctypes.c_void_p(stmt)) or b"").decode(errors="replace"))
            stmt = lib.sqlite3_next_stmt(ctypes.c_void_p(db), ctypes.c_void_p(stmt))
        # SQLITE_DBSTATUS_CACHE_USED 1, SCHEMA_USED 2, STMT_USED 3
        out.append({"thread": names.get(wrapper._thread_ident, str(wrapper._thread_ident)),
                    "cache_kb": _db_status(lib, db, 1) // 1024, "schema_kb": _db_status(lib, db, 2) // 1024,
                    "stmt_kb": _db_status(lib, db, 3) // 1024, "stmts": len(sql), **({"sql": sql} if statements else {})})
    return sorted(out, key=lambda c: -(c["cache_kb"] + c["schema_kb"] + c["stmt_kb"]))


def configured_cache_kib() -> int | None:
    """The cache_size (KiB) the default database's init_command gives each SQLite connection; None
    when Django is not set up or the command sets none (PostgreSQL has no init_command)."""
    import re
    try:
        from django.conf import settings
        if not settings.configured:
            return None
        db = settings.DATABASES["default"]
    except Exception:
        return None
    # by the command, not the ENGINE: embedded mode's is ugent_site.db, SQLite's with the writer queue
    found = re.search(r"PRAGMA\s+cache_size\s*=\s*(-?\d+)", db.get("OPTIONS", {}).get("init_command", ""), re.I)
    if found is None:
        return None
    value = int(found.group(1))
    return -value if value < 0 else value * 4  # negative: KiB; positive: pages (4 KiB)


def report(*, trim: bool = False, snapshot_path: Path | None = None, collect: bool = False,
           referrers: str = "", by_connection: bool = False, cache_keys: bool = False, maps: bool = False,
           statements: bool = False) -> dict:
    """The figures above, for this process, now (after a full collection with `collect`)."""
    if collect:
        gc.collect()
    status = _status()
    out: dict = {"pid": os.getpid(), "time": time.time(), "rss_kb": status.get("VmRSS", 0),
                 "rss_anon_kb": status.get("RssAnon", 0), "rss_file_kb": status.get("RssFile", 0),
                 "threads": threading.active_count(), "pymalloc": pymalloc()}
    libc = _libc()
    if libc is not None:
        m = libc.mallinfo2()
        out["malloc"] = {"arena_kb": m.arena // 1024, "mmapped_kb": m.hblkhd // 1024,
                         "in_use_kb": (m.uordblks + m.hblkhd) // 1024, "free_kb": m.fordblks // 1024,
                         "top_releasable_kb": m.keepcost // 1024}
    sqlite = _libsqlite()
    if sqlite is not None:
        out["sqlite"] = {"memory_used_kb": sqlite.sqlite3_memory_used() // 1024,
                         "highwater_kb": sqlite.sqlite3_memory_highwater(0) // 1024}
        # SQLITE_STATUS_PAGECACHE_OVERFLOW (2): page-cache pages malloc'd outside a SQLITE_CONFIG_PAGECACHE
        # buffer, which no build here configures: the pages every connection's cache holds now (beyond
        # the first bulk of each, ~20 pages), so the rest of memory_used_kb is schemas and statements
        cur, high = ctypes.c_int64(), ctypes.c_int64()
        if sqlite.sqlite3_status64(2, ctypes.byref(cur), ctypes.byref(high), 0) == 0:
            out["sqlite"].update(page_cache_kb=cur.value // 1024, page_cache_highwater_kb=high.value // 1024)
    out["python"] = {"allocated_blocks": sys.getallocatedblocks()}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        out["python"].update(traced_kb=current // 1024, traced_peak_kb=peak // 1024)
        if snapshot_path is not None:
            tracemalloc.take_snapshot().dump(str(snapshot_path))
            out["tracemalloc_snapshot"] = str(snapshot_path)
    try:
        out["held"] = held()
    except Exception as exc:  # a process that is not the daemon (no hub loaded): no figures
        out["held"] = {"error": repr(exc)}
    try:
        out["caches"] = caches()
    except Exception as exc:
        out["caches"] = {"error": repr(exc)}
    objects = gc.get_objects()
    counts = collections.Counter(_type_name(type(o)) for o in objects)
    # what the live weak references point at, by type ("(dead)" for one whose object is gone): a weakref is
    # small, and a set of them that only grows says which registry never lets go. (type(), never isinstance():
    # a lazy object answers isinstance() by evaluating what it wraps, a request's user say)
    out["weakref_referents"] = dict(collections.Counter(
        _weakref_referent(o) for o in objects if issubclass(type(o), weakref.ReferenceType)).most_common())
    del objects
    out["gc_objects"] = sum(counts.values())
    out["gc_types"] = dict(counts.most_common())  # (frozen objects are not among them: gc_frozen counts those)
    out["gc_frozen"] = gc.get_freeze_count()
    from ugent_common.malloctrim import trims
    out["malloc_trims"] = dict(trims)  # the periodic malloc_trim(0) so far (UGENT_MALLOC_TRIM_SECS)
    if "sqlite" in out:
        # each connection's page cache stops at cache_size: the daemon's (settings' init_command sets it
        # on every connection it opens), else SQLite's default, read from a connection of its own
        each_kb = configured_cache_kib()
        if each_kb is None:
            import sqlite3
            probe = sqlite3.connect(":memory:")
            try:
                (cache_size,) = probe.execute("PRAGMA cache_size").fetchone()
            finally:
                probe.close()
            each_kb = -cache_size if cache_size < 0 else cache_size * 4  # negative: KiB; positive: pages (4 KiB)
        connections = counts.get("sqlite3.Connection", 0)
        out["sqlite"].update(connections=connections, cache_size_kb=each_kb, page_cache_bound_kb=connections * each_kb)
    if cache_keys:
        from ugent_common import rows
        out["cache_keys"] = {"rows_sql": sorted(rows._qmark_sql)}
    if referrers:
        out["referrers"] = _referrers(referrers)
    if by_connection and "sqlite" in out:
        try:
            out["sqlite"]["by_connection"] = sqlite_connections(statements=statements)
        except Exception as exc:
            out["sqlite"]["by_connection"] = {"error": repr(exc)}
    if trim and libc is not None:
        libc.malloc_trim(0)
        after = _status()
        out["rss_after_trim_kb"] = after.get("VmRSS", 0)
        out["rss_after_trim_anon_kb"] = after.get("RssAnon", 0)
    if maps:
        out["mappings"] = mappings()  # (after the trim, when there is one)
    return out


#: Every Django connection opened since start(), by id, for as long as it lives.
_opened: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def _connection_opened(sender, connection, **kwargs) -> None:
    _opened[id(connection)] = connection


def start(mode: str, directory: Path) -> bool:
    """Install the SIGUSR2 hook when `mode` (UGENT_MEMSTATS) is on; True when it is."""
    global _started
    mode = (mode or "").strip().lower()
    if mode in ("", "0", "false", "off", "no") or _started:
        return False
    directory.mkdir(parents=True, exist_ok=True)
    from django.db.backends.signals import connection_created
    connection_created.connect(_connection_opened, weak=False, dispatch_uid="ugent-memstats")
    wanted = threading.Event()

    def write_reports():
        n = 0
        while True:
            wanted.wait()
            wanted.clear()
            n += 1
            base = directory / f"{os.getpid()}-{n}"
            try:
                request = directory / "request.json"
                asked = json.loads(request.read_text()) if request.exists() else {}
                request.unlink(missing_ok=True)
                if asked.get("tracemalloc") and not tracemalloc.is_tracing():
                    tracemalloc.start(int(asked["tracemalloc"]))
                snapshot = base.with_suffix(".tracemalloc") if asked.get("snapshot", True) else None
                data = report(trim=bool(asked.get("trim")), snapshot_path=snapshot,
                              collect=bool(asked.get("collect")), referrers=asked.get("referrers", ""),
                              by_connection=bool(asked.get("connections")),
                              cache_keys=bool(asked.get("cache_keys")), maps=bool(asked.get("maps")),
                              statements=bool(asked.get("statements")))
                tmp = base.with_suffix(".tmp")
                tmp.write_text(json.dumps(data, indent=1))
                tmp.rename(base.with_suffix(".json"))  # a reader never sees half a report
            except Exception:
                log.exception("memstats report failed")

    threading.Thread(target=write_reports, name="ugent-memstats", daemon=True).start()
    signal.signal(signal.SIGUSR2, lambda *_: wanted.set())
    _started = True
    log.warning("memstats on: kill -USR2 %s writes a memory report to %s", os.getpid(), directory)
    return True
