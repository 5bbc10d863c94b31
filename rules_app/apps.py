import sys

from django.apps import AppConfig

#: Management commands that run as a daemon handling messages: they enforce the rules (and record them).
ENFORCING_COMMANDS = ("rundaemon", "runsupervisor")


class RulesAppConfig(AppConfig):
    name = "rules_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Rules and routing"

    # Its hooks (routing, the rule engine) and status section are named in settings.

    def ready(self):
        # runsupervisor lives below this room and cannot say so itself (docs/design.md): it is seen here
        if len(sys.argv) > 1 and sys.argv[0].endswith("manage.py") and sys.argv[1] in ENFORCING_COMMANDS:
            from rules_app.runtime import enforce_here
            enforce_here()

    def background_services(self, mode):
        """rundaemon starts the rule engine (and its watcher) at start instead of on the first message."""
        return [RulesService()]


class RulesService:
    def start(self):
        from rules_app.runtime import enforce_here, runtime
        enforce_here()  # rundaemon enforces the rules on every message it takes: the record is its own
        runtime.ensure()

    def stop(self):
        from rules_app.runtime import runtime
        runtime.reset()
