"""Settings, all from the environment (django-environ) with working defaults.

REDIS_URL unset means embedded mode: SQLite under var/, Celery on an
in-process broker. REDIS_URL set means servers mode. No CHANNEL_LAYERS: stream
wake-ups go through channels_app/notify.py (why: its docstring).
"""
import os
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env") if (BASE_DIR / ".env").exists() else None

VAR_DIR = Path(env("UGENT_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = env("DJANGO_SECRET_KEY", default="ugent-dev-insecure-change-me")
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["*"])

INSTALLED_APPS = [
    "ugent_site.daphne_runserver.DaphneRunserverConfig",  # daphne's runserver, its server imported by runserver only
    "ugent_site.admin_site.ControlRoomAdminConfig",  # django.contrib.admin, with the health board as its index
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served from our own static files: no CDN
    "channels",
    "django_celery_beat",
    "channels_app",
    "rules_app",
    "cron_app",
    "plugins_app",
    "ugent_site",  # the wiring: rundaemon, which starts every room in one process
]

# The apps that plug into the conversation hub, by dotted path: the hub imports none of them
# (docs/design.md). Before-turn hooks run in priority order (lower first); after-turn hooks run in
# the transaction that records a turn's end; status sections make up GET /v1/ugent/status.
UGENT_BEFORE_TURN_HOOKS = [
    ("routing", 50, "rules_app.hooks.routing_hook"),
    ("rules", 100, "rules_app.hooks.rule_engine_hook"),
]
UGENT_AFTER_TURN_HOOKS = {
    "plugins": "plugins_app.channel.services.delivery_create_for_turn",
    "cron": "cron_app.services.cron_turn_ended",
    "harness": "channels_app.harness.harness_after_turn",  # /harness checks, verified with each answer
    "memory": "plugins_app.agent.memory.hooks.memory_turn_ended",
}
# A hook's probe: a statement its hook needs first, sent with the end's first round trip (docs/turns.md).
UGENT_AFTER_TURN_PROBES = {
    "harness": "channels_app.harness.harness_probe",
}
# A question a turn asks (channels_app.questions): a channel's conversation gets it as a delivery.
UGENT_QUESTION_ASKED_HOOKS = {
    "plugins": "plugins_app.channel.services.delivery_create_for_question",
}
# The native actions a rule's RunNativeAction names: the hub's turn runner runs them as the turn,
# after the receipt commits (channels_app.hooks.native_action), found by dotted path like the hooks.
UGENT_NATIVE_ACTIONS = {
    "compact_conversation": "rules_app.hooks.compact_conversation_action",
    "extract_memory": "rules_app.hooks.extract_memory_action",
}
# The workspace a conversation's turns work in (tools, sandbox, code context), where a room gives its own:
# a channel plugin's [plugins.routing] workspace (channels_app.sandbox.conversation_workspace).
UGENT_WORKSPACE_RESOLVERS = {
    "plugins": "plugins_app.channel.selectors.conversation_workspace",
}
UGENT_STATUS_SECTIONS = {
    "rules": "rules_app.runtime.status_section",
    "plugins": "plugins_app.channel.selectors.plugins_status",
    "cron": "cron_app.apps.status_section",
    "identity": "channels_app.federation.identity_status",
    "files": "channels_app.files.files_status",
    "tools": "channels_app.tools.tools_status",
    "citations": "channels_app.citations.citations_status",
    "queues": "channels_app.dispatch.queues_status",
    "overrun": "ugent_common.bounded.overrun_status",
}

MIDDLEWARE = [
    "ugent_site.middleware.RequestLogMiddleware",  # outermost: the request's line and count see its final status
    "django.middleware.security.SecurityMiddleware",
    # the admin's CSS and JS, from the daemon itself (no web server to configure): docs in README "The admin"
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "ugent_site.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "ugent_site.asgi.application"
WSGI_APPLICATION = None

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'ugent.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the stream readers run beside the turn writer; IMMEDIATE takes the
    # write lock up front so two writers queue instead of failing mid-transaction.
    # cache_size bounds each connection's page cache (KiB; every thread keeps its own connection,
    # 14-18 in a busy daemon). With SQLite's default, 2,000 KiB, the caches were still filling at the
    # 10,000th turn; at 128 KiB the busy ones are full by the 1,000th, and a turn is no slower: in WAL
    # mode a connection drops its whole cache at its next read once another one has written, so each
    # turn starts cold whatever the size (docs/performance.md, "Memory"). cache_spill keeps SQLite's
    # default threshold (2,000 KiB) for a transaction's dirty pages: below it they wait for the commit
    # instead of going to the WAL early, and the cache falls back to cache_size once they are written.
    UGENT_SQLITE_CACHE_KIB = max(env.int("UGENT_SQLITE_CACHE_KIB", default=128), 1)
    DATABASES["default"].setdefault("OPTIONS", {}).update({
        "init_command": ("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; "
                         f"PRAGMA cache_size=-{UGENT_SQLITE_CACHE_KIB}; PRAGMA cache_spill=-2000;"),
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    })
    # Writers of this process queue in arrival order, not in SQLite's sleeping busy handler
    # (ugent_site/db/base.py, docs/performance.md). UGENT_SQLITE_WRITER_QUEUE=false: Django's own backend.
    if env.bool("UGENT_SQLITE_WRITER_QUEUE", default=True):
        DATABASES["default"]["ENGINE"] = "ugent_site.db"
    # Each test run its own file: two suites on one checkout must not share (and drop) one database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test_ugent_{os.getpid()}.sqlite3")}
# Keep each thread's connection: a turn touches the database from the web thread, executor
# threads and a worker thread, and opening a connection per query dominated a turn's cost.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("UGENT_DB_CONN_MAX_AGE", default=600)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Django's, with a health check that looks at the socket before it asks the server (ugent_site/db/postgresql)
    DATABASES["default"]["ENGINE"] = "ugent_site.db.postgresql"
# The turn path's statements (ugent_common/rows.py) prepared once a connection and pipelined on
# PostgreSQL: planning them was most of the server's time a turn. false: sent as literal SQL, for a
# pooler that cannot keep a session's prepared statements (docs/deploy.md).
UGENT_PG_PREPARE = env.bool("UGENT_PG_PREPARE", default=True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = Path(env("UGENT_STATIC_ROOT", default=str(VAR_DIR / "static")))
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns about a missing one before the first collect
# Compressed, hashed names from `collectstatic` (rundaemon runs it when the files changed; servers
# mode runs it once per release). Before any collectstatic the files are served from the apps.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "ugent_site.staticfiles.StaticStorage"},
}
# Uploaded files (POST /v1/files, docs/files.md): the file system under the var dir, or an S3-compatible
# bucket through django-storages (UGENT_FILES_STORAGE=s3 and the UGENT_FILES_S3_* settings).
UGENT_FILES_DIR = Path(env("UGENT_FILES_DIR", default=str(VAR_DIR / "files")))
if env("UGENT_FILES_STORAGE", default="filesystem") == "s3":
    STORAGES["ugent_files"] = {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": env("UGENT_FILES_S3_BUCKET", default=""),
        "endpoint_url": env("UGENT_FILES_S3_ENDPOINT_URL", default="") or None,
        "region_name": env("UGENT_FILES_S3_REGION", default="") or None,
        "access_key": env("UGENT_FILES_S3_ACCESS_KEY_ID", default="") or None,
        "secret_key": (env("UGENT_FILES_S3_SECRET_ACCESS_KEY", default="")
                       or (Path(env("UGENT_FILES_S3_SECRET_ACCESS_KEY_FILE")).read_text().strip()
                           if env("UGENT_FILES_S3_SECRET_ACCESS_KEY_FILE", default="") else None)),
        "location": env("UGENT_FILES_S3_PREFIX", default="ugent-files"),
        "default_acl": None, "querystring_auth": False, "file_overwrite": False}}
else:
    STORAGES["ugent_files"] = {"BACKEND": "django.core.files.storage.FileSystemStorage",
                               "OPTIONS": {"location": str(UGENT_FILES_DIR), "base_url": None}}
WHITENOISE_USE_FINDERS = True

# --- run mode -------------------------------------------------------------
REDIS_URL = env("REDIS_URL", default="")
UGENT_MODE = "servers" if REDIS_URL else "embedded"

if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    # kombu's Redis transport with one client kept per channel (see ugent_site/broker.py).
    CELERY_BROKER_TRANSPORT = "ugent_site.broker:RedisTransport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
else:
    CELERY_BROKER_URL = "memory://"
    # memory:// woken by publishes and acks instead of polled (see ugent_site/broker.py).
    CELERY_BROKER_TRANSPORT = "ugent_site.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
# One queue per deployment: two daemons sharing a Redis must not run each other's turns.
CELERY_TASK_DEFAULT_QUEUE = env("UGENT_CELERY_QUEUE", default="ugent")
# Work that may hold a worker thread for seconds or minutes and that no sender waits for goes to a queue of
# its own: memory extraction (a model call after every turn), lance_embedded's index and backfill, and the
# retention jobs. A worker started without -Q takes both queues; a deployment that wants turns never to
# wait for a free thread behind that work runs its turn workers with `-Q <queue>` and one more worker with
# `-Q <queue>-background` (docs/deploy.md, "Queues").
UGENT_BACKGROUND_QUEUE = env("UGENT_BACKGROUND_QUEUE", default=CELERY_TASK_DEFAULT_QUEUE + "-background")
UGENT_BACKGROUND_TASKS = (
    "plugins_app.tasks.memory_extract_turn", "plugins_app.tasks.memory_vector_index",
    "plugins_app.tasks.memory_vector_backfill", "plugins_app.tasks.prune_media", "plugins_app.tasks.prune_deliveries",
    "plugins_app.tasks.prune_memory", "channels_app.tasks.prune_events", "channels_app.tasks.prune_files",
    "channels_app.tasks.rollup_usage",
)
# Both queues declared as Celery declares its default one (an exchange of the queue's name, routed by it), so
# the turn queue's messages and keys are what they were before there were two.
CELERY_TASK_QUEUES = tuple(Queue(name, Exchange(name), routing_key=name)
                           for name in (CELERY_TASK_DEFAULT_QUEUE, UGENT_BACKGROUND_QUEUE))
CELERY_TASK_ROUTES = {name: {"queue": UGENT_BACKGROUND_QUEUE} for name in UGENT_BACKGROUND_TASKS}
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Celery's Django fixup closes every database connection before and after each task unless this is
# set, so each turn opened a new connection (py-spy: a tenth of a turn's time). Tasks call
# close_old_connections() themselves, which honours CONN_MAX_AGE and the health checks.
CELERY_DB_REUSE_MAX = env.int("UGENT_CELERY_DB_REUSE_MAX", default=1000)
CELERY_TASK_SOFT_TIME_LIMIT = env.int("UGENT_TURN_SOFT_TIME_LIMIT", default=600)
CELERY_TASK_TIME_LIMIT = env.int("UGENT_TURN_TIME_LIMIT", default=660)
# A turn's liveness (docs/turns.md): the process running it renews its lease every RENEW seconds;
# the sweep (every SWEEP seconds) ends as interrupted a running turn whose lease has lapsed.
UGENT_TURN_LEASE_SECONDS = env.float("UGENT_TURN_LEASE_SECONDS", default=20)
UGENT_TURN_LEASE_RENEW_SECONDS = env.float("UGENT_TURN_LEASE_RENEW_SECONDS", default=5)
UGENT_TURN_SWEEP_SECONDS = env.int("UGENT_TURN_SWEEP_SECONDS", default=5)
# The runner ends a turn running longer than this as failed ("The turn ran out of time.").
UGENT_TURN_RUN_LIMIT = env.float("UGENT_TURN_RUN_LIMIT", default=CELERY_TASK_SOFT_TIME_LIMIT)
# A turn thread stuck in an engine past that limit is written off and replaced (channels_app.dispatch.TurnThreads),
# at most this many per process: each holds its memory and a database connection until the process restarts.
# Also the calls of one plugin engine (an asked engine, a summariser, a reply reader, an NLI engine) left running
# past their time limit at which that engine is not asked again until they end (ugent_common.bounded).
UGENT_TURN_STUCK_MAX = env.int("UGENT_TURN_STUCK_MAX", default=16)
# Seconds an in-process plugin (a chat engine, summariser, matcher, NLI engine) may take to start: its constructor
# runs on a thread of its own, and one past this is refused for a while (plugins_app.agent.engines.registry).
UGENT_PLUGIN_START_TIMEOUT = env.float("UGENT_PLUGIN_START_TIMEOUT", default=120.0)
# Questions (channels_app.questions): the longest a question may wait for its answer, in seconds (kept
# inside the turn's run limit, past which the turn fails), and the engines that read a free-text reply.
UGENT_QUESTION_MAX_TIMEOUT = env.float("UGENT_QUESTION_MAX_TIMEOUT", default=300)
UGENT_QUESTION_DEFAULT_TIMEOUT = env.float("UGENT_QUESTION_DEFAULT_TIMEOUT", default=120)
UGENT_OPTION_MATCHER_ENGINE = env("UGENT_OPTION_MATCHER_ENGINE", default="ugent-option-matcher")
UGENT_YESNO_ENGINE = env("UGENT_YESNO_ENGINE", default="ugent-yesno")
# Seconds one of those engines may take to read a reply; later, the reply does not fit. Below the channel SDK's
# 10 s call timeout, so a worker's inbound.submit is answered before it gives up on it.
UGENT_QUESTION_FIT_TIMEOUT = env.float("UGENT_QUESTION_FIT_TIMEOUT", default=5.0)
# An accepted turn not started within this many seconds is abandoned, never run late.
UGENT_TURN_QUEUE_TIMEOUT = env.float("UGENT_TURN_QUEUE_TIMEOUT", default=900)
# An accepted turn older than this, with the broker's queue empty, lost its task: it is dispatched again.
UGENT_TURN_REQUEUE_SECONDS = env.float("UGENT_TURN_REQUEUE_SECONDS", default=10)
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"

# --- the Web Channel API --------------------------------------------------
UGENT_WEB_BIND = env("UGENT_WEB_BIND", default="127.0.0.1")
UGENT_WEB_PORT = env.int("UGENT_WEB_PORT", default=8787)
# rundaemon keeps its threads on one CPU (auto), on these CPUs ("2,3"), or anywhere (off): ugent_common/affinity.py
UGENT_CPU_AFFINITY = env("UGENT_CPU_AFFINITY", default="auto")
# The operator key: UGENT_WEB_API_KEY, else the file UGENT_WEB_API_KEY_FILE names, else the key
# `rundaemon` generated on first start (var/web_api_key).
UGENT_WEB_API_KEY_FILE = Path(env("UGENT_WEB_API_KEY_FILE", default=str(VAR_DIR / "web_api_key")))
UGENT_WEB_API_KEY = env("UGENT_WEB_API_KEY", default="") or (
    UGENT_WEB_API_KEY_FILE.read_text().strip() if UGENT_WEB_API_KEY_FILE.exists() else "")
UGENT_CONFIG = env("UGENT_CONFIG", default="")
UGENT_WORKSPACE = env("UGENT_WORKSPACE", default=str(BASE_DIR / "workspace"))
UGENT_DEFAULT_MODEL = env("UGENT_DEFAULT_MODEL", default="")
# What the turn's sandbox allows (GET /v1/ugent/sandbox, /sandbox): paths tools may write (comma-separated,
# relative ones from the workspace; none by default: the workspace toolboxes read only), and network.
UGENT_SANDBOX_WRITABLE = env.list("UGENT_SANDBOX_WRITABLE", default=[])
UGENT_SANDBOX_NETWORK = env.bool("UGENT_SANDBOX_NETWORK", default=False)
# /btw and /refine ask the engine directly, in the request: at most this many seconds (and a compaction its
# summariser: channels_app.compaction).
UGENT_COMMAND_ENGINE_TIMEOUT = env.float("UGENT_COMMAND_ENGINE_TIMEOUT", default=60.0)
# The tool loop (docs/tools.md): tool steps a turn may take, seconds one tool call may run, and how
# deep delegated tasks go (1: a turn delegates, its task does not).
UGENT_TOOL_STEP_LIMIT = env.int("UGENT_TOOL_STEP_LIMIT", default=8)
UGENT_TOOL_TIMEOUT_SECONDS = env.float("UGENT_TOOL_TIMEOUT_SECONDS", default=30.0)
# A call past that timeout keeps its thread until it returns; a toolbox with this many such calls is refused
# at once until they end (channels_app.tools._run_in_thread).
UGENT_TOOL_OVERRUN_MAX = env.int("UGENT_TOOL_OVERRUN_MAX", default=8)
UGENT_TOOL_DELEGATION_DEPTH = env.int("UGENT_TOOL_DELEGATION_DEPTH", default=1)
# Seconds the citations' NLI engine ([citations] nli_engine) may take to check a completed turn's answer;
# later the lexical check decides (channels_app.citations).
UGENT_CITATIONS_NLI_TIMEOUT = env.float("UGENT_CITATIONS_NLI_TIMEOUT", default=30.0)
# The most bytes (as JSON) one tool result may be: it is stored, streamed and sent to the model whole, so a
# larger one is answered to the engine as an error that says so (docs/tools.md).
UGENT_TOOL_RESULT_MAX_BYTES = env.int("UGENT_TOOL_RESULT_MAX_BYTES", default=512 * 1024)
UGENT_LLM_BASE_URL = env("UGENT_LLM_BASE_URL", default="")
UGENT_LLM_API_KEY = env("UGENT_LLM_API_KEY", default="")
UGENT_LLM_MODEL = env("UGENT_LLM_MODEL", default="")
# GET /metrics answers operator keys; with UGENT_METRICS_BIND=host:port rundaemon also serves it there, keyless.
# Servers mode: set PROMETHEUS_MULTIPROC_DIR (one empty directory for every process) to sum their counts.
UGENT_METRICS_BIND = env("UGENT_METRICS_BIND", default="")
# A debug hook, off by default: "true" makes SIGUSR2 write a memory report to var/memstats/
# (ugent_site/memstats.py, docs/performance.md "Memory").
UGENT_MEMSTATS = env("UGENT_MEMSTATS", default="")
# Seconds between SSE keep-alive comment lines.
UGENT_SSE_KEEPALIVE = env.float("UGENT_SSE_KEEPALIVE", default=15.0)
# Seconds between an open SSE stream's checks of the key and identity token that opened it, when nothing asks
# sooner: a credentials change (wake-up), a changed ugent.toml, or the token's own expiry each ask at once or at
# the next keep-alive (docs/streams.md). The backstop for what none of them hears, such as a raw UPDATE.
UGENT_SSE_CREDENTIALS_RECHECK_SECS = env.float("UGENT_SSE_CREDENTIALS_RECHECK_SECS", default=300.0)
if not 1 <= UGENT_SSE_CREDENTIALS_RECHECK_SECS < float("inf"):  # 0 would check without end; nan never
    raise ImproperlyConfigured(f"UGENT_SSE_CREDENTIALS_RECHECK_SECS={UGENT_SSE_CREDENTIALS_RECHECK_SECS}: "
                               "it must be a number of seconds, at least 1.")
# Events an SSE subscriber's queue holds before it is cut loose with a ugent.gap (docs/streams.md).
UGENT_SSE_SUBSCRIBER_QUEUE = env.int("UGENT_SSE_SUBSCRIBER_QUEUE", default=1000)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["channels_app.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["channels_app.auth.HasCaller"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["channels_app.bodies.JsonObjectParser",
                               "rest_framework.parsers.MultiPartParser"],
    "EXCEPTION_HANDLER": "channels_app.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
# The API schema (channels_app/api_docs.py): GET /v1/openapi.json, Swagger UI at /v1/docs.
SPECTACULAR_SETTINGS = {
    "TITLE": "UGENT Web Channel API",
    "DESCRIPTION": ("OpenAI-compatible chat plus UGENT's streams, receipts and snapshots. Every request but "
                    "GET /v1/health, the schema and its page carries its key as x-api-key or Authorization: Bearer."),
    "VERSION": "0.1.0",
    "DEFAULT_GENERATOR_CLASS": "channels_app.api_docs.SchemaGenerator",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "channels_app.api_docs.stream_components"],
    "SCHEMA_PATH_PREFIX": r"/v1",
    "SERVE_INCLUDE_SCHEMA": True,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The one-value `object` enums, which drf-spectacular would otherwise name by hash.
    "ENUM_NAME_OVERRIDES": {"ReceiptStateEnum": "channels_app.api_docs.RECEIPT_STATES",
                            "ChatCompletionObjectEnum": ["chat.completion"], "ReceiptObjectEnum": ["ugent.receipt"],
                            "ModelObjectEnum": ["model"], "ListObjectEnum": ["list"],
                            "StopObjectEnum": ["ugent.stop"], "SteeringObjectEnum": ["ugent.steering"],
                            "ConversationSnapshotObjectEnum": ["ugent.conversation.snapshot"],
                            "SessionSnapshotObjectEnum": ["ugent.snapshot"],
                            "CommandResultObjectEnum": ["ugent.command"], "SandboxObjectEnum": ["ugent.sandbox"],
                            "DirectoryObjectEnum": ["ugent.directory"], "RepairObjectEnum": ["ugent.repair"]},
}

