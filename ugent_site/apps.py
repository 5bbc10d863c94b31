from django.apps import AppConfig
from django.core import checks


class UgentSiteConfig(AppConfig):
    name = "ugent_site"
    verbose_name = "UGENT"

    def ready(self):
        checks.register(operator_key_check, checks.Tags.security)

    def background_services(self, mode):
        """rundaemon's metrics listener, when UGENT_METRICS_BIND names one (ugent_site/metrics.py)."""
        from ugent_site.metrics import background_services
        return background_services(mode)


def operator_key_check(app_configs=None, **kwargs):
    """Servers mode never runs rundaemon, which makes the operator key: say so when there is none (at
    `migrate`, `check`, and in each web process's log, ugent_site/asgi.py)."""
    from django.conf import settings
    from ugent_site.operator_key import NO_OPERATOR_KEY
    if settings.UGENT_MODE != "servers" or settings.UGENT_WEB_API_KEY:
        return []
    return [checks.Warning(NO_OPERATOR_KEY.format(path=settings.UGENT_WEB_API_KEY_FILE), id="ugent.W001")]
