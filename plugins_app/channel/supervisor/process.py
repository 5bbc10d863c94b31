"""Worker processes: spawning, process groups, two-phase stop, kill on drop, pid files.

Nothing here imports Django. A worker is started from a ``WorkerSpec`` and owned
by a ``WorkerHandle``:

* It leads its own session and process group (``start_new_session=True``), so
  every signal goes to the group (``os.killpg``) and reaches the worker's own
  children too.
* On Linux it asks for ``PR_SET_PDEATHSIG(SIGKILL)`` before ``exec``, so a
  supervisor killed with ``kill -9`` takes its workers with it. The kernel sends
  that signal when the *thread* that forked the worker exits, not the process:
  spawn workers only from one long-lived thread (the supervisor's loop thread),
  never from a short-lived helper thread or a thread pool.
* Its environment is exactly the spec's ``env`` plus a minimal ``PATH``,
  ``LANG`` and ``HOME`` (the spec may override them); nothing else leaks from
  the parent. A secret (the bridge token) is not put there: any process of the
  same user reads ``/proc/<pid>/environ``. ``spawn(secret_fds=...)`` writes it
  into a pipe the worker inherits and names the pipe's fd in the environment
  instead; the worker reads it once and closes it.
* With ``spec.memory_max_mb`` its data size is capped (``RLIMIT_DATA`` on Linux:
  heap, anonymous mappings and thread stacks; ``RLIMIT_AS`` elsewhere) before
  ``exec``: an allocation past it fails (Python raises ``MemoryError``), the
  worker exits and is restarted like any crash. Each process of the worker's
  group has the limit on its own; it is no cgroup total.
* Its stdout and stderr go through a pipe that a reader thread drains into
  ``<log_dir>/<plugin>.log``, rotated to ``.log.1`` … ``.log.<LOG_BACKUPS>``
  before it would pass ``log_max_bytes`` (``RotatingLog``): no file is ever
  over the cap, and the thread keeps draining even when the disk refuses a
  write, so the worker never blocks on a full pipe.
* A handle that is garbage-collected (or left at interpreter exit) while its
  worker lives kills the worker's process group ("kill on drop").
* ``kill(wait)`` waits for the SIGKILLed worker at most ``wait`` seconds: a
  process in uninterruptible sleep (D state: a hung NFS or FUSE read, a failing
  disk) dies only when its kernel call returns, and the supervisor's one loop
  thread must not wait for it. The handle then stays, ``poll()`` reaps the
  worker once it exits, and until then its pid file stays too.
* With a ``pid_dir`` it writes ``<pid_dir>/<plugin>.json`` holding the worker's
  pid, pgid, start time (field 22 of ``/proc/<pid>/stat``) and the supervisor's
  pid and start time, so ``reap_stale`` can kill what a crashed supervisor left
  behind without ever killing an unrelated process that reused the pid.

PDEATHSIG reaches only the worker itself. Processes the worker forked stay in
its process group and are killed by ``terminate``, by kill on drop, and, after a
supervisor crash, by ``reap_stale`` on the next start. A worker started through
a wrapper (``sh -c "python -m worker ; true"``) is such a grandchild: the SDK's
``ChannelWorker.die_with_parent`` asks for its own parent-death signal, so it
stops when the wrapper is killed (docs/plugins.md says why no subreaper).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ugent_common.digits import ascii_int

try:
    import fcntl
    import resource
except ImportError:  # not on Unix
    fcntl = resource = None

logger = logging.getLogger(__name__)

IS_LINUX = sys.platform.startswith("linux")
PR_SET_PDEATHSIG = 1

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_LANG = "C.UTF-8"

_POLL_SECS = 0.02

# How long kill() waits for a SIGKILLed worker to be reaped before it gives up for now (D state).
KILL_WAIT_SECS = 2.0

# The limit a worker's memory cap sets: on Linux (since 4.7) RLIMIT_DATA counts the heap, private
# writable mappings and thread stacks, not address space merely reserved (PROT_NONE), which RLIMIT_AS
# counts too (glibc's 64 MiB malloc arenas, a JVM's or Go's heap reservation); elsewhere RLIMIT_DATA
# leaves mmap out, so RLIMIT_AS is the one that holds.
MEMORY_RLIMIT = None if resource is None else (resource.RLIMIT_DATA if IS_LINUX else resource.RLIMIT_AS)

DEFAULT_LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3  # <plugin>.log.1 … .log.3 beside <plugin>.log
_READ_CHUNK = 64 * 1024
# How long reaping a worker waits for its log reader to reach the end of the pipe: once the
# group is killed that is at once, unless a grandchild that left the group still holds it.
_READER_JOIN_SECS = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What to run for one plugin: command, args, the worker's whole environment, cwd, memory cap.

    ``env`` is exactly what the worker sees, apart from a minimal PATH/LANG/HOME
    added when the spec does not set them. ``memory_max_mb`` caps each of its
    processes' data size (0: no cap). Two specs compare equal when a running
    worker would not need a restart.
    """

    plugin_id: str
    command: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    memory_max_mb: int = 0

    def __post_init__(self):
        # Normalise so a list and a tuple of the same args compare equal.
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        if isinstance(self.memory_max_mb, bool) or not isinstance(self.memory_max_mb, int) or self.memory_max_mb < 0:
            raise ValueError(f"memory_max_mb must be a whole number of MiB, 0 or more (0: no cap), "
                             f"not {self.memory_max_mb!r}")

    @property
    def argv(self) -> list[str]:
        return [self.command, *self.args]

    def with_env(self, extra: Mapping[str, str]) -> "WorkerSpec":
        return dataclasses.replace(self, env={**self.env, **extra})


