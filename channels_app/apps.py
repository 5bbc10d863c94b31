from django.apps import AppConfig
from django.core import checks


class ChannelsAppConfig(AppConfig):
    name = "channels_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Conversations and turns"

    def ready(self):
        checks.register(web_auth_check, checks.Tags.security)
        checks.register(plugin_bounds_check)
        from django.db.models.signals import post_delete, post_save, pre_save

        from channels_app.auth import caller_rows_changed, credentials_changed, credentials_snapshot
        from channels_app.models import ApiKey, Caller, Issuer
        # a process keeps the rows of configured keys' callers (channels_app.auth.configured_caller)
        post_save.connect(caller_rows_changed, sender=Caller, dispatch_uid="ugent-caller-rows-changed")
        post_delete.connect(caller_rows_changed, sender=Caller, dispatch_uid="ugent-caller-rows-deleted")
        # open streams check their credentials again at once when they change (channels_app.fanout)
        for model in (ApiKey, Caller, Issuer):
            name = model.__name__
            pre_save.connect(credentials_snapshot, sender=model, dispatch_uid=f"ugent-credentials-was-{name}")
            post_save.connect(credentials_changed, sender=model, dispatch_uid=f"ugent-credentials-{name}")
            post_delete.connect(credentials_changed, sender=model, dispatch_uid=f"ugent-credentials-gone-{name}")


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


#: Settings that bound plugin calls, and the least each may be: below it every call of that kind would be
#: refused or cut at once (a tool, a /btw, a question's reply, an engine's start), so a typo shut a feature off.
PLUGIN_BOUNDS = {"UGENT_TOOL_TIMEOUT_SECONDS": (0, "seconds"), "UGENT_TOOL_OVERRUN_MAX": (1, "calls"),
                 "UGENT_COMMAND_ENGINE_TIMEOUT": (0, "seconds"), "UGENT_QUESTION_FIT_TIMEOUT": (0, "seconds"),
                 "UGENT_CITATIONS_NLI_TIMEOUT": (0, "seconds"), "UGENT_PLUGIN_START_TIMEOUT": (0, "seconds")}


def plugin_bounds_check(app_configs=None, **kwargs):
    """A time limit of 0 or less, or an overrun cap below 1, on plugin calls: said once, at start (ugent.E005)."""
    from django.conf import settings
    errors = []
    for name, (least, unit) in PLUGIN_BOUNDS.items():
        value = getattr(settings, name)
        if (value <= 0) if least == 0 else (value < least):
            need = "more than 0" if least == 0 else f"at least {least}"
            errors.append(checks.Error(f"{name} is {value:g}: it must be {need} {unit}, or every such plugin call "
                                       "is refused or cut at once", id="ugent.E005",
                                       hint="Set it to a positive value (README, Configuration), or leave it out."))
    return errors
