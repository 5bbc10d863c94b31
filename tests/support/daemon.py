"""Starting the real daemon for end-to-end tests, in either run mode.

Embedded: `manage.py rundaemon` (one process). Servers (REDIS_URL set): uvicorn
(the command the README gives) and a Celery worker as separate processes over
Redis and PostgreSQL.

A daemon starts on a copy of a database migrated once per test process (SQLite's backup, PostgreSQL's
CREATE DATABASE ... TEMPLATE): `migrate` on a new database was the heaviest part of a daemon's start, and
some thirty of them start in each pass of `make test`.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sqlite3
import tempfile
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.support.workers import static_root

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def web_command(port: int) -> list[str]:
    """The servers-mode web process as docs/deploy.md runs it (from the checkout's root)."""
    return [PY, "manage.py", "runweb", "--bind", "127.0.0.1", "--port", str(port)]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and to bind(0) (Linux), else 32768."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, for a process started seconds later to listen on. Taken below the ephemeral range:
    a port bind(0) gives back is one the kernel may hand to any outgoing connection (Redis, PostgreSQL,
    HTTP clients, of this or another test process) before the daemon binds it."""
    import random
    high = min(_ephemeral_low(), 65536)
    low = max(1024, high - 12000)
    for _ in range(100):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # (nothing free down there)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What a daemon has of its own; the rest of its environment may decide what its migrated database holds.
OWN_ENV = ("UGENT_VAR_DIR", "UGENT_WEB_API_KEY", "UGENT_WORKSPACE", "UGENT_SCRIPTED_LOG", "UGENT_CELERY_QUEUE",
           "DATABASE_URL", "UGENT_CRON_FILE")
#: What a daemon's processes read as they run, and neither migrate nor the profiles' shell write into the
#: database (names, or the start of names): daemons that differ only in these start from one template.
RUN_TIME_ENV = ("REDIS_URL", "UGENT_TURN_", "UGENT_COMPACT_", "UGENT_CRON_RUNNER_", "UGENT_CRON_WATCH",
                "UGENT_RULES_POLL_", "UGENT_RULES_HEARTBEAT_", "UGENT_METRICS_", "UGENT_LOG_", "UGENT_GC_",
                "UGENT_MEMSTATS", "UGENT_WARM_", "UGENT_SQLITE_CACHE_", "UGENT_TEST_", "UGENT_EXTRA_SUMMARIZERS",
                "UGENT_CONFIG_RECHECK_", "UGENT_SSE_")
#: (run mode, the rest of the environment) -> a migrated SQLite file, or a PostgreSQL database to copy
_templates: dict[tuple, object] = {}
#: This machine (or container) in a template's name, beside the process id
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _template_for(daemon: "Daemon"):
    key = (daemon.servers, tuple(sorted((k, v) for k, v in daemon.env.items()
                                        if k not in OWN_ENV and not k.startswith(RUN_TIME_ENV))))
    if key not in _templates:
        if daemon.servers:
            _sweep_templates(daemon.pg_admin)
            name = f"ugent_e2e_tpl_{os.getpid()}_{_HOST}_{uuid.uuid4().hex[:8]}"
            _pg(daemon.pg_admin, f'CREATE DATABASE "{name}"')
            atexit.register(_drop_template, daemon.pg_admin, name)
            _prepare_database({**daemon.env, "DATABASE_URL": daemon.env["DATABASE_URL"].rsplit("/", 1)[0] + "/" + name})
            _templates[key] = name
        else:
            where = Path(tempfile.mkdtemp(prefix="ugent-daemon-template-"))
            atexit.register(shutil.rmtree, where, True)
            _prepare_database({**daemon.env, "UGENT_VAR_DIR": str(where / "var"),
                               "UGENT_WORKSPACE": str(where / "workspace")})
            _templates[key] = where / "var" / "ugent.sqlite3"
    return _templates[key]


def _manage(env: dict, *args, check=True):
    return subprocess.run([PY, "manage.py", *args], cwd=ROOT, env=env, check=check, capture_output=True, text=True,
                          timeout=120)


def _prepare_database(env: dict) -> None:
    """Migrate the database `env` names and give it the tests' agent profiles, in one process (a second
    one cost another Django start, 1.5 s of CPU)."""
    _manage(env, "shell", "-c", (
        "from django.core.management import call_command;"
        "call_command('migrate', interactive=False, verbosity=0, skip_checks=False);"
        "from plugins_app.models import AgentProfile as P;"
        "P.objects.get_or_create(name='scripted', provider='scripted', defaults={'is_default': True});"
        f"P.objects.get_or_create(name='ugent-notes', provider='ugent-notes', "
        f"defaults={{'config': {{'path': '{ROOT / 'workspace' / 'notes'}'}}}})"))


def _pg(pg_admin: str, sql: str) -> None:
    import psycopg
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(sql)


def _sweep_templates(pg_admin: str) -> None:
    """Drop the templates of test processes that are gone without their exit's drop (killed, say)."""
    import psycopg
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        names = [n for (n,) in conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'ugent\\_e2e\\_tpl\\_%'").fetchall()]
    for name in names:
        parts = name.split("_")  # ugent, e2e, tpl, pid, host, random
        if len(parts) == 6 and parts[4] == _HOST and parts[3].isdigit() and not Path(f"/proc/{parts[3]}").exists():
            _drop_template(pg_admin, name)  # (only this host's: another machine's processes are not in /proc)


def _drop_template(pg_admin: str, name: str) -> None:
    try:
        _pg(pg_admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:  # the test run is ending: a leftover template is only disk space
        pass


def _sqlite_copy(source: Path, target: Path) -> None:
    """A consistent copy of a SQLite database (its WAL included), by SQLite's own backup."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


class Daemon:
    def __init__(self, tmp: Path, *, servers: bool | None = None, extra_env: dict | None = None,
                 beat: bool = False, worker_concurrency: int = 8, concurrency: int | None = None):
        self.tmp = tmp
        if concurrency is not None:  # turns at once in either mode: rundaemon's --concurrency, the worker's -c
            worker_concurrency = concurrency
        self.daemon_args = ["--concurrency", str(concurrency)] if concurrency is not None else []
        self.beat = beat  # servers mode: a `celery beat` process too (embedded mode always runs its own)
        self.worker_concurrency = worker_concurrency
        self.worker: subprocess.Popen | None = None
        self.servers = bool(os.environ.get("REDIS_URL")) if servers is None else servers
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.key = "ugk_e2e_" + uuid.uuid4().hex
        self.log = tmp / "scripted.log"
        self.procs: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
        self.env.update({
            "DJANGO_SETTINGS_MODULE": "ugent_site.settings",
            "UGENT_VAR_DIR": str(tmp / "var"),
            # one collectstatic for every daemon the suite starts (rundaemon collects only when files changed)
            "UGENT_STATIC_ROOT": str(static_root()),
            "UGENT_WEB_API_KEY": self.key,
            "UGENT_WORKSPACE": str(tmp / "workspace"),
            "UGENT_EXTRA_ENGINES": "scripted=tests.support.scripted:ScriptedEngine",
            "UGENT_SCRIPTED_LOG": str(self.log),
            "PYTHONPATH": str(ROOT),
            "UGENT_SSE_KEEPALIVE": "1",
            "UGENT_CELERY_QUEUE": "ugent-e2e-" + uuid.uuid4().hex[:8],
        })
        self.dbname = None
        if self.servers:
            self.dbname = "ugent_e2e_" + uuid.uuid4().hex[:10]
            base_db = os.environ.get("UGENT_TEST_PG", "postgres://root@127.0.0.1:5432/postgres")
            self.pg_admin = base_db
            self.env["DATABASE_URL"] = base_db.rsplit("/", 1)[0] + "/" + self.dbname
            self.env["REDIS_URL"] = os.environ["REDIS_URL"]
        else:
            self.env.pop("REDIS_URL", None)
            self.env.pop("DATABASE_URL", None)
        self.env.update(extra_env or {})

    def manage(self, *args, check=True):
        return _manage(self.env, *args, check=check)

    def _pg(self, sql: str):
        _pg(self.pg_admin, sql)

    def prepare(self):
        """The daemon's database, migrated and with the tests' agent profiles (a copy of a template), and its
        workspace; no process yet. For a test that sets the database up (`manage`) before the first start."""
        (self.tmp / "workspace").mkdir(parents=True, exist_ok=True)
        template = _template_for(self)
        if self.servers:
            self._pg(f'CREATE DATABASE "{self.dbname}" TEMPLATE "{template}"')
        else:
            (self.tmp / "var").mkdir(parents=True, exist_ok=True)
            _sqlite_copy(template, self.tmp / "var" / "ugent.sqlite3")
        return self

    def start(self):
        self.prepare()
        self.spawn()
        return self

    def spawn_worker(self, *, queues: str | None = None, concurrency: int | None = None) -> subprocess.Popen:
        """Servers mode: one more Celery worker (after kill_worker, the one that replaces it). `queues`: its
        -Q (both of the deployment's queues when None)."""
        out = open(self.tmp / "daemon.log", "ab")
        self.worker = subprocess.Popen(
            [PY, "-m", "celery", "-A", "ugent_site", "worker", "-P", "threads",
             "-c", str(concurrency or self.worker_concurrency), *(["-Q", queues] if queues else []),
             "-l", "WARNING", "--without-heartbeat", "--without-mingle", "--without-gossip",
             "-n", f"w{self.port}-{uuid.uuid4().hex[:6]}@%h"],
            cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(self.worker)
        return self.worker

    def kill_worker(self) -> None:
        """kill -9 the process running turns: the Celery worker (servers), the whole daemon (embedded)."""
        victims = [self.worker] if self.servers else list(self.procs)
        for p in victims:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            self.procs.remove(p)

    def sql(self, query: str, params=()) -> list[tuple]:
        """Read the daemon's database directly (its own file or database), as an operator would."""
        if self.servers:
            import psycopg
            with psycopg.connect(self.env["DATABASE_URL"], autocommit=True) as conn:
                cur = conn.execute(query.replace("?", "%s"), params)
                return cur.fetchall() if cur.description else []
        import sqlite3
        conn = sqlite3.connect(self.tmp / "var" / "ugent.sqlite3", timeout=30)
        try:
            rows = conn.execute(query, params).fetchall()
            conn.commit()  # (a write, as psycopg's autocommit above)
            return rows
        finally:
            conn.close()

    def spawn(self, wait: bool = True, *, worker: bool = True):
        """Start the daemon's processes; `wait`: until /v1/health answers. `worker`: servers mode, start one
        Celery worker on both queues (False: the test starts its own with spawn_worker)."""
        out = open(self.tmp / "daemon.log", "ab")
        if self.servers:
            if worker:
                self.spawn_worker()
            if self.beat:
                self.procs.append(subprocess.Popen(
                    [PY, "-m", "celery", "-A", "ugent_site", "beat", "-l", "WARNING", "--pidfile=",
                     "-S", "django_celery_beat.schedulers:DatabaseScheduler"],
                    cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            self.procs.append(subprocess.Popen(
                web_command(self.port),
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        else:
            self.procs.append(subprocess.Popen(
                [PY, "manage.py", "rundaemon", "--port", str(self.port), "--no-migrate", *self.daemon_args],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60):
        deadline = time.monotonic() + timeout
        # One client for every poll: httpx.get() makes a client each time, and each loads the CA bundle into
        # an SSL context (some 40 ms of CPU here; 35 s of a test pass's, at five polls a second of each start).
        with httpx.Client(timeout=1) as client:
            while time.monotonic() < deadline:
                for p in self.procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"daemon exited: {(self.tmp / 'daemon.log').read_text()[-3000:]}")
                try:
                    if client.get(self.base + "/v1/health").status_code == 200:
                        if self.servers and self.env.get("UGENT_WARM_AT_START") == "false":
                            time.sleep(1.0)  # the worker connects to the broker beside the web process
                        # (warming on, health waits for a warm worker: plugins_app/agent/warm.py)
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("daemon did not come up: " + (self.tmp / "daemon.log").read_text()[-3000:])

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> list[int]:
        codes = []
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        for p in self.procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(p.wait())
        self.procs = []
        return codes

    def close(self):
        self.stop()
        if self.servers and self.dbname:
            try:
                self._pg(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
            except Exception:
                pass

    def scripted_calls(self) -> list[str]:
        if not self.log.exists():
            return []
        import json
        return [json.loads(line)["last"] for line in self.log.read_text().splitlines() if line.strip()]
