"""The servers-mode layout of docs/deploy.md, started locally on free ports: for tests and the bench.

    python tests/support/layout.py up [--dir DIR]     # start it, print its addresses, run until Ctrl-C
    python tests/support/layout.py services           # only make sure the private PostgreSQL and Redis run

What it starts, each process with its own log file under DIR:

  * a private PostgreSQL cluster (Debian's `pg_createcluster`, cluster `ugentlayout`, port 5441, trust auth
    on loopback) and a private Redis (port 6391, no persistence): created when missing, reused when
    running, never the shared 5432/6379, so the tests may restart them;
  * HAProxy with deploy/haproxy.cfg (installed from Debian's packages when missing, as
    scripts/ensure-chromium.sh does for chromium) in front of
  * two uvicorn web processes (web-a, web-b), two Celery workers (worker-a, worker-b), one beat and one
    `manage.py runsupervisor`, over a database and a Celery queue of this layout's own.

Each worker's scripted engine (tests/support/scripted.py) logs to its own file, so a test can tell which
worker ran a turn; HAProxy names the web process that answered in `X-Ugent-Web`.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

if __name__ == "__main__":  # run as a script: tests/support/http.py must not stand in for the stdlib's http
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.support.daemon import PY, free_port, web_command  # noqa: E402
from tests.support.workers import static_root  # noqa: E402

PG_CLUSTER = os.environ.get("UGENT_LAYOUT_PG_CLUSTER", "ugentlayout")
PG_PORT = int(os.environ.get("UGENT_LAYOUT_PG_PORT", "5441"))
REDIS_PORT = int(os.environ.get("UGENT_LAYOUT_REDIS_PORT", "6391"))
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
WEBS = ("web-a", "web-b")
WORKERS = ("worker-a", "worker-b")


class LayoutError(RuntimeError):
    pass


def _run(*cmd, check=True, **kw):
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=120, **kw)


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise LayoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _sudo() -> list[str]:
    return [] if os.geteuid() == 0 or not shutil.which("sudo") else ["sudo"]


def ensure_haproxy() -> str:
    """HAProxy's path, installing Debian's package first when it is missing."""
    path = shutil.which("haproxy") or (os.path.exists("/usr/sbin/haproxy") and "/usr/sbin/haproxy")
    if path:
        return path
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(*_sudo(), "apt-get", "update", "-qq", env=env)
    _run(*_sudo(), "apt-get", "install", "-y", "-qq", "haproxy", env=env)
    path = shutil.which("haproxy") or (os.path.exists("/usr/sbin/haproxy") and "/usr/sbin/haproxy")
    if not path:
        raise LayoutError("haproxy could not be installed")
    return path


# --- the private PostgreSQL ---------------------------------------------------------------------

class PrivatePostgres:
    """A PostgreSQL cluster of the layout's own on PG_PORT (Debian's cluster tools, as root)."""

    def __init__(self, port: int = PG_PORT, cluster: str = PG_CLUSTER):
        self.port, self.cluster = port, cluster
        self.version = self._version()

    @staticmethod
    def _version() -> str:
        versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
        if not versions:
            raise LayoutError("no PostgreSQL server installed (Debian's postgresql package)")
        return versions[-1].split("/")[4]

    @property
    def admin_url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, dbname: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def _ctl(self, action: str, *extra: str):
        return _run(*_sudo(), "pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.cluster, action,
                    *extra, check=False)

    def exists(self) -> bool:
        return os.path.isdir(f"/etc/postgresql/{self.version}/{self.cluster}")

    def ready(self) -> bool:
        return _run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-q", check=False).returncode == 0

    def ensure(self) -> "PrivatePostgres":
        if not self.exists():
            _run(*_sudo(), "pg_createcluster", self.version, self.cluster, "-p", str(self.port),
                 "--", "--auth=trust")
        if not self.ready():
            self.start()
        return self

    def start(self):
        self._ctl("start")
        wait_until(self.ready, 60, what=f"PostgreSQL on port {self.port}")

    def stop(self):
        self._ctl("stop", "-m", "fast")
        wait_until(lambda: not self.ready(), 60, what=f"PostgreSQL on port {self.port} to stop")

    def sql(self, statement: str, dbname: str = "postgres", params=()):
        import psycopg
        with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=10) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else None


# --- the private Redis --------------------------------------------------------------------------

class PrivateRedis:
    """A Redis of the layout's own on REDIS_PORT, without persistence: a restart comes back empty."""

    def __init__(self, port: int = REDIS_PORT, workdir: Path | None = None):
        self.port = port
        self.workdir = workdir or Path(tempfile.gettempdir()) / f"ugent-layout-redis-{port}"

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cli(self, *args, check=False):
        return _run("redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args, check=check)

    def ready(self) -> bool:
        return self.cli("ping").stdout.strip() == "PONG"

    def ensure(self) -> "PrivateRedis":
        if not self.ready():
            self.start()
        return self

    def start(self):
        if not shutil.which("redis-server"):
            raise LayoutError("redis-server is not installed (Debian's redis-server package)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        _run("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "yes", "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"),
             "--pidfile", str(self.workdir / "redis.pid"))
        wait_until(self.ready, 30, what=f"Redis on port {self.port}")

    def stop(self):
        self.cli("shutdown", "nosave")
        wait_until(lambda: not self.ready(), 30, what=f"Redis on port {self.port} to stop")

    def restart(self):
        self.stop()
        self.start()


