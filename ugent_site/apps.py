from django.apps import AppConfig
from django.core import checks


class UgentSiteConfig(AppConfig):
    name = "ugent_site"
    verbose_name = "UGENT"

    def ready(self):
        from django.conf import settings

        from ugent_common.malloctrim import limit_arenas
        # as every process starts (rundaemon, a web process, a worker, the supervisor), before its threads do
        limit_arenas(settings.UGENT_MALLOC_ARENA_MAX)
        checks.register(operator_key_check, checks.Tags.security)

    def background_services(self, mode):
        """rundaemon's metrics listener, when UGENT_METRICS_BIND names one (ugent_site/metrics.py)."""
        from ugent_site.metrics import background_services
        return background_services(mode)


def operator_key_check(app_configs=None, **kwargs):
    """Servers mode never runs rundaemon, which makes the operator key: say so when there is none (at
    `migrate`, `check`, and in each web process's log, ugent_site/asgi.py).

    An operator key is UGENT_WEB_API_KEY (or its _FILE) under api_key_role "operator", or a
    [[web.auth.keys]] entry of role "operator" whose variable is set: what configured_keys() reads.
    Keys the admin issued to an operator-role Caller live in the database, which a system check does not
    query: the warning says they were not looked at."""
    from django.conf import settings
    from ugent_common import config
    from ugent_site.operator_key import NO_OPERATOR_KEY
    if settings.UGENT_MODE != "servers":
        return []
    if any(key.role == "operator" for key in config.configured_keys()):
        return []
    return [checks.Warning(NO_OPERATOR_KEY.format(path=settings.UGENT_WEB_API_KEY_FILE), id="ugent.W001")]
