from django.apps import AppConfig


class RulesAppConfig(AppConfig):
    name = "rules_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Rules and routing"

    def ready(self):
        from channels_app import hooks, status
        from rules_app.hooks import routing_hook, rule_engine_hook
        from rules_app.runtime import status_section
        hooks.register("routing", hooks.ROUTING_PRIORITY, routing_hook)
        hooks.register("rules", hooks.RULE_ENGINE_PRIORITY, rule_engine_hook)
        status.register("rules", status_section)

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