def worker_environment(spec_env: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: the spec's env over a minimal PATH/LANG/HOME."""
    base = {
        "PATH": DEFAULT_PATH,
        "LANG": DEFAULT_LANG,
        "HOME": os.environ.get("HOME") or "/",
    }
    base.update(spec_env)
    return base


# --- /proc helpers ---------------------------------------------------------

@dataclass(frozen=True)
class ProcStat:
    """The few fields of ``/proc/<pid>/stat`` the supervisor needs."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int  # clock ticks since boot (field 22)


def read_proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed, or None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        # rest[0] is field 3 (state); field N is rest[N - 3].
        return ProcStat(pid=pid, state=rest[0], ppid=int(rest[1]), pgrp=int(rest[2]),
                        session=int(rest[3]), start_time=int(rest[19]))
    except (IndexError, ValueError):
        return None


def proc_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot), or None."""
    st = read_proc_stat(pid)
    return st.start_time if st else None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """The process exists and is not a zombie (and started at ``start_time`` if given)."""
    st = read_proc_stat(pid)
    if st is None:
        if IS_LINUX or start_time is not None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if st.state in ("Z", "X"):
        return False
    return start_time is None or st.start_time == start_time


def group_members(pgid: int) -> list[ProcStat]:
    """Live (non-zombie) processes in process group ``pgid``, from /proc."""
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        pid = ascii_int(name)
        if pid is None:
            continue
        st = read_proc_stat(pid)
        if st and st.pgrp == pgid and st.state not in ("Z", "X"):
            members.append(st)
    return members


def group_alive(pgid: int) -> bool:
    if IS_LINUX:
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.warning("not permitted to signal process group %s", pgid)
        return False


# --- parent-death signal ---------------------------------------------------

def _load_prctl():
    if not IS_LINUX:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.prctl
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


# Loaded once in the parent: the preexec hook runs between fork and exec, where it
# should do as little as possible (no imports, no library loading).
_PRCTL = _load_prctl()


def memory_limit_bytes(memory_max_mb: int) -> int | None:
    """The byte limit a worker capped at ``memory_max_mb`` gets; None for no cap (0, or no
    setrlimit here). Never above this process's own hard limit, which the worker could not raise."""
    if not memory_max_mb or MEMORY_RLIMIT is None:
        return None
    limit = memory_max_mb * 1024 * 1024
    hard = resource.getrlimit(MEMORY_RLIMIT)[1]
    return limit if hard == resource.RLIM_INFINITY else min(limit, hard)


def _make_preexec(sig: int | None, memory_bytes: int | None = None):
    from ugent_common import affinity
    # a worker gets back the CPUs the daemon had before pinning itself (ugent_common.affinity)
    restore = affinity.original is not None
    if sig is not None and _PRCTL is None:
        sig = None
    if sig is None and memory_bytes is None:
        return affinity.restore_in_child if restore else None
    parent_pid = os.getpid()
    prctl = _PRCTL
    setrlimit, which = (resource.setrlimit, MEMORY_RLIMIT) if memory_bytes is not None else (None, None)

    def preexec():
        affinity.restore_in_child()
        if sig is not None:
            prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
            # The parent may have died before prctl took effect: no signal would come.
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
        if setrlimit is not None:
            # last (nothing after it may need to allocate past the cap); soft and hard alike: the worker
            # cannot lift its own cap
            setrlimit(which, (memory_bytes, memory_bytes))

    return preexec


# --- file names ------------------------------------------------------------

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


def safe_name(plugin_id: str) -> str:
    """A file name for a plugin id; ids that are not already safe get a hash suffix."""
    if _SAFE.match(plugin_id):
        return plugin_id
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", plugin_id)[:80].lstrip(".") or "plugin"
    return f"{cleaned}-{hashlib.sha1(plugin_id.encode()).hexdigest()[:8]}"


def pid_file_path(pid_dir: str | os.PathLike, plugin_id: str) -> Path:
    return Path(pid_dir) / f"{safe_name(plugin_id)}.json"


def log_file_path(log_dir: str | os.PathLike, plugin_id: str) -> Path:
    return Path(log_dir) / f"{safe_name(plugin_id)}.log"


def rotated_log_path(path: Path, n: int) -> Path:
    return path if n == 0 else path.with_name(f"{path.name}.{n}")


# One lock for every log write in this process: a restarted worker's reader and the reader
# still draining a grandchild of its previous run write the same file.
_LOG_LOCK = threading.Lock()


class RotatingLog:
    """A worker's log file, never over ``max_bytes``: before a write would pass the cap the
    file moves to ``.1`` (``.1`` to ``.2`` …, the oldest beyond ``backups`` dropped) and a
    new one starts. A single write larger than the cap keeps only its last ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_LOG_MAX_BYTES, backups: int = LOG_BACKUPS):
        if max_bytes < 1:
            raise ValueError(f"log max_bytes must be at least 1, not {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd: int | None = None

    def _current_fd(self) -> int:
        # Reopen when another writer rotated the file away from under this one.
        if self._fd is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return self._fd
            except FileNotFoundError:
                pass
            fd, self._fd = self._fd, None
            os.close(fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return self._fd

    def _rotate(self) -> None:
        for n in range(self.backups, 0, -1):
            try:
                os.replace(rotated_log_path(self.path, n - 1), rotated_log_path(self.path, n))
            except FileNotFoundError:
                pass
        if self.backups == 0:
            _unlink(self.path)

    def write(self, data: bytes) -> None:
        data = data[-self.max_bytes:]
        with _LOG_LOCK:
            fd = self._current_fd()
            if os.fstat(fd).st_size + len(data) > self.max_bytes:
                self._rotate()
                fd = self._current_fd()
            os.write(fd, data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_log_tail(path: Path, max_bytes: int) -> tuple[bytes, bool]:
    """The last ``max_bytes`` a worker wrote, across ``<plugin>.log`` and the files it was
    rotated to; and whether older bytes were left out (the first line may then be cut).
    Raises ``OSError`` when there is no log at all."""
    parts: list[bytes] = []
    wanted = max_bytes
    n = 0
    older = False  # bytes before the window: in the last file read, or in a file rotated before it
    while wanted > 0:
        try:
            with open(rotated_log_path(path, n), "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - wanted))
                parts.insert(0, fh.read())
                older = size > len(parts[0])
        except FileNotFoundError:
            if n == 0:
                raise
            return b"".join(parts), False
        wanted -= len(parts[0])
        n += 1
    return b"".join(parts), older or rotated_log_path(path, n).exists()


def _drain(fd: int, log: RotatingLog) -> None:
    """Copy the worker's pipe into its log until every writer has closed it. Never stops
    reading early: a write the disk refuses drops those bytes, not the worker's progress."""
    failed = False
    try:
        while True:
            try:
                data = os.read(fd, _READ_CHUNK)
            except InterruptedError:
                continue
            if not data:
                return
            try:
                log.write(data)
            except OSError as exc:
                if not failed:
                    logger.error("cannot write worker log %s (output dropped): %s", log.path, exc)
                failed = True
    finally:
        os.close(fd)
        log.close()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _unlink(path: Path | None) -> None:
    if path is None:
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# --- the handle ------------------------------------------------------------

class _Proc:
    """State shared by a handle and its drop finalizer (which must not hold the handle)."""

    __slots__ = ("plugin_id", "popen", "pgid", "pid_file", "pid_file_owner", "group_done", "log_reader")

    def __init__(self, plugin_id: str, popen: subprocess.Popen, pgid: int, pid_file: Path | None,
                 log_reader: threading.Thread | None = None):
        self.plugin_id = plugin_id
        self.popen = popen
        self.pgid = pgid
        self.pid_file = pid_file
        self.pid_file_owner = None  # (pid, start_time) written into pid_file
        self.group_done = False
        self.log_reader = log_reader

    def finish(self) -> None:
        """Leader reaped: kill stragglers in its group once, drop the pid file."""
        if self.group_done:
            return
        # Safe after the leader is reaped: Linux keeps a pid number reserved while
        # any process still uses it as a pgid, so this reaches only our group.
        _killpg(self.pgid, signal.SIGKILL)
        self.group_done = True
        self._remove_pid_file()
        # So that a reaped worker's last words are in its log when poll() says it exited.
        if self.log_reader is not None and self.log_reader is not threading.current_thread():
            self.log_reader.join(_READER_JOIN_SECS)

    def _remove_pid_file(self) -> None:
        path = self.pid_file
        if path is None:
            return
        try:
            with open(path) as fh:
                data = json.load(fh)
            # A newer start of the same plugin may already have rewritten the file.
            if (data.get("pid"), data.get("start_time")) != self.pid_file_owner:
                return
        except (OSError, ValueError):
            return
        _unlink(path)


def _kill_dropped(proc: _Proc) -> None:
    popen = proc.popen
    if popen.poll() is None:
        _killpg(proc.pgid, signal.SIGKILL)
        try:
            popen.wait(timeout=KILL_WAIT_SECS)
        except subprocess.TimeoutExpired:
            # its pid file stays, so the next supervisor's reap_stale finds it
            logger.error("plugin %s worker pid %s did not die after SIGKILL", proc.plugin_id, popen.pid)
            return
    proc.finish()


def _secret_pipes(secrets: Mapping[str, str]) -> tuple[dict[str, str], list[int]]:
    """For each (name, value): a pipe holding the value, its write end closed, and ``name`` =
    the read end's fd number in the environment returned. The caller passes the fds and closes them."""
    env: dict[str, str] = {}
    fds: list[int] = []
    try:
        for name, value in secrets.items():
            data = str(value).encode()
            if len(data) > select.PIPE_BUF:
                raise ValueError(f"{name}: a secret passed on a pipe must fit its buffer ({len(data)} bytes)")
            read_end, write_end = os.pipe()
            try:
                os.write(write_end, data)  # fits the pipe's buffer: never blocks
            finally:
                os.close(write_end)
            if read_end < 3 and fcntl is not None:
                # the child's stdin/stdout/stderr are set up over fds 0-2 (a daemon may have closed its own)
                low, read_end = read_end, fcntl.fcntl(read_end, fcntl.F_DUPFD_CLOEXEC, 3)
                os.close(low)
            fds.append(read_end)
            env[name] = str(read_end)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return env, fds


class WorkerHandle:
    """One running worker process, leader of its own process group.

    Create with ``WorkerHandle.spawn``. ``poll()`` reaps an exit (and kills
    anything left in the worker's group); ``terminate(grace)`` stops it in two
    phases. Dropping the last reference to a live handle kills its group.
    """

    def __init__(self, spec: WorkerSpec, popen: subprocess.Popen, *, started_at: float,
                 started_monotonic: float, pid_file: Path | None, log_path: Path | None,
                 log_reader: threading.Thread | None = None):
        self.spec = spec
        self.started_at = started_at
        self.started_monotonic = started_monotonic
        self.log_path = log_path
        self._proc = _Proc(spec.plugin_id, popen, popen.pid, pid_file, log_reader)
        self._finalizer = weakref.finalize(self, _kill_dropped, self._proc)

    @classmethod
    def spawn(cls, spec: WorkerSpec, *, log_dir: str | os.PathLike | None = None,
              pid_dir: str | os.PathLike | None = None,
              pdeathsig: int | None = signal.SIGKILL,
              log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
              secret_fds: Mapping[str, str] | None = None) -> "WorkerHandle":
        """Start ``spec`` as a new session and process group.

        Call from the supervisor's long-lived loop thread: the parent-death
        signal fires when the spawning thread exits. ``pdeathsig=None`` turns it
        off. Its output goes to ``<log_dir>/<plugin>.log``, capped at
        ``log_max_bytes`` with ``LOG_BACKUPS`` rotated files. Each
        ``secret_fds`` value is written into a pipe the worker inherits, and its
        name is set in the worker's environment to that pipe's fd number (the
        value itself is in no environment). Raises ``OSError`` if the command
        cannot be started.
        """
        memory_bytes = memory_limit_bytes(spec.memory_max_mb)
        secret_env, fds = _secret_pipes(secret_fds or {})
        try:
            return cls._spawn(spec, log_dir=log_dir, pid_dir=pid_dir,
                              preexec=_make_preexec(pdeathsig, memory_bytes), log_max_bytes=log_max_bytes,
                              secret_env=secret_env, pass_fds=fds)
        finally:
            for fd in fds:  # the worker has its own copies now
                os.close(fd)

    @classmethod
    def _spawn(cls, spec: WorkerSpec, *, log_dir, pid_dir, preexec, log_max_bytes: int,
               secret_env: Mapping[str, str], pass_fds: Sequence[int]) -> "WorkerHandle":
        log_path = log = read_end = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            log_path = log_file_path(log_dir, spec.plugin_id)
            log = RotatingLog(log_path, log_max_bytes)
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            cap = f" (memory cap {spec.memory_max_mb} MiB)" if spec.memory_max_mb else ""
            try:
                log.write(f"--- {stamp} starting {spec.argv!r}{cap}\n".encode())
                read_end, out = os.pipe()  # neither end is inherited by later workers
            except OSError:
                log.close()
                raise
        else:
            out = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            popen = subprocess.Popen(
                spec.argv,
                env=worker_environment({**spec.env, **secret_env}),
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                close_fds=True,
                pass_fds=tuple(pass_fds),
                start_new_session=True,
                preexec_fn=preexec,
            )
        except BaseException:
            if read_end is not None:
                os.close(read_end)
                log.close()
            raise
        finally:
            os.close(out)
        reader = None
        if read_end is not None:
            # Holds only the pipe and the file, never the handle: kill on drop still works,
            # and the thread ends when the last process holding the pipe's write end does.
            reader = threading.Thread(target=_drain, args=(read_end, log), daemon=True,
                                      name=f"plugin-log-{spec.plugin_id}")
            reader.start()
        handle = cls(spec, popen, started_at=time.time(), started_monotonic=time.monotonic(),
                     pid_file=pid_file_path(pid_dir, spec.plugin_id) if pid_dir is not None else None,
                     log_path=log_path, log_reader=reader)
        if pid_dir is not None:
            handle._write_pid_file(Path(pid_dir))
        return handle

    def _write_pid_file(self, pid_dir: Path) -> None:
        pid_dir.mkdir(parents=True, exist_ok=True)
        start_time = proc_start_time(self.pid)
        data = {
            "plugin_id": self.spec.plugin_id,
            "pid": self.pid,
            "pgid": self._proc.pgid,
            "start_time": start_time,
            "supervisor_pid": os.getpid(),
            "supervisor_start_time": proc_start_time(os.getpid()),
            "command": self.spec.argv,
        }
        try:
            _write_json_atomic(self._proc.pid_file, data)
            self._proc.pid_file_owner = (self.pid, start_time)
        except OSError:
            logger.exception("could not write pid file for plugin %s", self.spec.plugin_id)

    @property
    def pid(self) -> int:
        return self._proc.popen.pid

    @property
    def pgid(self) -> int:
        return self._proc.pgid

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped: negative for a signal, as ``subprocess`` reports it."""
        return self._proc.popen.returncode

    def poll(self) -> int | None:
        """The exit status if the worker has exited (its group is then killed), else None."""
        code = self._proc.popen.poll()
        if code is not None:
            self._proc.finish()
        return code

    def running(self) -> bool:
        return self.poll() is None

    def send_signal(self, sig: int) -> bool:
        """Signal the worker's whole process group (nothing once it is reaped and cleaned up)."""
        if self._proc.group_done:
            return False
        return _killpg(self._proc.pgid, sig)

    def stopped(self) -> bool:
        """The leader is reaped and nothing is left in its group."""
        if self._proc.popen.poll() is None:
            return False
        return self._proc.group_done or not group_alive(self._proc.pgid)

    def kill(self, wait: float = KILL_WAIT_SECS) -> int | None:
        """SIGKILL the group and reap the leader, waiting at most ``wait`` seconds for it.

        None when the leader has not died by then: SIGKILL takes effect only when
        a process leaves the kernel, and one in uninterruptible sleep (D state)
        may not for a long while. The handle keeps it; ``poll()`` reaps it once it
        exits (and only then is its pid file removed).
        """
        self.send_signal(signal.SIGKILL)
        try:
            code = self._proc.popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None
        self._proc.finish()
        return code

    def terminate(self, grace: float = 5.0, wait: float = KILL_WAIT_SECS) -> int | None:
        """Two-phase stop: SIGTERM to the group, up to ``grace`` seconds, then ``kill(wait)``."""
        self.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.stopped():
            time.sleep(_POLL_SECS)
        return self.kill(wait)

    def detach(self) -> None:
        """Forget the worker without killing it (turns off kill on drop)."""
        self._finalizer.detach()

    def __repr__(self):
        return f"<WorkerHandle {self.spec.plugin_id} pid={self.pid} rc={self.returncode}>"


# --- stale workers ---------------------------------------------------------

@dataclass(frozen=True)
class ReapedWorker:
    """A worker left by a crashed supervisor, the pids ``reap_stale`` killed for it, and those
    of them still alive after SIGKILL and the wait (in uninterruptible sleep)."""

    plugin_id: str
    pid: int
    pgid: int
    command: list
    killed: tuple[int, ...]
    survivors: tuple[ProcStat, ...] = ()


def _signal_stale(data: dict, targets: list[ProcStat], sig: int) -> None:
    if not targets:
        return
    pid, pgid = int(data["pid"]), int(data["pgid"])
    if any(st.pid == pid for st in targets):
        # The verified leader holds the pgid, so the group is certainly the worker's.
        _killpg(pgid, sig)
        return
    for st in targets:
        try:
            os.kill(st.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stale_targets(data: dict) -> list[ProcStat]:
    """The processes of a stale worker that may safely be killed (possibly none)."""
    pid, pgid, start_time = int(data["pid"]), int(data["pgid"]), data.get("start_time")
    if start_time is None:
        return []
    leader = read_proc_stat(pid)
    if leader is not None:
        if leader.start_time != start_time:
            return []  # the pid was reused: the old group is gone, this is someone else
        return [st for st in group_members(pgid) if st.start_time >= start_time]
    # The leader is gone (PDEATHSIG) but its children may linger in its group. While
    # any of them lives the pgid number stays reserved, so members of our worker's
    # session that started after it are its offspring.
    return [st for st in group_members(pgid)
            if st.session == pgid and st.start_time >= start_time]


def reap_stale(pid_dir: str | os.PathLike, *, grace: float = 2.0,
               kill_wait: float = KILL_WAIT_SECS) -> list[ReapedWorker]:
    """Kill workers left behind by supervisors that are no longer running.

    A pid file is stale when its supervisor (pid *and* start time) is not alive.
    For a stale file: if the worker's pid still runs with the recorded start
    time, its process group gets SIGTERM, ``grace`` seconds, then SIGKILL; if
    the leader died but processes of its group and session remain, those are
    killed the same way. A pid now held by a process with a different start
    time (reuse) is left alone. Every stale file is removed, but for a worker
    that SIGKILL has not ended within ``kill_wait`` seconds (D state): its file
    stays, and its ``ReapedWorker`` names the survivors, so the caller does not
    start the plugin again on top of them. Files of a live supervisor are kept.
    Without /proc nothing can be verified, so nothing is killed.
    """
    reaped: list[ReapedWorker] = []
    directory = Path(pid_dir)
    if not directory.is_dir():
        return reaped
    stale: list[tuple[Path, dict, list[ProcStat]]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            with open(path) as fh:
                data = json.load(fh)
            int(data["pid"]), int(data["pgid"]), int(data["supervisor_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("removing unreadable pid file %s", path)
            _unlink(path)
            continue
        sup_pid, sup_start = int(data["supervisor_pid"]), data.get("supervisor_start_time")
        if sup_start is not None and pid_alive(sup_pid, sup_start):
            continue
        stale.append((path, data, _stale_targets(data)))

    targets = [st for _, _, sts in stale for st in sts]
    if targets:
        for _, data, sts in stale:
            _signal_stale(data, sts, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(st.pid, st.start_time) for st in targets):
            time.sleep(_POLL_SECS)
        for _, data, _sts in stale:
            # Looked up afresh so a pid freed (and reused) during the grace is spared.
            _signal_stale(data, _stale_targets(data), signal.SIGKILL)
        deadline = time.monotonic() + kill_wait
        while time.monotonic() < deadline and any(pid_alive(st.pid, st.start_time) for st in targets):
            time.sleep(_POLL_SECS)

    for path, data, sts in stale:
        survivors = tuple(st for st in sts if pid_alive(st.pid, st.start_time))
        if sts:
            logger.warning("reaped stale worker of plugin %s (pids %s)", data.get("plugin_id"),
                           [st.pid for st in sts])
            reaped.append(ReapedWorker(plugin_id=str(data.get("plugin_id", path.stem)),
                                       pid=int(data["pid"]), pgid=int(data["pgid"]),
                                       command=list(data.get("command") or []),
                                       killed=tuple(st.pid for st in sts), survivors=survivors))
        if survivors:
            logger.error("stale worker of plugin %s did not die after SIGKILL (pids %s): its pid file %s "
                         "is kept, and the plugin is not started again until they are gone",
                         data.get("plugin_id"), [st.pid for st in survivors], path)
        else:
            _unlink(path)
    return reaped
