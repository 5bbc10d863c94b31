from django.apps import AppConfig
from django.core import checks


class ChannelsAppConfig(AppConfig):
    name = "channels_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Conversations and turns"

    def ready(self):
        checks.register(web_auth_check, checks.Tags.security)
        from django.db.models.signals import post_delete, post_save

        from channels_app.auth import caller_rows_changed
        from channels_app.models import Caller
        # a process keeps the rows of configured keys' callers (channels_app.auth.configured_caller)
        post_save.connect(caller_rows_changed, sender=Caller, dispatch_uid="ugent-caller-rows-changed")
        post_delete.connect(caller_rows_changed, sender=Caller, dispatch_uid="ugent-caller-rows-deleted")


def web_auth_check(app_configs=None, **kwargs):
    """ugent.toml as written: a file that does not parse (named, with the line), or a [web.auth] key the daemon
    does not understand, stops every manage.py command that runs checks (rundaemon, runsupervisor), naming
    it, rather than being ignored."""
    from ugent_common import config
    try:
        config.web_auth_check()
    except config.ConfigError as exc:
        return [checks.Error(str(exc), id="ugent.E001",
                             hint="Fix or remove it: a security setting that has no effect is not accepted.")]
    return []
