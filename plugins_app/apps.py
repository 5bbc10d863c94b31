from django.apps import AppConfig


class PluginsAppConfig(AppConfig):
    name = "plugins_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Plugins and agent profiles"

    def ready(self):
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