# The OVOS libraries' logger finds each line's caller without inspect.stack(), whose source reads cost a
# process's start 1.1 s of CPU (ugent_common/ovoslog.py). Before anything imports ovos-config.
from ugent_common.ovoslog import caller_by_frame  # noqa: E402

caller_by_frame()

# Plain lines, or JSON lines with UGENT_LOG_FORMAT=json; no secret in either, and a repeating warning
# once per five minutes with its count (ugent_common/logs.py).
from ugent_common.logs import logging_config  # noqa: E402

# (set but empty means the default, as unset does: logging_config reads "" so)
LOGGING = logging_config(
    fmt=env("UGENT_LOG_FORMAT", default=""), level=env("UGENT_LOG_LEVEL", default=""),
    # httpx logs every upstream request at INFO: a line per turn that says nothing the turn's row does not.
    loggers={"daphne": {"level": "WARNING"}, "uvicorn": {"level": "WARNING"}, "celery": {"level": "WARNING"},
             "django.channels.server": {"level": "WARNING"}, "httpx": {"level": "WARNING"},
             "httpcore": {"level": "WARNING"},
             # ("N changes detected" for every batch the rules and cron.toml watches see)
             "watchfiles": {"level": "WARNING"}})

# --- the rooms' own settings, from the environment (each app reads them through django.conf.settings) ---
# cron_app
UGENT_CRON_ENABLED = env.bool("UGENT_CRON_ENABLED", default=True)
UGENT_CRON_TASK_TIME_LIMIT = env.float("UGENT_CRON_TASK_TIME_LIMIT", default=600.0)
UGENT_CRON_RUN_TIME_LIMIT = env.int("UGENT_CRON_RUN_TIME_LIMIT", default=3660)
UGENT_CRON_FIRE_GRACE_SECS = env.int("UGENT_CRON_FIRE_GRACE_SECS", default=300)
UGENT_CRON_FILE = env.str("UGENT_CRON_FILE", default="")
UGENT_CRON_WATCH = env.bool("UGENT_CRON_WATCH", default=True)
UGENT_CRON_WATCH_POLL_SECS = env.float("UGENT_CRON_WATCH_POLL_SECS", default=1.0)
UGENT_CRON_RUNNER_LEASE_SECONDS = env.float("UGENT_CRON_RUNNER_LEASE_SECONDS", default=15.0)
# channels_app.compaction: the exchanges a compaction keeps as they are, and the share of a profile's
# context_tokens past which a turn's history is compacted before the engine is called
UGENT_COMPACT_KEEP_EXCHANGES = env.int("UGENT_COMPACT_KEEP_EXCHANGES", default=3)
UGENT_COMPACT_THRESHOLD = env.float("UGENT_COMPACT_THRESHOLD", default=0.8)
# rules_app
UGENT_RULES_WATCH = env.bool("UGENT_RULES_WATCH", default=True)
UGENT_RULES_POLL_INTERVAL = env.float("UGENT_RULES_POLL_INTERVAL", default=2.0)
UGENT_RULES_HEARTBEAT_SECONDS = env.float("UGENT_RULES_HEARTBEAT_SECONDS", default=10.0)
UGENT_ROUTING_RECHECK_SECONDS = env.float("UGENT_ROUTING_RECHECK_SECONDS", default=2.0)
UGENT_HOME = env("UGENT_HOME", default="")
# plugins_app.agent.memory (the backend and the recall budget are ugent.toml's [memory], or the admin's)
UGENT_MEMORY_SETTINGS_RECHECK_SECS = env.float("UGENT_MEMORY_SETTINGS_RECHECK_SECS", default=2.0)
# how long a process uses the row of a configured key's caller before reading it again (channels_app.auth)
UGENT_CALLER_RECHECK_SECS = env.float("UGENT_CALLER_RECHECK_SECS", default=2.0)
UGENT_MEMORY_EPHEMERAL_TTL_SECS = env.int("UGENT_MEMORY_EPHEMERAL_TTL_SECS", default=86400)
# expired facts are deleted this long after their expiry (the hourly retention job); negative: kept for ever
UGENT_MEMORY_EXPIRED_KEEP_SECS = env.int("UGENT_MEMORY_EXPIRED_KEEP_SECS", default=7 * 86400)
UGENT_MEMORY_EXCHANGES = env.int("UGENT_MEMORY_EXCHANGES", default=6)  # extract_memory reads this many
# lance_embedded's LanceDB dataset (rebuilt from the MemoryFact rows when missing): a dir, or a LanceDB URI
# (s3://…) that several hosts share in servers mode
UGENT_MEMORY_LANCE_DIR = env("UGENT_MEMORY_LANCE_DIR", default=str(VAR_DIR / "memory.lance"))
# from this many vectors on, the LanceDB table gets an IVF_PQ index (memory_vector_index); below, a flat scan
UGENT_MEMORY_LANCE_INDEX_MIN_ROWS = env.int("UGENT_MEMORY_LANCE_INDEX_MIN_ROWS", default=20000)
# plugins_app
UGENT_PLUGIN_RUN_DIR = env("UGENT_PLUGIN_RUN_DIR", default=str(VAR_DIR / "run" / "plugins"))
UGENT_PLUGIN_PID_DIR = env("UGENT_PLUGIN_PID_DIR", default=str(VAR_DIR / "run" / "plugin-pids"))
UGENT_PLUGIN_LOG_DIR = env("UGENT_PLUGIN_LOG_DIR", default=str(VAR_DIR / "log" / "plugins"))
UGENT_PLUGIN_LOG_MAX_BYTES = env.int("UGENT_PLUGIN_LOG_MAX_BYTES", default=10 * 1024 * 1024)
UGENT_PLUGIN_STATE_DIR = env("UGENT_PLUGIN_STATE_DIR", default=str(VAR_DIR / "plugin-state"))
# Each channel worker's data size cap in MiB (RLIMIT_DATA), unless its plugin sets limits.memory_max_mb; 0: none
UGENT_PLUGIN_MEMORY_MAX_MB = env.int("UGENT_PLUGIN_MEMORY_MAX_MB", default=2048)
# "" = <UGENT_HOME>/.ugent/plugins.toml, read when used (plugins_app.channel.conf.global_plugins_toml)
UGENT_GLOBAL_PLUGINS_TOML = env("UGENT_GLOBAL_PLUGINS_TOML", default="")
UGENT_SECRETS_KEY = env("UGENT_SECRETS_KEY", default="")
# Engine discovery and each profile's engine (the notes index) are warmed in the background at start
# (plugins_app/agent/warm.py), so the first turn does not wait for them.
UGENT_WARM_AT_START = env.bool("UGENT_WARM_AT_START", default=True)
# rundaemon opens the API once warm, or after this many seconds however far warming got.
UGENT_WARM_WAIT_SECS = env.float("UGENT_WARM_WAIT_SECS", default=30.0)
# What a process holds once started is frozen out of the cyclic garbage collector's walks
# (ugent_common/gcfreeze.py): false leaves the collector as Python sets it.
UGENT_GC_FREEZE = env.bool("UGENT_GC_FREEZE", default=True)
# Every so many seconds a process hands the C memory it freed back to the system (malloc_trim(0),
# ugent_common/malloctrim.py), so RSS shows what is in use; 0 never.
UGENT_MALLOC_TRIM_SECS = env.float("UGENT_MALLOC_TRIM_SECS", default=10.0)
# The most malloc arenas a process keeps (ugent_common/malloctrim.py limit_arenas), set as Django starts;
# 0 leaves glibc's own limit (eight a core); MALLOC_ARENA_MAX in the environment wins over it.
UGENT_MALLOC_ARENA_MAX = env.int("UGENT_MALLOC_ARENA_MAX", default=1)
UGENT_PLUGIN_SUPERVISOR_INTERVAL = env.float("UGENT_PLUGIN_SUPERVISOR_INTERVAL", default=0.5)
UGENT_PLUGIN_EMBEDDED_SUPERVISOR = env.bool("UGENT_PLUGIN_EMBEDDED_SUPERVISOR", default=True)
UGENT_PLUGIN_STOP_GRACE_SECS = env.float("UGENT_PLUGIN_STOP_GRACE_SECS", default=5.0)
UGENT_PLUGIN_BACKOFF_INITIAL_SECS = env.float("UGENT_PLUGIN_BACKOFF_INITIAL_SECS", default=1.0)
UGENT_PLUGIN_BACKOFF_MAX_SECS = env.float("UGENT_PLUGIN_BACKOFF_MAX_SECS", default=60.0)
UGENT_PLUGIN_RESTARTS_PER_ROUND = env.int("UGENT_PLUGIN_RESTARTS_PER_ROUND", default=5)
UGENT_PLUGIN_COOLDOWN_SECS = env.float("UGENT_PLUGIN_COOLDOWN_SECS", default=60.0)
UGENT_PLUGIN_STABLE_SECS = env.float("UGENT_PLUGIN_STABLE_SECS", default=60.0)
UGENT_PLUGIN_STARTUP_GRACE_SECS = env.float("UGENT_PLUGIN_STARTUP_GRACE_SECS", default=10.0)
UGENT_PLUGIN_REAP_GRACE_SECS = env.float("UGENT_PLUGIN_REAP_GRACE_SECS", default=2.0)
UGENT_PLUGIN_RETRY_BACKOFF_SECS = env.float("UGENT_PLUGIN_RETRY_BACKOFF_SECS", default=2.0)
UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS = env.float("UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS", default=300.0)
UGENT_PLUGIN_POLL_RECHECK_SECS = env.float("UGENT_PLUGIN_POLL_RECHECK_SECS", default=1.0)
UGENT_PLUGIN_MEDIA_MAX_BYTES = env.int("UGENT_PLUGIN_MEDIA_MAX_BYTES", default=8 * 1024 * 1024)
UGENT_PLUGIN_MEDIA_QUOTA_BYTES = env.int("UGENT_PLUGIN_MEDIA_QUOTA_BYTES", default=512 * 1024 * 1024)
UGENT_PLUGIN_MEDIA_TTL_SECS = env.int("UGENT_PLUGIN_MEDIA_TTL_SECS", default=86400)
# One plugin's inbound.submit calls: this many a second, up to UGENT_PLUGIN_SUBMIT_BURST at once; past them the
# bridge answers -32007 and the worker sends the message again a little later (0: no limit).
UGENT_PLUGIN_SUBMIT_RATE = env.float("UGENT_PLUGIN_SUBMIT_RATE", default=50.0)
UGENT_PLUGIN_SUBMIT_BURST = env.int("UGENT_PLUGIN_SUBMIT_BURST", default=500)
# How long a settled outbound delivery (delivered, or a dead letter the operator discarded) is kept
# after it settled; pending, in-flight and dead-lettered deliveries are never pruned.
UGENT_PLUGIN_DELIVERY_RETENTION_SECS = env.int("UGENT_PLUGIN_DELIVERY_RETENTION_SECS", default=7 * 86400)
# POST /v1/files: the largest upload taken (413 beyond), and how often the beat job deletes expired
# files; a file is kept for UGENT_PLUGIN_MEDIA_TTL_SECS after its upload (docs/files.md).
UGENT_FILES_MAX_BYTES = env.int("UGENT_FILES_MAX_BYTES", default=25 * 1024 * 1024)
# Any other request body (a chat, a command, the fields of a multipart form): the most Django reads,
# a 413 request_too_large beyond (channels_app.errors.request_too_large).
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("UGENT_MAX_REQUEST_BYTES", default=2_621_440)
UGENT_FILES_PRUNE_EVERY_SECS = env.int("UGENT_FILES_PRUNE_EVERY_SECS", default=600)
# The usage rollup (channels_app.usage): how often beat folds ended turns into each caller's and key's totals,
# and how old a turn must be to be folded (on PostgreSQL an id is handed out before its transaction commits:
# the margin outlasts any accept, so no turn below the mark is still to appear).
UGENT_USAGE_ROLLUP_SECS = env.int("UGENT_USAGE_ROLLUP_SECS", default=60)
UGENT_USAGE_ROLLUP_MARGIN_SECS = env.int("UGENT_USAGE_ROLLUP_MARGIN_SECS", default=300)
# A tool's artifact announced pending and not finished this long after it was announced is listed as
# failed ("did not arrive") once its turn has ended, checked as often as files are pruned (docs/tools.md).
UGENT_ARTIFACT_PENDING_SECS = env.int("UGENT_ARTIFACT_PENDING_SECS", default=3600)
# channels_app
UGENT_EVENT_RETENTION_SECS = env.int("UGENT_EVENT_RETENTION_SECS", default=7 * 86400)
UGENT_EVENT_PRUNE_EVERY_SECS = env.int("UGENT_EVENT_PRUNE_EVERY_SECS", default=3600)
UGENT_SSE_RETRY_MS = env.int("UGENT_SSE_RETRY_MS", default=1000)
# Federated identity (docs/identity.md): how long a JWKS is kept without a Cache-Control max-age, the
# bounds on what max-age may say, the least time between two fetches of one JWKS (an unknown kid
# fetches again at most this often), and how long a request with a token waits for a JWKS.
UGENT_JWKS_DEFAULT_TTL_SECS = env.float("UGENT_JWKS_DEFAULT_TTL_SECS", default=300.0)
UGENT_JWKS_MAX_TTL_SECS = env.float("UGENT_JWKS_MAX_TTL_SECS", default=86400.0)
UGENT_JWKS_MIN_REFRESH_SECS = env.float("UGENT_JWKS_MIN_REFRESH_SECS", default=30.0)
UGENT_JWKS_TIMEOUT_SECS = env.float("UGENT_JWKS_TIMEOUT_SECS", default=3.0)
# How often ugent.toml is checked for a change (keys, issuers, caller defaults take effect without a restart).
UGENT_CONFIG_RECHECK_SECS = env.float("UGENT_CONFIG_RECHECK_SECS", default=2.0)
# Where a [[web.auth.keys]] key_env not set in the environment is looked up: the plugins' vault.
UGENT_KEY_ENV_LOOKUPS = ["plugins_app.channel.secrets.secret_env_lookup"]
