from django.apps import AppConfig


class PluginsAppConfig(AppConfig):
    name = "plugins_app"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from channels_app import hooks, status
        from plugins_app import selectors, services
        # A plugin conversation's turn queues its answer in the transaction that ends the turn.
        hooks.register_after_turn("plugins", services.delivery_create_for_turn)
        status.register("plugins", selectors.plugins_status)

    def background_services(self, mode: str) -> list:
        """rundaemon runs the plugin supervisor in embedded mode (servers mode: `manage.py runsupervisor`)."""
        from plugins_app import conf
        if mode != "embedded" or not conf.EMBEDDED_SUPERVISOR:
            return []
        from plugins_app.runtime import SupervisorService
        return [SupervisorService()]
