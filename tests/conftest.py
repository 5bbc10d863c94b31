"""The shared cast: an operator, an application caller, two end users, an outsider."""
from __future__ import annotations

import os

import pytest

from plugins_app.agent.engines.registry import register_engine, reset as reset_engines
from tests.support.scripted import ScriptedEngine

register_engine("scripted", ScriptedEngine)

# This process is the tests' own, not a started daemon: it never freezes what it holds (ugent_common/gcfreeze.py),
# since frozen objects leave gc.get_objects(), which the memory tests count. tests/test_gcfreeze.py starts
# processes of its own.
from django.conf import settings as _settings  # noqa: E402

_settings.UGENT_GC_FREEZE = False
_settings.UGENT_MALLOC_TRIM_SECS = 0  # no trimming thread in the test process (tests/test_malloctrim.py runs its own)
# No rules watcher thread either: it outlived the test that started it and wrote its heartbeat during tests
# that may not touch the database, logging pytest-django's refusal by the hundred into every failure's
# output. The tests of watching turn it on (tests/rules_app/conftest.py's site, test_watcher.py); the
# daemons the tests start watch as a daemon does.
_settings.UGENT_RULES_WATCH = False
# Nor a cron file watch, whatever UGENT_CRON_FILE the environment names (tests/cron_app/test_cron_file_watch.py
# starts its own; tests/e2e/test_cron_file_daemon.py a daemon's).
_settings.UGENT_CRON_WATCH = False
# Accounts this process makes get a fast hash: PBKDF2's million rounds are 0.3-0.5 s a password here, paid by
# every admin_client and every account a test makes (Django's own advice for tests). The others stay listed,
# so a hash made by a daemon (its own settings, not this process's) still checks here.
_settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *_settings.PASSWORD_HASHERS]
# WhiteNoise finds a static file when it is asked for, not by walking every finder's files each time a test's
# Client loads the middleware (0.1-0.2 s each; 60 s of a test pass's CPU). Daemons keep the walk at start.
_settings.WHITENOISE_AUTOREFRESH = True

# A transactional test's flush on PostgreSQL deletes rows instead of truncating every table (its statements:
# 0.03 s, not 0.4).
from tests.support.pg_flush import delete_not_truncate  # noqa: E402

delete_not_truncate()
# And it leaves the content types and permissions alone while they are as post_migrate made them (0.1 s a test).
from tests.support.flush_keep import keep_what_post_migrate_makes  # noqa: E402

keep_what_post_migrate_makes()

OPERATOR_KEY = "ugk_test_operator"
APP_KEY = "ugk_test_crm"
OUTSIDER_KEY = "ugk_test_outsider"


@pytest.fixture(scope="session", autouse=True)
def _this_process_plays_the_daemon(django_db_setup):
    """The test client's requests are the daemon's: this process enforces the rules, and records them.
    Its rules watcher stops before the test database goes (it wrote a heartbeat into a database already
    dropped, and logged "no such table")."""
    from rules_app.runtime import enforce_here, runtime
    enforce_here()
    yield
    runtime.reset()


@pytest.fixture(autouse=True)
def _no_worker_warms_here(settings):
    """This process runs turns eagerly and is no Celery worker: in servers mode /v1/health would wait for a
    warm worker that never comes (plugins_app/agent/warm.py). tests/engines/test_warm.py turns it on."""
    settings.UGENT_WARM_AT_START = False


# Types only the tests append (a log's reader filtering, an old and a new type): listed for them alone.
TEST_EVENT_TYPES = frozenset({"ugent.test", "x.old", "x.new", "turn.started", "tool.started", "interaction.asked",
                              "compaction.done", "tool.call", "ugent.tool_result", "activity.x"})


@pytest.fixture(autouse=True)
def _event_types_listed(settings, monkeypatch):
    """Every event type the code appends must be in channels_app.events.EVENT_TYPES (the admin's type filter
    offers those): here one that is not fails the test that appends it (a daemon logs it once)."""
    from channels_app import events
    settings.UGENT_EVENT_TYPES_STRICT = True
    monkeypatch.setattr(events, "EVENT_TYPES", events.EVENT_TYPES | TEST_EVENT_TYPES)


@pytest.fixture(autouse=True)
def _log_repeats_forgotten():
    """A warning one test logged is new to the next: the repeat filter (ugent_common.logs) would write it
    again with "(repeated N times ...)" once a run has lasted longer than its five-minute window."""
    from ugent_common import logs
    logs.repeats_forget()


@pytest.fixture(autouse=True)
def _configured_callers_read_anew():
    """A test's database starts without the callers an earlier test's configured keys created (rolled back or
    flushed, which no signal reports): this process reads their rows anew (channels_app.auth.configured_caller)."""
    from channels_app.auth import caller_rows_changed
    caller_rows_changed()


@pytest.fixture(autouse=True)
def _eager_celery():
    from ugent_site.celery import app
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


@pytest.fixture(autouse=True)
def _fresh_engines():
    yield
    reset_engines()


