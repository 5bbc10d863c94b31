from django.apps import AppConfig
from django.conf import settings
from django.core import checks


def plugin_log_cap_check(app_configs=None, **kwargs):
    """UGENT_PLUGIN_LOG_MAX_BYTES below 1 makes every worker's spawn fail (each plugin "could not start", backing
    off for ever): said once, at start."""
    if settings.UGENT_PLUGIN_LOG_MAX_BYTES < 1:
        return [checks.Error(f"UGENT_PLUGIN_LOG_MAX_BYTES is {settings.UGENT_PLUGIN_LOG_MAX_BYTES}: a worker's log "
                             "needs a cap of at least 1 byte", id="ugent.E002",
                             hint="Set it to the bytes one log file may hold (default 10485760), or leave it out.")]
    return []


def plugin_memory_cap_check(app_configs=None, **kwargs):
    """A negative UGENT_PLUGIN_MEMORY_MAX_MB would make every worker's spawn fail: said once, at start."""
    if settings.UGENT_PLUGIN_MEMORY_MAX_MB < 0:
        return [checks.Error(f"UGENT_PLUGIN_MEMORY_MAX_MB is {settings.UGENT_PLUGIN_MEMORY_MAX_MB}: a worker's memory "
                             "cap is a whole number of MiB, 0 for none", id="ugent.E003",
                             hint="Set it to the MiB one worker process may hold (default 2048), 0 for no cap, "
                                  "or leave it out.")]
    return []


def plugin_submit_rate_check(app_configs=None, **kwargs):
    """A negative UGENT_PLUGIN_SUBMIT_RATE, or a burst below 1 with a rate, would refuse every bridge at its start
    (BridgeServer raises): said once, at start, naming the setting."""
    rate, burst = settings.UGENT_PLUGIN_SUBMIT_RATE, settings.UGENT_PLUGIN_SUBMIT_BURST
    if rate < 0:
        return [checks.Error(f"UGENT_PLUGIN_SUBMIT_RATE is {rate}: a plugin's inbound.submit rate is 0 (no limit) "
                             "or more calls a second", id="ugent.E004",
                             hint="Set it to the calls a second one plugin may make (default 50), or 0 for no limit.")]
    if rate > 0 and burst < 1:
        return [checks.Error(f"UGENT_PLUGIN_SUBMIT_BURST is {burst}: at least 1 inbound.submit must be let through "
                             "at once", id="ugent.E004",
                             hint="Set it to the calls one plugin may make at once (default 500), or leave it out.")]
    return []


class PluginsAppConfig(AppConfig):
    name = "plugins_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Plugins and agent profiles"

    def ready(self):
        checks.register(plugin_log_cap_check)
        checks.register(plugin_memory_cap_check)
        checks.register(plugin_submit_rate_check)
        # SQLite's full-text triggers on memory facts call ugent_memory_terms (migration 0011): every
        # connection gets it, whichever part of the daemon opens it
        from django.db.backends.signals import connection_created

        from plugins_app.agent.memory.backends import sqlite_functions_add
        connection_created.connect(sqlite_functions_add, dispatch_uid="ugent-memory-sqlite-functions")

    # A plugin conversation's turn queues its answer in the transaction that ends the turn: the
    # after-turn hook and the status section are named in settings.

    def background_services(self, mode: str) -> list:
        """rundaemon runs the plugin supervisor in embedded mode (servers mode: `manage.py runsupervisor`)."""
        from plugins_app.channel import conf
        if mode != "embedded" or not conf.EMBEDDED_SUPERVISOR:
            return []
        from plugins_app.channel.runtime import SupervisorService
        return [SupervisorService()]
