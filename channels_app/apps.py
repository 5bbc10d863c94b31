from django.apps import AppConfig
from django.core import checks


class ChannelsAppConfig(AppConfig):
    name = "channels_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Conversations and turns"

    def ready(self):
        checks.register(web_auth_check, checks.Tags.security)


def web_auth_check(app_configs=None, **kwargs):
    """ugent.toml's [web.auth] as written: a key the daemon does not understand stops every manage.py
    command that runs checks (rundaemon, runsupervisor), naming the key, rather than being ignored."""
    from ugent_common import config
    try:
        config.web_auth_check()
    except config.ConfigError as exc:
        return [checks.Error(str(exc), id="ugent.E001",
                             hint="Fix or remove it: a security setting that has no effect is not accepted.")]
    return []
