from django.apps import AppConfig


class RulesAppConfig(AppConfig):
    name = "rules_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Rules and routing"

    # Its hooks (routing, the rule engine) and status section are named in settings.

    def background_services(self, mode):
        """rundaemon starts the rule engine (and its watcher) at start instead of on the first message."""
        return [RulesService()]


class RulesService:
    def start(self):
        from rules_app.runtime import runtime
        runtime.ensure()

    def stop(self):
        from rules_app.runtime import runtime
        runtime.reset()
