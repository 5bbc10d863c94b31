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


HINT = ("Fix it, or write `[web.auth]` alone (or remove the file) to run with none: a security setting that "
        "would have no effect, or a file that cannot be told from one caught half-way through a write, is not "
        "taken.")


def web_auth_check(app_configs=None, **kwargs):
    """ugent.toml as written: a file that cannot be read, does not parse (named, with the line) or is empty
    (blank or comments alone: a write caught half-way; `[web.auth]` alone, or no file, is none), or a
    [web.auth] key the daemon does not understand, stops every manage.py command that runs checks
    (rundaemon, runsupervisor; not `identity`, whose export may be writing the file), naming it, rather
    than being ignored."""
    from ugent_common import config
    try:
        config.web_auth_check()
    except config.ConfigError as exc:
        return [checks.Error(str(exc), id="ugent.E001", hint=HINT)]
    return []
