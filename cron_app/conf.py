"""cron_app's settings, read from the environment with working defaults."""
from django.conf import settings

#: The channel a run's own conversation lives on; the hooks before the agent see it as the channel.
CRON_CHANNEL = "cron"
#: Actor keys a run speaks as when it acts for the operator or for nobody.
SYSTEM_ACTOR_USER = "system"
NOBODY_ACTOR_USER = "nobody"

#: Set false in a process group that must run no cron at all ("cron is not running here").
CRON_ENABLED_HERE = settings.UGENT_CRON_ENABLED
#: How long one task's agent turn may take before the run cuts it off (seconds).
TASK_TIME_LIMIT = settings.UGENT_CRON_TASK_TIME_LIMIT
#: How long a whole run may take, from its start to its last task's end (seconds); the sweep
#: ends a run still running past it as timed_out.
RUN_TIME_LIMIT = settings.UGENT_CRON_RUN_TIME_LIMIT
#: Celery soft/hard limits of one step of a run (a step never waits for a turn: it submits one,
#: or records an end and delivers the result).
STEP_SOFT_TIME_LIMIT = 300
STEP_TIME_LIMIT = 360
#: How often beat runs the sweep that resumes runs whose step a broker lost (seconds).
SWEEP_EVERY_SECS = 60
#: A slot fired later than this after its time counts as missed (catch-up policy applies).
FIRE_GRACE_SECS = settings.UGENT_CRON_FIRE_GRACE_SECS
#: The default cron.toml for `manage.py cron import` without a FILE; the file the daemon (beat in servers
#: mode) imports at start and whenever it changes, unless UGENT_CRON_WATCH is false.
CRON_FILE = settings.UGENT_CRON_FILE
#: A `cron run` process renews its lease on the run it executes this often; a run whose lease is
#: older than RUNNER_LEASE_SECS lost its process (kill -9) and ends interrupted at the next claim or sweep.
RUNNER_LEASE_SECS = settings.UGENT_CRON_RUNNER_LEASE_SECONDS
RUNNER_RENEW_SECS = max(0.2, RUNNER_LEASE_SECS / 3)


def cron_file_watched() -> str:
    """The cron.toml this process imports and watches ("" for none): UGENT_CRON_FILE, where cron runs and
    UGENT_CRON_WATCH is on."""
    if not (settings.UGENT_CRON_WATCH and settings.UGENT_CRON_ENABLED):
        return ""
    return settings.UGENT_CRON_FILE


def cron_watch_poll_secs() -> float:
    return max(0.1, float(settings.UGENT_CRON_WATCH_POLL_SECS))