def ensure_services() -> tuple[PrivatePostgres, PrivateRedis]:
    return PrivatePostgres().ensure(), PrivateRedis().ensure()


# --- the layout ---------------------------------------------------------------------------------

class Layout:
    """Proxy, two web processes, two workers, beat and the supervisor, over the private services."""

    def __init__(self, tmp: Path, *, extra_env: dict | None = None, worker_concurrency: int = 4):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.pg, self.redis = ensure_services()
        self.haproxy = ensure_haproxy()
        self.worker_concurrency = worker_concurrency
        self.dbname = "ugent_layout_" + uuid.uuid4().hex[:10]
        self.key = "ugk_layout_" + uuid.uuid4().hex
        self.proxy_port = free_port()
        self.base = f"http://127.0.0.1:{self.proxy_port}"
        self.web_ports = {name: free_port() for name in WEBS}
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST", "UGENT_"))}
        self.env.update({
            "DJANGO_SETTINGS_MODULE": "ugent_site.settings",
            "DATABASE_URL": self.pg.url(self.dbname),
            "REDIS_URL": self.redis.url(0),
            "UGENT_CELERY_QUEUE": "ugent-layout-" + uuid.uuid4().hex[:8],
            "UGENT_VAR_DIR": str(self.tmp / "var"),
            "UGENT_STATIC_ROOT": str(static_root()),
            "UGENT_WEB_API_KEY": self.key,
            "UGENT_WORKSPACE": str(self.tmp / "workspace"),
            "UGENT_EXTRA_ENGINES": "scripted=tests.support.scripted:ScriptedEngine",
            "UGENT_PLUGIN_RUN_DIR": str(self.tmp / "var" / "run" / "plugins"),
            "UGENT_GLOBAL_PLUGINS_TOML": str(self.tmp / "plugins.toml"),
            "PYTHONPATH": str(ROOT),
            "UGENT_SSE_KEEPALIVE": "1",
        })
        self.env.update(extra_env or {})

    # where each process writes
    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def scripted_log(self, worker: str) -> Path:
        return self.tmp / f"scripted-{worker}.log"

    def read_log(self, name: str) -> str:
        p = self.log(name)
        return p.read_text(errors="replace") if p.exists() else ""

    def web_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.web_ports[name]}"

    def manage(self, *args):
        return subprocess.run([PY, "manage.py", *args], cwd=ROOT, env=self.env, check=True, capture_output=True,
                              text=True, timeout=180)

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        out = open(self.log(name), "ab")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def start(self, profiles_shell: str | None = None) -> "Layout":
        (self.tmp / "workspace").mkdir(parents=True, exist_ok=True)
        self.pg.sql(f'CREATE DATABASE "{self.dbname}"')
        self.manage("migrate", "--noinput")
        self.manage("shell", "-c", profiles_shell or (
            "from plugins_app.models import AgentProfile as P;"
            "P.objects.get_or_create(name='scripted', provider='scripted', defaults={'is_default': True})"))
        for name in WORKERS:
            self.spawn_worker(name)
        self._spawn("beat", [PY, "-m", "celery", "-A", "ugent_site", "beat", "-l", "WARNING", "--pidfile=",
                             "-s", str(self.tmp / "beat-schedule"),
                             "-S", "django_celery_beat.schedulers:DatabaseScheduler"])
        self._spawn("supervisor", [PY, "manage.py", "runsupervisor"])
        for name in WEBS:
            self.spawn_web(name)
        self._spawn("proxy", [self.haproxy, "-db", "-f", str(HAPROXY_CFG)], env={
            **self.env, "UGENT_PROXY_BIND": f"127.0.0.1:{self.proxy_port}",
            "UGENT_WEB_A": f"127.0.0.1:{self.web_ports['web-a']}",
            "UGENT_WEB_B": f"127.0.0.1:{self.web_ports['web-b']}"})
        self.wait_ready()
        return self

    def spawn_web(self, name: str) -> subprocess.Popen:
        return self._spawn(name, web_command(self.web_ports[name]))

    def spawn_worker(self, name: str) -> subprocess.Popen:
        env = {**self.env, "UGENT_SCRIPTED_LOG": str(self.scripted_log(name))}
        return self._spawn(name, [
            PY, "-m", "celery", "-A", "ugent_site", "worker", "-P", "threads", "-c", str(self.worker_concurrency),
            "-l", "WARNING", "--without-heartbeat", "--without-mingle", "--without-gossip",
            "-n", f"{name}-{self.proxy_port}@%h"], env=env)

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(30)

    def served_by(self) -> set[str]:
        """The web processes HAProxy reaches now (one health request each way round)."""
        seen = set()
        for _ in range(4):
            r = httpx.get(self.base + "/v1/health", timeout=5)
            if r.status_code == 200:
                seen.add(r.headers.get("x-ugent-web"))
        return seen

    def workers_pinged(self) -> bool:
        r = subprocess.run([PY, "-m", "celery", "-A", "ugent_site", "inspect", "ping", "--timeout", "3"],
                           cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        return all(f"{w}-{self.proxy_port}@" in r.stdout for w in WORKERS)

    def wait_ready(self, timeout: float = 120):
        def up():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise LayoutError(f"{name} exited:\n{self.read_log(name)[-3000:]}")
            return self.served_by() == set(WEBS)
        try:
            wait_until(up, timeout, interval=0.3, what="both web processes behind the proxy")
        except LayoutError as exc:
            if "exited" in str(exc):
                raise
            raise LayoutError(str(exc) + "\n" + "\n".join(f"--- {n}\n{self.read_log(n)[-1500:]}" for n in self.procs))
        wait_until(self.workers_pinged, timeout, interval=0.5, what="both Celery workers")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def sql(self, query: str, params=()) -> list[tuple]:
        return self.pg.sql(query.replace("?", "%s"), self.dbname, params) or []

    def stop(self, timeout: float = 20):
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = {}

    def close(self):
        self.stop()
        try:
            if not self.pg.ready():
                self.pg.start()
            self.pg.sql(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        except Exception:
            pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "services"])
    ap.add_argument("--dir", help="where the logs go (default: a new temporary directory)")
    args = ap.parse_args(argv)
    if args.command == "services":
        pg, redis = ensure_services()
        print(f"postgresql {pg.admin_url}\nredis {redis.url()}")
        return
    layout = Layout(Path(args.dir or tempfile.mkdtemp(prefix="ugent-layout-"))).start()
    print(f"proxy {layout.base}\nkey {layout.key}\nlogs {layout.tmp}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        layout.close()


if __name__ == "__main__":
    main()