class Cast:
    def __init__(self):
        from channels_app.models import ApiKey, Caller
        from plugins_app.agent.models import AgentProfile
        self.operator = Caller.objects.create(name="workspace", role="operator")
        self.app = Caller.objects.create(name="crm", role="application", issuers=["example-crm"])
        self.outsider = Caller.objects.create(name="other-app", role="application", issuers=["elsewhere"])
        for caller, raw in ((self.operator, OPERATOR_KEY), (self.app, APP_KEY), (self.outsider, OUTSIDER_KEY)):
            key = ApiKey(caller=caller)
            key.set_key(raw)
            key.save()
        self.profile = AgentProfile.objects.create(name="scripted", provider="scripted", is_default=True)
        self.keys = {"operator": OPERATOR_KEY, "app": APP_KEY, "outsider": OUTSIDER_KEY}
        # the two end users: named by the operator, and federated through the application
        self.alice = {"key": OPERATOR_KEY, "user": "alice"}
        self.bob = {"key": OPERATOR_KEY, "user": "bob"}
        self.carol = {"key": APP_KEY, "federation_issuer": "example-crm", "federation_subject": "carol"}


@pytest.fixture
def cast(db):
    return Cast()


@pytest.fixture
def tcast(transactional_db):
    return Cast()


@pytest.fixture(scope="session", autouse=True)
def _close_thread_connections(django_db_setup, django_db_blocker):
    """Async views read the database from executor threads; their PostgreSQL sessions would keep the
    test database from being dropped, so end them before pytest-django tears it down."""
    yield
    from django.db import connection
    if connection.vendor != "postgresql":
        return
    if not str(connection.settings_dict.get("NAME", "")).startswith("test_"):
        return  # the test database is already gone
    with django_db_blocker.unblock():
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()")


#: This process's own session on PostgreSQL's maintenance database, which closes other threads' idle sessions
_session_sweeper = None
#: The name this process's sessions give PostgreSQL (application_name): the sweeper's only quarry
_SESSION_NAME = f"ugent-tests-{os.getpid()}"
if _settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
    _settings.DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = _SESSION_NAME


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A test leaves no idle session on PostgreSQL behind in other threads of this process. The test
    client runs an async view on an event loop and executor threads of its own, which end with the request;
    their sessions stay open until the collector frees the threads' connections. Under CI's load that
    reached 30-38 sessions a test process, and with the daemons' own, PostgreSQL's 100: "too many clients
    already" failed whichever test connected next. After every fixture's teardown (the rollback or flush,
    a patched clock put back), from a session of its own, on the test database only, and only this
    process's sessions (by their application_name: not a daemon's or a supervisor's pointed at it); the
    main thread's is left alone. A thread that outlives its test and is idle between statements loses its
    session too: its next statement fails, which is a leak to fix, not to hide."""
    global _session_sweeper
    yield
    from django.db import connection
    db = connection.settings_dict
    if connection.vendor != "postgresql" or not str(db.get("NAME", "")).startswith("test_"):
        return  # (after the last test the settings name the real database again)
    import psycopg
    own = connection.connection
    keep = [own.info.backend_pid] if own is not None and not own.closed else []
    try:
        if _session_sweeper is None or _session_sweeper.closed:
            _session_sweeper = psycopg.connect(host=db["HOST"] or None, port=db["PORT"] or None,
                                               user=db["USER"] or None, password=db["PASSWORD"] or None,
                                               dbname="postgres", autocommit=True)
        # (with a timeout, pg_terminate_backend waits until each session is gone)
        _session_sweeper.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = %s AND state = 'idle' "
            "AND application_name = %s AND backend_type = 'client backend' AND pid <> ALL(%s)",
            [db["NAME"], _SESSION_NAME, keep])
    except psycopg.Error as exc:
        import warnings
        warnings.warn(f"could not close the test process's idle PostgreSQL sessions: {exc}")
        _session_sweeper = None  # (the next test's teardown connects again)


# A test that failed and passed on a rerun is a bug report (README, Tests): keep what it failed with, and print
# it at the end of the run, since pytest-rerunfailures only names it. Under pytest-xdist the workers' reports
# reach the controlling process, which prints them.
_reruns: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        _reruns.append((f"{report.nodeid} ({report.when})", report.longreprtext[-6000:]))


def pytest_terminal_summary(terminalreporter):
    if _reruns:
        terminalreporter.section("what the rerun tests failed with")
        for name, text in _reruns:
            terminalreporter.write_line(f"--- {name}")
            terminalreporter.write_line(text)


def pytest_collection_modifyitems(config, items):
    """A test marked mode_free is the same in either run mode: only the embedded pass runs it (README, Tests).
    Under pytest-xdist the slowest files come first, so they are handed out first (tests/support/schedule.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.support.schedule import slowest_first
        slowest_first(items)
    for item in items:
        if item.get_closest_marker("mode_free") and (item.get_closest_marker("django_db") or {
                "db", "transactional_db", "cast", "tcast", "live_server"} & set(getattr(item, "fixturenames", ()))):
            raise pytest.UsageError(f"{item.nodeid} is marked mode_free but uses the database")
    if not os.environ.get("REDIS_URL"):
        return
    skip = pytest.mark.skip(reason="mode_free: the same in either run mode, run by the embedded pass")
    for item in items:
        if item.get_closest_marker("mode_free"):
            item.add_marker(skip)
